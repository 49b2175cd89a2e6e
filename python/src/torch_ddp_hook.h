// ddpkit hooks inside PyTorch's own DistributedDataParallel.
//
// PyTorch's c10d::Reducer accepts a C++ c10d::CommHookInterface. TorchDdpHook is one: it hands
// each of PyTorch's GradBuckets to a ddpkit CommHook as a ddpkit::GradBucket viewing the same
// buffer (no copy), on the autograd thread that launched the bucket, without the GIL and without
// any Python in between. It also counts, per bucket, what the hook sent and what it cost to
// launch.
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/hooks/post_local_sgd_hook.h>
#include <ddpkit/hooks/powersgd_hook.h>
#include <ddpkit/reducer/grad_bucket.h>
#include <ddpkit/reducer/reducer.h>

#include <torch/csrc/distributed/c10d/comm.hpp>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ddpkit {
namespace ps {
class ParameterServerClient;
}
namespace python {

// One registration: the hook, the state objects Python may inspect, and its counters.
struct HookState {
  std::string name;
  std::shared_ptr<ProcessGroup> group;
  CommHook hook;
  std::shared_ptr<hooks::PowerSGDState> powersgd;
  std::shared_ptr<hooks::PostLocalSGDState> local_sgd;
  std::shared_ptr<ps::ParameterServerClient> client;
  // Traffic of bucket i is attributed to key key_base + i of `group` (unique per registration, so
  // two models sharing a group keep apart).
  int64_t key_base = 0;
  std::atomic<bool> installed{false};

  struct Bucket {
    int64_t numel = 0;
    int64_t launches = 0;
    uint64_t allreduce_bytes = 0;  // what a ring allreduce of these buckets would have sent
  };
  mutable std::mutex mutex;
  std::map<size_t, Bucket> buckets;
  int64_t launches = 0;
  int64_t iterations = 0;  // backward passes seen (last buckets launched)
  int64_t adapter_ns = 0;  // wrapping PyTorch's bucket as ddpkit's
  int64_t launch_ns = 0;   // the whole runHook: adapter plus the hook's synchronous part
};

class TorchDdpHook : public c10d::CommHookInterface {
 public:
  explicit TorchDdpHook(std::shared_ptr<HookState> state) : state_(std::move(state)) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;

 private:
  std::shared_ptr<HookState> state_;
};

// A fresh key base for a registration's traffic counters.
int64_t next_traffic_key_base();

}  // namespace python
}  // namespace ddpkit
