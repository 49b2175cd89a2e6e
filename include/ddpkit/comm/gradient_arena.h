// Memory for DDP's gradients that every rank on the host maps (docs/shared_memory.md,
// "Gradients born in shared memory"). While an arena is in use on a thread, CPU allocations of
// exactly one of its block sizes come from it (as long as it has room): autograd's gradient of a
// parameter of that size is then born where the peers can read it and write their shares of the
// sum into it, so the bucket's allreduce copies nothing. Everything else, and everything on other
// threads, comes from the CPU allocator that was installed before (ddpkit installs a forwarding
// allocator once, the first time an arena is made).
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
  ~GradientArena();
  GradientArena(const GradientArena&) = delete;
  GradientArena& operator=(const GradientArena&) = delete;

  // From now on, on the calling thread, serve allocations from `arena`; null stops.
  static void use(const std::shared_ptr<GradientArena>& arena);
  // The arena in use on the calling thread, if any.
  static std::shared_ptr<GradientArena> in_use();

  bool contains(const void* p) const;
  size_t capacity() const { return capacity_; }
  size_t bytes_in_use() const;
  // The owner lets go: the arena goes once its last block is freed.
  void retire();

  // The forwarding allocator's side; not for callers.
  void* take(size_t n);
  void give_back(void* p);
  bool serves(size_t n) const { return sizes_.count(n) > 0; }

 private:
  static constexpr size_t kAlign = 4096;
  std::shared_ptr<shm::SharedBuffer> buffer_;
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
