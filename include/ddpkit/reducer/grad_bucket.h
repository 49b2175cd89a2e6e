// GradBucket: what a communication hook sees. Mirrors torch.distributed.GradBucket.
#pragma once

#include <ddpkit/comm/process_group.h>

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <vector>

namespace ddpkit {

class GradBucket {
 public:
  GradBucket(size_t index, size_t bucket_count, at::Tensor buffer, std::vector<int64_t> offsets,
             std::vector<std::vector<int64_t>> shapes, std::vector<at::Tensor> parameters, bool sparse);

  // Position of this bucket in launch order; 0 holds the gradients produced first.
  size_t index() const { return index_; }
  // True for the bucket launched last in an iteration (index() == bucket count - 1).
  bool is_last() const { return index_ + 1 == bucket_count_; }
  // The flattened gradients (1-D). For a sparse-gradient bucket: the sparse gradient itself.
  const at::Tensor& buffer() const { return buffer_; }
  // Views of the current buffer, one per parameter, shaped like the parameters.
  std::vector<at::Tensor> gradients() const;
  // The parameters whose gradients this bucket holds, in bucket order.
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  // Replaces the buffer (e.g. with a compressed copy); gradients() then views the new one.
  void set_buffer(at::Tensor buffer);
  bool is_sparse() const { return sparse_; }

 private:
  size_t index_;
  size_t bucket_count_;
  at::Tensor buffer_;
  std::vector<int64_t> offsets_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<at::Tensor> parameters_;
  bool sparse_;
};

// A communication hook: given a bucket, start communication and return a future whose value is
// one tensor that replaces the bucket's contents (same numel, dtype and device as the bucket's
// buffer as handed to the hook). State lives in the callable (a lambda capture or a functor).
// Threading rule (docs/threading.md): issue collectives through ddpkit::ProcessGroup only, never
// block on a collective inside a future callback, and issue the same collectives in the same
// order on every rank.
using CommHook = std::function<FuturePtr(GradBucket&)>;

}  // namespace ddpkit
