#include <ddpkit/runtime/allocator.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace ddpkit {

AllocatorTuning tune_allocator_for_training(std::size_t threshold_bytes) {
  AllocatorTuning done;
#if defined(__GLIBC__)
  const char* off = std::getenv("DDPKIT_MALLOC_TUNING");
  if (off && std::strcmp(off, "0") == 0) return done;
  // mallopt takes an int, and returns 1 when glibc accepted the value.
  const int value = threshold_bytes > static_cast<std::size_t>(INT_MAX) ? INT_MAX : static_cast<int>(threshold_bytes);
  if (!std::getenv("MALLOC_MMAP_THRESHOLD_")) done.mmap_threshold = mallopt(M_MMAP_THRESHOLD, value) == 1;
  if (!std::getenv("MALLOC_TRIM_THRESHOLD_")) done.trim_threshold = mallopt(M_TRIM_THRESHOLD, value) == 1;
#else
  (void)threshold_bytes;
#endif
  return done;
}

}  // namespace ddpkit
