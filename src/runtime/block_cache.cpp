// LargeBlockCache, and its stage of ddpkit's CPU allocator (include/ddpkit/runtime/block_cache.h).
#include <ddpkit/runtime/block_cache.h>

#include <ddpkit/runtime/cpu_allocator.h>

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

// ---- a stage of ddpkit's CPU allocator -------------------------------------------------------

namespace {
LargeBlockCache* installed = nullptr;  // never destroyed: tensors may be freed during exit

void* take_large(size_t n) { return installed->serves(n) ? installed->take(n) : nullptr; }
bool give_back_large(void* p) { return installed->give_back(p); }
}  // namespace

bool install_large_block_cache(size_t min_bytes, size_t idle_limit_bytes) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  // A user's own CPU allocator keeps its large blocks.
  if (installed || !cpu_allocator_fronts_c10_default()) return false;
  installed = new LargeBlockCache(min_bytes, idle_limit_bytes);
  return set_cpu_allocator_stage(CpuAllocatorStage::kLargeBlockCache, {&take_large, &give_back_large});
}

LargeBlockCache* installed_large_block_cache() { return installed; }

}  // namespace ddpkit
