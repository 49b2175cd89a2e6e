// One suite run against every codec make_codec knows (include/ddpkit/codecs/codec.h): round-trip
// bounds (and a cast's at both ends of its range), sizes, NaN/Inf, zeros among non-zeros and
// symmetric rounding, accumulation, the same bytes at every SIMD level (codecs with kernels per
// level), and the padded encode,
// residual and prefix decode the hooks use. A new codec is
// covered by adding it to make_codec; kExpectedBytesPerValue below holds what each may cost.
#include "harness.h"

#include <ddpkit/codecs/codec.h>

#include <cmath>
#include <limits>
#include <map>

namespace ddpkit {
namespace {

using codecs::Codec;

// The wire cost each codec is allowed, bytes per value for a large tensor (one line per codec).
const std::map<std::string, double> kExpectedBytesPerValue = {
    {"fp32", 4.0}, {"fp16", 2.0}, {"bf16", 2.0}, {"int8", 1.0 + 4.0 / 256}, {"int4", 0.5 + 4.0 / 128},
    {"int2", 0.25 + 4.0 / 128},
};

std::vector<codecs::SimdLevel> levels_here() {
  std::vector<codecs::SimdLevel> out;
  for (auto l : {codecs::SimdLevel::Scalar, codecs::SimdLevel::Avx2, codecs::SimdLevel::Avx512})
    if (codecs::cpu_supports(l)) out.push_back(l);
  return out;
}

// Values spread over six decades, both signs, in fp16's normal range.
at::Tensor spread_values(int64_t n, uint64_t seed) {
  at::Tensor sign = testing::seeded_randn({n}, seed).sign();
  at::Tensor exponent = testing::seeded_randn({n}, seed + 1).clamp(-2, 2) * 1.5;
  return (sign * at::pow(10.0, exponent)).contiguous();
}

at::Tensor encode(const Codec& c, const at::Tensor& x) {
  at::Tensor out = at::empty({c.encoded_bytes(x.numel())}, at::kByte);
  c.encode(x, out);
  return out;
}

at::Tensor decode(const Codec& c, const at::Tensor& bytes, int64_t n) {
  at::Tensor out = at::empty({n}, at::kFloat);
  c.decode(bytes, out);
  return out;
}

class CodecConformance : public ::testing::TestWithParam<std::string> {
 protected:
  std::shared_ptr<const Codec> codec = codecs::make_codec(GetParam());
};

TEST_P(CodecConformance, IsListedWithItsCost) {
  ASSERT_TRUE(kExpectedBytesPerValue.count(GetParam())) << "add " << GetParam() << " to kExpectedBytesPerValue";
  EXPECT_EQ(codec->name(), GetParam());
  const int64_t n = 1 << 20;
  EXPECT_NEAR(static_cast<double>(codec->encoded_bytes(n)) / n, kExpectedBytesPerValue.at(GetParam()), 1e-3);
  EXPECT_EQ(codec->encoded_bytes(0), 0);
}

TEST_P(CodecConformance, RoundTripWithinItsBound) {
  for (int64_t n : {1, 7, 127, 128, 129, 255, 256, 257, 1000, 4099}) {
    const at::Tensor x = spread_values(n, static_cast<uint64_t>(n));
    const at::Tensor y = decode(*codec, encode(*codec, x), n);
    const int64_t block = codec->block();
    for (int64_t b = 0; b < n; b += block) {
      const int64_t len = std::min(block, n - b);
      const at::Tensor xs = x.narrow(0, b, len), ys = y.narrow(0, b, len);
      // Per value: |err| <= bound * (|x| for casts, the block's max |x| for block codecs), plus
      // float32's own rounding of the decode.
      const at::Tensor reference = block == 1 ? xs.abs() : xs.abs().max().expand({len});
      const at::Tensor slack = reference * (codec->error_bound() + 1e-6);
      const at::Tensor err = (ys - xs).abs();
      EXPECT_TRUE(err.le(slack).all().item<bool>())
          << GetParam() << ", " << n << " values, block at " << b << ": worst error "
          << (err - slack).max().item<float>() << " over the bound";
    }
  }
}

TEST_P(CodecConformance, ZerosStayZeros) {
  const at::Tensor x = at::zeros({300});
  EXPECT_TRUE(decode(*codec, encode(*codec, x), 300).eq(0).all().item<bool>());
}

TEST_P(CodecConformance, NonFiniteNeverDecodesToFinite) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    at::Tensor x = spread_values(600, 3);
    x[5] = bad;
    x[399] = bad;
    const at::Tensor y = decode(*codec, encode(*codec, x), 600);
    EXPECT_FALSE(std::isfinite(y[5].item<float>())) << GetParam() << " turned " << bad << " finite";
    EXPECT_FALSE(std::isfinite(y[399].item<float>())) << GetParam() << " turned " << bad << " finite";
    // Blocks without one decode as usual.
    const int64_t block = codec->block();
    const int64_t clean = block == 1 ? 100 : ((5 / block) + 1) * block;
    if (clean + 10 < 399 / block * block)
      EXPECT_TRUE(at::isfinite(y.narrow(0, clean, 10)).all().item<bool>()) << GetParam();
  }
}

