// GradientArena, and its stage of ddpkit's CPU allocator (include/ddpkit/comm/gradient_arena.h).
//
// Blocks are handed out by exact size: DDP's gradients come back at the same sizes every
// iteration, so a freed block is reused as is and nothing needs coalescing. A DataPtr's context
// is its own address, as c10's default allocator does, so raw_allocate/raw_deleter keep working;
// the deleter finds the arena by address in a small registry, which also keeps an arena alive
// until its last block is freed.
#include <ddpkit/comm/gradient_arena.h>

#include <ddpkit/runtime/cpu_allocator.h>

#include "shm_domain.h"

#include <algorithm>
#include <numeric>

namespace ddpkit {
namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<GradientArena>> arenas;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: blocks may be freed during exit
  return *r;
}

std::shared_ptr<GradientArena> arena_of(const void* p) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& a : r.arenas)
    if (a->contains(p)) return a;
  return nullptr;
}

// A retired arena with no block left: the registry's reference was the last but its owner's.
void unregister(const GradientArena* arena) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.arenas.erase(std::remove_if(r.arenas.begin(), r.arenas.end(), [arena](const auto& a) { return a.get() == arena; }),
                 r.arenas.end());
}

thread_local std::weak_ptr<GradientArena> current;

// Its stage of ddpkit's CPU allocator (runtime/cpu_allocator.h): the calling thread's arena, for
// the sizes it serves.
void* take_from_arena(size_t n) {
  std::shared_ptr<GradientArena> arena = current.lock();
  return arena && arena->serves(n) ? arena->take(n) : nullptr;
}

bool give_back_to_arena(void* p) {
  std::shared_ptr<GradientArena> arena = arena_of(p);
  if (arena) arena->give_back(p);
  return arena != nullptr;
}

}  // namespace

GradientArena::GradientArena(std::shared_ptr<shm::SharedBuffer> buffer, uint8_t* own, std::vector<size_t> block_bytes)
    : buffer_(std::move(buffer)), base_(own), capacity_(buffer_->bytes), sizes_(block_bytes.begin(), block_bytes.end()) {}

GradientArena::GradientArena(std::shared_ptr<void> owner, uint8_t* base, size_t capacity, const std::vector<Place>& places)
    : owner_(std::move(owner)), placed_(true), base_(base), capacity_(capacity) {
  // Listed last first: the free list pops from its back, so equal sizes go out in list order.
  for (auto it = places.rbegin(); it != places.rend(); ++it) {
    if (it->bytes == 0 || it->offset + it->bytes > capacity_) continue;
    sizes_.insert(it->bytes);
    free_[it->bytes].push_back(it->offset);
  }
}

GradientArena::~GradientArena() = default;

void GradientArena::use(const std::shared_ptr<GradientArena>& arena) {
  if (arena) {
    set_cpu_allocator_stage(CpuAllocatorStage::kGradientArena, {&take_from_arena, &give_back_to_arena});
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (std::find(r.arenas.begin(), r.arenas.end(), arena) == r.arenas.end()) r.arenas.push_back(arena);
  }
  current = arena;
}

std::shared_ptr<GradientArena> GradientArena::in_use() { return current.lock(); }

bool GradientArena::poisoned() const { return buffer_ && buffer_->poisoned.load(); }

bool GradientArena::contains(const void* p) const {
  const auto* b = static_cast<const uint8_t*>(p);
  return b >= base_ && b < base_ + capacity_;
}

std::vector<const void*> GradientArena::blocks_in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<const void*> out;
  for (const auto& [offset, size] : live_) out.push_back(base_ + offset);
  return out;
}

size_t GradientArena::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t total = 0;
  for (const auto& [offset, size] : live_) total += size;
  return total;
}

void* GradientArena::take(size_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (retired_ || poisoned()) return nullptr;
  size_t offset;
  auto it = free_.find(n);
  if (it != free_.end() && !it->second.empty()) {
    offset = it->second.back();
    it->second.pop_back();
  } else if (placed_) {
    return nullptr;  // every place of this size is taken
  } else {
    const size_t rounded = (n + kAlign - 1) / kAlign * kAlign;
    if (top_ + rounded > capacity_) return nullptr;  // full: the caller's allocator takes it
    offset = top_;
    top_ += rounded;
  }
  live_[offset] = n;
  return base_ + offset;
}

void GradientArena::give_back(void* p) {
  bool last = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t offset = static_cast<size_t>(static_cast<uint8_t*>(p) - base_);
    auto it = live_.find(offset);
    if (it == live_.end()) return;
    // After a failed collective a peer may still write here: such a block is never reused.
    if (!poisoned()) free_[it->second].push_back(offset);
    live_.erase(it);
    last = retired_ && live_.empty();
  }
  if (last) unregister(this);
}

void GradientArena::retire() {
  bool unused = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    retired_ = true;
    unused = live_.empty();
  }
  if (unused) unregister(this);
}

}  // namespace ddpkit
