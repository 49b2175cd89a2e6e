// FullyShardedDataParallel on one CUDA device over NCCL (a group of one rank), timed against the
// same model trained without FSDP. Built only where libtorch has CUDA and NCCL; the PyTorch side of
// the comparison, and the table, come from bench/fsdp_cuda_vs_pytorch.py, which runs this.
//
//   build-pip/fsdp_cuda_bench --mode local|full_shard|shard_grad_op|no_shard [--bf16] [--steps N] [--batch B]
//
// Workload (the same as bench/pytorch_fsdp.py's, scaled to a GPU): MLP 1024-4096-1024 x4 (33.6M
// parameters), every Linear a unit, cross entropy, SGD(lr 0.05, momentum 0.9); `local --bf16` is
// the model wholly in bf16, without FSDP. Each step ends with
// a device synchronize, so a step's time is what the GPU and the host together took. Prints one
// JSON line: {"mode", "bf16", "median_step_ms", "min_step_ms"}.
#include <ddpkit/ddpkit.h>

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using namespace ddpkit;

static int program_main(int argc, char** argv) {
  std::string mode = "full_shard";
  bool bf16 = false;
  int steps = 30;
  int64_t batch = 4096;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mode" && i + 1 < argc) {
      mode = argv[++i];
    } else if (a == "--bf16") {
      bf16 = true;
    } else if (a == "--steps" && i + 1 < argc) {
      steps = std::stoi(argv[++i]);
    } else if (a == "--batch" && i + 1 < argc) {
      batch = std::stoll(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: fsdp_cuda_bench --mode local|full_shard|shard_grad_op|no_shard [--bf16] "
                           "[--steps N] [--batch B]\n(unknown argument '%s')\n", a.c_str());
      return 2;
    }
  }
  if (c10::cuda::device_count() == 0) {
    std::fprintf(stderr, "fsdp_cuda_bench: no CUDA device\n");
    return 2;
  }
  if (steps < 4) {
    std::fprintf(stderr, "fsdp_cuda_bench: --steps must be at least 4 (3 are warm-up), got %d\n", steps);
    return 2;
  }
  const at::Device cuda(at::kCUDA, 0);
  const std::vector<int64_t> dims = {1024, 4096, 1024, 4096, 1024, 4096, 1024, 4096, 1024};
  torch::manual_seed(1);
  torch::nn::Sequential net;
  for (size_t i = 0; i + 1 < dims.size(); ++i) {
    net->push_back(torch::nn::Linear(dims[i], dims[i + 1]));
    if (i + 2 < dims.size()) net->push_back(torch::nn::Functional(torch::relu));
  }
  net->to(cuda);

  std::unique_ptr<FullyShardedDataParallel<torch::nn::Sequential>> fsdp;
  std::vector<at::Tensor> params = net->parameters();
  if (mode != "local") {
    auto pg = std::make_shared<ProcessGroup>(c10::make_intrusive<c10d::HashStore>(), 0, 1,
                                             ProcessGroupOptions().backend("nccl"));
    MixedPrecision mp;
    if (bf16) mp.param_dtype(at::kBFloat16).reduce_dtype(at::kBFloat16);
    fsdp = std::make_unique<FullyShardedDataParallel<torch::nn::Sequential>>(
        net, pg,
        FullyShardedDataParallelOptions()
            .sharding_strategy(parse_sharding_strategy(mode))
            .mixed_precision(mp)
            .auto_wrap_policy(size_based_auto_wrap_policy(1 << 20)));
    params = fsdp->parameters();
  } else if (bf16) {
    net->to(at::kBFloat16);  // local bf16: the whole model in bf16, what FSDP's bf16 compute costs at least
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  auto gen_opts = at::TensorOptions().device(cuda);
  const at::Tensor x = at::randn({batch, dims.front()}, gen_opts);
  const at::Tensor y = at::randint(0, dims.back(), {batch}, gen_opts.dtype(at::kLong));

  std::vector<double> ms;
  for (int s = 0; s < steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    at::Tensor out = fsdp ? fsdp->forward(x) : net->forward(bf16 ? x.to(at::kBFloat16) : x);
    torch::nn::functional::cross_entropy(out.to(at::kFloat), y).backward();
    opt.step();
    torch::cuda::synchronize();
    const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  std::printf("{\"mode\": \"%s\", \"bf16\": %s, \"median_step_ms\": %.3f, \"min_step_ms\": %.3f}\n", mode.c_str(),
              bf16 ? "true" : "false", ms[ms.size() / 2], ms.front());
  return 0;
}

int main(int argc, char** argv) {
  return ddpkit::run_main("fsdp_cuda_bench", [&] { return program_main(argc, argv); });
}
