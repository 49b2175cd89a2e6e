// LargeBlockCache, and the CPU allocator that puts libtorch's large blocks in it
// (include/ddpkit/runtime/block_cache.h).
#include <ddpkit/runtime/block_cache.h>

#include <ddpkit/compat.h>

#include <c10/core/CPUAllocator.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>

namespace ddpkit {

namespace {
size_t page_rounded(size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}
}  // namespace

LargeBlockCache::LargeBlockCache(size_t min_bytes, size_t idle_limit_bytes)
    : min_bytes_(std::max<size_t>(1, min_bytes)), idle_limit_(idle_limit_bytes) {}

LargeBlockCache::~LargeBlockCache() { release_idle(); }

void* LargeBlockCache::take(size_t n) {
  const size_t bytes = page_rounded(std::max<size_t>(n, 1));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Its own size, the most recently kept (its pages are the likeliest still resident); else the
    // smallest larger one, its tail unmapped: pages the larger block touched would stay resident
    // behind a smaller one (DDP's 96 MB broadcast buffer under a 64 MB momentum held 32 MB more).
    auto [first, last] = by_size_.equal_range(bytes);  // first: the smallest kept size >= bytes
    auto hit = first != last ? std::prev(last) : first;
    if (hit != by_size_.end()) {
      const Idle block = *hit->second;
      idle_.erase(hit->second);
      by_size_.erase(hit);
      stats_.idle_bytes -= block.bytes;
      if (block.bytes > bytes) {
        munmap(static_cast<char*>(block.p) + bytes, block.bytes - bytes);
        stats_.mapped_bytes -= block.bytes - bytes;
      }
      out_[block.p] = bytes;
      ++stats_.reused;
      return block.p;
    }
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  out_[p] = bytes;
  stats_.mapped_bytes += bytes;
  ++stats_.mapped;
  return p;
}

bool LargeBlockCache::give_back(void* p) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = out_.find(p);
  if (it == out_.end()) return false;
  const size_t bytes = it->second;
  out_.erase(it);
  by_size_.emplace(bytes, idle_.insert(idle_.end(), Idle{p, bytes}));
  stats_.idle_bytes += bytes;
  while (stats_.idle_bytes > idle_limit_) unmap_oldest_locked();
  return true;
}

void LargeBlockCache::unmap_oldest_locked() {
  const Idle oldest = idle_.front();
  auto [first, last] = by_size_.equal_range(oldest.bytes);
  for (auto it = first; it != last; ++it)
    if (it->second == idle_.begin()) {
      by_size_.erase(it);
      break;
    }
  idle_.pop_front();
  munmap(oldest.p, oldest.bytes);
  stats_.idle_bytes -= oldest.bytes;
  stats_.mapped_bytes -= oldest.bytes;
  ++stats_.unmapped;
}

void LargeBlockCache::release_idle() {
  std::lock_guard<std::mutex> lock(mutex_);
  while (!idle_.empty()) unmap_oldest_locked();
}

LargeBlockCache::Stats LargeBlockCache::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

// ---- behind libtorch's CPU allocator ----------------------------------------------------------

namespace {

// Never destroyed: tensors may be freed during exit.
LargeBlockCache* installed = nullptr;
c10::DeleterFnPtr next_raw_deleter = nullptr;

void free_cached(void* p) { installed->give_back(p); }

// raw_allocate's blocks come back here without their DataPtr: ours, or the replaced allocator's.
void free_any(void* p) {
  if (p && !installed->give_back(p) && next_raw_deleter) next_raw_deleter(p);
}

struct CachingCpuAllocator final : compat::CpuAllocatorBase {
  c10::Allocator* next = nullptr;
  c10::DataPtr allocate_bytes(size_t n) const {
    if (installed->serves(n))
      if (void* p = installed->take(n)) return {p, p, &free_cached, c10::Device(c10::DeviceType::CPU)};
    // The allocator we replaced (allocate is const in 1.13 and not in 2.x: call it through the base).
    return static_cast<c10::Allocator*>(next)->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const { return &free_any; }
};

}  // namespace

bool install_large_block_cache(size_t min_bytes, size_t idle_limit_bytes) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (installed) return false;
  // Only in front of c10's own allocator: one installed later (GradientArena's forwarding one)
  // passes on to what it found, and would be bypassed if this went in front of it.
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != c10::GetDefaultCPUAllocator()) return false;
  installed = new LargeBlockCache(min_bytes, idle_limit_bytes);
  static CachingCpuAllocator* allocator = new CachingCpuAllocator();
  allocator->next = current;
  next_raw_deleter = current->raw_deleter();
  c10::SetCPUAllocator(allocator, /*priority=*/0);
  return true;
}

LargeBlockCache* installed_large_block_cache() { return installed; }

}  // namespace ddpkit