TEST_P(CodecConformance, DecodeScalesAndAccumulates) {
  const at::Tensor x = spread_values(1000, 9);
  const at::Tensor bytes = encode(*codec, x);
  const at::Tensor plain = decode(*codec, bytes, 1000);
  at::Tensor scaled = at::empty({1000});
  codec->decode(bytes, scaled, 0.25f);
  EXPECT_TRUE(at::allclose(scaled, plain * 0.25, 1e-6, 1e-7)) << GetParam();
  at::Tensor acc = at::ones({1000});
  codec->decode(bytes, acc, 2.0f, /*accumulate=*/true);
  EXPECT_TRUE(at::allclose(acc, plain * 2 + 1, 1e-6, 1e-6)) << GetParam();
}

// Zeros among non-zeros in one block (an unused embedding row beside used ones) decode to exactly
// 0, and the rounding is odd-symmetric: -x decodes to minus what x decodes to, so over values of
// both signs the error is zero-mean (int2's four levels had no 0 and pushed every 0 by +max/3).
TEST_P(CodecConformance, ZerosAmongNonZerosStayZerosAndRoundingIsSymmetric) {
  for (int64_t n : {128, 300, 1000}) {
    at::Tensor x = spread_values(n, 31 + static_cast<uint64_t>(n));
    x.slice(0, 0, n, 3).zero_();  // every third value, in every block
    const at::Tensor y = decode(*codec, encode(*codec, x), n);
    const at::Tensor zeros = x.eq(0);
    EXPECT_TRUE(y.masked_select(zeros).eq(0).all().item<bool>())
        << GetParam() << ": a 0 among non-zeros decoded to " << y.masked_select(zeros).abs().max().item<float>();
    const at::Tensor negated = decode(*codec, encode(*codec, -x), n);
    EXPECT_TRUE(at::equal(negated, -y)) << GetParam() << ", " << n << " values: -x does not decode to -decode(x)";
  }
}

// A cast keeps its relative bound over [normal_min, finite_max]; below, its subnormals keep the
// absolute error normal_min x bound; above, a value may become Inf, never a wrong finite value.
TEST_P(CodecConformance, CastsKeepTheirBoundAtBothEndsOfTheirRange) {
  if (codec->block() != 1 || codec->error_bound() == 0) GTEST_SKIP() << GetParam() << " has no range of its own";
  const double lo = codec->normal_min(), hi = codec->finite_max(), bound = codec->error_bound();
  ASSERT_GT(lo, 0) << GetParam();
  ASSERT_LE(hi, std::numeric_limits<float>::max()) << GetParam();
  // Inside, at both ends: relative.
  std::vector<float> inside = {static_cast<float>(lo), static_cast<float>(lo) * 1.37f, static_cast<float>(hi),
                               static_cast<float>(hi) * 0.77f};
  for (float v : std::vector<float>(inside)) inside.push_back(-v);
  const at::Tensor x = at::tensor(inside);
  const at::Tensor y = decode(*codec, encode(*codec, x), x.numel());
  EXPECT_TRUE((y - x).abs().le(x.abs() * (bound + 1e-7)).all().item<bool>())
      << GetParam() << ": worst relative error " << ((y - x).abs() / x.abs()).max().item<double>();
  // Below: absolute, down to float32's own subnormals.
  const float l = static_cast<float>(lo);
  const at::Tensor small = at::tensor({l * 0.3f, -l * 0.0065f, l * 1e-3f, std::numeric_limits<float>::denorm_min()});
  const at::Tensor ys = decode(*codec, encode(*codec, small), small.numel());
  EXPECT_TRUE((ys - small).abs().le(lo * bound * (1 + 1e-6)).all().item<bool>())
      << GetParam() << ": worst error below normal_min " << (ys - small).abs().max().item<double>() << " > "
      << lo * bound;
  // Above (where the format's range ends before float32's): Inf with the sign, never finite.
  if (hi < std::numeric_limits<float>::max()) {
    const at::Tensor big = at::tensor({static_cast<float>(hi) * 2.f, -static_cast<float>(hi) * 2.f});
    const at::Tensor yb = decode(*codec, encode(*codec, big), 2);
    EXPECT_TRUE(at::isinf(yb).all().item<bool>()) << GetParam() << " turned " << hi * 2 << " into " << yb;
    EXPECT_TRUE(yb.sign().eq(big.sign()).all().item<bool>()) << GetParam();
  }
}

