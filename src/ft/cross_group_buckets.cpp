// CrossGroupBuckets (cross_group_buckets.h): the group's reduction, then the cross-group average,
// in bucket order.
#include "cross_group_buckets.h"

#include <ddpkit/error.h>

namespace ddpkit {
namespace ft {

CrossGroupBuckets::CrossGroupBuckets(std::function<Crossing()> cross, std::function<void(const std::string&)> fail,
                                     std::function<void()> issued)
    : current_cross_(std::move(cross)), fail_(std::move(fail)), issued_(std::move(issued)) {}

FuturePtr CrossGroupBuckets::operator()(const BucketCrossing& bucket) {
  DDPKIT_CHECK(!bucket.buffer.is_sparse(), "fault tolerance: bucket ", bucket.index, " holds a sparse gradient; the "
               "cross-group average takes dense buckets (average sparse gradients with ft::Manager::allreduce)");
  const size_t index = bucket.index;
  FuturePtr result;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (index == 0) {  // a new backward: the reducer launches buckets 0, 1, ... in order
      for (const auto& s : slots_)
        DDPKIT_CHECK(!s.result || s.result->completed(), "fault tolerance: a backward began while the previous "
                     "one's buckets were still crossing");
      Crossing now = current_cross_();
      crossing_ = static_cast<bool>(now.group);
      group_ = now.group;
      staging_ = std::move(now.staging);
      slots_.assign(bucket.bucket_count, Slot{});
      next_ = 0;
      failed_ = false;
    }
    if (!crossing_) return bucket.group;  // alone in the quorum: the group's result is the replicas' average
    DDPKIT_CHECK(index < slots_.size(), "fault tolerance: bucket ", index, " of ", bucket.bucket_count,
                 " outside the ", slots_.size(), " this backward began with");
    slots_[index].bucket = bucket;
    if (index + 1 < slots_.size()) slots_[index + 1].offset = slots_[index].offset + bucket.buffer.numel();
    slots_[index].result = result = make_tensor_future(bucket.buffer.device());
  }
  // Runs at once, here, when the group's reduction is done already.
  std::weak_ptr<CrossGroupBuckets> weak = weak_from_this();
  bucket.group->addCallback([weak, index](c10::ivalue::Future&) {
    if (auto self = weak.lock()) self->on_group_done(index);
  });
  return result;
}

void CrossGroupBuckets::on_group_done(size_t index) {
  std::vector<std::function<void()>> completions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (index >= slots_.size() || !slots_[index].result) return;
    slots_[index].ready = true;
    while (next_ < slots_.size() && slots_[next_].ready) completions.push_back(launch(next_++));
  }
  for (auto& c : completions) c();
}

at::Tensor CrossGroupBuckets::staging_for(size_t index, const at::Tensor& buffer, const ProcessGroup& group) {
  const int64_t offset = slots_[index].offset;
  if (staging_.defined() && buffer.scalar_type() == staging_.scalar_type() && offset + buffer.numel() <= staging_.numel()) {
    at::Tensor s = staging_.narrow(0, offset, buffer.numel());
    if (group.sums_in_place(s)) return s;
  }
  return scratch_for(index, buffer);
}

at::Tensor CrossGroupBuckets::scratch_for(size_t index, const at::Tensor& like) {
  if (scratch_.size() < slots_.size()) scratch_.resize(slots_.size());
  at::Tensor& s = scratch_[index];
  if (!s.defined() || s.numel() != like.numel() || s.scalar_type() != like.scalar_type() || s.device() != like.device())
    s = at::empty({like.numel()}, like.options());
  return s;
}

std::function<void()> CrossGroupBuckets::launch(size_t index) {
  // Moved out: the slot must not keep this step's gradients alive into the next step.
  const BucketCrossing b = std::move(slots_[index].bucket);
  FuturePtr result = slots_[index].result;
  if (b.group->hasError()) {  // the group's own reduction failed: a group failure, not a skipped step
    auto error = b.group->exception_ptr();
    return [result, error] { result->setError(error); };
  }
  const at::Tensor value = b.group->value().toTensor();
  if (failed_) return [result, value] { result->markCompleted(value); };
  FuturePtr crossing;
  at::Tensor averaged;
  try {
    std::shared_ptr<ProcessGroup> group = group_.lock();
    if (!group) throw CommError("the cross-group process group was retired (a new quorum) during the step");
    if (!b.parts.empty()) {
      crossing = group->allreduce_parts(staging_for(index, b.buffer, *group), b.parts, 1.0 / group->size());
      averaged = b.buffer;  // the parts hold the result, as the reducer expects of its built-in path
    } else {
      at::Tensor s = scratch_for(index, value);
      s.copy_(value.reshape({-1}));
      crossing = group->allreduce(s, c10d::ReduceOp::AVG);
      averaged = s.view(value.sizes());
    }
  } catch (const std::exception& e) {
    failed_ = true;
    scratch_.clear();
    fail_(e.what());
    return [result, value] { result->markCompleted(value); };
  }
  std::weak_ptr<CrossGroupBuckets> weak = weak_from_this();
  std::function<void()> issued = index == 0 ? issued_ : nullptr;
  return [crossing, result, value, averaged, weak, issued] {
    if (issued) issued();
    crossing->addCallback([result, value, averaged, weak](c10::ivalue::Future& f) {
      if (!f.hasError()) {
        result->markCompleted(averaged);
        return;
      }
      std::string why = "the cross-group average failed";
      try {
        std::rethrow_exception(f.exception_ptr());
      } catch (const std::exception& e) {
        why = e.what();
      } catch (...) {
      }
      if (auto self = weak.lock()) self->on_crossing_failed(why);
      result->markCompleted(value);
    });
  };
}

void CrossGroupBuckets::on_crossing_failed(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed_ = true;
    scratch_.clear();  // the aborted work keeps what it holds; no later step reads it
  }
  fail_(why);
}

}  // namespace ft
}  // namespace ddpkit
