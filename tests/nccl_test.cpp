// NCCL: built only when libtorch has CUDA and NCCL (scripts/check-pip-torch.sh on a GPU machine).
// One rank per GPU, as threads (NCCL refuses two ranks on one device); with one GPU the group has
// one rank, which still runs every collective through NCCL's kernels.
#include "harness.h"

#include <c10/cuda/CUDAFunctions.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

namespace ddpkit {
namespace {

int nccl_world() { return std::max(1, std::min<int>(4, c10::cuda::device_count())); }

void spawn_nccl(const testing::RankFn& fn) {
  const int world = nccl_world();
  testing::spawn_groups(
      world,
      [world](const c10::intrusive_ptr<c10d::Store>& store, int r) {
        c10::cuda::set_device(static_cast<c10::DeviceIndex>(r));  // this rank thread's GPU
        return std::make_shared<ProcessGroup>(store, r, world,
                                              ProcessGroupOptions().backend("nccl").timeout(std::chrono::seconds(60)));
      },
      fn);
}

at::TensorOptions on(int rank, at::ScalarType dtype = at::kFloat) {
  return at::TensorOptions().device(at::kCUDA, rank).dtype(dtype);
}

TEST(Nccl, EveryCollective) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  spawn_nccl([](int rank, std::shared_ptr<ProcessGroup> pg) {
    const int n = pg->size();
    const double sum = n * (n + 1) / 2.0;
    for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      at::Tensor t = at::full({1000}, rank + 1, on(rank, dtype));
      ProcessGroup::wait(pg->allreduce(t));
      EXPECT_TRUE(t.to(at::kFloat).eq(sum).all().item<bool>()) << dtype;
    }
    at::Tensor b = at::full({257}, rank == 0 ? 7 : -1, on(rank));
    ProcessGroup::wait(pg->broadcast(b, 0));
    EXPECT_TRUE(b.eq(7).all().item<bool>());
    std::vector<at::Tensor> parts;
    for (int k = 0; k < n; ++k) parts.push_back(at::empty({33}, on(rank)));
    ProcessGroup::wait(pg->allgather(parts, at::full({33}, rank, on(rank))));
    for (int k = 0; k < n; ++k) EXPECT_TRUE(parts[k].eq(k).all().item<bool>());
    at::Tensor in = at::arange(n * 64, on(rank)) + rank, out = at::empty({64}, on(rank));
    ProcessGroup::wait(pg->reduce_scatter(out, in));
    const at::Tensor expect = (at::arange(64, on(rank)) + rank * 64) * n + n * (n - 1) / 2.0;
    EXPECT_TRUE(out.equal(expect));
    at::Tensor a_in = at::full({n * 8}, rank, on(rank)), a_out = at::empty({n * 8}, on(rank));
    ProcessGroup::wait(pg->alltoall(a_out, a_in));
    for (int k = 0; k < n; ++k) EXPECT_TRUE(a_out.narrow(0, k * 8, 8).eq(k).all().item<bool>());
  });
}

// A DDP step on CUDA parameters averages gradients like the same step on CPU without DDP.
TEST(Nccl, DdpStepAveragesGradients) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const int world = nccl_world();
  std::vector<at::Tensor> inputs;
  for (int r = 0; r < world; ++r) inputs.push_back(testing::seeded_randn({16, 8}, 100 + r));
  auto reference = testing::make_mlp(3);
  for (int r = 0; r < world; ++r) reference->forward(inputs[r]).sum().div(world).backward();
  spawn_nccl([&](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto model = testing::make_mlp(3);
    model->to(at::Device(at::kCUDA, rank));
    DistributedDataParallel<torch::nn::Sequential> ddp(model, pg, DistributedDataParallelOptions().bucket_cap_mb(0.001));
    ddp.forward(inputs[rank].to(at::Device(at::kCUDA, rank))).sum().backward();
    const auto got = model->parameters(), want = reference->parameters();
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(at::allclose(got[i].grad().cpu(), want[i].grad(), 1e-5, 1e-6)) << "parameter " << i;
  });
}

// ---- FullyShardedDataParallel on CUDA parameters over NCCL ----

// Units: each Linear (size policy 100); the root holds no parameters of its own.
torch::nn::Sequential make_fsdp_mlp() { return testing::make_mlp(11, {24, 48, 48, 40, 6}); }

at::Tensor fsdp_input(int step, int rank) { return testing::seeded_randn({5, 24}, 300 + 10 * step + rank); }
at::Tensor fsdp_target(int step, int rank) { return testing::seeded_randn({5, 6}, 700 + 10 * step + rank); }
constexpr int kFsdpSteps = 3;

