// at::Tensor <-> wire::Tensor. Decoding checks every size against the shape, so a malformed
// message is an error, never an out-of-bounds read.
#pragma once

#include "parameter_server.pb.h"

#include <ATen/ATen.h>
#include <grpcpp/support/byte_buffer.h>

#include <string>

namespace ddpkit {
namespace ps {

// Bytes of tensor data a message carries (data + indices).
int64_t payload_bytes(const wire::Tensor& t);
// Returns the tensor (CPU); on a malformed message returns an undefined tensor and sets *error.
// A dense tensor owns its memory unless `borrow_dense`: then it views the message's bytes and is
// valid only while the message lives (saves a copy when the caller only reads it once).
at::Tensor decode_tensor(const wire::Tensor& t, std::string* error, bool borrow_dense = false);
// Which part of a bucket a request carries (GradientRequest fields 5-7); count 0: the whole bucket.
struct ChunkOf {
  int64_t index = 0, count = 0, bucket_numel = 0;
};
// A serialized GradientRequest whose tensor bytes are not copied: the data slice refers to the
// (contiguous CPU) tensor's memory until gRPC has sent it. With `shared`, the data bytes are there
// (the caller put them) and the message carries only the gradient's dtype and shape, and a
// sparse gradient's (coalesced, CPU) indices.
grpc::ByteBuffer serialize_gradient_request(int trainer, int64_t batch, int64_t bucket, const at::Tensor& gradient,
                                            ChunkOf chunk = {}, const wire::SharedMemoryRef* shared = nullptr);
// A dense tensor over `bytes` bytes at `data` (shared memory), shaped as `t` says; undefined with
// *error when `t` is sparse, carries data of its own, or its shape needs another size.
at::Tensor view_dense(const wire::Tensor& t, uint8_t* data, int64_t bytes, std::string* error);
// A sparse tensor whose indices are in `t` and whose values (at most `room` bytes) are at `values`
// (shared memory); undefined with *error when `t` is dense, carries data, or needs more room.
at::Tensor decode_sparse_at(const wire::Tensor& t, const uint8_t* values, int64_t room, std::string* error);
// A serialized GradientReply of `average`, its data sent from the tensor's memory, no copy.
grpc::ByteBuffer serialize_reply(const at::Tensor& average);
// A serialized GradientReply saying the average's data is in shared memory (its dtype, shape and,
// sparse, coalesced indices given).
grpc::ByteBuffer serialize_shared_memory_reply(const at::Tensor& average);
// Parses a serialized GradientReply holding a dense tensor, copying its elements straight from
// the received slices into `into` (same numel and dtype). False with *error otherwise.
bool parse_dense_reply_into(grpc::ByteBuffer& reply, at::Tensor& into, std::string* error);

// The dtype a (validated) message names.
at::ScalarType scalar_type_of(const wire::Tensor& t);

// "float32[4, 8]" or "sparse float32[1024, 1024] (nnz 37)" for error messages.
std::string describe(const wire::Tensor& t);

}  // namespace ps
}  // namespace ddpkit
