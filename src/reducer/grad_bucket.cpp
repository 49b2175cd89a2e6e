// GradBucket: one bucket as a comm hook sees it (include/ddpkit/reducer/grad_bucket.h).
#include <ddpkit/reducer/grad_bucket.h>

#include <ddpkit/error.h>

#include <c10/util/accumulate.h>

namespace ddpkit {

GradBucket::GradBucket(size_t index, size_t bucket_count, at::Tensor buffer, std::vector<int64_t> offsets,
                       std::vector<std::vector<int64_t>> shapes, std::vector<at::Tensor> parameters,
                       bool sparse)
    : index_(index), bucket_count_(bucket_count), buffer_(std::move(buffer)), offsets_(std::move(offsets)),
      shapes_(std::move(shapes)), parameters_(std::move(parameters)), sparse_(sparse) {}

std::vector<at::Tensor> GradBucket::gradients() const {
  if (sparse_) return {buffer_};
  std::vector<at::Tensor> out;
  out.reserve(shapes_.size());
  for (size_t i = 0; i < shapes_.size(); ++i)
    out.push_back(buffer_.narrow(0, offsets_[i], c10::multiply_integers(shapes_[i])).view(shapes_[i]));
  return out;
}

void GradBucket::set_buffer(at::Tensor buffer) {
  DDPKIT_CHECK(buffer.defined(), "GradBucket::set_buffer: undefined tensor for bucket ", index_);
  buffer_ = std::move(buffer);
}

}  // namespace ddpkit
