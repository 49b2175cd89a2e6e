// Gradient bucket assignment, as c10d's compute_bucket_assignment_by_size
// (include/ddpkit/reducer/bucket_assignment.h).
#include <ddpkit/reducer/bucket_assignment.h>

#include <ddpkit/error.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>

namespace ddpkit {

BucketAssignment compute_bucket_assignment_by_size(const std::vector<at::Tensor>& tensors,
                                                   const std::vector<size_t>& size_limits,
                                                   const std::vector<bool>& expect_sparse,
                                                   const std::vector<size_t>& order) {
  DDPKIT_CHECK(!tensors.empty(), "bucket assignment needs at least one tensor");
  DDPKIT_CHECK(!size_limits.empty(), "bucket assignment needs at least one size limit");
  DDPKIT_CHECK(expect_sparse.empty() || expect_sparse.size() == tensors.size(), "expect_sparse has ",
               expect_sparse.size(), " entries for ", tensors.size(), " tensors");
  DDPKIT_CHECK(order.empty() || order.size() == tensors.size(), "order has ", order.size(),
               " entries for ", tensors.size(), " tensors");

  struct Entry {
    std::vector<size_t> indices;
    size_t limit;
    size_t first_position;  // position in visiting order of its first tensor
  };
  struct Accumulator {
    std::vector<size_t> indices;
    size_t bytes = 0;
    size_t limit_index = 0;
    size_t first_position = 0;
  };
  // Ordered map: leftovers come out in a deterministic order on every rank.
  using Key = std::pair<int, std::string>;
  std::map<Key, Accumulator> open;
  std::vector<Entry> closed;

  for (size_t pos = 0; pos < tensors.size(); ++pos) {
    const size_t index = order.empty() ? pos : order[pos];
    DDPKIT_CHECK(index < tensors.size(), "order names tensor ", index, " of ", tensors.size());
    const at::Tensor& t = tensors[index];
    if (!expect_sparse.empty() && expect_sparse[index]) {
      closed.push_back({{index}, 0, pos});
      continue;
    }
    DDPKIT_CHECK(!t.is_sparse(), "tensor ", index, " is sparse: mark it in expect_sparse");
    auto& acc = open[Key(static_cast<int>(t.scalar_type()), t.device().str())];
    if (acc.indices.empty()) acc.first_position = pos;
    acc.indices.push_back(index);
    acc.bytes += static_cast<size_t>(t.numel()) * t.element_size();
    const size_t limit = size_limits[std::min(acc.limit_index, size_limits.size() - 1)];
    if (acc.bytes >= limit) {
      closed.push_back({std::move(acc.indices), limit, acc.first_position});
      acc.indices.clear();
      acc.bytes = 0;
      acc.limit_index = std::min(acc.limit_index + 1, size_limits.size() - 1);
    }
  }
  for (auto& kv : open) {
    if (!kv.second.indices.empty()) {
      const size_t limit = size_limits[std::min(kv.second.limit_index, size_limits.size() - 1)];
      closed.push_back({std::move(kv.second.indices), limit, kv.second.first_position});
    }
  }
  if (order.empty()) {
    std::stable_sort(closed.begin(), closed.end(), [](const Entry& a, const Entry& b) {
      return *std::min_element(a.indices.begin(), a.indices.end()) <
             *std::min_element(b.indices.begin(), b.indices.end());
    });
  }
  BucketAssignment out;
  for (auto& e : closed) {
    out.buckets.push_back(std::move(e.indices));
    out.size_limits.push_back(e.limit);
  }
  return out;
}

}  // namespace ddpkit
