// What the packed low-bit codecs (int4.cpp, int2.cpp) share: blocks of 128 values, each with one
// float32 scale taken from the block's largest |x|.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace ddpkit {
namespace codecs {
namespace detail {

constexpr int64_t kPackedBlock = 128;

inline int64_t packed_blocks(int64_t numel) { return (numel + kPackedBlock - 1) / kPackedBlock; }

// The largest |x| of the block's n values, or NaN when one is NaN or Inf (the block's scale is then
// NaN, so all of it decodes to NaN).
inline float block_absmax(const float* x, int64_t n) {
  float amax = 0.f;
  bool nonfinite = false;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    nonfinite |= !(a <= std::numeric_limits<float>::max());
    amax = a > amax ? a : amax;
  }
  return nonfinite ? std::numeric_limits<float>::quiet_NaN() : amax;
}

}  // namespace detail
}  // namespace codecs
}  // namespace ddpkit
