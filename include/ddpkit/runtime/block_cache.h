// Large CPU blocks kept when freed and handed out again (tune_allocator_for_training puts libtorch's
// large allocations here).
//
// A training step makes and frees the same large blocks every time: autograd's gradients before they
// are accumulated or copied into a bucket, a hook's encoded buckets, FSDP's gathered units. Kept in
// glibc's heap (what the raised mmap threshold alone did, to spare the page faults), where a freed
// block lands depends on every allocation made before it: one rank of the same job peaked at 551,
// 599 or 663 MB with nothing changed but the length of its arguments (mlp25, --no-ddp, 10 steps).
// Here each large block is a mapping of its own, reused at its page-rounded size: a step faults
// nothing in after the first, and the peak is the blocks live at once plus those kept, whatever
// the small allocations did.
//
// A request takes a kept block of its size, else the smallest larger kept one (cut to its size, the
// rest unmapped), else a new mapping. Kept blocks beyond the idle limit are unmapped, oldest first.
// Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>

namespace ddpkit {

class LargeBlockCache {
 public:
  // Serves requests of at least `min_bytes`; keeps at most `idle_limit_bytes` of freed blocks.
  LargeBlockCache(size_t min_bytes, size_t idle_limit_bytes);
  ~LargeBlockCache();  // unmaps the kept blocks; blocks still out are the caller's to give back first
  LargeBlockCache(const LargeBlockCache&) = delete;
  LargeBlockCache& operator=(const LargeBlockCache&) = delete;

  bool serves(size_t n) const { return n >= min_bytes_; }
  // A block of at least n bytes (page-aligned), or null when the system has no memory to map.
  void* take(size_t n);
  // False when `p` is not a block this cache handed out.
  bool give_back(void* p);
  // Unmaps every kept block.
  void release_idle();

  struct Stats {
    size_t mapped_bytes = 0;  // out and kept
    size_t idle_bytes = 0;    // kept
    int64_t reused = 0, mapped = 0, unmapped = 0;
  };
  Stats stats() const;

 private:
  struct Idle {
    void* p;
    size_t bytes;
  };
  void unmap_oldest_locked();

  const size_t min_bytes_, idle_limit_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, size_t> out_;                      // block -> its mapped bytes
  std::list<Idle> idle_;                                       // oldest first
  std::multimap<size_t, std::list<Idle>::iterator> by_size_;   // kept blocks by size
  Stats stats_;
};

// The cache tune_allocator_for_training made a stage of ddpkit's CPU allocator (cpu_allocator.h),
// serving libtorch's large blocks; null if none.
LargeBlockCache* installed_large_block_cache();
// tune_allocator_for_training's side, not for callers: makes the cache that stage, once; false
// when one is installed already, or when the allocator ddpkit's stands in front of is a user's own
// rather than c10's (it keeps its large blocks).
bool install_large_block_cache(size_t min_bytes, size_t idle_limit_bytes);

}  // namespace ddpkit
