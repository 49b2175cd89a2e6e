// The state every transport of a group shares: sequencer, counters, scratch pool (group_core.h).
#include "group_core.h"

#include <algorithm>
#include <sstream>

namespace ddpkit {

std::string describe_comm_failure(const std::string& op, int rank, int world_size, std::exception_ptr cause) {
  std::string msg;
  try {
    std::rethrow_exception(cause);
  } catch (const c10::Error& e) {
    msg = e.what_without_backtrace();
  } catch (const std::exception& e) {
    msg = e.what();
  } catch (...) {
    msg = "unknown error";
  }
  // CommErrors raised further down already carry the context; do not wrap them twice.
  if (msg.rfind("ddpkit: ", 0) == 0) return msg;
  // Gloo's words when a pair's operation ran past the group's timeout (the peer neither answered
  // nor closed the connection: stopped, or still tearing its group down); say it in plain words.
  if (msg.find("Application timeout caused pair closure") != std::string::npos)
    msg += " (timed out after the group's timeout: a peer did not answer)";
  return "ddpkit: " + op + " failed on rank " + std::to_string(rank) + " of " + std::to_string(world_size) + ": " +
         msg;
}

namespace detail {

std::string describe_tensor(const at::Tensor& t) {
  std::ostringstream os;
  os << t.numel() * t.element_size() << " B " << t.scalar_type();
  return os.str();
}

void on_contiguous(const at::Tensor& t, const std::function<void(const at::Tensor&)>& fn) {
  if (t.is_contiguous()) return fn(t);
  at::Tensor c = t.contiguous();
  fn(c);
  t.copy_(c);
}

}  // namespace detail

namespace {
thread_local int64_t t_traffic_key = -1;
}

TrafficScope::TrafficScope(int64_t key) : previous_(t_traffic_key) { t_traffic_key = key; }
TrafficScope::~TrafficScope() { t_traffic_key = previous_; }
int64_t TrafficScope::current() { return t_traffic_key; }

GroupCore::GroupCore(int rank, int world_size, ProcessGroupOptions options)
    : rank_(rank),
      world_size_(world_size),
      options_(std::move(options)),
      piece_bytes_(options_.piece_bytes()),
      sequencer_(std::make_unique<JobThread>()) {}

void GroupCore::set_piece_bytes(int64_t bytes) {
  DDPKIT_CHECK(bytes >= 1, "piece_bytes must be >= 1, got ", bytes);
  piece_bytes_.store(bytes, std::memory_order_relaxed);
}

int64_t GroupCore::pieces_for(uint64_t bytes_per_rank) const {
  const uint64_t per_peer = bytes_per_rank / std::max(1, world_size_ - 1);
  const uint64_t piece = static_cast<uint64_t>(piece_bytes());  // >= 1: checked when set
  return static_cast<int64_t>(std::max<uint64_t>(1, (per_peer + piece - 1) / piece));
}

void GroupCore::post(std::function<void()> job) {
  DDPKIT_CHECK(sequencer_, "process group is shutting down");
  if (sequencer_->is_current()) {  // inside run_ordered: issue inline, in program order
    job();
    return;
  }
  sequencer_->post([key = TrafficScope::current(), job = std::move(job)] {
    TrafficScope scope(key);
    job();
  });
}

void GroupCore::stop() { sequencer_.reset(); }

void GroupCore::fail(const FuturePtr& result, const std::string& what, std::exception_ptr cause) const {
  result->setError(std::make_exception_ptr(CommError(describe_comm_failure(what, rank_, world_size_, cause))));
}

void GroupCore::link(const c10::intrusive_ptr<c10d::Work>& work, const FuturePtr& result, const at::Tensor& value,
                     const std::string& what) const {
  const int rank = rank_, world = world_size_;
  work->getFuture()->addCallback([result, value, what, rank, world](c10::ivalue::Future& f) {
    if (f.hasError()) {
      result->setError(
          std::make_exception_ptr(CommError(describe_comm_failure(what, rank, world, f.exception_ptr()))));
    } else {
      result->markCompleted(c10::IValue(value));
    }
  });
}

FuturePtr GroupCore::issue(const std::string& what, uint64_t bus_bytes, const at::Tensor& value,
                           std::function<c10::intrusive_ptr<c10d::Work>()> op) {
  auto result = make_tensor_future(value.device());
  post([this, result, value, what, bus_bytes, op = std::move(op)] {
    try {
      count(bus_bytes, bus_bytes);
      link(op(), result, value, what);
    } catch (...) {
      fail(result, what, std::current_exception());
    }
  });
  return result;
}

FuturePtr GroupCore::divided_by_size(const FuturePtr& sum, const at::Tensor& tensor) const {
  auto result = make_tensor_future(tensor.device());
  const int rank = rank_, world = world_size_;
  sum->addCallback([tensor, result, rank, world](c10::ivalue::Future& f) {
    if (f.hasError()) return result->setError(f.exception_ptr());
    try {
      tensor.div_(world);
      result->markCompleted(c10::IValue(tensor));
    } catch (...) {
      result->setError(std::make_exception_ptr(
          CommError(describe_comm_failure("allreduce (AVG)", rank, world, std::current_exception()))));
    }
  });
  return result;
}

void GroupCore::count(uint64_t bytes_sent, uint64_t bytes_received, bool shared_memory) {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  for (CommStats* s : {&totals_, TrafficScope::current() >= 0 ? &by_key_[TrafficScope::current()] : nullptr}) {
    if (!s) continue;
    (shared_memory ? s->shm_bytes_sent : s->bytes_sent) += bytes_sent;
    (shared_memory ? s->shm_bytes_received : s->bytes_received) += bytes_received;
    s->collectives += 1;
  }
}

CommStats GroupCore::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return totals_;
}

CommStats GroupCore::traffic(int64_t key) const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  auto it = by_key_.find(key);
  return it == by_key_.end() ? CommStats{} : it->second;
}

void GroupCore::reset_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  totals_ = {};
  by_key_.clear();
}

at::Tensor GroupCore::take_workspace(at::ScalarType dtype, int64_t numel) {
  {
    std::lock_guard<std::mutex> lock(pool_mutex_);
    auto it = pool_.find({static_cast<int>(dtype), numel});
    if (it != pool_.end() && !it->second.empty()) {
      at::Tensor t = std::move(it->second.back());
      it->second.pop_back();
      return t;
    }
  }
  return at::empty({numel}, at::TensorOptions().dtype(dtype));
}

void GroupCore::give_workspace(at::Tensor t) {
  std::lock_guard<std::mutex> lock(pool_mutex_);
  auto& slot = pool_[{static_cast<int>(t.scalar_type()), t.numel()}];
  if (slot.size() < 4) slot.push_back(std::move(t));  // bounded: at most 4 per shape
}

}  // namespace ddpkit
