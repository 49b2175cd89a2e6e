// NCCL: built only when libtorch has CUDA and NCCL (scripts/check-pip-torch.sh on a GPU machine).
// One rank per GPU, as threads (NCCL refuses two ranks on one device); with one GPU the group has
// one rank, which still runs every collective through NCCL's kernels.
#include "harness.h"

#include <c10/cuda/CUDAFunctions.h>

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

}  // namespace
}  // namespace ddpkit
