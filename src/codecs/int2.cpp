// int2: 2-bit codes with one float32 scale per block of 128 values (0.28 B/value). Three levels,
// -s, 0 and +s with s = 2/3 of the block's max|x|: a value moves by at most a third of that max (the
// same bound as four levels -max, -max/3, max/3, max, and on heavy-tailed values such as
// pseudo-gradients half their squared error), and the rounding is odd-symmetric, so its error is
// zero-mean and an exact 0 stays 0 (four levels have no zero: each 0 in a mixed block, such as
// an unused embedding row, was pushed by +max/3 every round). DiLoCo's outer momentum averages the
// rounding over rounds, and error feedback (DiLoCoOptions::error_feedback) can carry it to the
// next round instead.
//
// Layout of n values: ceil(n / 4) bytes of codes (value 4i+j in bits 2j..2j+1 of byte i), padded
// to a multiple of 4, then one float32 scale s per block. Code k in 0..2 decodes to (k - 1) * s (3
// is never written, and decodes to 0). An all-zero block has scale 0. A block holding NaN or Inf
// gets a NaN scale: all of it decodes to NaN. Plain loops: there is one code path at every SIMD
// level.
#include "codec_checks.h"
#include "packed_blocks.h"

#include <ddpkit/codecs/codec.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace ddpkit {
namespace codecs {
namespace {
// Its own namespace: the codecs' files compile as one unity batch, and int4.cpp has helpers of
// the same names.
namespace int2 {

constexpr int64_t kBlock = detail::kPackedBlock;

int64_t code_bytes(int64_t numel) { return ((numel + 3) / 4 + 3) / 4 * 4; }
float block_scale(const float* x, int64_t n) { return detail::block_absmax(x, n) * (2.f / 3.f); }

// The nearest level's code: level (k - 1) * scale is nearest for k = round(x / scale) + 1. Ties
// (|x| = scale / 2) round to even, i.e. to 0 on both sides: -x always gets the opposite level of x.
inline uint8_t code_of(float x, float inverse) {
  float k = std::nearbyint(x * inverse);
  k = k > 1.f ? 1.f : (k < -1.f ? -1.f : k);
  return static_cast<uint8_t>(k + 1.f);
}

constexpr float kLevel[4] = {-1.f, 0.f, 1.f, 0.f};

class Int2Codec final : public Codec {
 public:
  const std::string& name() const override { return name_; }
  int64_t encoded_bytes(int64_t numel) const override { return code_bytes(numel) + 4 * detail::packed_blocks(numel); }

  void encode(const at::Tensor& src, const at::Tensor& out) const override {
    detail::check_encode(*this, src, src.numel(), out, detail::Values::Float32Cpu);
    const int64_t n = src.numel();
    const float* x = src.data_ptr<float>();
    uint8_t* codes = out.data_ptr<uint8_t>();
    uint8_t* scales = codes + code_bytes(n);
    std::memset(codes, 0, static_cast<size_t>(code_bytes(n)));
    for (int64_t b = 0; b < detail::packed_blocks(n); ++b) {
      const int64_t start = b * kBlock, len = std::min(kBlock, n - start);
      const float scale = block_scale(x + start, len);
      std::memcpy(scales + 4 * b, &scale, 4);
      if (std::isnan(scale) || scale == 0.f) continue;  // NaN or 0 through the scale
      const float inverse = 1.f / scale;
      // kBlock is a multiple of 4, so a block starts on a byte.
      uint8_t* c = codes + start / 4;
      for (int64_t i = 0; i < len; ++i) c[i / 4] |= static_cast<uint8_t>(code_of(x[start + i], inverse) << (2 * (i & 3)));
    }
  }

  void decode(const at::Tensor& encoded, const at::Tensor& dst, float multiplier, bool accumulate) const override {
    detail::check_decode(*this, encoded, dst.numel(), dst, detail::Values::Float32Cpu);
    const int64_t n = dst.numel();
    const uint8_t* codes = encoded.data_ptr<uint8_t>();
    const uint8_t* scales = codes + code_bytes(n);
    float* out = dst.data_ptr<float>();
    for (int64_t b = 0; b < detail::packed_blocks(n); ++b) {
      const int64_t start = b * kBlock, len = std::min(kBlock, n - start);
      float scale;
      std::memcpy(&scale, scales + 4 * b, 4);
      scale *= multiplier;
      const uint8_t* c = codes + start / 4;
      float* o = out + start;
      for (int64_t i = 0; i < len; ++i) {
        const int k = (c[i / 4] >> (2 * (i & 3))) & 3;
        const float v = kLevel[k] * scale;
        o[i] = accumulate ? o[i] + v : v;
      }
    }
  }

  int64_t block() const override { return kBlock; }
  double error_bound() const override { return 1.0 / 3.0; }

 private:
  std::string name_ = "int2";
};

}  // namespace int2
}  // namespace

std::shared_ptr<const Codec> make_int2_codec() { return std::make_shared<int2::Int2Codec>(); }

}  // namespace codecs
}  // namespace ddpkit
