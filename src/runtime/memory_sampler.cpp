#include <ddpkit/runtime/memory_sampler.h>

#include <ddpkit/error.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

namespace ddpkit {

namespace {

// "Name:   1234 kB" lines of a /proc file into the fields named in `want`.
template <size_t N>
void read_kb_fields(const char* path, const char* const (&names)[N], int64_t* const (&out)[N]) {
  FILE* f = std::fopen(path, "r");
  if (!f) return;
  char line[256];
  while (std::fgets(line, sizeof line, f)) {
    for (size_t i = 0; i < N; ++i) {
      const size_t len = std::strlen(names[i]);
      long long kb = 0;
      if (std::strncmp(line, names[i], len) == 0 && line[len] == ':' && std::sscanf(line + len + 1, "%lld", &kb) == 1)
        *out[i] = kb * 1024;
    }
  }
  std::fclose(f);
}

struct OwnedRegion {
  size_t bytes;
  bool reserved;
};
std::mutex& owned_mutex() {
  static std::mutex m;
  return m;
}
std::map<const void*, OwnedRegion>& owned_regions() {
  static auto* regions = new std::map<const void*, OwnedRegion>();  // outlives static destructors
  return *regions;
}

// Pages of the shared mapping at `base` that are in memory (allocated, whether or not this process
// touched them).
int64_t resident_bytes(const void* base, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t pages = (bytes + page - 1) / page;
  std::vector<unsigned char> in(pages);
  if (mincore(const_cast<void*>(base), bytes, in.data()) != 0) return static_cast<int64_t>(bytes);
  int64_t n = 0;
  for (unsigned char v : in) n += v & 1;
  return n * static_cast<int64_t>(page);
}

}  // namespace

void note_owned_shared_memory(const void* base, size_t bytes, bool reserved) {
  std::lock_guard<std::mutex> lock(owned_mutex());
  owned_regions()[base] = OwnedRegion{bytes, reserved};
}

void forget_owned_shared_memory(const void* base) {
  std::lock_guard<std::mutex> lock(owned_mutex());
  owned_regions().erase(base);
}

namespace {

// The owned regions' bytes and count, under one lock.
std::pair<int64_t, int> owned_totals() {
  std::lock_guard<std::mutex> lock(owned_mutex());
  int64_t total = 0;
  for (const auto& kv : owned_regions())
    total += kv.second.reserved ? static_cast<int64_t>(kv.second.bytes) : resident_bytes(kv.first, kv.second.bytes);
  return {total, static_cast<int>(owned_regions().size())};
}

}  // namespace

int64_t owned_shared_memory_bytes() { return owned_totals().first; }

int owned_shared_memory_regions() { return owned_totals().second; }

MemoryCounts read_memory_counts(bool with_pss) {
  MemoryCounts c;
  read_kb_fields("/proc/self/status", {"VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"},
                 {&c.rss, &c.anon, &c.file, &c.shmem, &c.peak_rss});
  if (with_pss) read_kb_fields("/proc/self/smaps_rollup", {"Pss", "Pss_File", "Pss_Shmem"}, {&c.pss, &c.pss_file, &c.pss_shmem});
  std::tie(c.owned_shared, c.owned_regions) = owned_totals();
  return c;
}

PeakMemorySampler::PeakMemorySampler(std::chrono::milliseconds interval) : interval_(interval) {
  DDPKIT_CHECK(interval.count() > 0, "PeakMemorySampler: the interval must be positive, got ", interval.count(), " ms");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const MemoryCounts c = read_memory_counts(true);
    peak_rss_at_start_ = c.peak_rss;
    take(c);
    pss_reads_ = 1;
  }
  thread_ = std::thread([this] { run(); });
}

PeakMemorySampler::~PeakMemorySampler() { stop(); }

void PeakMemorySampler::take(const MemoryCounts& c) {
  // Learn this process's share of its file and shared-memory pages where PSS was read. Pss_Shmem is
  // missing on kernels before 5.x's rollup split; then the whole Pss - anonymous is spread over both.
  if (c.pss >= 0) {
    if (c.pss_file >= 0 && c.pss_shmem >= 0) {
      share_file_ = c.file > 0 ? std::min(1.0, static_cast<double>(c.pss_file) / c.file) : 1.0;
      share_shmem_ = c.shmem > 0 ? std::min(1.0, static_cast<double>(c.pss_shmem) / c.shmem) : 1.0;
    } else if (c.file + c.shmem > 0) {
      share_file_ = share_shmem_ = std::clamp(static_cast<double>(c.pss - c.anon) / (c.file + c.shmem), 0.0, 1.0);
    }
  }
  // Shared memory: what this process made for its peers, in full, where it made any, but never less
  // than its share of all it maps (shared memory made elsewhere, or owned regions that are mostly
  // untouched and so count only what is resident); else its share.
  const double share = share_shmem_ * static_cast<double>(c.shmem);
  const double shmem_part = c.owned_regions > 0 ? std::max(static_cast<double>(c.owned_shared), share) : share;
  const double shared_part = share_file_ * c.file + shmem_part;
  const int64_t estimate = c.anon + static_cast<int64_t>(shared_part);
  peak_estimate_ = std::max(peak_estimate_, estimate);
  if (c.rss >= largest_rss_) {
    largest_rss_ = c.rss;
    shared_discount_at_largest_ = c.file + c.shmem - static_cast<int64_t>(shared_part);
  }
  peak_rss_ = std::max(peak_rss_, c.peak_rss);
}

void PeakMemorySampler::run() {
  using clock = std::chrono::steady_clock;
  auto next_pss = clock::now() + std::chrono::seconds(1);
  auto pss_gap = std::chrono::seconds(1);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, interval_, [this] { return stopping_; });
    if (stopping_) break;
    const bool with_pss = clock::now() >= next_pss;
    lock.unlock();
    const MemoryCounts c = read_memory_counts(with_pss);
    lock.lock();
    if (with_pss) {
      ++pss_reads_;
      pss_gap *= 2;
      next_pss = clock::now() + pss_gap;
    }
    take(c);
  }
}

void PeakMemorySampler::sample() {
  const MemoryCounts c = read_memory_counts(false);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!stopped_) take(c);
}

void PeakMemorySampler::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return;
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  const MemoryCounts c = read_memory_counts(true);
  std::lock_guard<std::mutex> lock(mutex_);
  ++pss_reads_;
  take(c);
  // A peak between polls: VmHWM is exact for resident pages, and the shared part at the largest
  // poll is what of it was not this process's.
  if (peak_rss_ > peak_rss_at_start_) peak_estimate_ = std::max(peak_estimate_, peak_rss_ - shared_discount_at_largest_);
  stopped_ = true;
}

int64_t PeakMemorySampler::peak_pss_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_estimate_;
}

int64_t PeakMemorySampler::peak_rss_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_rss_;
}

}  // namespace ddpkit
