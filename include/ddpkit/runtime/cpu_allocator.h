// ddpkit's CPU allocator: one allocator put in front of libtorch's, which asks its stages in a fixed
// order and passes what none of them takes to the allocator it replaced:
//   1. the gradient arena in use on the calling thread (comm/gradient_arena.h): DDP's gradients
//      born in shared memory, FSDP's in their unit's flat gradient;
//   2. the large block cache (runtime/block_cache.h), where tune_allocator_for_training put one;
//   3. the allocator it replaced.
// It goes in the first time a stage is set, so the order holds whichever of them comes first: the
// arena must see its gradients before the cache sees any large block. Each block's deleter is its
// stage's; raw_deleter asks every stage whose block it is.
#pragma once

#include <cstddef>

namespace ddpkit {

enum class CpuAllocatorStage { kGradientArena = 0, kLargeBlockCache = 1 };

struct CpuAllocatorStageFns {
  void* (*take)(size_t n) = nullptr;     // a block of n > 0 bytes, or null: the next stage's
  bool (*give_back)(void* p) = nullptr;  // false when p is not this stage's block
};

// Installs ddpkit's CPU allocator if it is not yet, and sets the stage. Each stage is set once:
// false (nothing changed) when it is set already.
bool set_cpu_allocator_stage(CpuAllocatorStage stage, CpuAllocatorStageFns fns);

// Installs ddpkit's CPU allocator if it is not yet; true when the allocator it stands in front of
// is c10's own (not one a user installed before it).
bool cpu_allocator_fronts_c10_default();

}  // namespace ddpkit