// Only codecs with kernels per SIMD level (simd_kernels()): the others run one code path.
TEST_P(CodecConformance, EverySimdLevelWritesTheSameBytes) {
  if (!codec->simd_kernels()) GTEST_SKIP() << GetParam() << " has one code path at every SIMD level";
  if (levels_here().size() < 2) GTEST_SKIP() << "this CPU has one SIMD level: nothing to compare";
  const codecs::SimdLevel before = codecs::simd_level();
  const at::Tensor x = spread_values(5000, 11);
  at::Tensor first, first_decoded;
  for (auto level : levels_here()) {
    codecs::set_simd_level(level);
    const at::Tensor bytes = encode(*codec, x);
    const at::Tensor decoded = decode(*codec, bytes, 5000);
    if (!first.defined()) {
      first = bytes;
      first_decoded = decoded;
      continue;
    }
    EXPECT_TRUE(at::equal(bytes, first)) << GetParam() << " at " << codecs::simd_level_name();
    EXPECT_TRUE(at::equal(decoded, first_decoded)) << GetParam() << " at " << codecs::simd_level_name();
  }
  codecs::set_simd_level(before);
}

TEST_P(CodecConformance, WrongBuffersAreNamedErrors) {
  const at::Tensor x = at::randn({100});
  at::Tensor small = at::empty({codec->encoded_bytes(100) - 1}, at::kByte);
  EXPECT_THAT(testing::error_of([&] { codec->encode(x, small); }), ::testing::HasSubstr(GetParam() + " codec"));
  EXPECT_THAT(testing::error_of([&] { codec->encode(x.to(at::kInt), encode(*codec, x)); }),
              ::testing::HasSubstr("values, got Int"));
  EXPECT_THAT(testing::error_of([&] { codec->encode_padded(x, 99, encode(*codec, x)); }),
              ::testing::HasSubstr("100 values do not fit an encoding of 99"));
  at::Tensor too_many = at::empty({101});
  EXPECT_THAT(testing::error_of([&] { codec->decode_prefix(encode(*codec, x), 100, too_many); }),
              ::testing::HasSubstr("101 values are more than the 100 encoded"));
}

// What the hooks and the outer all-reduce call: a short tail padded with zeros, a scale folded into
// the encode, the error-feedback residual, and part of an encoding decoded.
TEST_P(CodecConformance, PaddedEncodeIsTheEncodeOfTheZeroPaddedValues) {
  for (int64_t n : {0, 1, 100, 129, 300}) {
    const int64_t numel = 512;
    const at::Tensor x = spread_values(std::max<int64_t>(n, 1), 21).narrow(0, 0, n);
    at::Tensor padded = at::zeros({numel});
    padded.narrow(0, 0, n).copy_(x);
    at::Tensor out = at::empty({codec->encoded_bytes(numel)}, at::kByte);
    codec->encode_padded(x, numel, out);
    EXPECT_TRUE(at::equal(out, encode(*codec, padded))) << GetParam() << ", " << n << " of " << numel;
    codec->encode_padded(x, numel, out, 0.5f);  // a power of two: x * 0.5 is exact
    EXPECT_TRUE(at::equal(out, encode(*codec, padded * 0.5))) << GetParam() << " scaled, " << n << " of " << numel;
  }
}

