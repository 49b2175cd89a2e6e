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
#include <vector>

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
#define DDPKIT_QUANTIZE_AVX2 __attribute__((target("avx2,fma")))

DDPKIT_QUANTIZE_AVX2 void amax_avx2(const float* x, int64_t n, float& amax, bool& nonfinite) {
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
DDPKIT_QUANTIZE_AVX2 void quantize_avx2(const float* x, int64_t n, BlockScale s, int8_t* q, float* r) {
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
DDPKIT_QUANTIZE_AVX2 void dequantize_avx2(const int8_t* q, int64_t n, float scale, float* out, bool accumulate) {
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i))));
    _mm256_storeu_ps(out + i, accumulate ? _mm256_fmadd_ps(v, sc, _mm256_loadu_ps(out + i)) : _mm256_mul_ps(v, sc));
  }
  dequantize_scalar(q + i, n - i, scale, out + i, accumulate);
}

// ---- AVX-512: 16 lanes ----------------------------------------------------------------------------
#define DDPKIT_QUANTIZE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

DDPKIT_QUANTIZE_AVX512 void amax_avx512(const float* x, int64_t n, float& amax, bool& nonfinite) {
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
DDPKIT_QUANTIZE_AVX512 void quantize_avx512(const float* x, int64_t n, BlockScale s, int8_t* q, float* r) {
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
DDPKIT_QUANTIZE_AVX512 void dequantize_avx512(const int8_t* q, int64_t n, float scale, float* out, bool accumulate) {
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
    _mm512_storeu_ps(out + i, accumulate ? _mm512_fmadd_ps(v, sc, _mm512_loadu_ps(out + i)) : _mm512_mul_ps(v, sc));
  }
  dequantize_scalar(q + i, n - i, scale, out + i, accumulate);
}

struct QuantizeKernels {
  void (*amax)(const float*, int64_t, float&, bool&);
  void (*quantize)(const float*, int64_t, BlockScale, int8_t*, float*);
  void (*dequantize)(const int8_t*, int64_t, float, float*, bool);
};
const QuantizeKernels& quantize_kernels() {
  static const QuantizeKernels scalar{amax_scalar, quantize_scalar, dequantize_scalar};
  static const QuantizeKernels avx2{amax_avx2, quantize_avx2, dequantize_avx2};
  static const QuantizeKernels avx512{amax_avx512, quantize_avx512, dequantize_avx512};
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
  const QuantizeKernels& k = quantize_kernels();
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
  const QuantizeKernels& k = quantize_kernels();
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
namespace {

// PyTorch's hook runs these as separate ATen kernels, each rounding to float32: quantize is
// clamp(round_half_even(x / scale) + zero_point, 0, 255), decode is (code - zero_point) * scale,
// summed into the result in the parts' order and divided at the end. The kernels below run the
// same operations per element in one pass. They are compiled without FMA (target "avx2" alone):
// a contracted multiply-add would round once where ATen rounds twice. NaN gives code 0.
void affine_encode_scalar(const float* x, int64_t n, float scale, float zero_point, uint8_t* q) {
  for (int64_t i = 0; i < n; ++i) {
    float v = std::nearbyint(x[i] / scale) + zero_point;
    v = v > 0.f ? v : 0.f;
    v = v < 255.f ? v : 255.f;
    q[i] = static_cast<uint8_t>(v);
  }
}
// out = (first ? 0 : out) + decode(q), divided by `divide_by` unless it is 0.
void affine_decode_scalar(const uint8_t* q, int64_t n, float scale, float zero_point, float* out, bool first,
                          float divide_by) {
  for (int64_t i = 0; i < n; ++i) {
    const float t = (static_cast<float>(q[i]) - zero_point) * scale;
    const float a = first ? t : out[i] + t;
    out[i] = divide_by != 0.f ? a / divide_by : a;
  }
}

#define DDPKIT_AVX2_NO_FMA __attribute__((target("avx2")))

DDPKIT_AVX2_NO_FMA void affine_encode_avx2(const float* x, int64_t n, float scale, float zero_point, uint8_t* q) {
  const __m256 s = _mm256_set1_ps(scale), z = _mm256_set1_ps(zero_point), lo = _mm256_setzero_ps(),
               hi = _mm256_set1_ps(255.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(v, z), lo), hi);  // max_ps gives its second operand for NaN
    const __m256i c = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packus_epi16(w, w));
  }
  affine_encode_scalar(x + i, n - i, scale, zero_point, q + i);
}
DDPKIT_AVX2_NO_FMA void affine_decode_avx2(const uint8_t* q, int64_t n, float scale, float zero_point, float* out,
                                           bool first, float divide_by) {
  const __m256 s = _mm256_set1_ps(scale), z = _mm256_set1_ps(zero_point), d = _mm256_set1_ps(divide_by);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
    const __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(c), z), s);
    __m256 a = first ? t : _mm256_add_ps(_mm256_loadu_ps(out + i), t);
    if (divide_by != 0.f) a = _mm256_div_ps(a, d);
    _mm256_storeu_ps(out + i, a);
  }
  affine_decode_scalar(q + i, n - i, scale, zero_point, out + i, first, divide_by);
}

