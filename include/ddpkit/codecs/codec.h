// Codecs for float32 values on the wire, behind one interface: the outer all-reduce of DiLoCo
// (ddpkit/diloco) takes any of them by name, and tests/codec_conformance_test.cpp runs one suite
// against every codec make_codec knows.
//
//   fp32   4 B/value, exact
//   fp16   2 B/value, round to nearest even (c10::Half); relative error 2^-11 for |x| in
//          [6.1e-5, 65504] only: below, fp16's subnormals keep an absolute error of 3e-8 (use bf16
//          for pseudo-gradients that small); above, a value may become Inf (normal_min, finite_max)
//   bf16   2 B/value, round to nearest even (c10::BFloat16): float32's range
//   int8   1 B/value + 4 B per block of 256: symmetric, scale max|x|/127 (codecs/quantize.h)
//   int4   0.5 B/value + 4 B per block of 128: symmetric, codes -7..7, scale max|x|/7 (0.53 B/value)
//   int2   0.25 B/value + 4 B per block of 128: levels -2/3, 0, 2/3 of max|x| (0.28 B/value)
//
// Every codec: a NaN or Inf input never decodes to a finite value (a block codec turns the whole
// block into NaN); the error of a finite value is at most error_bound() times |x| (block() == 1,
// within [normal_min(), finite_max()]) or times the largest |x| of its block; the rounding is
// odd-symmetric (-x decodes to minus what x decodes to), so an exact 0 stays 0 and the error is
// zero-mean; a codec with kernels per SIMD level (simd_kernels()) writes the same bytes at every
// level. A new codec is
// one file under src/codecs/ and one line in make_codec (src/codecs/codec.cpp): encode, decode,
// the sizes; encode_padded and decode_prefix have general defaults it may speed up.
//
// Users: DDP's fp16/bf16 hooks and wrappers and the int8 allreduce hook (ddpkit/hooks), and
// DiLoCo's outer all-reduce (ddpkit/diloco). fp32, fp16, bf16 and int8 run on any device (the
// casts also from any floating type); int4 and int2 on CPU.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit {
namespace codecs {

class Codec {
 public:
  virtual ~Codec() = default;
  virtual const std::string& name() const = 0;
  // Bytes of `numel` values encoded.
  virtual int64_t encoded_bytes(int64_t numel) const = 0;
  // `src`: contiguous float32 CPU values; `out`: contiguous uint8, encoded_bytes(src.numel()) bytes.
  virtual void encode(const at::Tensor& src, const at::Tensor& out) const = 0;
  // dst = decode(encoded) * multiplier, or dst += that when `accumulate`; dst is contiguous
  // float32 of the encoded count, `encoded` its encoded_bytes.
  virtual void decode(const at::Tensor& encoded, const at::Tensor& dst, float multiplier = 1.0f,
                      bool accumulate = false) const = 0;
  // Values that share one scale (1: each is cast on its own).
  virtual int64_t block() const = 0;
  // The largest error of a finite value, relative to |x| (block() == 1) or to its block's max |x|.
  virtual double error_bound() const = 0;
  // The magnitudes over which a cast (block() == 1) keeps error_bound(): [normal_min(),
  // finite_max()]. Below normal_min() the format's subnormals keep an absolute error of at most
  // normal_min() * error_bound(); above finite_max() a value may round to +-Inf. Block codecs scale
  // each block: every finite float32.
  virtual double normal_min() const { return 0; }
  virtual double finite_max() const;
  // Whether the codec runs kernels chosen by the SIMD level (set_simd_level): fp16, bf16, int8.
  virtual bool simd_kernels() const { return false; }

  // The element type a process group can sum the encoded bytes as (fp32, fp16, bf16: an allreduce
  // of the encoding is the encoding of the sum), or Undefined for a block codec, whose codes are
  // decoded before they are summed (the reduce-scatter / all-gather of hooks and DiLoCo).
  virtual at::ScalarType summable_type() const { return at::ScalarType::Undefined; }

  // The general encode: src * multiplier (src.numel() <= numel values; the rest of the `numel`
  // count as zeros) into `out` (encoded_bytes(numel) bytes). With `residual` defined (float32,
  // src.numel() values) it also writes src * multiplier - decode(out) there: the error that error
  // feedback adds back next time. The default pads and scales in a temporary.
  virtual void encode_padded(const at::Tensor& src, int64_t numel, const at::Tensor& out, float multiplier = 1.0f,
                             const at::Tensor& residual = {}) const;
  // dst = decode(encoded)[0 : dst.numel()] * multiplier, or dst += that when `accumulate`;
  // `encoded` holds `numel` values (dst.numel() <= numel). The default decodes into a temporary.
  virtual void decode_prefix(const at::Tensor& encoded, int64_t numel, const at::Tensor& dst, float multiplier = 1.0f,
                             bool accumulate = false) const;
};

// The codec named `name` (codec_names()); an unknown name is a UsageError listing them.
std::shared_ptr<const Codec> make_codec(const std::string& name);
std::vector<std::string> codec_names();

// int8 with `block` values per scale (a positive multiple of 16; make_codec("int8") is block
// 256); the int8 allreduce hook's Int8Options::block chooses it.
std::shared_ptr<const Codec> make_int8_codec(int64_t block);
// The 4-bit and 2-bit codecs (src/codecs/int4.cpp, int2.cpp), exposed for make_codec.
std::shared_ptr<const Codec> make_int4_codec();
std::shared_ptr<const Codec> make_int2_codec();

}  // namespace codecs
}  // namespace ddpkit
