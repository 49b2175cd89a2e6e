#include <ddpkit/codecs/cast.h>
#include <ddpkit/error.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cpuid.h>
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12's AVX-512 intrinsics start from an "undefined" vector and warn about it inside the
// header (GCC bug 105593, fixed in 13); the warning says nothing about this file.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <cstring>

namespace ddpkit {
namespace codecs {
namespace {

// Elements per task when ATen runs with several threads; large enough to amortise dispatch.
constexpr int64_t kGrain = 1 << 16;

// ---- scalar reference (also the tails of the vector loops) -------------------------------------
inline uint16_t f2h(float x) { return c10::Half(x).x; }
inline float h2f(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
inline uint16_t f2b(float x) { return c10::BFloat16(x).x; }
inline float b2f(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

void f2h_scalar(const float* in, uint16_t* out, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) out[i] = f2h(in[i] * s);
}
void h2f_scalar(const uint16_t* in, float* out, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) out[i] = h2f(in[i]) * s;
}
void f2b_scalar(const float* in, uint16_t* out, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) out[i] = f2b(in[i] * s);
}
void b2f_scalar(const uint16_t* in, float* out, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) out[i] = b2f(in[i]) * s;
}
template <bool kBf16>
void sum_scalar(const uint16_t* const* in, int k, uint16_t* out, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = 0.f;
    for (int r = 0; r < k; ++r) acc += kBf16 ? b2f(in[r][i]) : h2f(in[r][i]);
    if (s != 1.f) acc *= s;
    out[i] = kBf16 ? f2b(acc) : f2h(acc);
  }
}
// Full-precision sums (the shared-memory allreduce): left to the compiler, built per target below.
template <typename T>
inline void sum_full(const T* const* in, int k, T* out, int64_t n, T s) {
  for (int64_t i = 0; i < n; ++i) {
    T acc = in[0][i];
    for (int r = 1; r < k; ++r) acc += in[r][i];
    out[i] = s == T(1) ? acc : acc * s;
  }
}
void sum_f32_scalar(const float* const* in, int k, float* out, int64_t n, float s) { sum_full(in, k, out, n, s); }
void sum_f64_scalar(const double* const* in, int k, double* out, int64_t n, double s) { sum_full(in, k, out, n, s); }

// ---- AVX2 + F16C: 8 lanes ------------------------------------------------------------------------
#define DDPKIT_AVX2 __attribute__((target("avx2,f16c,fma")))

DDPKIT_AVX2 inline __m128i bf16_round_avx2(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i biased = _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  __m256i r = _mm256_srli_epi32(biased, 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
  // Pack 8 x u32 (all <= 0xffff) into 8 x u16: packus works per 128-bit lane, so fix the order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(packed);
}
DDPKIT_AVX2 inline __m256 bf16_load_avx2(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
DDPKIT_AVX2 inline __m256 f16_load_avx2(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

DDPKIT_AVX2 void f2h_avx2(const float* in, uint16_t* out, int64_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(in + i), vs);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  f2h_scalar(in + i, out + i, n - i, s);
}
DDPKIT_AVX2 void h2f_avx2(const uint16_t* in, float* out, int64_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(f16_load_avx2(in + i), vs));
  h2f_scalar(in + i, out + i, n - i, s);
}
DDPKIT_AVX2 void f2b_avx2(const float* in, uint16_t* out, int64_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(in + i), vs);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), bf16_round_avx2(v));
  }
  f2b_scalar(in + i, out + i, n - i, s);
}
DDPKIT_AVX2 void b2f_avx2(const uint16_t* in, float* out, int64_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(bf16_load_avx2(in + i), vs));
  b2f_scalar(in + i, out + i, n - i, s);
}
template <bool kBf16>
DDPKIT_AVX2 void sum_avx2(const uint16_t* const* in, int k, uint16_t* out, int64_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int r = 0; r < k; ++r)
      acc = _mm256_add_ps(acc, kBf16 ? bf16_load_avx2(in[r] + i) : f16_load_avx2(in[r] + i));
    if (s != 1.f) acc = _mm256_mul_ps(acc, vs);
    const __m128i h = kBf16 ? bf16_round_avx2(acc) : _mm256_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  if (i < n) {
    const uint16_t* tails[64];
    DDPKIT_CHECK(k <= 64, "sum_low_precision_into supports at most 64 inputs, got ", k);
    for (int r = 0; r < k; ++r) tails[r] = in[r] + i;
    sum_scalar<kBf16>(tails, k, out + i, n - i, s);
  }
}

