// Block-wise symmetric int8 quantization, the wire format of the scalable int8 allreduce.
//
// A tensor of `numel` float32 values is cut into blocks of `block` elements; each block travels
// as `block` int8 codes q = round_half_even(x * 127 / max|x|) followed, after all blocks, by one
// float32 scale max|x| / 127 per block. Decoding gives q * scale, so each value is off by at most
// scale / 2 = max_block|x| / 254. A block holding NaN or Inf decodes to NaN everywhere: non-finite
// gradients are never turned into finite ones. Kernels use AVX-512 or AVX2 when the CPU has them
// (the level of codecs::simd_level()); every level produces the same bytes. GPU tensors take the
// same format through ATen operations (detail::int8_*_aten).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace ddpkit {
namespace codecs {

// Bytes of an encoded tensor of `numel` elements (rounded up to whole blocks).
int64_t int8_encoded_bytes(int64_t numel, int64_t block);

// Encodes the first `valid` elements of `src` (float32, contiguous) as a tensor of `numel`
// elements (numel >= valid; the rest count as zeros) into `out` (uint8, int8_encoded_bytes(numel,
// block) bytes). With `residual` defined (float32, `valid` elements), writes src - decode(out)
// there: the quantization error, for error feedback.
void int8_encode(const at::Tensor& src, int64_t valid, int64_t numel, int64_t block, const at::Tensor& out,
                 const at::Tensor& residual = {});

// dst[0:count] (+)= decode(encoded)[0:count] * multiplier, accumulating when `accumulate` (one
// fused multiply-add per element, identical on every SIMD level). `numel` is the encoded length.
void int8_decode(const at::Tensor& encoded, int64_t numel, int64_t block, const at::Tensor& dst, int64_t count,
                 float multiplier = 1.0f, bool accumulate = false);

// ---- PyTorch's quantization hooks' format: uint8 affine, per row --------------------------------
// MinMaxObserver / PerChannelMinMaxObserver.calculate_qparams for quint8 (0..255), in the same
// float32 operations, per row of `values` (1-D) cut into rows of `cols`, the last row padded with
// zeros (one row of all of them for per-tensor): {scale, zero_point}, one each per row.
std::pair<at::Tensor, at::Tensor> uint8_affine_qparams(const at::Tensor& values, int64_t cols);

// The payload of the rows x cols block whose elements are `values` (1-D, contiguous, at most
// rows * cols of them; the rest are zeros) under one scale and zero point per row: [rows scales]
// [rows zero points] (float32, first so they stay aligned), then [rows * cols codes]. One pass,
// no temporaries: on the CPU, the float32 operations of PyTorch's hook bit for bit.
at::Tensor uint8_affine_encode(const at::Tensor& values, int64_t rows, int64_t cols, const at::Tensor& scale,
                               const at::Tensor& zero_point);

// out = the mean of the payloads' decoded values (each rows x cols; `out` holds the first
// out.numel() of them, 1-D): summed in the payloads' order from zero, then divided by their count,
// in one pass as PyTorch's hook does in several.
void uint8_affine_decode_mean(const std::vector<at::Tensor>& parts, int64_t rows, int64_t cols, const at::Tensor& out);

namespace detail {
void int8_encode_aten(const at::Tensor& src, int64_t valid, int64_t numel, int64_t block, const at::Tensor& out,
                      const at::Tensor& residual);
void int8_decode_aten(const at::Tensor& encoded, int64_t numel, int64_t block, const at::Tensor& dst, int64_t count,
                      float multiplier, bool accumulate);
}  // namespace detail

}  // namespace codecs
}  // namespace ddpkit
