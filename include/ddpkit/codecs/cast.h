// Fused precision casts used by the compression hooks and the low-precision allreduce.
// ATen's fp32->fp16 cast runs at a few GB/s on CPU; these kernels use AVX-512 or AVX2+F16C when
// the CPU has them (chosen once at run time; DDPKIT_SIMD=scalar|avx2|avx512 forces a level) and
// round to nearest even exactly like c10::Half / c10::BFloat16, so every level gives the same bits.
#pragma once

#include <ATen/ATen.h>

namespace ddpkit {
namespace codecs {

enum class SimdLevel { Scalar, Avx2, Avx512 };
SimdLevel simd_level();            // the level in use
const char* simd_level_name();     // "scalar", "avx2+f16c", "avx512"
// Forces a level (tests and benchmarks); a level the CPU lacks is refused with an error.
void set_simd_level(SimdLevel level);
bool cpu_supports(SimdLevel level);

// dst = cast(src * scale), in one pass. Fast paths: float32 -> float16/bfloat16 and
// float16/bfloat16 -> float32 on contiguous CPU tensors; any other pair goes through ATen.
// src and dst must have the same number of elements.
void cast_scaled_into(const at::Tensor& src, const at::Tensor& dst, double scale = 1.0);
// Same, into a new contiguous tensor of `dtype`.
at::Tensor cast_scaled(const at::Tensor& src, at::ScalarType dtype, double scale = 1.0);

// out[i] = round(sum over k of float(inputs[k][i])) for float16/bfloat16 tensors of equal size,
// accumulating in fp32 (one rounding, not one per addition). Contiguous CPU tensors only.
void sum_low_precision_into(const std::vector<at::Tensor>& inputs, const at::Tensor& out);

// out[i] = scale * sum over k of inputs[k][i], on raw buffers of n elements of `dtype` (float32,
// float64, float16, bfloat16; the 16-bit types accumulate in fp32 and round once). One thread:
// the shared-memory collectives call it from every rank at once. `out` may be one of the inputs.
bool sums_raw(c10::ScalarType dtype);
void sum_raw(c10::ScalarType dtype, const void* const* inputs, int count, void* out, int64_t n, double scale = 1.0);

}  // namespace codecs
}  // namespace ddpkit
