// The codec interface (include/ddpkit/codecs/codec.h) over the existing kernels: fp32, the
// fp16/bf16 casts (codecs/cast.h) and block int8 (codecs/quantize.h); int4 and int2 have files of their own.
#include "codec_checks.h"

#include <ddpkit/codecs/cast.h>
#include <ddpkit/codecs/codec.h>
#include <ddpkit/codecs/quantize.h>
#include <ddpkit/error.h>

#include <cstring>
#include <functional>
#include <limits>
#include <map>

namespace ddpkit {
namespace codecs {
namespace {

using detail::check_decode;
using detail::check_encode;
using detail::check_residual;
using detail::Values;

class Fp32Codec final : public Codec {
 public:
  const std::string& name() const override { return name_; }
  int64_t encoded_bytes(int64_t numel) const override { return 4 * numel; }
  void encode(const at::Tensor& src, const at::Tensor& out) const override {
    check_encode(*this, src, src.numel(), out);
    if (src.numel() == 0) return;
    if (!src.device().is_cpu()) {
      out.view(at::kFloat).copy_(src.view({-1}));
      return;
    }
    std::memcpy(out.data_ptr(), src.data_ptr(), static_cast<size_t>(out.numel()));
  }
  void decode(const at::Tensor& encoded, const at::Tensor& dst, float multiplier, bool accumulate) const override {
    check_decode(*this, encoded, dst.numel(), dst);
    if (dst.numel() == 0) return;
    if (!dst.device().is_cpu()) {
      const at::Tensor in = encoded.view(at::kFloat).view(dst.sizes());
      if (accumulate) dst.add_(in, multiplier);
      else dst.copy_(in).mul_(multiplier);
      return;
    }
    const auto* in = reinterpret_cast<const float*>(encoded.data_ptr<uint8_t>());
    float* out = dst.data_ptr<float>();
    const int64_t n = dst.numel();
    if (accumulate)  // a multiply and an add (std::fma is a library call without -mfma)
      for (int64_t i = 0; i < n; ++i) out[i] += in[i] * multiplier;
    else if (multiplier == 1.0f)
      std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
    else
      for (int64_t i = 0; i < n; ++i) out[i] = in[i] * multiplier;
  }
  int64_t block() const override { return 1; }
  double error_bound() const override { return 0; }
  at::ScalarType summable_type() const override { return at::kFloat; }

 private:
  std::string name_ = "fp32";
};

// fp16 / bf16: the cast kernels (every SIMD level rounds to nearest even alike). The padded
// encode and prefix decode are the compress hooks' path: one pass, scaled, on any device.
class CastCodec final : public Codec {
 public:
  CastCodec(std::string name, at::ScalarType type, double bound, double normal_min, double finite_max)
      : name_(std::move(name)), type_(type), bound_(bound), normal_min_(normal_min), finite_max_(finite_max) {}
  const std::string& name() const override { return name_; }
  int64_t encoded_bytes(int64_t numel) const override { return 2 * numel; }
  void encode(const at::Tensor& src, const at::Tensor& out) const override { encode_padded(src, src.numel(), out, 1.0f, {}); }
  void decode(const at::Tensor& encoded, const at::Tensor& dst, float multiplier, bool accumulate) const override {
    decode_prefix(encoded, dst.numel(), dst, multiplier, accumulate);
  }
  void encode_padded(const at::Tensor& src, int64_t numel, const at::Tensor& out, float multiplier,
                     const at::Tensor& residual) const override {
    check_encode(*this, src, numel, out, Values::AnyFloating);
    at::Tensor low = out.view(type_);
    if (src.numel() > 0) cast_scaled_into(src.view({-1}), low.narrow(0, 0, src.numel()), multiplier);
    if (numel > src.numel()) low.narrow(0, src.numel(), numel - src.numel()).zero_();
    if (residual.defined()) {
      check_residual(*this, residual, src.numel());
      cast_scaled_into(low.narrow(0, 0, src.numel()), residual, -1.0);
      residual.add_(src.view({-1}), multiplier);
    }
  }
  void decode_prefix(const at::Tensor& encoded, int64_t numel, const at::Tensor& dst, float multiplier,
                     bool accumulate) const override {
    check_decode(*this, encoded, numel, dst, Values::AnyFloating);
    if (dst.numel() == 0) return;
    const at::Tensor low = encoded.view(type_).narrow(0, 0, dst.numel());
    if (!accumulate) return cast_scaled_into(low, dst, multiplier);
    at::Tensor widened = at::empty_like(dst);
    cast_scaled_into(low, widened, multiplier);
    dst.add_(widened);
  }
  int64_t block() const override { return 1; }
  double error_bound() const override { return bound_; }
  double normal_min() const override { return normal_min_; }
  double finite_max() const override { return finite_max_; }
  bool simd_kernels() const override { return true; }
  at::ScalarType summable_type() const override { return type_; }

