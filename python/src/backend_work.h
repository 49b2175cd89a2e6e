// How the ddpkit backend's collectives become c10d work: where their completions run, and in which
// order they reach ddpkit's group. Included by backend.cpp only.
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/compat.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ddpkit {
namespace python {

// Runs the completions of work futures off ddpkit's own threads. A user's callback may issue a
// collective and wait for it (PyTorch's PowerSGD hook does): on the shared-memory or Gloo thread
// that completed the first, that wait would block the thread the second needs (the PowerSGD hang
// on Gloo). A blocked callback here costs one thread: when every thread is busy, another starts.
class CallbackRunner {
 public:
  static std::shared_ptr<CallbackRunner> make() { return std::shared_ptr<CallbackRunner>(new CallbackRunner()); }
  void post(std::function<void()> fn, const std::shared_ptr<CallbackRunner>& self) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(fn));
    if (static_cast<int>(queue_.size()) > idle_) {
      std::thread([self] { self->loop(); }).detach();  // the state outlives the backend
    } else {
      wake_.notify_one();
    }
  }
  void stop() {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    wake_.notify_all();
  }

 private:
  CallbackRunner() = default;
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      ++idle_;
      const bool got = wake_.wait_for(lock, std::chrono::seconds(10), [&] { return !queue_.empty() || stopping_; });
      --idle_;
      if (queue_.empty()) {
        if (stopping_ || !got) return;  // idle threads go after a while
        continue;
      }
      std::function<void()> fn = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  int idle_ = 0;
  bool stopping_ = false;
};

using ListFuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// c10d work whose getFuture() holds the list of output tensors, which is what PyTorch's DDP
// reducer and torch.futures expect. Completed by IssueOrder (or complete_on_runner).
class FutureWork : public c10d::Work {
 public:
  FutureWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->completed() && future_->hasError() ? future_->exception_ptr() : nullptr;
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  void synchronize() override {}
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout == std::chrono::milliseconds(0)) {
      future_->wait();
    } else {
      // Collectives end within the group's timeout on their own; this bounds the caller's wait.
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!future_->completed()) {
        if (std::chrono::steady_clock::now() > deadline)
          throw std::runtime_error("ddpkit backend: " + c10d::opTypeToString(retrieveOpType()) +
                                   " did not complete within the " + std::to_string(timeout.count()) +
                                   " ms given to Work.wait");
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    if (on_handout_) on_handout_();
    return future_;
  }
  // Completes the future with the outputs, or with `error`; its callbacks run here.
  void complete(std::exception_ptr error) {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }
  void wait_completed() { future_->wait(); }
  // Called whenever getFuture() hands the future out (callbacks may follow).
  void on_handout(std::function<void()> fn) { on_handout_ = std::move(fn); }

 private:
  std::vector<at::Tensor> outputs_;
  ListFuturePtr future_;
  std::function<void()> on_handout_;
};

// Completes `work`'s future on `runner` once `done` has.
inline void complete_on_runner(const FuturePtr& done, const c10::intrusive_ptr<FutureWork>& work,
                               const std::shared_ptr<CallbackRunner>& runner) {
  done->addCallback([work, runner](c10::ivalue::Future& f) {
    std::exception_ptr error = f.hasError() ? f.exception_ptr() : nullptr;
    runner->post([work, error] { work->complete(error); }, runner);
  });
}

// The order collectives reach ddpkit's group, which is how ranks match them. A completion callback
// that issues a collective (PyTorch's PowerSGD hook does, and waits for it) runs on a thread of
// its own, so left alone it would race the program's next collective, and two ranks could issue
// the pair in opposite orders. The order is fixed to NCCL's, where such a callback runs inline when
// it is attached: a collective whose future has been handed out (getFuture, where callbacks come
// from) holds back the collectives issued after that in its scope until it closes (completed, its
// callbacks and whatever they issued done, depth first); they queue, not wait, and are issued in
// order by a runner thread. A scope is the program, or the work whose callbacks are issuing.
// Collectives whose futures nobody asked for hold nothing back and complete where they land.
class IssueOrder : public std::enable_shared_from_this<IssueOrder> {
 public:
  explicit IssueOrder(std::shared_ptr<CallbackRunner> runner) : runner_(std::move(runner)) {}

