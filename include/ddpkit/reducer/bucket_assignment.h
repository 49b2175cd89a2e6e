// Gradient bucket assignment, with the semantics of c10d's compute_bucket_assignment_by_size.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <vector>

namespace ddpkit {

struct BucketAssignment {
  std::vector<std::vector<size_t>> buckets;  // tensor indices per bucket
  std::vector<size_t> size_limits;           // the cap each bucket was filled against
};

// Groups tensors into buckets per (dtype, device). Tensors are visited in `order` (default:
// 0..n-1); a bucket closes as soon as its byte size reaches its cap (so it may exceed it). Caps are
// taken from `size_limits` in turn per (dtype, device), the last one repeating. A tensor marked in
// `expect_sparse` gets a bucket of its own. Without `order`, buckets are sorted by their smallest
// tensor index; with it, they keep the order in which they closed (leftovers last, by dtype/device).
BucketAssignment compute_bucket_assignment_by_size(const std::vector<at::Tensor>& tensors,
                                                   const std::vector<size_t>& size_limits,
                                                   const std::vector<bool>& expect_sparse = {},
                                                   const std::vector<size_t>& order = {});

}  // namespace ddpkit
