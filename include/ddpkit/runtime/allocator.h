// Process-wide glibc malloc settings that suit training.
//
// A large model's gradients, activations and communication buffers are tens of MB each. glibc
// serves blocks above its mmap threshold (dynamic, at most 32 MB) with fresh mappings and returns
// them on free, so every step faults the same memory in again page by page; on a 25M-parameter
// MLP a quarter of the step went to page faults. Raising the mmap and trim thresholds keeps large
// blocks in the heap for reuse. The cost: freed memory below the trim threshold stays with the
// process instead of going back to the system.
//
// It is a process-wide choice, so the library never makes it on its own: call this once, early in
// main (before threads allocate), as `ddpkit train` does. No-op on a libc other than glibc.
#pragma once

#include <cstddef>

namespace ddpkit {

struct AllocatorTuning {
  bool mmap_threshold = false;  // M_MMAP_THRESHOLD was set by this call
  bool trim_threshold = false;  // M_TRIM_THRESHOLD was set by this call
};

// Sets M_MMAP_THRESHOLD and M_TRIM_THRESHOLD to `threshold_bytes` (default 1 GiB), except where the
// user already chose through glibc's MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ variables, or
// DDPKIT_MALLOC_TUNING=0 is set. Returns what it set.
AllocatorTuning tune_allocator_for_training(std::size_t threshold_bytes = std::size_t{1} << 30);

}  // namespace ddpkit
