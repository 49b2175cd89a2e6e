#include "torch_ddp_hook.h"

#include <ddpkit/error.h>

#include <chrono>

namespace ddpkit {
namespace python {

int64_t next_traffic_key_base() {
  // Bucket indices stay far below 2^20; keys below 2^20 belong to ddpkit's own Reducer.
  static std::atomic<int64_t> next{1};
  return next.fetch_add(1) << 20;
}

c10::intrusive_ptr<c10::ivalue::Future> TorchDdpHook::runHook(c10d::GradBucket& torch_bucket) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const at::Tensor& buffer = torch_bucket.getBuffer();
  const size_t index = torch_bucket.getIndex();
  const bool sparse = buffer.is_sparse();
  std::vector<at::Tensor> parameters = torch_bucket.getParameters();
  // PyTorch lays a dense bucket's gradients out back to back in parameter order.
  std::vector<int64_t> offsets;
  std::vector<std::vector<int64_t>> shapes;
  if (!sparse) {
    int64_t offset = 0;
    offsets.reserve(parameters.size());
    shapes.reserve(parameters.size());
    for (const auto& p : parameters) {
      offsets.push_back(offset);
      shapes.push_back(p.sizes().vec());
      offset += p.numel();
    }
    DDPKIT_CHECK(offset == buffer.numel(), "PyTorch bucket ", index, " holds ", buffer.numel(),
                 " elements but its parameters ", offset);
  }
  // PyTorch's bucket knows only whether it is last; ddpkit's derives that from the bucket count.
  const size_t count = torch_bucket.isLast() ? index + 1 : index + 2;
  GradBucket bucket(index, count, buffer, std::move(offsets), std::move(shapes), std::move(parameters), sparse);
  const auto adapted = clock::now();

  FuturePtr future;
  {
    TrafficScope scope(state_->key_base + static_cast<int64_t>(index));
    future = state_->hook(bucket);
  }
  const auto end = clock::now();

  std::lock_guard<std::mutex> lock(state_->mutex);
  auto& b = state_->buckets[index];
  b.numel = sparse ? buffer._nnz() : buffer.numel();
  ++b.launches;
  const uint64_t n = static_cast<uint64_t>(state_->group->size());
  if (!sparse) b.allreduce_bytes += 2 * (n - 1) * static_cast<uint64_t>(b.numel * buffer.element_size()) / n;
  ++state_->launches;
  if (torch_bucket.isLast()) ++state_->iterations;
  state_->adapter_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(adapted - start).count();
  state_->launch_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count();
  return future;
}

at::Tensor TorchDdpHook::parseHookResult(const c10::IValue& result) {
  DDPKIT_CHECK(result.isTensor(), "hook '", state_->name, "' returned a ", result.tagKind(), ", not a tensor");
  return result.toTensor();
}

}  // namespace python
}  // namespace ddpkit
