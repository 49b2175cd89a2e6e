// The Reducer's bucket layout: its buckets built from an assignment (in shared memory where the
// group sums in place), the gradient arena, and the layout's cap, freezing and restoring
// (include/ddpkit/reducer/reducer.h; the rest of the Reducer is in reducer.cpp).
#include <ddpkit/reducer/reducer.h>

#include <ddpkit/comm/gradient_arena.h>

#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>

namespace ddpkit {
namespace {

// A tensor sharing `buffer`'s storage at `offset` with `shape`, that autograd does not treat as
// a view: libtorch's Optimizer::zero_grad() calls detach_() on gradients, which refuses views.
at::Tensor alias_of(const at::Tensor& buffer, int64_t offset, const std::vector<int64_t>& shape) {
  at::NoGradGuard no_grad;
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
  return at::empty({0}, buffer.options()).set_(buffer.storage(), buffer.storage_offset() + offset, shape, strides);
}

}  // namespace

void Reducer::make_arena(std::unique_lock<std::mutex>& lock) {
  arena_considered_ = true;
  if (!gradients_born_in_arenas()) return;
  // One block per parameter big enough to be worth it; small gradients go through the bucket.
  std::vector<int64_t> sizes;
  for (const Bucket& b : buckets_) {
    if (!b.in_place) continue;
    for (size_t v : b.vars) {
      const int64_t bytes = params_[v].numel() * static_cast<int64_t>(params_[v].element_size());
      if (bytes >= GradientArena::kMinBlockBytes && params_[v].is_contiguous()) sizes.push_back(bytes);
    }
  }
  if (sizes.empty()) return;
  lock.unlock();  // collective: do not hold the lock while waiting
  std::shared_ptr<GradientArena> arena = pg_->gradient_arena(sizes);
  lock.lock();
  if (hook_ && arena) {
    arena->retire();  // a hook arrived meanwhile
    arena.reset();
  }
  arena_ = std::move(arena);
}

void Reducer::build_buckets(const BucketAssignment& assignment) {
  std::vector<Bucket> buckets;
  locator_.assign(params_.size(), {0, 0});
  for (size_t b = 0; b < assignment.buckets.size(); ++b) {
    Bucket bucket;
    bucket.vars = assignment.buckets[b];
    const at::Tensor& first = params_[bucket.vars.front()];
    bucket.sparse = expect_sparse_[bucket.vars.front()];
    int64_t total = 0;
    for (size_t slot = 0; slot < bucket.vars.size(); ++slot) {
      const at::Tensor& p = params_[bucket.vars[slot]];
      locator_[bucket.vars[slot]] = {b, slot};
      bucket.offsets.push_back(total);
      bucket.shapes.push_back(p.sizes().vec());
      total += p.numel();
    }
    if (!bucket.sparse) {
      // On CPU the group may place it in shared memory, where ranks on one host sum in place.
      bucket.buffer = first.device().is_cpu() ? pg_->allreduce_buffer(total, first.scalar_type())
                                              : at::zeros({total}, first.options().requires_grad(false));
      bucket.in_place = pg_->sums_in_place(bucket.buffer);
      for (size_t slot = 0; slot < bucket.vars.size(); ++slot) {
        at::Tensor view = alias_of(bucket.buffer, bucket.offsets[slot], bucket.shapes[slot]);
        if (options_.gradient_as_bucket_view) {
          // Keep any gradient already accumulated (e.g. under no_sync) and make .grad the view.
          at::Tensor& grad = params_[bucket.vars[slot]].mutable_grad();
          if (grad.defined()) {
            view.copy_(grad);
            grad = view;
          }
        }
        bucket.views.push_back(std::move(view));
      }
    }
    buckets.push_back(std::move(bucket));
  }
  buckets_ = std::move(buckets);
}

std::vector<std::vector<size_t>> Reducer::bucket_indices() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) out.push_back(b.vars);
  return out;
}

std::vector<size_t> Reducer::unused_parameters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<size_t> out;
  for (size_t i = 0; i < globally_unused_.size(); ++i)
    if (globally_unused_[i]) out.push_back(i);
  return out;
}