using AffineEncode = void (*)(const float*, int64_t, float, float, uint8_t*);
using AffineDecode = void (*)(const uint8_t*, int64_t, float, float, float*, bool, float);
AffineEncode affine_encode_kernel() {
  return simd_level() == SimdLevel::Scalar ? affine_encode_scalar : affine_encode_avx2;
}
AffineDecode affine_decode_kernel() {
  return simd_level() == SimdLevel::Scalar ? affine_decode_scalar : affine_decode_avx2;
}

// Elements per parallel task, and per pass over the parts (a slice that stays in cache while
// every part is added into it).
constexpr int64_t kAffineGrain = 32768;
constexpr int64_t kAffineSlice = 4096;

// Calls fn(row, offset, len) for the segments of elements [begin, end) of a rows x cols block
// stored row after row: within one row, at most kAffineSlice long.
template <typename Fn>
void for_row_segments(int64_t begin, int64_t end, int64_t cols, Fn&& fn) {
  while (begin < end) {
    const int64_t row = begin / cols, col = begin % cols;
    const int64_t len = std::min({cols - col, end - begin, kAffineSlice});
    fn(row, begin, len);
    begin += len;
  }
}

struct AffineParts {
  const float* scale;
  const float* zero_point;
  const uint8_t* codes;
};
AffineParts affine_parts(const at::Tensor& packed, int64_t rows, int64_t cols, const char* what) {
  DDPKIT_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == rows * cols + 8 * rows,
               what, ": a payload must be a contiguous uint8 tensor of ", rows * cols + 8 * rows, " bytes (", rows,
               " x ", cols, " codes and ", rows, " scales and zero points), got ", packed.numel());
  const uint8_t* base = packed.data_ptr<uint8_t>();
  return {reinterpret_cast<const float*>(base), reinterpret_cast<const float*>(base + 4 * rows), base + 8 * rows};
}

}  // namespace

std::pair<at::Tensor, at::Tensor> uint8_affine_qparams(const at::Tensor& values, int64_t cols) {
  DDPKIT_CHECK(values.dim() == 1 && cols >= 1, "uint8_affine_qparams: takes a 1-D tensor and cols >= 1, got ",
               values.dim(), "-D and cols ", cols);
  const int64_t numel = values.numel(), full = numel / cols, rows = std::max<int64_t>((numel + cols - 1) / cols, 1);
  at::Tensor lows = at::zeros({rows}, values.options()), highs = at::zeros({rows}, values.options());
  if (full > 0) {
    auto mm = at::aminmax(values.narrow(0, 0, full * cols).view({full, cols}), 1);
    lows.narrow(0, 0, full).copy_(std::get<0>(mm));
    highs.narrow(0, 0, full).copy_(std::get<1>(mm));
  }
  // The last row's zero padding changes nothing below: the minimum is clamped to <= 0 and the
  // maximum to >= 0 anyway.
  if (full * cols < numel) {
    auto mm = at::aminmax(values.narrow(0, full * cols, numel - full * cols));
    lows[full] = std::get<0>(mm);
    highs[full] = std::get<1>(mm);
  }
  at::Tensor min_neg = at::clamp_max(lows, 0.0);
  at::Tensor max_pos = at::clamp_min(highs, 0.0);
  at::Tensor scale = (max_pos - min_neg) / 255.0;
  scale = at::clamp_min(scale, std::numeric_limits<float>::epsilon());
  at::Tensor zero_point = at::clamp(0 - at::round(min_neg / scale).to(at::kInt), 0, 255);
  return {scale, zero_point.to(at::kFloat)};
}