TEST_P(CodecConformance, ResidualIsWhatTheEncodingLost) {
  for (float multiplier : {1.0f, 0.25f}) {
    const at::Tensor x = spread_values(300, 23);
    at::Tensor out = at::empty({codec->encoded_bytes(384)}, at::kByte);
    at::Tensor residual = at::empty({300});
    codec->encode_padded(x, 384, out, multiplier, residual);
    at::Tensor decoded = at::empty({300});
    codec->decode_prefix(out, 384, decoded);
    const double scale = x.abs().max().item<double>() * multiplier;
    EXPECT_TRUE(at::allclose(residual, x * multiplier - decoded, 0, 1e-6 * scale))
        << GetParam() << " x " << multiplier << ": worst " << (residual - (x * multiplier - decoded)).abs().max().item<float>();
    if (codec->error_bound() == 0) EXPECT_TRUE(residual.eq(0).all().item<bool>()) << GetParam();
  }
}

// Error feedback: each round sends x_t + e and keeps what that lost as the next e, so the decoded
// rounds sum to the true sum less the last residual, whatever the codec rounds away each time.
TEST_P(CodecConformance, ErrorFeedbackKeepsTheRunningSumWithinOneRounding) {
  const int64_t n = 1000, rounds = 40;
  at::Tensor residual = at::zeros({n}), sent_sum = at::zeros({n}), true_sum = at::zeros({n});
  at::Tensor out = at::empty({codec->encoded_bytes(n)}, at::kByte), decoded = at::empty({n});
  double largest = 0;
  for (int64_t t = 0; t < rounds; ++t) {
    const at::Tensor x = spread_values(n, 100 + static_cast<uint64_t>(t)) * 1e-2;
    true_sum += x;
    const at::Tensor with_error = x + residual;
    largest = std::max(largest, with_error.abs().max().item<double>());
    codec->encode_padded(with_error, n, out, 1.0f, residual);
    codec->decode(out, decoded);
    sent_sum += decoded;
  }
  // sum(decoded) = sum(x) - e_last, and |e_last| <= bound x its block's max |x + e|.
  const double gap = (sent_sum - true_sum).abs().max().item<double>();
  EXPECT_LE(gap, codec->error_bound() * largest * 1.001 + 1e-5) << GetParam();
  EXPECT_TRUE(at::allclose(sent_sum + residual, true_sum, 1e-4, 1e-5)) << GetParam();
}

TEST_P(CodecConformance, PrefixDecodeIsThePrefixOfTheDecode) {
  const at::Tensor x = spread_values(1000, 25);
  const at::Tensor bytes = encode(*codec, x);
  const at::Tensor whole = decode(*codec, bytes, 1000);
  for (int64_t v : {0, 1, 129, 999}) {
    at::Tensor part = at::empty({v});
    codec->decode_prefix(bytes, 1000, part, 0.5f);
    EXPECT_TRUE(at::equal(part, whole.narrow(0, 0, v) * 0.5)) << GetParam() << ", " << v << " values";
    at::Tensor acc = at::ones({v});
    codec->decode_prefix(bytes, 1000, acc, 2.0f, /*accumulate=*/true);
    EXPECT_TRUE(at::allclose(acc, whole.narrow(0, 0, v) * 2 + 1, 1e-6, 1e-6)) << GetParam() << ", " << v << " values";
  }
}

// A summable codec's bytes are an array of its element type (what the compress hooks allreduce);
// a block codec has none.
TEST_P(CodecConformance, SummableTypeViewsTheEncoding) {
  const at::ScalarType type = codec->summable_type();
  if (type == at::ScalarType::Undefined) {
    EXPECT_GT(codec->block(), 1) << GetParam();
    return;
  }
  EXPECT_EQ(codec->block(), 1) << GetParam();
  const at::Tensor x = spread_values(257, 27);
  const at::Tensor bytes = encode(*codec, x);
  EXPECT_EQ(bytes.view(type).numel(), 257) << GetParam();
  EXPECT_TRUE(at::equal(bytes.view(type), x.to(type))) << GetParam() << ": not the round-to-nearest cast";
}

INSTANTIATE_TEST_SUITE_P(Codecs, CodecConformance, ::testing::ValuesIn(codecs::codec_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

TEST(Codecs, AnUnknownNameListsTheKnownOnes) {
  EXPECT_THAT(testing::error_of([] { codecs::make_codec("int3"); }),
              ::testing::HasSubstr("unknown codec 'int3' (codecs: fp32, fp16, bf16, int8, int4, int2)"));
}

}  // namespace
}  // namespace ddpkit
