// int4: symmetric 4-bit codes with one float32 scale per block of 128 values (0.53 B/value).
//
// Layout of n values: ceil(n / 2) bytes of codes (value 2i in the low nibble of byte i, 2i+1 in
// the high one; a code c in -7..7 stored as c + 8), padded to a multiple of 4, then one float32
// scale max|x| / 7 per block. Decoding gives c * scale, so a value is off by at most
// max_block|x| / 14. A block holding NaN or Inf gets a NaN scale: all of it decodes to NaN. One
// plain loop per block, written so the compiler vectorizes it the same way at every level.
#include "codec_checks.h"
#include "packed_blocks.h"

#include <ddpkit/codecs/codec.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace ddpkit {
namespace codecs {
namespace {

constexpr int64_t kBlock = detail::kPackedBlock;

int64_t code_bytes(int64_t numel) { return ((numel + 1) / 2 + 3) / 4 * 4; }
float block_scale(const float* x, int64_t n) { return detail::block_absmax(x, n) / 7.f; }

inline uint8_t code_of(float x, float inverse) {
  float q = std::nearbyint(x * inverse);
  q = q > 7.f ? 7.f : (q < -7.f ? -7.f : q);
  return static_cast<uint8_t>(static_cast<int>(q) + 8);
}

class Int4Codec final : public Codec {
 public:
  const std::string& name() const override { return name_; }
  int64_t encoded_bytes(int64_t numel) const override { return code_bytes(numel) + 4 * detail::packed_blocks(numel); }

  void encode(const at::Tensor& src, const at::Tensor& out) const override {
    detail::check_encode(*this, src, src.numel(), out, detail::Values::Float32Cpu);
    const int64_t n = src.numel();
    const float* x = src.data_ptr<float>();
    uint8_t* codes = out.data_ptr<uint8_t>();
    uint8_t* scales = codes + code_bytes(n);
    std::memset(codes, 0x88, static_cast<size_t>(code_bytes(n)));  // code 0 everywhere, padding included
    for (int64_t b = 0; b < detail::packed_blocks(n); ++b) {
      const int64_t start = b * kBlock, len = std::min(kBlock, n - start);
      const float scale = block_scale(x + start, len);
      std::memcpy(scales + 4 * b, &scale, 4);
      if (std::isnan(scale) || scale == 0.f) continue;  // codes 0: NaN or 0 through the scale
      const float inverse = 1.f / scale;
      // kBlock is even, so a block starts on a byte.
      uint8_t* c = codes + start / 2;
      int64_t i = 0;
      for (; i + 1 < len; i += 2)
        c[i / 2] = static_cast<uint8_t>(code_of(x[start + i], inverse) | (code_of(x[start + i + 1], inverse) << 4));
      if (i < len) c[i / 2] = static_cast<uint8_t>(code_of(x[start + i], inverse) | 0x80);
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
      const uint8_t* c = codes + start / 2;
      float* o = out + start;
      for (int64_t i = 0; i < len; ++i) {
        const int code = ((c[i / 2] >> (4 * (i & 1))) & 0xF) - 8;
        const float v = static_cast<float>(code) * scale;
        o[i] = accumulate ? o[i] + v : v;
      }
    }
  }

  int64_t block() const override { return kBlock; }
  double error_bound() const override { return 1.0 / 14.0; }

 private:
  std::string name_ = "int4";
};

}  // namespace

std::shared_ptr<const Codec> make_int4_codec() { return std::make_shared<Int4Codec>(); }

}  // namespace codecs
}  // namespace ddpkit
