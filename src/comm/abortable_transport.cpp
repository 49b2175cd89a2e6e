// The abortable transport: any transport whose collectives a caller can abandon. abort(reason)
// completes every collective still in flight with a CommError(reason) at once, and every later one
// fails the same way without being issued. The wrapped transport's own work is not interrupted (a
// c10d Gloo collective cannot be): it ends when its peers answer or its timeout passes, and its
// result is dropped. A group so aborted is done: make a new one (with a new store prefix) to go on.
// Used across replica groups (ddpkit/ft), where a lost group's heartbeat, not the collective's
// timeout, decides when the survivors stop waiting (ProcessGroupOptions::abortable).
#include "transport.h"

#include <set>

namespace ddpkit {

namespace {

// What the callbacks share with the transport: they may run after it is gone (a Gloo collective
// completing while the group is destroyed).
struct AbortState {
  struct Call {
    FuturePtr outer;
    std::atomic<bool> done{false};
  };
  std::mutex mu;
  std::string reason;  // set once: aborted
  std::set<std::shared_ptr<Call>> in_flight;
};

class AbortableTransport final : public ForwardingTransport {
 public:
  AbortableTransport(GroupCore& core, std::unique_ptr<Transport> inner)
      : ForwardingTransport(core, std::move(inner)), state_(std::make_shared<AbortState>()) {}

  std::string name() const override { return inner_->name() + ", abortable"; }

  FuturePtr allreduce(const at::Tensor& t, c10d::ReduceOp op) override {
    return guarded(t, [&] { return inner_->allreduce(t, op); });
  }
  // The wrapped transport's own: where it sums in place (shared memory) the parts are not staged
  // through the buffer, which the default on allreduce() would do.
  FuturePtr allreduce_parts(const at::Tensor& buffer, const std::vector<at::Tensor>& parts, double scale) override {
    return guarded(buffer, [&] { return inner_->allreduce_parts(buffer, parts, scale); });
  }
  FuturePtr broadcast(const at::Tensor& t, int root) override {
    return guarded(t, [&] { return inner_->broadcast(t, root); });
  }
  FuturePtr allgather_into_tensor(const at::Tensor& output, const at::Tensor& input) override {
    return guarded(output, [&] { return inner_->allgather_into_tensor(output, input); });
  }
  FuturePtr alltoall(const at::Tensor& output, const at::Tensor& input) override {
    return guarded(output, [&] { return inner_->alltoall(output, input); });
  }
  FuturePtr barrier() override {
    return guarded(at::Tensor(), [&] { return inner_->barrier(); });
  }
  FuturePtr two_phase(const std::shared_ptr<TwoPhaseJob>& job, const at::Tensor& value,
                      const std::string& what) override {
    return guarded(value, [&] { return inner_->two_phase(job, value, what); });
  }
  FuturePtr monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) override {
    return guarded(at::Tensor(), [&] { return inner_->monitored_barrier(timeout, wait_all_ranks); });
  }

  bool abort(const std::string& reason) override {
    std::set<std::shared_ptr<AbortState::Call>> calls;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (!state_->reason.empty()) return true;
      state_->reason = reason.empty() ? "aborted" : reason;
      calls.swap(state_->in_flight);
    }
    for (const auto& c : calls)
      if (!c->done.exchange(true)) c->outer->setError(std::make_exception_ptr(CommError(failure(reason))));
    return true;
  }

 private:
  std::string failure(const std::string& reason) const {
    return "ddpkit: collective aborted on rank " + std::to_string(core_.rank()) + " of " +
           std::to_string(core_.size()) + " (process group '" + core_.options().group_name() + "'): " + reason;
  }

  template <typename Issue>
  FuturePtr guarded(const at::Tensor& value, Issue&& issue) {
    auto call = std::make_shared<AbortState::Call>();
    call->outer = make_tensor_future(value.defined() ? value.device() : c10::Device(c10::kCPU));
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (!state_->reason.empty()) {
        call->outer->setError(std::make_exception_ptr(CommError(failure(state_->reason))));
        return call->outer;
      }
      state_->in_flight.insert(call);
    }
    FuturePtr inner = issue();
    std::weak_ptr<AbortState> weak = state_;
    inner->addCallback([call, weak](c10::ivalue::Future& f) {
      if (auto s = weak.lock()) {
        std::lock_guard<std::mutex> lock(s->mu);
        s->in_flight.erase(call);
      }
      if (call->done.exchange(true)) return;  // aborted first: the result is dropped
      if (f.hasError()) {
        call->outer->setError(f.exception_ptr());
      } else {
        call->outer->markCompleted(f.value());
      }
    });
    return call->outer;
  }

  std::shared_ptr<AbortState> state_;
};

}  // namespace

std::unique_ptr<Transport> make_abortable_transport(GroupCore& core, std::unique_ptr<Transport> inner) {
  return std::make_unique<AbortableTransport>(core, std::move(inner));
}

}  // namespace ddpkit
