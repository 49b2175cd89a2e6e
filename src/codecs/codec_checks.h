// The argument checks every codec's encode and decode share (src/codecs/*.cpp), so that a wrong
// buffer is named the same way whichever codec gets it.
#pragma once

#include <ddpkit/codecs/codec.h>
#include <ddpkit/error.h>

namespace ddpkit {
namespace codecs {
namespace detail {

// What a codec's values may be: float32 on any device; any floating type (the casts, which the
// compress hooks feed with fp16/bf16 gradients too); float32 on the CPU (the int4/int2 loops).
enum class Values { Float32, AnyFloating, Float32Cpu };

// `numel` encoded values (at least the tensor's), the buffers contiguous and on one device.
inline void check_encode(const Codec& c, const at::Tensor& src, int64_t numel, const at::Tensor& out,
                         Values values = Values::Float32) {
  const bool any = values == Values::AnyFloating;
  DDPKIT_CHECK(src.is_contiguous() && (src.scalar_type() == at::kFloat || (any && at::isFloatingType(src.scalar_type()))),
               c.name(), " codec: encode takes contiguous ", any ? "floating" : "float32", " values, got ",
               src.scalar_type(), src.is_contiguous() ? "" : " (not contiguous)");
  DDPKIT_CHECK(values != Values::Float32Cpu || src.device().is_cpu(), c.name(), " codec: encode takes CPU values, got ",
               src.device());
  DDPKIT_CHECK(numel >= src.numel(), c.name(), " codec: ", src.numel(), " values do not fit an encoding of ", numel);
  DDPKIT_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.numel() == c.encoded_bytes(numel) &&
                   out.device() == src.device(),
               c.name(), " codec: encode needs a contiguous uint8 output of ", c.encoded_bytes(numel), " bytes on ",
               src.device(), " for ", numel, " values, got ", out.numel(), " of ", out.scalar_type(), " on ",
               out.device());
}

inline void check_decode(const Codec& c, const at::Tensor& encoded, int64_t numel, const at::Tensor& dst,
                         Values values = Values::Float32) {
  const bool any = values == Values::AnyFloating;
  DDPKIT_CHECK(dst.is_contiguous() && (dst.scalar_type() == at::kFloat || (any && at::isFloatingType(dst.scalar_type()))),
               c.name(), " codec: decode writes contiguous ", any ? "floating" : "float32", " values, got ",
               dst.scalar_type(), dst.is_contiguous() ? "" : " (not contiguous)");
  DDPKIT_CHECK(values != Values::Float32Cpu || dst.device().is_cpu(), c.name(), " codec: decode writes CPU values, got ",
               dst.device());
  DDPKIT_CHECK(numel >= dst.numel(), c.name(), " codec: ", dst.numel(), " values are more than the ", numel, " encoded");
  DDPKIT_CHECK(encoded.scalar_type() == at::kByte && encoded.is_contiguous() && encoded.numel() == c.encoded_bytes(numel) &&
                   encoded.device() == dst.device(),
               c.name(), " codec: ", numel, " values decode from ", c.encoded_bytes(numel), " contiguous uint8 bytes on ",
               dst.device(), ", got ", encoded.numel(), " of ", encoded.scalar_type(), " on ", encoded.device());
}

// An error-feedback residual: float32, contiguous, one value per encoded input value.
inline void check_residual(const Codec& c, const at::Tensor& residual, int64_t n) {
  DDPKIT_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.numel() == n, c.name(),
               " codec: the residual must be contiguous float32 of ", n, " values, got ", residual.numel(), " of ",
               residual.scalar_type());
}

}  // namespace detail
}  // namespace codecs
}  // namespace ddpkit