at::Tensor uint8_affine_encode(const at::Tensor& values, int64_t rows, int64_t cols, const at::Tensor& scale,
                               const at::Tensor& zero_point) {
  DDPKIT_CHECK(values.dim() == 1 && values.scalar_type() == at::kFloat && values.is_contiguous() &&
                   values.numel() <= rows * cols,
               "uint8_affine_encode: values must be a contiguous 1-D float32 tensor of at most ", rows, " x ", cols,
               " elements, got ", values.sizes(), " ", values.scalar_type());
  DDPKIT_CHECK(scale.numel() == rows && zero_point.numel() == rows, "uint8_affine_encode: need ", rows,
               " scales and zero points, got ", scale.numel(), " and ", zero_point.numel());
  at::Tensor packed = at::empty({rows * cols + 8 * rows}, values.options().dtype(at::kByte));
  packed.narrow(0, 0, rows * 4).view(at::kFloat).copy_(scale);
  packed.narrow(0, rows * 4, rows * 4).view(at::kFloat).copy_(zero_point);
  at::Tensor codes = packed.narrow(0, 8 * rows, rows * cols);
  if (!values.device().is_cpu()) {  // GPU: the same operations in ATen
    at::Tensor x = at::zeros({rows * cols}, values.options());
    x.narrow(0, 0, values.numel()).copy_(values);
    codes.view({rows, cols}).copy_(
        at::clamp(at::round(x.view({rows, cols}) / scale.view({rows, 1})) + zero_point.view({rows, 1}), 0, 255));
    return packed;
  }
  const AffineParts part = affine_parts(packed, rows, cols, "uint8_affine_encode");
  uint8_t* q = packed.data_ptr<uint8_t>() + 8 * rows;
  const float* x = values.data_ptr<float>();
  const int64_t valid = values.numel();
  const AffineEncode encode = affine_encode_kernel();
  at::parallel_for(0, rows * cols, kAffineGrain, [&](int64_t begin, int64_t end) {
    for_row_segments(begin, end, cols, [&](int64_t row, int64_t at, int64_t len) {
      const int64_t real = std::max<int64_t>(0, std::min(len, valid - at));
      encode(x + at, real, part.scale[row], part.zero_point[row], q + at);
      if (real < len) {  // the zero padding past the values
        const float zero = 0.f;
        uint8_t code;
        affine_encode_scalar(&zero, 1, part.scale[row], part.zero_point[row], &code);
        std::memset(q + at + real, code, static_cast<size_t>(len - real));
      }
    });
  });
  return packed;
}

void uint8_affine_decode_mean(const std::vector<at::Tensor>& parts, int64_t rows, int64_t cols, const at::Tensor& out) {
  DDPKIT_CHECK(!parts.empty(), "uint8_affine_decode_mean: no payloads");
  DDPKIT_CHECK(out.dim() == 1 && out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() <= rows * cols,
               "uint8_affine_decode_mean: out must be a contiguous 1-D float32 tensor of at most ", rows, " x ", cols,
               " elements, got ", out.sizes(), " ", out.scalar_type());
  const float divide_by = static_cast<float>(parts.size());
  if (!out.device().is_cpu()) {  // GPU: the same operations in ATen
    at::Tensor acc = at::zeros({rows, cols}, out.options());
    for (const auto& p : parts) {
      at::Tensor scale = p.narrow(0, 0, rows * 4).view(at::kFloat).unsqueeze(1);
      at::Tensor zero_point = p.narrow(0, rows * 4, rows * 4).view(at::kFloat).unsqueeze(1);
      acc.add_((p.narrow(0, 8 * rows, rows * cols).view({rows, cols}).to(at::kFloat) - zero_point) * scale);
    }
    out.copy_(acc.div_(divide_by).view({-1}).narrow(0, 0, out.numel()));
    return;
  }
  std::vector<AffineParts> in;
  for (const auto& p : parts) in.push_back(affine_parts(p, rows, cols, "uint8_affine_decode_mean"));
  float* y = out.data_ptr<float>();
  const AffineDecode decode = affine_decode_kernel();
  at::parallel_for(0, out.numel(), kAffineGrain, [&](int64_t begin, int64_t end) {
    for_row_segments(begin, end, cols, [&](int64_t row, int64_t at, int64_t len) {
      for (size_t k = 0; k < in.size(); ++k)
        decode(in[k].codes + at, len, in[k].scale[row], in[k].zero_point[row], y + at, k == 0,
               k + 1 == in.size() ? divide_by : 0.f);
    });
  });
}

}  // namespace codecs
}  // namespace ddpkit
