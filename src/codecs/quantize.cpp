// GCC 12 flags _mm512_undefined_* inside its own intrinsic headers (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <ddpkit/codecs/cast.h>
#include <ddpkit/codecs/quantize.h>
#include <ddpkit/error.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace ddpkit {
namespace codecs {
namespace {

// Blocks per parallel task.
constexpr int64_t kGrainBlocks = 256;

struct BlockScale {
  float scale;    // max|x| / 127, NaN for a non-finite block
  float inverse;  // 127 / max|x|, 0 for an all-zero or non-finite block
};

inline BlockScale scale_for(float amax, bool nonfinite) {
  if (nonfinite || !std::isfinite(amax)) return {std::numeric_limits<float>::quiet_NaN(), 0.f};
  if (amax == 0.f) return {0.f, 0.f};
  return {amax / 127.f, 127.f / amax};
}

// ---- scalar (reference, and the tails) ------------------------------------------------------------
void amax_scalar(const float* x, int64_t n, float& amax, bool& nonfinite) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (!(a <= std::numeric_limits<float>::max())) nonfinite = true;  // NaN or Inf
    amax = a > amax ? a : amax;
  }
}
void quantize_scalar(const float* x, int64_t n, BlockScale s, int8_t* q, float* r) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::nearbyint(x[i] * s.inverse);
    const int8_t c = static_cast<int8_t>(v > 127.f ? 127.f : (v < -127.f ? -127.f : v));
    q[i] = c;
    if (r) r[i] = std::fma(-static_cast<float>(c), s.scale, x[i]);
  }
}
void dequantize_scalar(const int8_t* q, int64_t n, float scale, float* out, bool accumulate) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = accumulate ? std::fma(static_cast<float>(q[i]), scale, out[i]) : static_cast<float>(q[i]) * scale;
}

// ---- AVX2: 8 lanes --------------------------------------------------------------------------------
#define DDPKIT_AVX2 __attribute__((target("avx2,fma")))

DDPKIT_AVX2 void amax_avx2(const float* x, int64_t n, float& amax, bool& nonfinite) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 fmax = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 acc = _mm256_setzero_ps();
  __m256 bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
    acc = _mm256_max_ps(acc, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, fmax, _CMP_NLE_UQ));  // NaN or > FLT_MAX
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) amax = l > amax ? l : amax;
  if (_mm256_movemask_ps(bad)) nonfinite = true;
  amax_scalar(x + i, n - i, amax, nonfinite);
}
DDPKIT_AVX2 void quantize_avx2(const float* x, int64_t n, BlockScale s, int8_t* q, float* r) {
  const __m256 inv = _mm256_set1_ps(s.inverse), sc = _mm256_set1_ps(s.scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v, inv));  // MXCSR: round half to even
    // 8 x i32 -> 8 x i8 with saturation (values are within [-127, 127] already).
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    const __m128i b = _mm_packs_epi16(w, w);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), b);
    if (r) _mm256_storeu_ps(r + i, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(c), sc, v));
  }
  quantize_scalar(x + i, n - i, s, q + i, r ? r + i : nullptr);
}
DDPKIT_AVX2 void dequantize_avx2(const int8_t* q, int64_t n, float scale, float* out, bool accumulate) {
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i))));
    _mm256_storeu_ps(out + i, accumulate ? _mm256_fmadd_ps(v, sc, _mm256_loadu_ps(out + i)) : _mm256_mul_ps(v, sc));
  }
  dequantize_scalar(q + i, n - i, scale, out + i, accumulate);
}

// ---- AVX-512: 16 lanes ----------------------------------------------------------------------------
#define DDPKIT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

DDPKIT_AVX512 void amax_avx512(const float* x, int64_t n, float& amax, bool& nonfinite) {
  const __m512 fmax = _mm512_set1_ps(std::numeric_limits<float>::max());
  __m512 acc = _mm512_setzero_ps();
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    acc = _mm512_max_ps(acc, a);
    bad |= _mm512_cmp_ps_mask(a, fmax, _CMP_NLE_UQ);
  }
  const float m = _mm512_reduce_max_ps(acc);
  amax = m > amax ? m : amax;
  if (bad) nonfinite = true;
  amax_scalar(x + i, n - i, amax, nonfinite);
}
DDPKIT_AVX512 void quantize_avx512(const float* x, int64_t n, BlockScale s, int8_t* q, float* r) {
  const __m512 inv = _mm512_set1_ps(s.inverse), sc = _mm512_set1_ps(s.scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(c));
    if (r) _mm512_storeu_ps(r + i, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(c), sc, v));
  }
  quantize_scalar(x + i, n - i, s, q + i, r ? r + i : nullptr);
}
DDPKIT_AVX512 void dequantize_avx512(const int8_t* q, int64_t n, float scale, float* out, bool accumulate) {
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
    _mm512_storeu_ps(out + i, accumulate ? _mm512_fmadd_ps(v, sc, _mm512_loadu_ps(out + i)) : _mm512_mul_ps(v, sc));
  }
  dequantize_scalar(q + i, n - i, scale, out + i, accumulate);
}

