#include "wire_tensor.h"

#include <ddpkit/codecs/sparse.h>
#include <ddpkit/error.h>

#include <c10/util/accumulate.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <cstring>
#include <limits>
#include <sstream>

namespace ddpkit {
namespace ps {
namespace {

wire::DType to_wire(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return wire::FLOAT32;
    case at::kDouble: return wire::FLOAT64;
    case at::kHalf: return wire::FLOAT16;
    case at::kBFloat16: return wire::BFLOAT16;
    default: DDPKIT_CHECK(false, "parameter server: gradients of dtype ", t, " are not supported (float32, float64, float16, bfloat16)");
  }
  return wire::DTYPE_UNSPECIFIED;
}

bool from_wire(wire::DType t, at::ScalarType* out) {
  switch (t) {
    case wire::FLOAT32: *out = at::kFloat; return true;
    case wire::FLOAT64: *out = at::kDouble; return true;
    case wire::FLOAT16: *out = at::kHalf; return true;
    case wire::BFLOAT16: *out = at::kBFloat16; return true;
    default: return false;
  }
}

const char* dtype_name(wire::DType t) {
  switch (t) {
    case wire::FLOAT32: return "float32";
    case wire::FLOAT64: return "float64";
    case wire::FLOAT16: return "float16";
    case wire::BFLOAT16: return "bfloat16";
    default: return "unknown-dtype";
  }
}

void put_bytes(const at::Tensor& t, std::string* out) {
  at::Tensor c = t.is_contiguous() ? t : t.contiguous();
  out->assign(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

// A slice over the tensor's bytes, no copy: the slice holds a reference to the tensor until gRPC
// has sent it. The tensor must not change meanwhile (a gradient being averaged does not).
grpc::Slice tensor_slice(const at::Tensor& contiguous_cpu) {
  auto* keep = new at::Tensor(contiguous_cpu);
  return grpc::Slice(keep->data_ptr(), keep->nbytes(), [](void* p) { delete static_cast<at::Tensor*>(p); }, keep);
}

// A Tensor message carrying `data` as field 3, serialized as [head slice][data slice]: `head` is
// what goes before the data (the outer fields and the Tensor's other fields).
std::vector<grpc::Slice> with_data(const std::string& head, const at::Tensor& data, const std::string& tail = "") {
  std::vector<grpc::Slice> out;
  out.emplace_back(head);
  if (data.defined() && data.nbytes() > 0) out.push_back(tensor_slice(data));
  if (!tail.empty()) out.emplace_back(tail);
  return out;
}

}  // namespace

namespace {
// Everything but `data`: the dtype and shape, and a sparse tensor's layout and indices (it must be
// coalesced). All a message needs when the data bytes are in shared memory.
void header_without_data(const at::Tensor& t, wire::Tensor* out) {
  out->set_dtype(to_wire(t.scalar_type()));
  out->clear_shape();
  for (int64_t s : t.sizes()) out->add_shape(s);
  out->set_sparse(t.is_sparse());
  if (t.is_sparse()) {
    out->set_sparse_dim(static_cast<int32_t>(t.sparse_dim()));
    out->set_nnz(t._nnz());
    put_bytes(t._indices(), out->mutable_indices());
  }
}
}  // namespace

// Everything but `data`; returns the contiguous CPU tensor whose bytes belong in `data`.
at::Tensor encode_header(const at::Tensor& tensor, wire::Tensor* out) {
  at::Tensor t = tensor.device().is_cpu() ? tensor : tensor.cpu();
  if (t.is_sparse()) t = codecs::coalesce(t);
  header_without_data(t, out);
  return t.is_sparse() ? t._values().contiguous() : t.contiguous();
}

namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedOutputStream;

// Writes field `field` of the enclosing message: a Tensor with `header`'s fields and `n` bytes of
// data, up to where those bytes go (they follow in a slice of their own).
void write_tensor_up_to_data(CodedOutputStream& out, int field, const wire::Tensor& header, size_t n) {
  const std::string head = header.SerializeAsString();
  const size_t len = head.size() + 1 + CodedOutputStream::VarintSize64(n) + n;  // + field 3's tag
  WireFormatLite::WriteTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, &out);
  out.WriteVarint64(len);
  out.WriteRaw(head.data(), static_cast<int>(head.size()));
  WireFormatLite::WriteTag(3, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, &out);
  out.WriteVarint64(n);
}

}  // namespace

grpc::ByteBuffer serialize_gradient_request(int trainer, int64_t batch, int64_t bucket, const at::Tensor& gradient,
                                            ChunkOf chunk, const wire::SharedMemoryRef* shared) {
  wire::Tensor header;
  at::Tensor data;  // undefined: the bytes are in shared memory, no copy to make contiguous or CPU
  if (shared)
    header_without_data(gradient, &header);
  else
    data = encode_header(gradient, &header);
  const size_t data_bytes = data.defined() ? data.nbytes() : 0;
  std::string head, tail;
  {
    google::protobuf::io::StringOutputStream raw(&head);
    CodedOutputStream out(&raw);
    WireFormatLite::WriteInt32(1, trainer, &out);
    WireFormatLite::WriteInt64(2, batch, &out);
    WireFormatLite::WriteInt64(3, bucket, &out);
    write_tensor_up_to_data(out, 4, header, data_bytes);
  }
  {
    google::protobuf::io::StringOutputStream raw(&tail);
    CodedOutputStream out(&raw);
    if (chunk.count != 0) {
      WireFormatLite::WriteInt64(5, chunk.index, &out);
      WireFormatLite::WriteInt64(6, chunk.count, &out);
      WireFormatLite::WriteInt64(7, chunk.bucket_numel, &out);
    }
    if (shared) WireFormatLite::WriteBytes(8, shared->SerializeAsString(), &out);
  }
  auto slices = with_data(head, data, tail);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer serialize_reply(const at::Tensor& average) {
  wire::Tensor header;
  const at::Tensor data = encode_header(average, &header);
  std::string head;
  {
    google::protobuf::io::StringOutputStream raw(&head);
    CodedOutputStream out(&raw);
    write_tensor_up_to_data(out, 1, header, data.nbytes());  // GradientReply.average
  }
  auto slices = with_data(head, data);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer serialize_shared_memory_reply(const at::Tensor& average) {
  wire::GradientReply reply;
  header_without_data(average, reply.mutable_average());
  reply.set_in_shared_memory(true);
  grpc::ByteBuffer out;
  bool own = false;
  DDPKIT_CHECK(grpc::SerializationTraits<wire::GradientReply>::Serialize(reply, &out, &own).ok(),
               "cannot serialize a GradientReply");
  return out;
}

bool parse_dense_reply_into(grpc::ByteBuffer& reply, at::Tensor& into, std::string* error) {
  using google::protobuf::internal::WireFormatLite;
  grpc::ProtoBufferReader reader(&reply);
  google::protobuf::io::CodedInputStream in(&reader);
  in.SetTotalBytesLimit(std::numeric_limits<int>::max());
  const int64_t want = into.numel() * static_cast<int64_t>(into.element_size());
  bool got_data = false;
  wire::DType dtype = wire::DTYPE_UNSPECIFIED;
  // GradientReply: field 1 is the Tensor; anything else is skipped.
  for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
    if (WireFormatLite::GetTagFieldNumber(tag) != 1 ||
        WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      if (!WireFormatLite::SkipField(&in, tag)) break;
      continue;
    }
    uint32_t len = 0;
    if (!in.ReadVarint32(&len)) break;
    const auto limit = in.PushLimit(static_cast<int>(len));
    for (uint32_t t = in.ReadTag(); t != 0; t = in.ReadTag()) {
      const int field = WireFormatLite::GetTagFieldNumber(t);
      if (field == 3 && WireFormatLite::GetTagWireType(t) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
        uint32_t n = 0;
        if (!in.ReadVarint32(&n)) break;
        if (static_cast<int64_t>(n) != want) {
          *error = "reply carries " + std::to_string(n) + " bytes for a gradient of " + std::to_string(want);
          return false;
        }
        if (into.is_contiguous() && into.device().is_cpu()) {
          if (!in.ReadRaw(into.data_ptr(), static_cast<int>(n))) break;
        } else {
          at::Tensor tmp = at::empty({into.numel()}, into.options().device(c10::kCPU));
          if (!in.ReadRaw(tmp.data_ptr(), static_cast<int>(n))) break;
          into.copy_(tmp.view(into.sizes()));
        }
        got_data = true;
      } else if (field == 1 && WireFormatLite::GetTagWireType(t) == WireFormatLite::WIRETYPE_VARINT) {
        uint32_t v = 0;
        if (!in.ReadVarint32(&v)) break;
        dtype = static_cast<wire::DType>(v);
      } else if (field == 4 && WireFormatLite::GetTagWireType(t) == WireFormatLite::WIRETYPE_VARINT) {
        uint32_t v = 0;
        if (!in.ReadVarint32(&v)) break;
        if (v) {
          *error = "reply is sparse, the gradient dense";
          return false;
        }
      } else if (!WireFormatLite::SkipField(&in, t)) {
        break;
      }
    }
    in.PopLimit(limit);
  }
  at::ScalarType st;
  if (!got_data || !from_wire(dtype, &st) || st != into.scalar_type()) {
    *error = got_data ? "reply dtype differs from the gradient's" : "malformed reply (no tensor data)";
    return false;
  }
  return true;
}

at::ScalarType scalar_type_of(const wire::Tensor& t) {
  at::ScalarType out;
  DDPKIT_CHECK(from_wire(t.dtype(), &out), "unknown dtype code ", t.dtype());
  return out;
}

int64_t payload_bytes(const wire::Tensor& t) { return static_cast<int64_t>(t.data().size() + t.indices().size()); }

std::string describe(const wire::Tensor& t) {
  std::ostringstream os;
  if (t.sparse()) os << "sparse ";
  os << dtype_name(t.dtype()) << "[";
  for (int i = 0; i < t.shape_size(); ++i) os << (i ? ", " : "") << t.shape(i);
  os << "]";
  if (t.sparse()) os << " (sparse_dim " << t.sparse_dim() << ", nnz " << t.nnz() << ")";
  return os.str();
}

namespace {
// Bytes of `count` elements of `elem` bytes over `sizes`, or -1 when the product overflows: the
// sizes come off the wire, and a product that wraps could match a short message.
int64_t checked_bytes(const std::vector<int64_t>& sizes, int64_t elem) {
  int64_t bytes = elem;
  for (int64_t s : sizes)
    if (__builtin_mul_overflow(bytes, s, &bytes)) return -1;
  return bytes;
}
}  // namespace

namespace {
// The dtype and shape a message names, checked; false with *error otherwise.
bool read_header(const wire::Tensor& t, at::ScalarType* dtype, std::vector<int64_t>* shape, std::string* error) {
  if (!from_wire(t.dtype(), dtype)) {
    *error = "unknown dtype code " + std::to_string(t.dtype());
    return false;
  }
  shape->assign(t.shape().begin(), t.shape().end());
  // libtorch's kernels take at most 25 dimensions (TensorIterator) and throw beyond: a gradient
  // of more than 16 is refused here, with a message, rather than failing inside the averaging.
  if (shape->size() > 16) {
    *error = std::to_string(shape->size()) + " dimensions (at most 16) in " + describe(t);
    return false;
  }
  for (int64_t s : *shape)
    if (s < 0 || s > (int64_t(1) << 40)) {
      *error = "bad dimension " + std::to_string(s) + " in " + describe(t);
      return false;
    }
  return true;
}
}  // namespace

namespace {
// A coalesced sparse tensor from `t`'s layout and indices and the values at `values`: exactly
// `bytes` of them, or (room) at most `bytes`. Indices are checked against the shape.
at::Tensor sparse_from(const wire::Tensor& t, at::ScalarType dtype, const std::vector<int64_t>& shape, const char* values,
                       int64_t bytes, bool room, std::string* error) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t sparse_dim = t.sparse_dim(), nnz = t.nnz();
  if (sparse_dim < 1 || sparse_dim > static_cast<int64_t>(shape.size()) || nnz < 0) {
    *error = "bad sparse layout " + describe(t);
    return {};
  }
  std::vector<int64_t> value_shape{nnz};
  value_shape.insert(value_shape.end(), shape.begin() + sparse_dim, shape.end());
  const int64_t index_bytes = checked_bytes({sparse_dim, nnz}, 8);
  const int64_t value_bytes = checked_bytes(value_shape, elem);
  if (index_bytes < 0 || value_bytes < 0 || static_cast<int64_t>(t.indices().size()) != index_bytes ||
      (room ? value_bytes > bytes : value_bytes != bytes)) {
    *error = describe(t) + " needs " + std::to_string(index_bytes) + " bytes of indices and " +
             std::to_string(value_bytes) + " of values, the message has " + std::to_string(t.indices().size()) +
             " and " + (room ? "its shared-memory place " : "") + std::to_string(bytes);
    return {};
  }
  at::Tensor indices = at::empty({sparse_dim, nnz}, at::TensorOptions().dtype(at::kLong));
  at::Tensor out_values = at::empty(value_shape, at::TensorOptions().dtype(dtype));
  // nnz 0 or an empty dense part: no bytes, and a null data_ptr that memcpy must not see.
  if (index_bytes) std::memcpy(indices.data_ptr(), t.indices().data(), index_bytes);
  if (value_bytes) std::memcpy(out_values.data_ptr(), values, value_bytes);
  try {
    // Rejects indices outside the shape: they would corrupt the sum.
    at::_validate_sparse_coo_tensor_args(indices, out_values, shape);
  } catch (const c10::Error& e) {
    *error = describe(t) + ": " + e.what_without_backtrace();
    return {};
  }
  return codecs::coalesce(at::_sparse_coo_tensor_unsafe(indices, out_values, shape));
}
}  // namespace

at::Tensor view_dense(const wire::Tensor& t, uint8_t* data, int64_t bytes, std::string* error) {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  if (!read_header(t, &dtype, &shape, error)) return {};
  const int64_t want = checked_bytes(shape, static_cast<int64_t>(c10::elementSize(dtype)));
  if (t.sparse() || !t.data().empty() || want != bytes) {
    *error = describe(t) + (t.sparse() ? " is sparse" : t.data().empty() ? "" : " carries data") +
             " in shared memory of " + std::to_string(bytes) + " bytes (" +
             (want < 0 ? std::string("more than 2^63") : std::to_string(want)) + " needed)";
    return {};
  }
  return at::from_blob(data, shape, at::TensorOptions().dtype(dtype));
}

at::Tensor decode_tensor(const wire::Tensor& t, std::string* error, bool borrow_dense) {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  if (!read_header(t, &dtype, &shape, error)) return {};
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  if (!t.sparse()) {
    const int64_t bytes = checked_bytes(shape, elem);
    if (bytes < 0 || static_cast<int64_t>(t.data().size()) != bytes) {
      *error = describe(t) + " needs " + (bytes < 0 ? std::string("more than 2^63") : std::to_string(bytes)) +
               " bytes of data, the message has " + std::to_string(t.data().size());
      return {};
    }
    if (borrow_dense)
      return at::from_blob(const_cast<char*>(t.data().data()), shape, at::TensorOptions().dtype(dtype));
    at::Tensor out = at::empty(shape, at::TensorOptions().dtype(dtype));
    if (!t.data().empty()) std::memcpy(out.data_ptr(), t.data().data(), t.data().size());  // empty: data_ptr is null
    return out;
  }
  return sparse_from(t, dtype, shape, t.data().data(), static_cast<int64_t>(t.data().size()), /*room=*/false, error);
}

at::Tensor decode_sparse_at(const wire::Tensor& t, const uint8_t* values, int64_t room, std::string* error) {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  if (!read_header(t, &dtype, &shape, error)) return {};
  if (!t.sparse() || !t.data().empty()) {
    *error = describe(t) + (t.sparse() ? " carries data" : " is dense") + " where its values are in shared memory";
    return {};
  }
  return sparse_from(t, dtype, shape, reinterpret_cast<const char*>(values), room, /*room=*/true, error);
}

}  // namespace ps
}  // namespace ddpkit