// One process on the CPU, every rank's batch concatenated: what FSDP over NCCL must equal.
std::map<std::string, at::Tensor> fsdp_reference(int world) {
  auto model = make_fsdp_mlp();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kFsdpSteps; ++step) {
    opt.zero_grad();
    std::vector<at::Tensor> xs, ys;
    for (int r = 0; r < world; ++r) {
      xs.push_back(fsdp_input(step, r));
      ys.push_back(fsdp_target(step, r));
    }
    torch::mse_loss(model->forward(at::cat(xs)), at::cat(ys)).backward();
    opt.step();
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

struct CudaFsdpCase {
  std::string name;
  ShardingStrategy strategy;
  MixedPrecision mixed_precision;
  bool fp16_hook = false;
  double tolerance;
};

TEST(Nccl, FsdpOnCudaEqualsSingleProcessTraining) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const int world = nccl_world();
  const auto want = fsdp_reference(world);
  MixedPrecision bf16;
  bf16.param_dtype(at::kBFloat16).reduce_dtype(at::kBFloat16);
  MixedPrecision fp16_compute;
  fp16_compute.param_dtype(at::kHalf).reduce_dtype(at::kFloat);
  const std::vector<CudaFsdpCase> cases = {
      {"full_shard", ShardingStrategy::kFullShard, {}, false, 1e-5},
      {"shard_grad_op", ShardingStrategy::kShardGradOp, {}, false, 1e-5},
      {"no_shard", ShardingStrategy::kNoShard, {}, false, 1e-5},
      {"full_shard bf16", ShardingStrategy::kFullShard, bf16, false, 3e-2},
      {"full_shard fp16 compute, fp32 reduce", ShardingStrategy::kFullShard, fp16_compute, false, 5e-3},
      {"full_shard fp16_compress_hook", ShardingStrategy::kFullShard, {}, true, 2e-3},
  };
  for (const auto& c : cases) {
    spawn_nccl([&](int rank, std::shared_ptr<ProcessGroup> pg) {
      auto model = make_fsdp_mlp();
      model->to(at::Device(at::kCUDA, rank));
      FullyShardedDataParallel<torch::nn::Sequential> fsdp(
          model, pg,
          FullyShardedDataParallelOptions()
              .sharding_strategy(c.strategy)
              .mixed_precision(c.mixed_precision)
              .auto_wrap_policy(size_based_auto_wrap_policy(100)));
      EXPECT_EQ(fsdp.units().size(), 5u) << c.name;  // the root and four Linears
      if (c.fp16_hook)
        fsdp.register_comm_hook(std::make_shared<fsdp::LowPrecisionState>(fsdp.shard_group()),
                                fsdp::fp16_compress_hook);
      for (const auto& p : fsdp.parameters()) EXPECT_TRUE(p.is_cuda()) << c.name;
      torch::optim::SGD opt(fsdp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int step = 0; step < kFsdpSteps; ++step) {
        opt.zero_grad();
        const at::Tensor x = fsdp_input(step, rank).to(at::Device(at::kCUDA, rank));
        const at::Tensor y = fsdp_target(step, rank).to(at::Device(at::kCUDA, rank));
        torch::mse_loss(fsdp.forward(x).to(at::kFloat), y).backward();
        opt.step();
      }
      const auto got = fsdp.full_state_dict(/*rank0_only=*/false);
      ASSERT_EQ(got.size(), want.size()) << c.name;
      for (const auto& kv : want) {
        const at::Tensor* t = got.find(kv.first);
        ASSERT_TRUE(t) << c.name << ": no " << kv.first;
        EXPECT_TRUE(t->is_cuda()) << c.name << ": " << kv.first;
        EXPECT_LE(testing::relative_error(t->cpu(), kv.second), c.tolerance) << c.name << ": " << kv.first;
      }
    });
  }
}

// A model and a group that cannot carry its tensors are refused when wrapped, by name.
TEST(Nccl, FsdpRefusesAGroupOfTheWrongBackend) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  spawn_nccl([](int rank, std::shared_ptr<ProcessGroup> nccl) {
    auto cpu_model = make_fsdp_mlp();
    EXPECT_THAT(testing::error_of([&] { FullyShardedDataParallel<torch::nn::Sequential> f(cpu_model, nccl); }),
                ::testing::HasSubstr("the parameters are on cpu but process group"));
    auto gloo = std::make_shared<ProcessGroup>(nccl->store(), nccl->rank(), nccl->size(),
                                               ProcessGroupOptions().group_name("fsdp-gloo"));
    auto cuda_model = make_fsdp_mlp();
    cuda_model->to(at::Device(at::kCUDA, rank));
    EXPECT_THAT(testing::error_of([&] { FullyShardedDataParallel<torch::nn::Sequential> f(cuda_model, gloo); }),
                ::testing::HasSubstr("is gloo: nccl carries CUDA tensors"));
  });
}

}  // namespace
}  // namespace ddpkit
