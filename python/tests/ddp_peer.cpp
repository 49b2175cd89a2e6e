// The C++ side of the Python parity tests: the same MLP, data and steps as
// python/tests/test_parity.py, trained with ddpkit's own C++ DistributedDataParallel, writing
// every step's averaged gradients so the test can compare them with PyTorch's DDP running the
// same ddpkit hook, registered after one step of DDP's built-in allreduce. Weights and data come from libtorch's generator seeded as the Python side
// seeds it (one libtorch, one generator: the same numbers).
//
//   ddp_peer --dims 128,512,10 --steps 4 --batch 16 --lr 0.1 --bucket-cap-mb 0.5 --out DIR \
//            --hook allreduce --hook "powersgd:matrix_approximation_rank=2,start_powerSGD_iter=2"
// Ranks from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
#include <ddpkit/ddpkit.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <fstream>
#include <iostream>
#include <sstream>

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

bool truthy(const std::string& v) { return v == "1" || v == "true" || v == "True"; }

// "name:key=value,key=value" with the Python option names (those make_hook's hooks take).
ddpkit::hooks::HookOptions parse_options(const std::string& name, const std::string& spec) {
  ddpkit::hooks::HookOptions o;
  for (const auto& kv : split(spec, ',')) {
    const auto eq = kv.find('=');
    DDPKIT_CHECK(eq != std::string::npos, "ddp_peer: option '", kv, "' is not key=value");
    const std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
    if (k == "block") o.int8().block(std::stoll(v));
    else if (k == "error_feedback") o.int8().error_feedback(truthy(v));
    else if (k == "bucket_size") o.perchannel_bucket_size(std::stoll(v));
    else if (k == "matrix_approximation_rank") o.powersgd().matrix_approximation_rank(std::stoll(v));
    else if (k == "start_powerSGD_iter") o.powersgd().start_powerSGD_iter(std::stoll(v));
    else if (k == "min_compression_rate") o.powersgd().min_compression_rate(std::stod(v));
    else if (k == "use_error_feedback") o.powersgd().use_error_feedback(truthy(v));
    else if (k == "warm_start") o.powersgd().warm_start(truthy(v));
    else if (k == "orthogonalization_epsilon") o.powersgd().orthogonalization_epsilon(std::stod(v));
    else if (k == "random_seed") o.powersgd().random_seed(std::stoull(v));
    else if (k == "batch_tensors_with_same_shape") o.powersgd().batch_tensors_with_same_shape(truthy(v));
    else DDPKIT_CHECK(false, "ddp_peer: hook ", name, ": unknown option ", k);
  }
  return o;
}

}  // namespace

static int program_main(int argc, char** argv) {
  std::vector<int64_t> dims;
  int64_t steps = 4, batch = 16;
  double lr = 0.1, bucket_cap_mb = 25;
  std::string out;
  std::vector<std::string> hooks;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--dims") for (const auto& d : split(value, ',')) dims.push_back(std::stoll(d));
    else if (flag == "--steps") steps = std::stoll(value);
    else if (flag == "--batch") batch = std::stoll(value);
    else if (flag == "--lr") lr = std::stod(value);
    else if (flag == "--bucket-cap-mb") bucket_cap_mb = std::stod(value);
    else if (flag == "--out") out = value;
    else if (flag == "--hook") hooks.push_back(value);
    else { std::cerr << "ddp_peer: unknown flag " << flag << "\n"; return 2; }
  }
  if (dims.size() < 2 || out.empty() || hooks.empty()) {
    std::cerr << "usage: ddp_peer --dims A,B,... --out DIR --hook SPEC [--hook SPEC ...]\n";
    return 2;
  }
  ddpkit::set_compute_threads(1);
  auto pg = ddpkit::init_process_group(ddpkit::InitOptions().timeout(std::chrono::seconds(60)));
  for (const auto& spec : hooks) {
    const auto colon = spec.find(':');
    const std::string name = spec.substr(0, colon);
    const auto options = parse_options(name, colon == std::string::npos ? "" : spec.substr(colon + 1));

    torch::nn::Sequential model;
    for (size_t i = 0; i + 1 < dims.size(); ++i) {
      model->push_back(torch::nn::Linear(dims[i], dims[i + 1]));
      if (i + 2 < dims.size()) model->push_back(torch::nn::ReLU());
    }
    {
      at::NoGradGuard no_grad;
      at::manual_seed(0);
      for (auto& p : model->parameters()) p.copy_(at::randn(p.sizes()) * 0.1);
    }
    ddpkit::DistributedDataParallel<torch::nn::Sequential> ddp(
        model, pg, ddpkit::DistributedDataParallelOptions().bucket_cap_mb(bucket_cap_mb));
    std::ofstream file(out + "/" + name + ".rank" + std::to_string(pg->rank()) + ".bin", std::ios::binary);
    for (int64_t s = 0; s < steps; ++s) {
      // Step 0 runs DDP's built-in allreduce: the buckets are rebuilt in gradient-ready order after
      // it, on both sides alike; the hook then sees the same buckets as in PyTorch's DDP.
      if (s == 1) ddp.register_comm_hook(ddpkit::hooks::make_hook(name, pg, options), name);
      at::manual_seed(1000 + 100 * s + pg->rank());
      at::Tensor x = at::randn({batch, dims.front()});
      at::Tensor y = at::randn({batch, dims.back()});
      at::Tensor loss = torch::nn::functional::mse_loss(ddp.forward(x), y);
      loss.backward();
      at::NoGradGuard no_grad;
      for (auto& p : model->parameters()) {
        at::Tensor g = p.grad().contiguous();
        file.write(reinterpret_cast<const char*>(g.data_ptr<float>()), g.numel() * sizeof(float));
        p.sub_(g, lr);
        p.mutable_grad().zero_();
      }
    }
  }
  std::cout << "ddp_peer: rank " << pg->rank() << " wrote " << hooks.size() << " hooks\n";
  return 0;
}

int main(int argc, char** argv) {
  return ddpkit::run_main("ddpkit_ddp_peer", [&] { return program_main(argc, argv); });
}