struct Kernels {
  void (*amax)(const float*, int64_t, float&, bool&);
  void (*quantize)(const float*, int64_t, BlockScale, int8_t*, float*);
  void (*dequantize)(const int8_t*, int64_t, float, float*, bool);
};
const Kernels& kernels() {
  static const Kernels scalar{amax_scalar, quantize_scalar, dequantize_scalar};
  static const Kernels avx2{amax_avx2, quantize_avx2, dequantize_avx2};
  static const Kernels avx512{amax_avx512, quantize_avx512, dequantize_avx512};
  switch (simd_level()) {
    case SimdLevel::Avx512: return avx512;
    case SimdLevel::Avx2: return avx2;
    default: return scalar;
  }
}

void check_block(int64_t block) {
  DDPKIT_CHECK(block >= 16 && block % 16 == 0, "int8 block size must be a positive multiple of 16, got ", block);
}

}  // namespace

int64_t int8_encoded_bytes(int64_t numel, int64_t block) {
  check_block(block);
  const int64_t blocks = (numel + block - 1) / block;
  return blocks * block + blocks * static_cast<int64_t>(sizeof(float));
}

void int8_encode(const at::Tensor& src, int64_t valid, int64_t numel, int64_t block, const at::Tensor& out,
                 const at::Tensor& residual) {
  check_block(block);
  DDPKIT_CHECK(src.scalar_type() == at::kFloat && src.is_contiguous(),
               "int8_encode: src must be a contiguous float32 tensor, got ", src.scalar_type());
  DDPKIT_CHECK(valid >= 0 && valid <= numel && valid <= src.numel(), "int8_encode: valid (", valid,
               ") must be within numel (", numel, ") and src (", src.numel(), ")");
  DDPKIT_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.numel() == int8_encoded_bytes(numel, block),
               "int8_encode: out must be a contiguous uint8 tensor of ", int8_encoded_bytes(numel, block), " bytes");
  DDPKIT_CHECK(!residual.defined() || (residual.scalar_type() == at::kFloat && residual.is_contiguous() &&
                                       residual.numel() >= valid),
               "int8_encode: residual must be a contiguous float32 tensor of at least ", valid, " elements");
  if (!src.device().is_cpu()) return detail::int8_encode_aten(src, valid, numel, block, out, residual);
  const int64_t blocks = (numel + block - 1) / block;
  const float* x = src.data_ptr<float>();
  auto* codes = reinterpret_cast<int8_t*>(out.data_ptr<uint8_t>());
  auto* scales_bytes = out.data_ptr<uint8_t>() + blocks * block;
  float* r = residual.defined() ? residual.data_ptr<float>() : nullptr;
  const Kernels& k = kernels();
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * block;
      const int64_t len = std::max<int64_t>(0, std::min(block, valid - start));
      float amax = 0.f;
      bool nonfinite = false;
      k.amax(x + start, len, amax, nonfinite);
      const BlockScale s = scale_for(amax, nonfinite);
      if (std::isnan(s.scale)) {
        // Codes 0 (decoding gives NaN through the scale); no error is fed back from such a block.
        std::memset(codes + start, 0, static_cast<size_t>(block));
        if (r) std::fill(r + start, r + start + len, 0.f);
      } else {
        k.quantize(x + start, len, s, codes + start, r ? r + start : nullptr);
        if (len < block) std::memset(codes + start + len, 0, static_cast<size_t>(block - len));
      }
      std::memcpy(scales_bytes + b * sizeof(float), &s.scale, sizeof(float));
    }
  });
}

void int8_decode(const at::Tensor& encoded, int64_t numel, int64_t block, const at::Tensor& dst, int64_t count,
                 float multiplier, bool accumulate) {
  check_block(block);
  DDPKIT_CHECK(encoded.scalar_type() == at::kByte && encoded.is_contiguous() &&
                   encoded.numel() == int8_encoded_bytes(numel, block),
               "int8_decode: encoded must be a contiguous uint8 tensor of ", int8_encoded_bytes(numel, block), " bytes");
  DDPKIT_CHECK(dst.scalar_type() == at::kFloat && dst.is_contiguous() && dst.numel() >= count && count <= numel,
               "int8_decode: dst must be a contiguous float32 tensor of at least ", count, " elements");
  if (!dst.device().is_cpu()) return detail::int8_decode_aten(encoded, numel, block, dst, count, multiplier, accumulate);
  const int64_t blocks = (numel + block - 1) / block;
  const auto* codes = reinterpret_cast<const int8_t*>(encoded.data_ptr<uint8_t>());
  const uint8_t* scales_bytes = encoded.data_ptr<uint8_t>() + blocks * block;
  float* out = dst.data_ptr<float>();
  const Kernels& k = kernels();
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * block;
      const int64_t len = std::max<int64_t>(0, std::min(block, count - start));
      if (len == 0) break;
      float scale;
      std::memcpy(&scale, scales_bytes + b * sizeof(float), sizeof(float));
      k.dequantize(codes + start, len, scale * multiplier, out + start, accumulate);
    }
  });
}

