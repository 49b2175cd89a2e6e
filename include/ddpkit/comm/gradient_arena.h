// Memory that autograd's gradients are born in. While an arena is in use on a thread, CPU
// allocations of exactly one of its block sizes come from it (as long as it has room); everything
// else, and everything on other threads, goes on to the large block cache, if any, and libtorch's
// own allocator (the arena is the first stage of ddpkit's CPU allocator, runtime/cpu_allocator.h,
// installed the first time an arena is used). Two kinds:
// - DDP's (docs/shared_memory.md, "Gradients born in shared memory"): over memory every rank on
//   the host maps, blocks anywhere in it: a parameter's gradient is born where the peers can read
//   it and write their shares of the sum into it, so the bucket's allreduce copies nothing.
// - FSDP's (docs/fsdp.md): a unit's flat gradient with one place per parameter, at its offset:
//   a gradient born in its place is already where the reduce-scatter reads it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace ddpkit {
namespace shm {
struct SharedBuffer;
}

class GradientArena : public std::enable_shared_from_this<GradientArena> {
 public:
  // Over this rank's memory `own` of `buffer` (ProcessGroup::gradient_arena makes them), serving
  // blocks of exactly these sizes.
  GradientArena(std::shared_ptr<shm::SharedBuffer> buffer, uint8_t* own, std::vector<size_t> block_bytes);
  // Over `capacity` bytes at `base` (kept alive by `owner` while any block is out), serving only
  // these places, each to one allocation at a time.
  struct Place {
    size_t bytes = 0, offset = 0;
  };
  GradientArena(std::shared_ptr<void> owner, uint8_t* base, size_t capacity, const std::vector<Place>& places);
  ~GradientArena();
  GradientArena(const GradientArena&) = delete;
  GradientArena& operator=(const GradientArena&) = delete;

  // From now on, on the calling thread, serve allocations from `arena`; null stops.
  static void use(const std::shared_ptr<GradientArena>& arena);
  // The arena in use on the calling thread, if any.
  static std::shared_ptr<GradientArena> in_use();

  bool contains(const void* p) const;
  // The addresses of the blocks handed out and not yet freed.
  std::vector<const void*> blocks_in_use() const;
  size_t capacity() const { return capacity_; }
  size_t bytes_in_use() const;
  // The owner lets go: the arena goes once its last block is freed.
  void retire();

  // The allocator stage's side; not for callers.
  void* take(size_t n);
  void give_back(void* p);
  bool serves(size_t n) const { return sizes_.count(n) > 0; }

  // DDP's arenas hold a block only for gradients at least this big; smaller ones go through the
  // bucket (a block of its own would cost a page for little).
  static constexpr int64_t kMinBlockBytes = 64 << 10;

 private:
  static constexpr size_t kAlign = 4096;
  bool poisoned() const;  // DDP's: a failed collective may still write into the buffer
  std::shared_ptr<shm::SharedBuffer> buffer_;  // DDP's; null for places
  std::shared_ptr<void> owner_;                 // places: what keeps their memory alive
  bool placed_ = false;                         // serves its places only, never above them
  uint8_t* base_ = nullptr;
  size_t capacity_ = 0;
  std::unordered_set<size_t> sizes_;
  mutable std::mutex mutex_;
  size_t top_ = 0;                                          // never handed out above this
  std::unordered_map<size_t, std::vector<size_t>> free_;   // by size: offsets of freed blocks
  std::unordered_map<size_t, size_t> live_;                // offset -> size
  bool retired_ = false;
};

}  // namespace ddpkit
