#include "wire_tensor.h"

#include <ddpkit/error.h>

#include <c10/util/accumulate.h>

#include <cstring>
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

}  // namespace

void encode_tensor(const at::Tensor& tensor, wire::Tensor* out) {
  at::Tensor t = tensor.device().is_cpu() ? tensor : tensor.cpu();
  out->set_dtype(to_wire(t.scalar_type()));
  out->clear_shape();
  for (int64_t s : t.sizes()) out->add_shape(s);
  if (t.is_sparse()) {
    at::Tensor c = t.coalesce();
    out->set_sparse(true);
    out->set_sparse_dim(static_cast<int32_t>(c.sparse_dim()));
    out->set_nnz(c._nnz());
    put_bytes(c._indices(), out->mutable_indices());
    put_bytes(c._values(), out->mutable_data());
  } else {
    out->set_sparse(false);
    put_bytes(t, out->mutable_data());
  }
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

at::Tensor decode_tensor(const wire::Tensor& t, std::string* error) {
  at::ScalarType dtype;
  if (!from_wire(t.dtype(), &dtype)) {
    *error = "unknown dtype code " + std::to_string(t.dtype());
    return {};
  }
  std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  for (int64_t s : shape)
    if (s < 0 || s > (int64_t(1) << 40)) {
      *error = "bad dimension " + std::to_string(s) + " in " + describe(t);
      return {};
    }
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  if (!t.sparse()) {
    const int64_t numel = c10::multiply_integers(shape);
    if (static_cast<int64_t>(t.data().size()) != numel * elem) {
      *error = describe(t) + " needs " + std::to_string(numel * elem) + " bytes of data, the message has " +
               std::to_string(t.data().size());
      return {};
    }
    at::Tensor out = at::empty(shape, at::TensorOptions().dtype(dtype));
    std::memcpy(out.data_ptr(), t.data().data(), t.data().size());
    return out;
  }
  const int64_t sparse_dim = t.sparse_dim(), nnz = t.nnz();
  if (sparse_dim < 1 || sparse_dim > static_cast<int64_t>(shape.size()) || nnz < 0) {
    *error = "bad sparse layout " + describe(t);
    return {};
  }
  std::vector<int64_t> value_shape{nnz};
  value_shape.insert(value_shape.end(), shape.begin() + sparse_dim, shape.end());
  const int64_t index_bytes = sparse_dim * nnz * 8;
  const int64_t value_bytes = c10::multiply_integers(value_shape) * elem;
  if (static_cast<int64_t>(t.indices().size()) != index_bytes || static_cast<int64_t>(t.data().size()) != value_bytes) {
    *error = describe(t) + " needs " + std::to_string(index_bytes) + " bytes of indices and " +
             std::to_string(value_bytes) + " of values, the message has " + std::to_string(t.indices().size()) +
             " and " + std::to_string(t.data().size());
    return {};
  }
  at::Tensor indices = at::empty({sparse_dim, nnz}, at::TensorOptions().dtype(at::kLong));
  at::Tensor values = at::empty(value_shape, at::TensorOptions().dtype(dtype));
  std::memcpy(indices.data_ptr(), t.indices().data(), index_bytes);
  std::memcpy(values.data_ptr(), t.data().data(), value_bytes);
  try {
    // Rejects indices outside the shape: they would corrupt the sum.
    at::_validate_sparse_coo_tensor_args(indices, values, shape);
  } catch (const c10::Error& e) {
    *error = describe(t) + ": " + e.what_without_backtrace();
    return {};
  }
  return at::_sparse_coo_tensor_unsafe(indices, values, shape).coalesce();
}

bool decode_dense_into(const wire::Tensor& t, at::Tensor& into, std::string* error) {
  at::ScalarType dtype;
  if (t.sparse() || !from_wire(t.dtype(), &dtype) || dtype != into.scalar_type() ||
      static_cast<int64_t>(t.data().size()) != into.numel() * static_cast<int64_t>(into.element_size())) {
    *error = "reply " + describe(t) + " does not fit the gradient (" + std::to_string(into.numel()) + " x " +
             c10::toString(into.scalar_type()) + ")";
    return false;
  }
  if (into.is_contiguous() && into.device().is_cpu()) {
    std::memcpy(into.data_ptr(), t.data().data(), t.data().size());
  } else {
    at::Tensor tmp = at::empty({into.numel()}, at::TensorOptions().dtype(dtype));
    std::memcpy(tmp.data_ptr(), t.data().data(), t.data().size());
    into.copy_(tmp.view(into.sizes()));
  }
  return true;
}

}  // namespace ps
}  // namespace ddpkit