DDPKIT_AVX2 void sum_f32_avx2(const float* const* in, int k, float* out, int64_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 acc = _mm256_loadu_ps(in[0] + i);
    for (int r = 1; r < k; ++r) acc = _mm256_add_ps(acc, _mm256_loadu_ps(in[r] + i));
    if (s != 1.f) acc = _mm256_mul_ps(acc, vs);
    _mm256_storeu_ps(out + i, acc);
  }
  if (i < n) {
    const float* tails[64];
    for (int r = 0; r < k; ++r) tails[r] = in[r] + i;
    sum_full(tails, k, out + i, n - i, s);
  }
}
DDPKIT_AVX2 void sum_f64_avx2(const double* const* in, int k, double* out, int64_t n, double s) { sum_full(in, k, out, n, s); }

// ---- AVX-512: 16 lanes ---------------------------------------------------------------------------
#define DDPKIT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))

DDPKIT_AVX512 inline __m256i bf16_round_avx512(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i biased = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __m512i r = _mm512_srli_epi32(biased, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}
DDPKIT_AVX512 inline __m512 bf16_load_avx512(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
DDPKIT_AVX512 inline __m512 f16_load_avx512(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

DDPKIT_AVX512 void f2h_avx512(const float* in, uint16_t* out, int64_t n, float s) {
  const __m512 vs = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(in + i), vs);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  f2h_scalar(in + i, out + i, n - i, s);
}
DDPKIT_AVX512 void h2f_avx512(const uint16_t* in, float* out, int64_t n, float s) {
  const __m512 vs = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_mul_ps(f16_load_avx512(in + i), vs));
  h2f_scalar(in + i, out + i, n - i, s);
}
DDPKIT_AVX512 void f2b_avx512(const float* in, uint16_t* out, int64_t n, float s) {
  const __m512 vs = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(in + i), vs);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), bf16_round_avx512(v));
  }
  f2b_scalar(in + i, out + i, n - i, s);
}
DDPKIT_AVX512 void b2f_avx512(const uint16_t* in, float* out, int64_t n, float s) {
  const __m512 vs = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_mul_ps(bf16_load_avx512(in + i), vs));
  b2f_scalar(in + i, out + i, n - i, s);
}
template <bool kBf16>
DDPKIT_AVX512 void sum_avx512(const uint16_t* const* in, int k, uint16_t* out, int64_t n, float s) {
  const __m512 vs = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int r = 0; r < k; ++r)
      acc = _mm512_add_ps(acc, kBf16 ? bf16_load_avx512(in[r] + i) : f16_load_avx512(in[r] + i));
    if (s != 1.f) acc = _mm512_mul_ps(acc, vs);
    const __m256i h = kBf16 ? bf16_round_avx512(acc)
                            : _mm512_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
  }
  if (i < n) {
    const uint16_t* tails[64];
    DDPKIT_CHECK(k <= 64, "sum_low_precision_into supports at most 64 inputs, got ", k);
    for (int r = 0; r < k; ++r) tails[r] = in[r] + i;
    sum_scalar<kBf16>(tails, k, out + i, n - i, s);
  }
}

DDPKIT_AVX512 void sum_f32_avx512(const float* const* in, int k, float* out, int64_t n, float s) {
  const __m512 vs = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 acc = _mm512_loadu_ps(in[0] + i);
    for (int r = 1; r < k; ++r) acc = _mm512_add_ps(acc, _mm512_loadu_ps(in[r] + i));
    if (s != 1.f) acc = _mm512_mul_ps(acc, vs);
    _mm512_storeu_ps(out + i, acc);
  }
  if (i < n) {
    const float* tails[64];
    for (int r = 0; r < k; ++r) tails[r] = in[r] + i;
    sum_full(tails, k, out + i, n - i, s);
  }
}
DDPKIT_AVX512 void sum_f64_avx512(const double* const* in, int k, double* out, int64_t n, double s) { sum_full(in, k, out, n, s); }

