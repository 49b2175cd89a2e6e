// CrossGroupBuckets (cross_group_buckets.h): the group's reduction, then the cross-group average,
// in bucket order.
#include "cross_group_buckets.h"

#include <ddpkit/error.h>

namespace ddpkit {
namespace ft {

Contribution Contribution::of(const Quorum& q, int replica, bool async) {
  Contribution c;
  c.contributors = static_cast<int>(q.participants.size());
  if (!async) return c;
  auto adds_own = [&q](size_t i) {
    const GroupInfo& p = q.participants[i];
    if (p.step != q.max_step || p.healing) return false;
    const int source = q.heal_sources[i];
    return source < 0 || (p.heal && q.participants[static_cast<size_t>(source)].heal);
  };
  c.contributors = 0;
  for (size_t i = 0; i < q.participants.size(); ++i) c.contributors += adds_own(i) ? 1 : 0;
  c.contributes = replica >= 0 && adds_own(static_cast<size_t>(replica));
  return c;
}

void Contribution::prepare(at::Tensor& tensor) const {
  if (!contributes) tensor.zero_();
}

void Contribution::average(at::Tensor& sum) const { sum.div_(contributors); }

CrossGroupBuckets::CrossGroupBuckets(WhenCrossing when_crossing, std::function<void(const std::string&)> fail,
                                     std::function<void()> issued)
    : when_crossing_(std::move(when_crossing)), fail_(std::move(fail)), issued_(std::move(issued)) {}

FuturePtr CrossGroupBuckets::operator()(const BucketCrossing& bucket) {
  DDPKIT_CHECK(!bucket.buffer.is_sparse(), "fault tolerance: bucket ", bucket.index, " holds a sparse gradient; the "
               "cross-group average takes dense buckets (average sparse gradients with ft::Manager::allreduce)");
  const size_t index = bucket.index;
  FuturePtr result;
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (index == 0) {  // a new backward: the reducer launches buckets 0, 1, ... in order
      for (const auto& s : slots_)
        DDPKIT_CHECK(!s.result || s.result->completed(), "fault tolerance: a backward began while the previous "
                     "one's buckets were still crossing");
      generation = ++generation_;
      known_ = crossing_ = false;
      group_.reset();
      staging_ = at::Tensor();
      slots_.assign(bucket.bucket_count, Slot{});
      next_ = 0;
      failed_ = false;
    }
    DDPKIT_CHECK(index < slots_.size(), "fault tolerance: bucket ", index, " of ", bucket.bucket_count,
                 " outside the ", slots_.size(), " this backward began with");
    slots_[index].bucket = bucket;
    if (index + 1 < slots_.size()) slots_[index + 1].offset = slots_[index].offset + bucket.buffer.numel();
    slots_[index].result = result = make_tensor_future(bucket.buffer.device());
  }
  std::weak_ptr<CrossGroupBuckets> weak = weak_from_this();
  if (generation > 0)  // at once when the crossing is known already, else as the quorum's round ends
    when_crossing_([weak, generation](Crossing c) {
      if (auto self = weak.lock()) self->on_crossing_known(generation, std::move(c));
    });
  // Runs at once, here, when the group's reduction is done already.
  bucket.group->addCallback([weak, index](c10::ivalue::Future&) {
    if (auto self = weak.lock()) self->on_group_done(index);
  });
  return result;
}

void CrossGroupBuckets::on_crossing_known(uint64_t generation, Crossing now) {
  std::vector<std::function<void()>> completions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (generation != generation_) return;
    crossing_ = static_cast<bool>(now.group);
    group_ = now.group;
    staging_ = std::move(now.staging);
    contribution_ = now.contribution;
    known_ = true;
    while (next_ < slots_.size() && slots_[next_].ready) completions.push_back(launch(next_++));
  }
  for (auto& c : completions) c();
}

void CrossGroupBuckets::on_group_done(size_t index) {
  std::vector<std::function<void()>> completions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (index >= slots_.size() || !slots_[index].result) return;
    slots_[index].ready = true;
    if (!known_) return;  // issued, in order, when the crossing is known
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
  // Alone in the quorum (the group's result is the replicas' average), or the step failed already.
  if (failed_ || !crossing_) return [result, value] { result->markCompleted(value); };
  FuturePtr crossing;
  at::Tensor averaged;
  try {
    std::shared_ptr<ProcessGroup> group = group_.lock();
    if (!group) throw CommError("the cross-group process group was retired (a new quorum) during the step");
    const Contribution c = contribution_;
    if (!b.parts.empty()) {
      for (at::Tensor part : b.parts) c.prepare(part);  // a healing group's gradients are overwritten anyway
      crossing = group->allreduce_parts(staging_for(index, b.buffer, *group), b.parts, 1.0 / c.contributors);
      averaged = b.buffer;  // the parts hold the result, as the reducer expects of its built-in path
    } else {
      at::Tensor s = scratch_for(index, value);
      s.copy_(value.reshape({-1}));
      c.prepare(s);
      crossing = group->allreduce(s, c10d::ReduceOp::SUM)->then(
          [s, c](c10::ivalue::Future& f) -> c10::IValue {
            f.value();  // rethrows a failed allreduce
            at::Tensor sum = s;
            c.average(sum);
            return c10::IValue(sum);
          },
          c10::TensorType::get());
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
