#include <ddpkit/ps/trainer_hooks.h>

#include <ddpkit/hooks/default_hooks.h>

#include <atomic>

namespace ddpkit {
namespace ps {
namespace {

// Batch numbering and metric recording shared by the three hooks.
class HookState {
 public:
  explicit HookState(std::shared_ptr<metrics::MetricsLogger> log) : log_(std::move(log)) {}

  // The batch this bucket belongs to; the next call after the last bucket starts a new batch.
  int64_t batch_of(const GradBucket& bucket) {
    const int64_t b = batch_.load();
    if (bucket.is_last()) batch_.store(b + 1);
    return b;
  }

  // Runs `start` (which issues the communication) and times it until its future completes, as a
  // hook_future_metric event named `name`.
  template <typename Start>
  FuturePtr timed(int64_t batch, const GradBucket& bucket, const std::string& name, Start&& start) {
    if (!log_) return start();
    const std::string key = std::to_string(batch) + "," + std::to_string(bucket.index());
    log_->record_start("hook_future_metric", key, name);
    FuturePtr future = start();
    auto log = log_;
    future->addCallback([log, key](c10::ivalue::Future&) { log->record_end("hook_future_metric", key); });
    return future;
  }

 private:
  std::shared_ptr<metrics::MetricsLogger> log_;
  std::atomic<int64_t> batch_{0};
};

FuturePtr to_server(ParameterServerClient& client, HookState& state, GradBucket& bucket) {
  const int64_t batch = state.batch_of(bucket);
  const at::Tensor& buffer = bucket.buffer();
  if (buffer.is_sparse())
    return state.timed(batch, bucket, "rpc_sparse", [&] { return client.average(batch, bucket.index(), buffer); });
  // The average lands in the bucket itself: no second copy.
  return state.timed(batch, bucket, "rpc_dense", [&] { return client.average(batch, bucket.index(), buffer, buffer); });
}

// The default allreduce hook (it coalesces sparse buckets), timed as the seed names it.
FuturePtr allreduce(const CommHook& allreduce_hook, const std::string& backend, HookState& state, GradBucket& bucket,
                    int64_t batch) {
  const std::string name = backend + (bucket.is_sparse() ? "_sparse_allreduce" : "_dense_allreduce");
  return state.timed(batch, bucket, name, [&] { return allreduce_hook(bucket); });
}

}  // namespace

CommHook rpc_hook(std::shared_ptr<ParameterServerClient> client, std::shared_ptr<metrics::MetricsLogger> log) {
  DDPKIT_CHECK(client, "rpc_hook: parameter server client is null");
  auto state = std::make_shared<HookState>(std::move(log));
  return [client = std::move(client), state](GradBucket& bucket) { return to_server(*client, *state, bucket); };
}

CommHook sparse_rpc_hook(std::shared_ptr<ParameterServerClient> client, std::shared_ptr<ProcessGroup> pg,
                         std::shared_ptr<metrics::MetricsLogger> log) {
  DDPKIT_CHECK(client, "sparse_rpc_hook: parameter server client is null");
  DDPKIT_CHECK(pg, "sparse_rpc_hook: process group is null");
  auto state = std::make_shared<HookState>(std::move(log));
  return [client = std::move(client), dense = hooks::allreduce_hook(pg), backend = pg->backend_name(),
          state](GradBucket& bucket) {
    if (bucket.is_sparse()) return to_server(*client, *state, bucket);
    return allreduce(dense, backend, *state, bucket, state->batch_of(bucket));
  };
}

CommHook hybrid_hook(std::shared_ptr<ProcessGroup> sparse_pg, std::shared_ptr<ProcessGroup> dense_pg,
                     std::shared_ptr<metrics::MetricsLogger> log) {
  DDPKIT_CHECK(sparse_pg && dense_pg, "hybrid_hook: a process group is null");
  DDPKIT_CHECK(sparse_pg->size() == dense_pg->size(), "hybrid_hook: the sparse group has ", sparse_pg->size(),
               " ranks, the dense group ", dense_pg->size());
  auto state = std::make_shared<HookState>(std::move(log));
  return [sparse = hooks::allreduce_hook(sparse_pg), dense = hooks::allreduce_hook(dense_pg),
          sparse_backend = sparse_pg->backend_name(), dense_backend = dense_pg->backend_name(), state](GradBucket& bucket) {
    const int64_t batch = state->batch_of(bucket);
    return bucket.is_sparse() ? allreduce(sparse, sparse_backend, *state, bucket, batch)
                              : allreduce(dense, dense_backend, *state, bucket, batch);
  };
}

CommHook timed_hook(CommHook inner, std::shared_ptr<metrics::MetricsLogger> log, std::string name) {
  DDPKIT_CHECK(inner, "timed_hook: the wrapped hook is empty");
  DDPKIT_CHECK(log, "timed_hook: metrics logger is null");
  auto state = std::make_shared<HookState>(std::move(log));
  return [inner = std::move(inner), state, name = std::move(name)](GradBucket& bucket) {
    const int64_t batch = state->batch_of(bucket);
    return state->timed(batch, bucket, name, [&] { return inner(bucket); });
  };
}

}  // namespace ps
}  // namespace ddpkit
