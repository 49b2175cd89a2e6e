// at::Tensor <-> wire::Tensor. Decoding checks every size against the shape, so a malformed
// message is an error, never an out-of-bounds read.
#pragma once

#include "parameter_server.pb.h"

#include <ATen/ATen.h>

#include <string>

namespace ddpkit {
namespace ps {

// Dense: the elements (contiguous copy). Sparse: coalesced indices and values.
void encode_tensor(const at::Tensor& tensor, wire::Tensor* out);
// Bytes of tensor data a message carries (data + indices).
int64_t payload_bytes(const wire::Tensor& t);
// Returns the tensor (CPU, owning its memory); on a malformed message returns an undefined tensor
// and sets *error.
at::Tensor decode_tensor(const wire::Tensor& t, std::string* error);
// A dense message's elements copied into `into` (same numel and dtype, any layout); false with
// *error when they do not fit.
bool decode_dense_into(const wire::Tensor& t, at::Tensor& into, std::string* error);
// "float32[4, 8]" or "sparse float32[1024, 1024] (nnz 37)" for error messages.
std::string describe(const wire::Tensor& t);

}  // namespace ps
}  // namespace ddpkit
