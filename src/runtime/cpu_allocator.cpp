// ddpkit's CPU allocator and its stages (include/ddpkit/runtime/cpu_allocator.h).
#include <ddpkit/runtime/cpu_allocator.h>

#include <ddpkit/compat.h>

#include <c10/core/CPUAllocator.h>

#include <array>
#include <atomic>
#include <mutex>

namespace ddpkit {
namespace {

constexpr size_t kStages = 2;

// Set once each and read on every allocation: atomics, never cleared (blocks may be freed during exit).
struct Stage {
  std::atomic<void* (*)(size_t)> take{nullptr};
  std::atomic<bool (*)(void*)> give_back{nullptr};
};
std::array<Stage, kStages> stages;

c10::Allocator* replaced = nullptr;
c10::DeleterFnPtr replaced_raw_deleter = nullptr;

// A block's DataPtr deleter: its stage's.
template <size_t S>
void free_from_stage(void* p) {
  stages[S].give_back.load(std::memory_order_acquire)(p);
}
constexpr std::array<c10::DeleterFnPtr, kStages> kStageDeleters = {&free_from_stage<0>, &free_from_stage<1>};

// raw_allocate's blocks come back without their DataPtr: a stage's, or the replaced allocator's.
void free_any(void* p) {
  if (!p) return;
  for (const Stage& s : stages)
    if (auto give_back = s.give_back.load(std::memory_order_acquire); give_back && give_back(p)) return;
  if (replaced_raw_deleter) replaced_raw_deleter(p);
}

struct DdpkitCpuAllocator final : compat::CpuAllocatorBase {
  c10::DataPtr allocate_bytes(size_t n) const {
    if (n > 0)
      for (size_t s = 0; s < kStages; ++s)
        if (auto take = stages[s].take.load(std::memory_order_acquire))
          if (void* p = take(n)) return {p, p, kStageDeleters[s], c10::Device(c10::DeviceType::CPU)};
    // allocate is const in 1.13 and not in 2.x: call it through the base.
    return static_cast<c10::Allocator*>(replaced)->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const { return &free_any; }
};

void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    static DdpkitCpuAllocator* allocator = new DdpkitCpuAllocator();  // never destroyed, as its blocks
    replaced = c10::GetCPUAllocator();
    replaced_raw_deleter = replaced->raw_deleter();
    c10::SetCPUAllocator(allocator, /*priority=*/0);
  });
}

}  // namespace

bool set_cpu_allocator_stage(CpuAllocatorStage stage, CpuAllocatorStageFns fns) {
  static std::mutex mutex;
  const auto s = static_cast<size_t>(stage);
  if (s >= kStages || !fns.take || !fns.give_back) return false;
  install();
  if (stages[s].take.load(std::memory_order_acquire)) return false;  // the common case: set already
  std::lock_guard<std::mutex> lock(mutex);
  if (stages[s].take.load()) return false;
  // give_back first: a block is taken only once its stage can take it back.
  stages[s].give_back.store(fns.give_back, std::memory_order_release);
  stages[s].take.store(fns.take, std::memory_order_release);
  return true;
}

bool cpu_allocator_fronts_c10_default() {
  install();
  return replaced == c10::GetDefaultCPUAllocator();
}

}  // namespace ddpkit