 private:
  std::string name_;
  at::ScalarType type_;
  double bound_, normal_min_, finite_max_;
};

// Block int8 (codecs/quantize.h): its kernels pad, and write the residual, themselves.
class Int8Codec final : public Codec {
 public:
  explicit Int8Codec(int64_t block) : block_(block) {
    int8_encoded_bytes(0, block_);  // validates the block size
  }
  const std::string& name() const override { return name_; }
  int64_t encoded_bytes(int64_t numel) const override { return int8_encoded_bytes(numel, block_); }
  void encode(const at::Tensor& src, const at::Tensor& out) const override {
    check_encode(*this, src, src.numel(), out);
    int8_encode(src, src.numel(), src.numel(), block_, out);
  }
  void decode(const at::Tensor& encoded, const at::Tensor& dst, float multiplier, bool accumulate) const override {
    check_decode(*this, encoded, dst.numel(), dst);
    int8_decode(encoded, dst.numel(), block_, dst, dst.numel(), multiplier, accumulate);
  }
  void encode_padded(const at::Tensor& src, int64_t numel, const at::Tensor& out, float multiplier,
                     const at::Tensor& residual) const override {
    if (multiplier != 1.0f) return Codec::encode_padded(src, numel, out, multiplier, residual);
    check_encode(*this, src, numel, out);
    int8_encode(src, src.numel(), numel, block_, out, residual);
  }
  void decode_prefix(const at::Tensor& encoded, int64_t numel, const at::Tensor& dst, float multiplier,
                     bool accumulate) const override {
    check_decode(*this, encoded, numel, dst);
    int8_decode(encoded, numel, block_, dst, dst.numel(), multiplier, accumulate);
  }
  int64_t block() const override { return block_; }
  double error_bound() const override { return 1.0 / 254.0; }
  bool simd_kernels() const override { return true; }

 private:
  std::string name_ = "int8";
  int64_t block_;
};

using Factory = std::function<std::shared_ptr<const Codec>()>;

const std::vector<std::pair<std::string, Factory>>& registry() {
  static const std::vector<std::pair<std::string, Factory>> codecs = {
      {"fp32", [] { return std::make_shared<Fp32Codec>(); }},
      // Half an ulp: 2^-11 of |x| for fp16 (normal range), 2^-8 for bf16.
      // fp16: 2^-14 is its smallest normal, 65504 its largest finite value; bf16 has float32's
      // exponent range, and its largest finite value is (2 - 2^-7) * 2^127.
      {"fp16", [] { return std::make_shared<CastCodec>("fp16", at::kHalf, 1.0 / 2048, 6.103515625e-05, 65504.0); }},
      {"bf16", [] {
         return std::make_shared<CastCodec>("bf16", at::kBFloat16, 1.0 / 256, std::numeric_limits<float>::min(),
                                            3.3895313892515355e38);
       }},
      {"int8", [] { return make_int8_codec(256); }},
      {"int4", [] { return make_int4_codec(); }},
      {"int2", [] { return make_int2_codec(); }},
  };
  return codecs;
}

}  // namespace

double Codec::finite_max() const { return std::numeric_limits<float>::max(); }

void Codec::encode_padded(const at::Tensor& src, int64_t numel, const at::Tensor& out, float multiplier,
                          const at::Tensor& residual) const {
  DDPKIT_CHECK(numel >= src.numel(), name(), " codec: ", src.numel(), " values do not fit an encoding of ", numel);
  DDPKIT_CHECK(src.scalar_type() == at::kFloat, name(), " codec: encode takes float32 values, got ", src.scalar_type());
  const int64_t n = src.numel();
  at::Tensor whole = src;
  if (n != numel || multiplier != 1.0f || !src.is_contiguous()) {
    whole = at::zeros({numel}, src.options());
    if (n > 0) whole.narrow(0, 0, n).copy_(src.reshape({-1})).mul_(multiplier);
  }
  encode(whole.view({-1}), out);
  if (!residual.defined()) return;
  check_residual(*this, residual, n);
  decode_prefix(out, numel, residual, -1.0f, false);
  residual.add_(whole.view({-1}).narrow(0, 0, n));
}

void Codec::decode_prefix(const at::Tensor& encoded, int64_t numel, const at::Tensor& dst, float multiplier,
                          bool accumulate) const {
  DDPKIT_CHECK(numel >= dst.numel(), name(), " codec: ", dst.numel(), " values are more than the ", numel, " encoded");
  if (numel == dst.numel()) return decode(encoded, dst, multiplier, accumulate);
  at::Tensor whole = at::empty({numel}, dst.options());
  decode(encoded, whole, multiplier, false);
  const at::Tensor prefix = whole.narrow(0, 0, dst.numel()).view(dst.sizes());
  if (accumulate) dst.add_(prefix);
  else dst.copy_(prefix);
}

std::shared_ptr<const Codec> make_int8_codec(int64_t block) { return std::make_shared<Int8Codec>(block); }

std::vector<std::string> codec_names() {
  std::vector<std::string> names;
  for (const auto& entry : registry()) names.push_back(entry.first);
  return names;
}

std::shared_ptr<const Codec> make_codec(const std::string& name) {
  std::string known;
  for (const auto& entry : registry()) {
    if (entry.first == name) return entry.second();
    known += (known.empty() ? "" : ", ") + entry.first;
  }
  throw UsageError("unknown codec '" + name + "' (codecs: " + known + ")");
}

}  // namespace codecs
}  // namespace ddpkit