namespace detail {

// The same format with ATen operations, for GPU tensors (and tests on CPU): the same codes and
// scales as the kernels above; decoded values may differ from the CPU kernels' in the last bit
// (a multiply and an add where they fuse), identically on every rank.
void int8_encode_aten(const at::Tensor& src, int64_t valid, int64_t numel, int64_t block, const at::Tensor& out,
                      const at::Tensor& residual) {
  const int64_t blocks = (numel + block - 1) / block;
  at::Tensor x = at::zeros({blocks * block}, src.options());
  x.narrow(0, 0, valid).copy_(src.narrow(0, 0, valid));
  at::Tensor xb = x.view({blocks, block});
  at::Tensor amax = xb.abs().amax(1);
  at::Tensor bad = amax.isfinite().logical_not();
  at::Tensor scale = at::where(bad, at::full_like(amax, std::numeric_limits<float>::quiet_NaN()), amax / 127.0f);
  at::Tensor inverse = at::where(bad.logical_or(amax == 0), at::zeros_like(amax), 127.0f / amax);
  at::Tensor q = at::where(bad.unsqueeze(1), at::zeros_like(xb), at::round(xb * inverse.unsqueeze(1)).clamp(-127, 127));
  out.narrow(0, 0, blocks * block).view(at::kChar).copy_(q.reshape({-1}));
  out.narrow(0, blocks * block, blocks * 4).view(at::kFloat).copy_(scale);
  if (residual.defined()) {
    at::Tensor r = at::where(bad.unsqueeze(1), at::zeros_like(xb), xb - q * scale.unsqueeze(1));
    residual.narrow(0, 0, valid).copy_(r.reshape({-1}).narrow(0, 0, valid));
  }
}

void int8_decode_aten(const at::Tensor& encoded, int64_t numel, int64_t block, const at::Tensor& dst, int64_t count,
                      float multiplier, bool accumulate) {
  const int64_t blocks = (numel + block - 1) / block;
  at::Tensor codes = encoded.narrow(0, 0, blocks * block).view(at::kChar).view({blocks, block}).to(at::kFloat);
  at::Tensor scale = encoded.narrow(0, blocks * block, blocks * 4).view(at::kFloat) * multiplier;
  at::Tensor values = (codes * scale.unsqueeze(1)).reshape({-1}).narrow(0, 0, count);
  if (accumulate) {
    dst.narrow(0, 0, count).add_(values);
  } else {
    dst.narrow(0, 0, count).copy_(values);
  }
}

}  // namespace detail
// ---- PyTorch's quantization hooks' format: uint8 affine --------------------------------------------

std::pair<at::Tensor, at::Tensor> uint8_affine_qparams(const at::Tensor& x2d) {
  auto mm = at::aminmax(x2d, 1);
  at::Tensor min_neg = at::clamp_max(std::get<0>(mm), 0.0);
  at::Tensor max_pos = at::clamp_min(std::get<1>(mm), 0.0);
  at::Tensor scale = (max_pos - min_neg) / 255.0;
  scale = at::clamp_min(scale, std::numeric_limits<float>::epsilon());
  at::Tensor zero_point = at::clamp(0 - at::round(min_neg / scale).to(at::kInt), 0, 255);
  return {scale, zero_point.to(at::kFloat)};
}

at::Tensor uint8_affine_encode(const at::Tensor& block, const at::Tensor& scale, const at::Tensor& zero_point) {
  const int64_t rows = block.size(0), cols = block.size(1);
  at::Tensor packed = at::empty({rows * cols + 2 * rows * 4}, block.options().dtype(at::kByte));
  packed.narrow(0, 0, rows * 4).view(at::kFloat).copy_(scale);
  packed.narrow(0, rows * 4, rows * 4).view(at::kFloat).copy_(zero_point);
  at::Tensor codes = packed.narrow(0, 8 * rows, rows * cols).view({rows, cols});
  codes.copy_(at::clamp(at::round(block / scale.unsqueeze(1)) + zero_point.unsqueeze(1), 0, 255));
  return packed;
}

void uint8_affine_decode_add(const at::Tensor& packed, int64_t rows, int64_t cols, at::Tensor& acc) {
  at::Tensor scale = packed.narrow(0, 0, rows * 4).view(at::kFloat).unsqueeze(1);
  at::Tensor zero_point = packed.narrow(0, rows * 4, rows * 4).view(at::kFloat).unsqueeze(1);
  at::Tensor codes = packed.narrow(0, 8 * rows, rows * cols).view({rows, cols});
  acc.add_((codes.to(at::kFloat) - zero_point) * scale);
}

}  // namespace codecs
}  // namespace ddpkit
