// A process's peak memory with every page counted once across the processes of a host: the figure
// to compare strategies on one host by (peak_pss_bytes in ddpkit train's JSON).
//
// VmHWM (peak_rss_bytes) counts every resident page a process maps, so ranks on one host that map
// each other's shared memory (DDP's gradient arena, FSDP's shards) and the same libtorch pages each
// count them in full: summed over ranks it can be several times the host's physical memory. And it
// leaves out shared memory that is allocated but mapped by no process right now (a reserved
// segment's untouched pages). Here:
// - anonymous pages count in full (ranks do not fork each other);
// - file pages (libtorch's code) count in proportion to the processes that map them (PSS);
// - shared memory ddpkit made for the host's ranks (memfd segments: collective slots, gradient
//   arenas, buckets) counts in full for the process that made it (reserved regions whether touched
//   or not, others as far as they are resident), and not for the peers that map it, but a process
//   never counts less than its PSS share of all the shared memory it maps; a process that made
//   none counts that share.
// Summed over a host's ranks this is what the host holds for them (bench/fsdp_bench.py compares it
// with the job's memory cgroup).
//
// Reading PSS (/proc/self/smaps_rollup) walks every page table of the process, too slow to poll.
// So a thread polls the cheap counts (/proc/self/status) every `interval` and the owned segments'
// sizes, and reads PSS at start and then at growing intervals (1 s, 2 s, 4 s, ...) to learn this
// process's share of its file and shared-memory pages. The peak is the largest poll's estimate,
// and, when VmHWM rose while it ran, no less than VmHWM adjusted as at the largest poll, so an
// anonymous peak between polls is not missed.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace ddpkit {

// The resident counts of /proc/self/status, the shared memory this process made for its peers,
// and, where read, smaps_rollup's PSS; in bytes.
struct MemoryCounts {
  int64_t rss = 0, anon = 0, file = 0, shmem = 0, peak_rss = 0;
  int64_t pss = -1, pss_file = -1, pss_shmem = -1;  // -1: not read
  int64_t owned_shared = 0;  // owned_shared_memory_bytes()
  int owned_regions = 0;     // owned_shared_memory_regions()
};
// Reads /proc/self/status, and smaps_rollup too when `with_pss` (slow: it walks the page tables).
MemoryCounts read_memory_counts(bool with_pss);

// The shared memory this process made for its peers: what `note_owned_shared_memory` recorded and
// `forget_owned_shared_memory` has not removed. A reserved region counts in full; another, the
// pages it has in memory. Thread-safe.
void note_owned_shared_memory(const void* base, size_t bytes, bool reserved);
void forget_owned_shared_memory(const void* base);
int64_t owned_shared_memory_bytes();
// How many regions are recorded (0: this process made no shared memory for peers).
int owned_shared_memory_regions();

class PeakMemorySampler {
 public:
  // Starts the polling thread; interval must be positive.
  explicit PeakMemorySampler(std::chrono::milliseconds interval = std::chrono::milliseconds(20));
  ~PeakMemorySampler();
  PeakMemorySampler(const PeakMemorySampler&) = delete;
  PeakMemorySampler& operator=(const PeakMemorySampler&) = delete;

  // Polls now as well (cheap): callers that know where a peak lies (the end of forward) call it there.
  void sample();
  // Stops polling, reads PSS once more, and fixes the figures below. Idempotent.
  void stop();
  // The peak estimate so far (final after stop()), and VmHWM.
  int64_t peak_pss_bytes();
  int64_t peak_rss_bytes();
  // How many times PSS itself was read (at start, at 1, 2, 4, ... s, and at stop()).
  int pss_reads() const { return pss_reads_.load(); }

 private:
  void run();
  void take(const MemoryCounts& c);  // under mutex_

  std::chrono::milliseconds interval_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false, stopped_ = false;
  double share_file_ = 1, share_shmem_ = 1;  // this process's share of its file / shmem pages
  int64_t peak_estimate_ = 0, largest_rss_ = 0, shared_discount_at_largest_ = 0, peak_rss_ = 0;
  int64_t peak_rss_at_start_ = 0;  // VmHWM when sampling began: a high before then is not this peak's
  std::atomic<int> pss_reads_{0};
  std::thread thread_;
};

}  // namespace ddpkit