// ---- dispatch ------------------------------------------------------------------------------------
struct CastKernels {
  void (*f2h)(const float*, uint16_t*, int64_t, float);
  void (*h2f)(const uint16_t*, float*, int64_t, float);
  void (*f2b)(const float*, uint16_t*, int64_t, float);
  void (*b2f)(const uint16_t*, float*, int64_t, float);
  void (*sum_h)(const uint16_t* const*, int, uint16_t*, int64_t, float);
  void (*sum_b)(const uint16_t* const*, int, uint16_t*, int64_t, float);
  void (*sum_f)(const float* const*, int, float*, int64_t, float);
  void (*sum_d)(const double* const*, int, double*, int64_t, double);
};

const CastKernels kScalar{f2h_scalar, h2f_scalar,        f2b_scalar,     b2f_scalar,
                      sum_scalar<false>, sum_scalar<true>, sum_f32_scalar, sum_f64_scalar};
const CastKernels kAvx2{f2h_avx2, h2f_avx2, f2b_avx2, b2f_avx2, sum_avx2<false>, sum_avx2<true>, sum_f32_avx2, sum_f64_avx2};
const CastKernels kAvx512{f2h_avx512,        h2f_avx512,       f2b_avx512,     b2f_avx512,
                      sum_avx512<false>, sum_avx512<true>, sum_f32_avx512, sum_f64_avx512};

SimdLevel best_level() {
  if (const char* forced = std::getenv("DDPKIT_SIMD")) {
    const std::string f(forced);
    if (f == "scalar") return SimdLevel::Scalar;
    if (f == "avx2" && cpu_supports(SimdLevel::Avx2)) return SimdLevel::Avx2;
    if (f == "avx512" && cpu_supports(SimdLevel::Avx512)) return SimdLevel::Avx512;
  }
  if (cpu_supports(SimdLevel::Avx512)) return SimdLevel::Avx512;
  if (cpu_supports(SimdLevel::Avx2)) return SimdLevel::Avx2;
  return SimdLevel::Scalar;
}

std::atomic<SimdLevel>& level_slot() {
  static std::atomic<SimdLevel> level{best_level()};
  return level;
}

const CastKernels& cast_kernels() {
  switch (level_slot().load(std::memory_order_relaxed)) {
    case SimdLevel::Avx512: return kAvx512;
    case SimdLevel::Avx2: return kAvx2;
    default: return kScalar;
  }
}

bool is_fast_lowp(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

}  // namespace

namespace {
// CPUID.1:ECX bit 29. (clang 14's __builtin_cpu_supports does not know "f16c"; GCC's does.)
bool has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29));
}
}  // namespace

bool cpu_supports(SimdLevel level) {
  switch (level) {
    case SimdLevel::Scalar: return true;
    case SimdLevel::Avx2:
      return __builtin_cpu_supports("avx2") && has_f16c() && __builtin_cpu_supports("fma");
    case SimdLevel::Avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && has_f16c();
  }
  return false;
}

SimdLevel simd_level() { return level_slot().load(); }

const char* simd_level_name() {
  switch (simd_level()) {
    case SimdLevel::Avx512: return "avx512";
    case SimdLevel::Avx2: return "avx2+f16c";
    default: return "scalar";
  }
}

void set_simd_level(SimdLevel level) {
  DDPKIT_CHECK(cpu_supports(level), "this CPU does not support SIMD level ", static_cast<int>(level));
  level_slot().store(level);
}

