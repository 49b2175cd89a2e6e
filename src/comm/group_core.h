// What every transport of a process group shares (internal): who this rank is, the options, the
// sequencer that issues collectives in one order on every rank, the traffic counters and the
// pool of scratch tensors. The ProcessGroup owns one; its transports hold a reference.
#pragma once

#include <ddpkit/comm/process_group.h>

#include "job_thread.h"

#include <atomic>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ddpkit {

class GroupCore {
 public:
  GroupCore(int rank, int world_size, ProcessGroupOptions options);
  GroupCore(const GroupCore&) = delete;
  GroupCore& operator=(const GroupCore&) = delete;

  int rank() const { return rank_; }
  int size() const { return world_size_; }
  const ProcessGroupOptions& options() const { return options_; }
  std::chrono::milliseconds timeout() const { return options_.timeout(); }
  int64_t piece_bytes() const { return piece_bytes_.load(std::memory_order_relaxed); }
  void set_piece_bytes(int64_t bytes);
  // How many pieces of piece_bytes() per peer `bytes_per_rank` makes: at least 1.
  int64_t pieces_for(uint64_t bytes_per_rank) const;

  // Runs `job` on the sequencer, after every job posted before it (inline when called from it:
  // a run_ordered job issues in program order). Its collectives count towards the poster's
  // TrafficScope key.
  void post(std::function<void()> job);
  // Runs what is queued and stops the sequencer; later posts fail. The transports' own threads
  // may still be handed work by queued jobs, so the group stops this first.
  void stop();

  // Issues a c10d collective (`op`, run on the sequencer) and completes the returned future with
  // `value` when its Work completes, or with a CommError naming `what`.
  FuturePtr issue(const std::string& what, uint64_t bus_bytes, const at::Tensor& value,
                  std::function<c10::intrusive_ptr<c10d::Work>()> op);
  // Completes `result` with `value` when `work` completes (or with its error, naming `what`).
  void link(const c10::intrusive_ptr<c10d::Work>& work, const FuturePtr& result, const at::Tensor& value,
            const std::string& what) const;
  // Completes `result` with a CommError: "<what> failed on rank R of N: <cause>".
  void fail(const FuturePtr& result, const std::string& what, std::exception_ptr cause) const;
  // A future completing with `future`'s tensor divided by the world size (AVG as a SUM).
  FuturePtr divided_by_size(const FuturePtr& sum, const at::Tensor& tensor) const;

  // Counts one collective's bytes (see CommStats) towards the totals and the current TrafficScope key.
  void count(uint64_t bytes_sent, uint64_t bytes_received, bool shared_memory = false);
  CommStats stats() const;
  CommStats traffic(int64_t key) const;
  void reset_stats();

  // Scratch tensors reused across calls: a fresh large allocation costs more in page faults than
  // most transfers. Give a tensor back when its collective has completed.
  at::Tensor take_workspace(at::ScalarType dtype, int64_t numel);
  void give_workspace(at::Tensor t);

 private:
  const int rank_;
  const int world_size_;
  const ProcessGroupOptions options_;
  std::atomic<int64_t> piece_bytes_;

  std::mutex pool_mutex_;
  std::map<std::pair<int, int64_t>, std::vector<at::Tensor>> pool_;

  mutable std::mutex stats_mutex_;
  CommStats totals_;
  std::map<int64_t, CommStats> by_key_;

  std::unique_ptr<JobThread> sequencer_;
};

namespace detail {

// "<bytes> B <dtype>", for operation names in errors.
std::string describe_tensor(const at::Tensor& t);

inline uint64_t bytes_of(const at::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(t.element_size());
}

// Runs fn on `t` if contiguous, else on a contiguous copy that is copied back (in-place collectives).
void on_contiguous(const at::Tensor& t, const std::function<void(const at::Tensor&)>& fn);

}  // namespace detail
}  // namespace ddpkit
