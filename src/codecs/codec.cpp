// The codec interface (include/ddpkit/codecs/codec.h) over the existing kernels: fp32, the
// fp16/bf16 casts (codecs/cast.h) and block int8 (codecs/quantize.h); int4 is in int4.cpp.
#include <ddpkit/codecs/cast.h>
#include <ddpkit/codecs/codec.h>
#include <ddpkit/codecs/quantize.h>
#include <ddpkit/error.h>

#include <cstring>
#include <functional>
#include <map>

namespace ddpkit {
namespace codecs {
namespace {

void check_encode(const Codec& c, const at::Tensor& src, const at::Tensor& out) {
  DDPKIT_CHECK(src.device().is_cpu() && src.scalar_type() == at::kFloat && src.is_contiguous(), c.name(),
               " codec: encode takes contiguous float32 CPU values, got ", src.scalar_type(), " on ", src.device());
  DDPKIT_CHECK(out.device().is_cpu() && out.scalar_type() == at::kByte && out.is_contiguous() &&
                   out.numel() == c.encoded_bytes(src.numel()),
               c.name(), " codec: encode needs a contiguous uint8 CPU output of ", c.encoded_bytes(src.numel()),
               " bytes for ", src.numel(), " values, got ", out.numel(), " of ", out.scalar_type());
}

void check_decode(const Codec& c, const at::Tensor& encoded, const at::Tensor& dst) {
  DDPKIT_CHECK(dst.device().is_cpu() && dst.scalar_type() == at::kFloat && dst.is_contiguous(), c.name(),
               " codec: decode writes contiguous float32 CPU values, got ", dst.scalar_type(), " on ", dst.device());
  DDPKIT_CHECK(encoded.device().is_cpu() && encoded.scalar_type() == at::kByte && encoded.is_contiguous() &&
                   encoded.numel() == c.encoded_bytes(dst.numel()),
               c.name(), " codec: ", dst.numel(), " values decode from ", c.encoded_bytes(dst.numel()),
               " contiguous uint8 bytes, got ", encoded.numel(), " of ", encoded.scalar_type());
}

class Fp32Codec final : public Codec {
 public:
  const std::string& name() const override { return name_; }
  int64_t encoded_bytes(int64_t numel) const override { return 4 * numel; }
  void encode(const at::Tensor& src, const at::Tensor& out) const override {
    check_encode(*this, src, out);
    if (src.numel() > 0) std::memcpy(out.data_ptr(), src.data_ptr(), static_cast<size_t>(out.numel()));
  }
  void decode(const at::Tensor& encoded, const at::Tensor& dst, float multiplier, bool accumulate) const override {
    check_decode(*this, encoded, dst);
    if (dst.numel() == 0) return;
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

 private:
  std::string name_ = "fp32";
};

// fp16 / bf16: the cast kernels (every SIMD level rounds to nearest even alike).
class CastCodec final : public Codec {
 public:
  CastCodec(std::string name, at::ScalarType type, double bound) : name_(std::move(name)), type_(type), bound_(bound) {}
  const std::string& name() const override { return name_; }
  int64_t encoded_bytes(int64_t numel) const override { return 2 * numel; }
  void encode(const at::Tensor& src, const at::Tensor& out) const override {
    check_encode(*this, src, out);
    if (src.numel() > 0) cast_scaled_into(src, out.view(type_));
  }
  void decode(const at::Tensor& encoded, const at::Tensor& dst, float multiplier, bool accumulate) const override {
    check_decode(*this, encoded, dst);
    if (dst.numel() == 0) return;
    const at::Tensor low = encoded.view(type_);
    if (!accumulate) return cast_scaled_into(low, dst, multiplier);
    at::Tensor widened = at::empty_like(dst);
    cast_scaled_into(low, widened, multiplier);
    dst.add_(widened);
  }
  int64_t block() const override { return 1; }
  double error_bound() const override { return bound_; }

 private:
  std::string name_;
  at::ScalarType type_;
  double bound_;
};

class Int8Codec final : public Codec {
 public:
  static constexpr int64_t kBlock = 256;
  const std::string& name() const override { return name_; }
  int64_t encoded_bytes(int64_t numel) const override { return int8_encoded_bytes(numel, kBlock); }
  void encode(const at::Tensor& src, const at::Tensor& out) const override {
    check_encode(*this, src, out);
    int8_encode(src, src.numel(), src.numel(), kBlock, out);
  }
  void decode(const at::Tensor& encoded, const at::Tensor& dst, float multiplier, bool accumulate) const override {
    check_decode(*this, encoded, dst);
    int8_decode(encoded, dst.numel(), kBlock, dst, dst.numel(), multiplier, accumulate);
  }
  int64_t block() const override { return kBlock; }
  double error_bound() const override { return 1.0 / 254.0; }

 private:
  std::string name_ = "int8";
};

using Factory = std::function<std::shared_ptr<const Codec>()>;

const std::vector<std::pair<std::string, Factory>>& registry() {
  static const std::vector<std::pair<std::string, Factory>> codecs = {
      {"fp32", [] { return std::make_shared<Fp32Codec>(); }},
      // Half an ulp: 2^-11 of |x| for fp16 (normal range), 2^-8 for bf16.
      {"fp16", [] { return std::make_shared<CastCodec>("fp16", at::kHalf, 1.0 / 2048); }},
      {"bf16", [] { return std::make_shared<CastCodec>("bf16", at::kBFloat16, 1.0 / 256); }},
      {"int8", [] { return std::make_shared<Int8Codec>(); }},
      {"int4", [] { return make_int4_codec(); }},
  };
  return codecs;
}

}  // namespace

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