void cast_scaled_into(const at::Tensor& src, const at::Tensor& dst, double scale) {
  DDPKIT_CHECK(src.numel() == dst.numel(), "cast_scaled_into: src has ", src.numel(),
               " elements but dst has ", dst.numel());
  const bool fast = src.device().is_cpu() && dst.device().is_cpu() && src.is_contiguous() &&
                    dst.is_contiguous() &&
                    ((src.scalar_type() == at::kFloat && is_fast_lowp(dst.scalar_type())) ||
                     (is_fast_lowp(src.scalar_type()) && dst.scalar_type() == at::kFloat));
  if (!fast) {
    // Generic path (GPU tensors, float64, strided views): ATen does the cast.
    if (scale == 1.0) {
      dst.view_as(src).copy_(src);
    } else {
      dst.view_as(src).copy_(src.to(at::promote_types(src.scalar_type(), at::kFloat)) * scale);
    }
    return;
  }
  const CastKernels& k = cast_kernels();
  const float s = static_cast<float>(scale);
  const auto sdt = src.scalar_type();
  const auto ddt = dst.scalar_type();
  at::parallel_for(0, src.numel(), kGrain, [&](int64_t b, int64_t e) {
    if (sdt == at::kFloat) {
      const float* in = src.data_ptr<float>() + b;
      auto* out = static_cast<uint16_t*>(dst.data_ptr()) + b;
      (ddt == at::kHalf ? k.f2h : k.f2b)(in, out, e - b, s);
    } else {
      const auto* in = static_cast<const uint16_t*>(src.data_ptr()) + b;
      float* out = dst.data_ptr<float>() + b;
      (sdt == at::kHalf ? k.h2f : k.b2f)(in, out, e - b, s);
    }
  });
}

at::Tensor cast_scaled(const at::Tensor& src, at::ScalarType dtype, double scale) {
  auto dst = at::empty(src.sizes(), src.options().dtype(dtype).memory_format(at::MemoryFormat::Contiguous));
  cast_scaled_into(src.contiguous(), dst, scale);
  return dst;
}

void sum_low_precision_into(const std::vector<at::Tensor>& inputs, const at::Tensor& out) {
  DDPKIT_CHECK(!inputs.empty(), "sum_low_precision_into needs at least one input");
  const auto dt = out.scalar_type();
  DDPKIT_CHECK(is_fast_lowp(dt), "sum_low_precision_into takes float16 or bfloat16, got ", dt);
  DDPKIT_CHECK(out.is_contiguous() && out.device().is_cpu(), "sum_low_precision_into: out must be a contiguous CPU tensor");
  std::vector<const uint16_t*> ptrs;
  for (const auto& t : inputs) {
    DDPKIT_CHECK(t.scalar_type() == dt && t.numel() == out.numel() && t.is_contiguous() && t.device().is_cpu(),
                 "sum_low_precision_into: every input must be a contiguous CPU ", dt, " tensor of ",
                 out.numel(), " elements");
    ptrs.push_back(static_cast<const uint16_t*>(t.data_ptr()));
  }
  const CastKernels& k = cast_kernels();
  auto* o = static_cast<uint16_t*>(out.data_ptr());
  const int count = static_cast<int>(ptrs.size());
  at::parallel_for(0, out.numel(), kGrain, [&](int64_t b, int64_t e) {
    std::vector<const uint16_t*> shifted(ptrs.size());
    for (size_t r = 0; r < ptrs.size(); ++r) shifted[r] = ptrs[r] + b;
    (dt == at::kHalf ? k.sum_h : k.sum_b)(shifted.data(), count, o + b, e - b, 1.f);
  });
}

bool sums_raw(c10::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
}

void sum_raw(c10::ScalarType dtype, const void* const* inputs, int count, void* out, int64_t n, double scale) {
  DDPKIT_CHECK(count >= 1 && count <= 64, "sum_raw takes 1 to 64 inputs, got ", count);
  const CastKernels& k = cast_kernels();
  switch (dtype) {
    case at::kFloat:
      return k.sum_f(reinterpret_cast<const float* const*>(inputs), count, static_cast<float*>(out), n,
                     static_cast<float>(scale));
    case at::kDouble:
      return k.sum_d(reinterpret_cast<const double* const*>(inputs), count, static_cast<double*>(out), n, scale);
    case at::kHalf:
    case at::kBFloat16:
      return (dtype == at::kHalf ? k.sum_h : k.sum_b)(reinterpret_cast<const uint16_t* const*>(inputs), count,
                                                      static_cast<uint16_t*>(out), n, static_cast<float>(scale));
    default:
      DDPKIT_CHECK(false, "sum_raw: no kernel for ", dtype, " (float32, float64, float16, bfloat16)");
  }
}

}  // namespace codecs
}  // namespace ddpkit
