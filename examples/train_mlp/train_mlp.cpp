// A data-parallel training program on ddpkit, as a libtorch user writes one: an MLP learns a
// fixed random "teacher" labelling of Gaussian inputs, each rank on its own shard, gradients
// averaged by DistributedDataParallel (with an optional fp16 compression hook).
//
//   ddpkit launch --nproc 2 ./train_mlp [--hook fp16] [--epochs 5]
//
// Rank 0 prints the loss per epoch and a last line "train_mlp: ... ranks agree" once every rank
// ends with the same parameters; the exit status is non-zero if they differ or nothing was learnt.
#include <ddpkit/ddpkit.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/loss.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

static int train(int argc, char** argv) {
  ddpkit::tune_allocator_for_training();  // before anything allocates: large blocks stay in the heap
  std::string hook = "allreduce";
  int epochs = 5;
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 < argc && !std::strcmp(argv[i], "--hook")) hook = argv[i + 1];
    else if (i + 1 < argc && !std::strcmp(argv[i], "--epochs")) epochs = std::atoi(argv[i + 1]);
    else { std::fprintf(stderr, "usage: train_mlp [--hook allreduce|fp16] [--epochs N]\n"); return 2; }
  }
  ddpkit::set_compute_threads(1);

  auto pg = ddpkit::init_process_group();  // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  const int rank = pg->rank(), world = pg->size();

  // The same data everywhere (seeded), sharded by rank.
  torch::manual_seed(7);
  const int64_t n = 4096, features = 32, classes = 4;
  const at::Tensor inputs = torch::randn({n, features});
  const at::Tensor labels = inputs.matmul(torch::randn({features, classes})).argmax(1);

  torch::manual_seed(rank + 100);  // different initial weights per rank: DDP broadcasts rank 0's
  torch::nn::Sequential net(torch::nn::Linear(features, 64), torch::nn::ReLU(), torch::nn::Linear(64, classes));
  ddpkit::DistributedDataParallel<torch::nn::Sequential> ddp(net, pg);
  if (hook == "fp16") ddp.register_comm_hook(ddpkit::hooks::fp16_compress_hook(pg), "fp16");
  else if (hook != "allreduce") { std::fprintf(stderr, "train_mlp: unknown --hook '%s'\n", hook.c_str()); return 2; }

  // torch::optim::SGD's results, in one pass over each parameter (include/ddpkit/optim/sgd.h).
  ddpkit::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::nn::CrossEntropyLoss criterion;
  const int64_t batch = 64;
  double first = 0, last = 0;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    double sum = 0;
    int64_t steps = 0;
    for (int64_t start = rank * batch; start + batch <= n; start += world * batch, ++steps) {
      opt.zero_grad();
      auto loss = criterion(ddp.forward(inputs.narrow(0, start, batch)), labels.narrow(0, start, batch));
      loss.backward();  // gradients are averaged across ranks when this returns
      opt.step();
      sum += loss.item<double>();
    }
    last = sum / static_cast<double>(steps);
    if (epoch == 0) first = last;
    if (rank == 0) std::printf("epoch %d: mean loss %.4f\n", epoch + 1, last);
  }

  // Every rank must hold rank 0's parameters, bit for bit.
  at::Tensor flat = torch::cat([&] {
    std::vector<at::Tensor> v;
    for (const auto& p : net->parameters()) v.push_back(p.detach().reshape({-1}));
    return v;
  }());
  at::Tensor reference = flat.clone();
  ddpkit::ProcessGroup::wait(pg->broadcast(reference, 0));
  at::Tensor mismatch = at::tensor({flat.equal(reference) ? 0.0f : 1.0f});
  ddpkit::ProcessGroup::wait(pg->allreduce(mismatch));
  const bool agree = mismatch.item<float>() == 0.0f;
  const bool learnt = last < 0.8 * first;
  if (rank == 0) {
    std::printf("train_mlp: world %d, hook %s, loss %.4f -> %.4f, ranks %s\n", world, hook.c_str(), first, last,
                agree ? "agree" : "DIFFER");
  }
  return agree && learnt ? 0 : 1;
}

// What train() throws (a rank lost, a bad launch environment) ends in one line and an exit
// status, not a stack trace.
int main(int argc, char** argv) {
  return ddpkit::run_main("train_mlp", [&] { return train(argc, argv); });
}
