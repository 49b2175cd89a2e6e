#include <ddpkit/codecs/cast.h>
#include <ddpkit/codecs/sparse.h>
#include <ddpkit/error.h>

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

namespace ddpkit {
namespace codecs {
namespace {

// A table of one slot per row is cheap next to the values when rows are not far more numerous
// than the entries; beyond that the sort in at::coalesce wins.
bool row_table_fits(int64_t rows, int64_t nnz) { return rows <= 8 * nnz + (int64_t{1} << 16); }

constexpr int32_t kUnseen = -1;
constexpr int32_t kSeen = -2;

}  // namespace

at::Tensor coalesce(const at::Tensor& sparse) {
  DDPKIT_CHECK(sparse.is_sparse(), "coalesce: expected a sparse COO tensor, got layout ", sparse.layout());
  if (sparse.is_coalesced()) return sparse;
  const int64_t nnz = sparse._nnz();
  const at::Tensor values = sparse._values();
  if (!sparse.device().is_cpu() || sparse.sparse_dim() != 1 || nnz == 0 || nnz > INT32_MAX ||
      !sums_raw(values.scalar_type()) || !row_table_fits(sparse.size(0), nnz))
    return sparse.coalesce();

  const int64_t rows = sparse.size(0);
  const at::Tensor indices = sparse._indices().contiguous();
  const int64_t* row_of = indices.data_ptr<int64_t>();
  std::vector<int32_t> slot(static_cast<size_t>(rows), kUnseen);
  for (int64_t i = 0; i < nnz; ++i) {
    const int64_t r = row_of[i];
    DDPKIT_CHECK(r >= 0 && r < rows, "coalesce: entry ", i, " has row ", r, ", outside [0, ", rows, ")");
    slot[r] = kSeen;
  }
  int64_t unique = 0;
  for (int64_t r = 0; r < rows; ++r)
    if (slot[r] == kSeen) slot[r] = static_cast<int32_t>(unique++);
  at::Tensor out_indices = at::empty({1, unique}, indices.options());
  int64_t* out_rows = out_indices.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    if (slot[r] >= 0) out_rows[slot[r]] = r;

  const at::Tensor in = values.contiguous();
  std::vector<int64_t> value_shape = in.sizes().vec();
  value_shape[0] = unique;
  at::Tensor out = at::empty(value_shape, in.options());
  const int64_t width = nnz > 0 ? in.numel() / nnz : 0;  // elements per row
  const int64_t row_bytes = width * static_cast<int64_t>(in.element_size());
  const auto* src = static_cast<const char*>(in.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  const c10::ScalarType dtype = in.scalar_type();
  // Each task owns a range of output rows and walks every entry in order, so the order of the
  // additions, and so the result, does not depend on the number of threads.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, unique, grain, [&](int64_t lo, int64_t hi) {
    std::vector<uint8_t> written(static_cast<size_t>(hi - lo), 0);
    for (int64_t i = 0; i < nnz; ++i) {
      const int64_t s = slot[row_of[i]];
      if (s < lo || s >= hi) continue;
      char* to = dst + s * row_bytes;
      const char* from = src + i * row_bytes;
      if (!written[s - lo]) {
        std::memcpy(to, from, static_cast<size_t>(row_bytes));
        written[s - lo] = 1;
      } else {
        const void* pair[2] = {to, from};
        sum_raw(dtype, pair, 2, to, width);
      }
    }
  });
  return at::_sparse_coo_tensor_unsafe(out_indices, out, sparse.sizes())._coalesced_(true);
}

}  // namespace codecs
}  // namespace ddpkit