  // The work of the collective `start` issues (returning its future). `done` (may be null) gets
  // that future's outcome as it lands. When `start` runs at once its exceptions reach the caller;
  // when queued, the work's.
  c10::intrusive_ptr<FutureWork> issue(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
                                       std::function<FuturePtr()> start, const FuturePtr& done) {
    auto op = std::make_shared<Op>();
    op->work = c10::make_intrusive<FutureWork>(rank, type, std::move(outputs));
    op->start = std::move(start);
    op->done = done;
    std::weak_ptr<IssueOrder> weak_self = shared_from_this();
    std::weak_ptr<Op> weak_op = op;
    op->work->on_handout([weak_self, weak_op] {
      auto self = weak_self.lock();
      auto o = weak_op.lock();
      if (self && o) self->handed_out(o);
    });
    const Scope& here = current();
    op->parent = here.owner == this ? here.node : nullptr;
    Op* scope = op->parent ? op->parent.get() : &root_;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (op->parent) ++op->parent->open;
      if (scope->held > 0 || scope->draining || !scope->waiting.empty()) {
        scope->waiting.push_back(op);
        return op->work;
      }
      op->launched = true;
    }
    FuturePtr issued;
    try {
      issued = op->start();
    } catch (...) {
      if (done) done->setError(std::current_exception());
      release(op);
      throw;
    }
    watch(op, issued);
    return op->work;
  }

  // Waits (up to `limit`) until no collective is queued or holding others back, so that a queued
  // one is not issued on a group that is gone.
  void drain(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait_for(lock, limit, [&] { return program_idle(); });
  }

 private:
  struct Op {
    std::shared_ptr<Op> parent;  // the op whose callbacks issued this one; null at top level
    c10::intrusive_ptr<FutureWork> work;
    std::function<FuturePtr()> start;
    FuturePtr done;
    int open = 1;            // its own completion, plus each op its callbacks issued and not closed
    bool launched = false;   // start() has run (or is running)
    bool watched = false;    // its future was handed out: callbacks may issue in its scope
    bool completing_inline = false;  // unwatched, landed: its future is being completed in place
    bool closed = false;
    // As a scope:
    int held = 0;            // launched, watched, open ops of this scope: later ones queue behind
    bool draining = false;   // a runner is issuing the queued ops
    std::deque<std::shared_ptr<Op>> waiting;
  };
  using OpPtr = std::shared_ptr<Op>;
  struct Scope {
    const IssueOrder* owner = nullptr;
    OpPtr node;
  };
  static Scope& current() {
    thread_local Scope scope;
    return scope;
  }
  Op* scope_of(const Op& op) { return op.parent ? op.parent.get() : &root_; }
  // Nothing at top level is queued or holding later collectives back (under mutex_).
  bool program_idle() const { return root_.held == 0 && !root_.draining && root_.waiting.empty(); }

  void handed_out(const OpPtr& op) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (op->completing_inline) {
      // Its future is being completed without callbacks; attach after that, as to any completed one.
      lock.unlock();
      op->work->wait_completed();
      return;
    }
    if (op->closed || op->watched) return;
    op->watched = true;
    if (op->launched) ++scope_of(*op)->held;
  }

  // Completes the op's work once `issued` lands: in place when nobody holds its future, else on
  // the runner with its callbacks scoped to the op.
  void watch(const OpPtr& op, const FuturePtr& issued) {
    auto self = shared_from_this();
    issued->addCallback([self, op](c10::ivalue::Future& f) {
      std::exception_ptr error = f.hasError() ? f.exception_ptr() : nullptr;
      if (op->done) {
        if (error) {
          op->done->setError(error);
        } else {
          op->done->markCompleted(f.value());
        }
      }
      bool in_place;
      {
        std::lock_guard<std::mutex> lock(self->mutex_);
        in_place = !op->watched;
        op->completing_inline = in_place;
      }
      if (in_place) {
        self->finish(op, error);
      } else {
        self->runner_->post([self, op, error] {
          Scope saved = current();
          current() = Scope{self.get(), op};
          self->finish(op, error);
          current() = saved;
        }, self->runner_);
      }
    });
  }

  void finish(const OpPtr& op, std::exception_ptr error) {
    op->work->complete(error);
    Scope saved = current();
    current() = Scope{};
    release(op);
    current() = saved;
  }

  // One of op's open counts is done; when none is left the op closes, which may free its scope's
  // queue (issued on a runner) and close the scope in turn.
  void release(OpPtr op) {
    std::vector<Op*> to_drain;
    std::vector<OpPtr> keep;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (op && --op->open == 0) {
        op->closed = true;
        Op* scope = scope_of(*op);
        if (op->watched && op->launched) --scope->held;
        if (scope->held == 0 && !scope->draining && !scope->waiting.empty()) {
          scope->draining = true;
          to_drain.push_back(scope);
          keep.push_back(op->parent);
        }
        op = op->parent;  // which counted this op
      }
      if (program_idle()) idle_.notify_all();
    }
    for (size_t i = 0; i < to_drain.size(); ++i) {
      auto self = shared_from_this();
      Op* scope = to_drain[i];
      OpPtr keep_scope = keep[i];  // a child scope stays alive until drained
      runner_->post([self, scope, keep_scope] { self->drain_queue(scope); }, runner_);
    }
  }

  // Issues a scope's queued ops in order until one of them holds the rest back again.
  void drain_queue(Op* scope) {
    for (;;) {
      OpPtr next;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (scope->held > 0 || scope->waiting.empty()) {
          scope->draining = false;
          if (program_idle()) idle_.notify_all();
          return;
        }
        next = scope->waiting.front();
        scope->waiting.pop_front();
        next->launched = true;
        if (next->watched) ++scope->held;
      }
      FuturePtr issued;
      try {
        issued = next->start();
      } catch (...) {
        issued = make_tensor_future();
        issued->setError(std::current_exception());
      }
      watch(next, issued);
    }
  }

  std::shared_ptr<CallbackRunner> runner_;
  std::mutex mutex_;
  std::condition_variable idle_;
  Op root_;  // the program's scope
};

}  // namespace python
}  // namespace ddpkit