void Reducer::freeze_bucket_layout() {
  std::lock_guard<std::mutex> lock(mutex_);
  DDPKIT_CHECK(!backward_started_, "freeze_bucket_layout during a backward pass");
  layout_fixed_ = true;
  rebuilt_ = true;
  rebuild_pending_ = false;
  ready_order_.clear();
}

void Reducer::restore_bucket_layout(const std::vector<std::vector<size_t>>& buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  DDPKIT_CHECK(!backward_started_, "restore_bucket_layout during a backward pass");
  std::vector<bool> seen(params_.size(), false);
  BucketAssignment assignment;
  for (size_t b = 0; b < buckets.size(); ++b) {
    DDPKIT_CHECK(!buckets[b].empty(), "restore_bucket_layout: bucket ", b, " is empty");
    const at::Tensor& first = params_.at(std::min(buckets[b].front(), params_.size() - 1));
    for (size_t v : buckets[b]) {
      DDPKIT_CHECK(v < params_.size(), "restore_bucket_layout: bucket ", b, " names parameter ", v, " of ",
                   params_.size(), " (was the checkpoint taken from another model?)");
      DDPKIT_CHECK(!seen[v], "restore_bucket_layout: parameter ", names_[v], " is in two buckets");
      seen[v] = true;
      DDPKIT_CHECK(params_[v].scalar_type() == first.scalar_type() && params_[v].device() == first.device(),
                   "restore_bucket_layout: bucket ", b, " mixes dtypes or devices");
      DDPKIT_CHECK(!expect_sparse_[v] || buckets[b].size() == 1, "restore_bucket_layout: sparse parameter ",
                   names_[v], " must have a bucket of its own");
    }
    assignment.buckets.push_back(buckets[b]);
  }
  for (size_t v = 0; v < params_.size(); ++v)
    DDPKIT_CHECK(seen[v], "restore_bucket_layout: parameter ", names_[v], " is in no bucket");
  // The same layout keeps its buckets (and their memory: a heal restores the layout every time).
  bool same = buckets.size() == buckets_.size();
  for (size_t b = 0; same && b < buckets.size(); ++b) same = buckets_[b].vars == buckets[b];
  if (!same) build_buckets(assignment);
  layout_fixed_ = true;
  rebuilt_ = true;
  rebuild_pending_ = false;
  ready_order_.clear();
}

void Reducer::set_bucket_cap(size_t bucket_bytes_cap) {
  std::lock_guard<std::mutex> lock(mutex_);
  DDPKIT_CHECK(bucket_bytes_cap > 0, "set_bucket_cap: the cap must be positive");
  DDPKIT_CHECK(!backward_started_, "set_bucket_cap during a backward pass");
  DDPKIT_CHECK(!layout_fixed_, "set_bucket_cap: the bucket layout was frozen or restored (ZeRO, a checkpoint's "
                               "layout) and cannot change");
  DDPKIT_CHECK(rebuilt_ || iterations_ == 0, "set_bucket_cap between the first iteration and the rebuild of the "
                                             "buckets in gradient-ready order (at the next forward)");
  build_buckets(assignment_for_cap(bucket_bytes_cap));
  options_.bucket_bytes_cap = bucket_bytes_cap;
}

BucketAssignment Reducer::assignment_for_cap(size_t bucket_bytes_cap) const {
  std::vector<size_t> order;
  for (const auto& b : buckets_) order.insert(order.end(), b.vars.begin(), b.vars.end());
  return compute_bucket_assignment_by_size(params_, {options_.first_bucket_bytes, bucket_bytes_cap}, expect_sparse_,
                                           order);
}

std::vector<std::vector<size_t>> Reducer::bucket_indices_for_cap(size_t bucket_bytes_cap) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return assignment_for_cap(bucket_bytes_cap).buckets;
}

size_t Reducer::bucket_cap() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.bucket_bytes_cap;
}

bool Reducer::layout_fixed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return layout_fixed_;
}

}  // namespace ddpkit
