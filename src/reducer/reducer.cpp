// The Reducer (include/ddpkit/reducer/reducer.h); GradBucket and the bucket assignment have files
// of their own.
#include <ddpkit/reducer/reducer.h>

#include <ddpkit/comm/gradient_arena.h>

#include <c10/util/accumulate.h>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <sstream>
#include <unordered_set>

namespace ddpkit {
namespace {

// Adds the milliseconds since construction to *total when it goes.
class PhaseTimer {
 public:
  explicit PhaseTimer(double* total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~PhaseTimer() {
    *total_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

 private:
  double* total_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

// ---- Reducer -------------------------------------------------------------------------------------
namespace {

std::string join_names(const std::vector<std::string>& names, size_t max_items = 8) {
  std::ostringstream os;
  for (size_t i = 0; i < names.size() && i < max_items; ++i) os << (i ? ", " : "") << names[i];
  if (names.size() > max_items) os << ", ... (" << names.size() << " in all)";
  return os.str();
}

// The gradient of an unused sparse parameter (or a joined rank's): no entries.
at::Tensor sparse_zeros_like(const at::Tensor& param) {
  return at::zeros(param.sizes(), param.options().layout(at::kSparse).requires_grad(false));
}

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << t.numel() << " elements, " << t.scalar_type() << ", " << t.device() << (t.is_sparse() ? ", sparse" : "");
  return os.str();
}

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names, std::vector<bool> expect_sparse,
                 std::shared_ptr<ProcessGroup> pg, ReducerOptions options)
    : params_(std::move(params)), names_(std::move(names)), expect_sparse_(std::move(expect_sparse)),
      pg_(std::move(pg)), options_(options) {
  DDPKIT_CHECK(pg_, "Reducer needs a process group");
  DDPKIT_CHECK(!params_.empty(), "DistributedDataParallel needs at least one parameter that requires grad");
  if (names_.size() != params_.size()) {
    names_.clear();
    for (size_t i = 0; i < params_.size(); ++i) names_.push_back("parameter " + std::to_string(i));
  }
  if (expect_sparse_.empty()) expect_sparse_.assign(params_.size(), false);
  DDPKIT_CHECK(expect_sparse_.size() == params_.size(), "expect_sparse has ", expect_sparse_.size(),
               " entries for ", params_.size(), " parameters");
  DDPKIT_CHECK(options_.first_bucket_bytes > 0 && options_.bucket_bytes_cap > 0,
               "bucket caps must be positive (first ", options_.first_bucket_bytes, " B, cap ",
               options_.bucket_bytes_cap, " B)");
  for (size_t i = 0; i < params_.size(); ++i) {
    DDPKIT_CHECK(params_[i].requires_grad() && params_[i].is_leaf(), "parameter '", names_[i],
                 "' must be a leaf tensor that requires grad");
  }
  divisor_ = at::scalar_tensor(static_cast<double>(pg_->size()), at::kDouble);
  divisor_value_ = static_cast<double>(pg_->size());

  // Initial buckets: reverse registration order approximates gradient-ready order.
  std::vector<size_t> reversed(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) reversed[i] = params_.size() - 1 - i;
  build_buckets(compute_bucket_assignment_by_size(
      params_, {options_.first_bucket_bytes, options_.bucket_bytes_cap}, expect_sparse_, reversed));

  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    DDPKIT_CHECK(acc, "parameter '", names_[i], "' has no grad accumulator");
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<compat::LambdaPostHook>([this, i] { autograd_hook(i); })));
    accumulators_.push_back(std::move(acc));
  }
  var_ready_.assign(params_.size(), false);
  globally_unused_.assign(params_.size(), false);
}

Reducer::~Reducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  stop_using_arenas();
  if (arena_) arena_->retire();
}

void Reducer::stop_using_arenas() {
  const std::shared_ptr<GradientArena> current = GradientArena::in_use();
  if (current && (current == arena_ || current == cross_arena_)) GradientArena::use(nullptr);
  cross_arena_.reset();  // its owner (the cross-replica reduction) decides when it goes
}

void Reducer::register_comm_hook(CommHook hook, std::string name) {
  std::lock_guard<std::mutex> lock(mutex_);
  DDPKIT_CHECK(hook, "register_comm_hook: the hook is empty");
  DDPKIT_CHECK(!hook_, "register_comm_hook: a comm hook ('", hook_name_, "') is already registered; ",
               "register_comm_hook may be called only once");
  DDPKIT_CHECK(!backward_started_, "register_comm_hook: cannot register during backward");
  hook_ = std::move(hook);
  if (arena_) {  // a hook needs whole buckets: gradients are copied into them
    arena_->retire();
    arena_.reset();
  }
  hook_name_ = name.empty() ? "user hook" : std::move(name);
}

void Reducer::set_cross_replica_reduction(CrossReplicaReduction reduction) {
  std::lock_guard<std::mutex> lock(mutex_);
  DDPKIT_CHECK(reduction.reduce, "set_cross_replica_reduction: the reduction is empty");
  DDPKIT_CHECK(!cross_.reduce, "set_cross_replica_reduction may be called only once");
  DDPKIT_CHECK(!backward_started_ && iterations_ == 0, "set_cross_replica_reduction: before the first backward");
  cross_ = std::move(reduction);
}

std::string Reducer::hook_name() const { return hook_ ? "comm hook '" + hook_name_ + "'" : "default allreduce"; }

void Reducer::set_divisor(int64_t divisor) {
  DDPKIT_CHECK(divisor >= 1, "gradient divisor must be >= 1, got ", divisor);
  divisor_ = at::scalar_tensor(static_cast<double>(divisor), at::kDouble);
  divisor_value_ = static_cast<double>(divisor);
}

void Reducer::prepare_for_forward(int source_rank) {
  std::unique_lock<std::mutex> lock(mutex_);
  DDPKIT_CHECK(!backward_started_,
               "the previous backward pass did not finish its gradient reduction (an exception, or a backward "
               "that never reached the end); this DistributedDataParallel instance cannot continue");
  stop_using_arenas();
  if (!arena_considered_) make_arena(lock);
  if (!rebuild_pending_) return;
  // Agree on one order: the source rank's recorded gradient-ready order, completed with the
  // parameters it never saw in reverse registration order.
  const int64_t n = static_cast<int64_t>(params_.size());
  at::Tensor order = at::empty({n}, at::kLong);
  if (pg_->rank() == source_rank) {
    std::vector<bool> seen(params_.size(), false);
    int64_t k = 0;
    auto* o = order.data_ptr<int64_t>();
    for (size_t v : ready_order_) {
      if (!seen[v]) {
        seen[v] = true;
        o[k++] = static_cast<int64_t>(v);
      }
    }
    for (int64_t v = n - 1; v >= 0; --v)
      if (!seen[v]) o[k++] = v;
  }
  lock.unlock();  // a collective: do not hold the lock while waiting
  if (order.device() != params_.front().device() && pg_->backend_name() == "nccl") {
    at::Tensor dev = order.to(params_.front().device());
    ProcessGroup::wait(pg_->broadcast(dev, source_rank));
    order = dev.cpu();
  } else {
    ProcessGroup::wait(pg_->broadcast(order, source_rank));
  }
  lock.lock();
  std::vector<size_t> ord(params_.size());
  for (int64_t i = 0; i < n; ++i) ord[i] = static_cast<size_t>(order.data_ptr<int64_t>()[i]);
  build_buckets(compute_bucket_assignment_by_size(
      params_, {options_.first_bucket_bytes, options_.bucket_bytes_cap}, expect_sparse_, ord));
  rebuilt_ = true;
  rebuild_pending_ = false;
  ready_order_.clear();
}

std::vector<bool> Reducer::find_used_parameters(const std::vector<at::Tensor>& outputs) const {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    if (auto fn = out.grad_fn()) {
      if (seen.insert(fn.get()).second) stack.push_back(fn.get());
    } else if (out.is_leaf()) {
      auto acc = torch::autograd::impl::try_get_grad_accumulator(out);
      if (acc && seen.insert(acc.get()).second) stack.push_back(acc.get());
    }
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      auto* next = edge.function.get();
      if (next && seen.insert(next).second) stack.push_back(next);
    }
  }
  std::vector<bool> used(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) used[i] = seen.count(accumulators_[i].get()) > 0;
  return used;
}

void Reducer::reset_iteration_state() {
  std::fill(var_ready_.begin(), var_ready_.end(), false);
  for (auto& b : buckets_) {
    b.pending = b.vars.size();
    b.future.reset();
    b.parts.clear();
  }
  next_bucket_ = 0;
  used_map_future_.reset();
  backward_started_ = false;
  stop_using_arenas();
}

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  DDPKIT_CHECK(!backward_started_, "prepare_for_backward: the previous backward is still reducing");
  reset_iteration_state();
  used_map_needed_ = options_.find_unused_parameters || (options_.static_graph && !static_unused_known_);
  if (used_map_needed_) {
    locally_used_ = find_used_parameters(outputs);
  } else if (options_.static_graph) {
    locally_used_.assign(params_.size(), true);
    for (size_t i = 0; i < params_.size(); ++i) locally_used_[i] = !globally_unused_[i];
  } else {
    locally_used_.assign(params_.size(), true);
  }
  expect_hooks_ = true;
  // This backward's gradients are born where the built-in path sums them in place.
  if (!hook_ && arena_) {
    GradientArena::use(arena_);
  } else if (gradients_born_in_arenas() && cross_.gradient_arena) {
    cross_arena_ = cross_.gradient_arena();
    if (cross_arena_) GradientArena::use(cross_arena_);
  }
}

void Reducer::autograd_hook(size_t var) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!expect_hooks_) return;  // forward ran without grad sync (no_sync, or not through DDP)
  if (!backward_started_) on_backward_start();
  mark_var_ready(var, false);
}

void Reducer::on_backward_start() {
  backward_started_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
  if (used_map_needed_) {
    // Issued before any bucket: the same position in the collective order on every rank.
    used_map_ = at::empty({static_cast<int64_t>(params_.size())}, at::kInt);
    auto* u = used_map_.data_ptr<int32_t>();
    for (size_t i = 0; i < params_.size(); ++i) u[i] = locally_used_[i] ? 1 : 0;
    at::Tensor m = used_map_;
    if (pg_->backend_name() == "nccl") m = used_map_.to(params_.front().device());
    used_map_ = m;
    used_map_future_ = pg_->allreduce(m);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!locally_used_[i] && !var_ready_[i]) mark_var_ready(i, true);
  }
}

void Reducer::mark_var_ready(size_t var, bool unused) {
  if (var_ready_[var]) {
    throw c10::Error(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
        "ddpkit: parameter '" + names_[var] +
            "' was marked ready twice in one backward pass. Each parameter may produce its gradient once per "
            "iteration (reentrant backward, or a parameter used in several autograd graphs, is not supported)");
  }
  var_ready_[var] = true;
  if (!rebuilt_ && !unused) ready_order_.push_back(var);
  const auto [b, slot] = locator_[var];
  Bucket& bucket = buckets_[b];
  {
    PhaseTimer timer(&times_.copy_in_ms);
    place_gradient(bucket, slot, var, !unused && params_[var].grad().defined());
  }
  if (--bucket.pending == 0) launch_ready_buckets();
}

// Puts var's gradient where its bucket's launch will find it: its slot (scaled on the no-hook
// path), its own memory (summed where it lies), or nowhere (the identity reduction).
void Reducer::place_gradient(Bucket& bucket, size_t slot, size_t var, bool has_grad) {
  at::Tensor& param = params_[var];
  const at::Tensor& grad = param.grad();
  if (bucket.sparse) {
    if (has_grad) {
      DDPKIT_CHECK(grad.is_sparse(), "parameter '", names_[var], "' was expected to produce a sparse gradient");
      bucket.buffer = hook_ || divisor_value_ == 1 ? grad : grad.div(divisor_value_);
    } else {
      bucket.buffer = sparse_zeros_like(param);
    }
  } else {
    DDPKIT_CHECK(!has_grad || !grad.is_sparse(), "parameter '", names_[var],
                 "' produced a sparse gradient; DistributedDataParallel detects sparse Embedding/EmbeddingBag "
                 "modules, or pass expect_sparse_gradients");
    at::Tensor& view = bucket.views[slot];
    if (reduction_is_identity()) {
      // Left where it lies (a view of the bucket or not); finalize_backward gives a used
      // parameter without one zeros.
    } else if (reduces_gradients_in_place(bucket)) {
      // The gradient is reduced where it lies (ProcessGroup::allreduce_parts); one that cannot be
      // (another layout or dtype, or part of a graph), or none, goes through its view.
      if (bucket.parts.empty()) bucket.parts.resize(bucket.vars.size());
      if (has_grad && grad.is_contiguous() && grad.scalar_type() == view.scalar_type() &&
          grad.device() == view.device() && grad.numel() == view.numel() && !grad.requires_grad()) {
        bucket.parts[slot] = grad.view({-1});
      } else {
        if (has_grad) {
          view.copy_(grad);
        } else {
          view.zero_();
        }
        bucket.parts[slot] = view.view({-1});
      }
    } else if (!has_grad) {
      view.zero_();
    } else {
      const bool is_view = grad.data_ptr() == view.data_ptr() && grad.strides() == view.strides();
      if (is_view) {
        if (!hook_ && divisor_value_ != 1) view.div_(divisor_);
      } else {
        if (hook_ || divisor_value_ == 1) {
          view.copy_(grad);
        } else {
          at::div_out(view, grad, divisor_);
        }
        if (options_.gradient_as_bucket_view) param.mutable_grad() = view;
      }
    }
  }
}

bool Reducer::reduces_gradients_in_place(const Bucket& bucket) const {
  // Crossing replicas, the gradients are reduced where they lie on any transport (those that do
  // not sum in place stage them through the buffer): in the group, then across.
  return (bucket.in_place || (cross_.reduce && !bucket.sparse)) && !hook_ && !options_.gradient_as_bucket_view;
}

bool Reducer::gradients_born_in_arenas() const {
  return options_.gradients_in_shared_memory && !options_.gradient_as_bucket_view && !hook_;
}

bool Reducer::reduction_is_identity() const { return pg_->size() == 1 && !hook_ && !cross_.reduce && divisor_value_ == 1; }

void Reducer::launch_ready_buckets() {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) launch_bucket(next_bucket_++);
}

void Reducer::launch_bucket(size_t index) {
  PhaseTimer timer(&times_.launch_ms);
  Bucket& bucket = buckets_[index];
  TrafficScope traffic(static_cast<int64_t>(index));  // this bucket's collectives count towards it
  if (!bucket.sparse) {
    const uint64_t n = static_cast<uint64_t>(pg_->size());
    const uint64_t bytes = static_cast<uint64_t>(bucket.buffer.numel()) * bucket.buffer.element_size();
    if (allreduce_bytes_.size() <= index) allreduce_bytes_.resize(index + 1, 0);
    allreduce_bytes_[index] += 2 * (n - 1) * bytes / n;
  }
  bucket.future = reduce_in_group(bucket, index);
  if (cross_.reduce) {
    // Across the replicas next; on the in-place path the gradients stay where they lie.
    const bool in_place = reduces_gradients_in_place(bucket);
    bucket.future = cross_.reduce({index, buckets_.size(), bucket.buffer, in_place ? bucket.parts : std::vector<at::Tensor>{},
                            bucket.future});
  }
}

FuturePtr Reducer::reduce_in_group(Bucket& bucket, size_t index) {
  if (reduces_gradients_in_place(bucket)) {
    // Scaled as the sum is taken, on every rank alike: a joined rank's zeros come as the buffer.
    if (bucket.parts.empty()) bucket.parts = {bucket.buffer};
    if (pg_->size() == 1 && divisor_value_ == 1) return completed_future(bucket.buffer);  // crossing replicas only
    return pg_->allreduce_parts(bucket.buffer, bucket.parts, 1.0 / divisor_.item<double>());
  }
  if (!hook_) {
    if (reduction_is_identity()) return completed_future(bucket.buffer);  // nothing to sum, nothing to scale
    return pg_->allreduce(bucket.buffer);
  }
  std::vector<at::Tensor> params;
  for (size_t v : bucket.vars) params.push_back(params_[v]);
  GradBucket gb(index, buckets_.size(), bucket.buffer, bucket.offsets, bucket.shapes, std::move(params), bucket.sparse);
  FuturePtr future;
  try {
    future = hook_(gb);
  } catch (const std::exception& e) {
    throw CommError("ddpkit: " + hook_name() + " threw for bucket " + std::to_string(index) + " on rank " +
                    std::to_string(pg_->rank()) + ": " + e.what());
  }
  DDPKIT_CHECK(future, hook_name(), " returned a null future for bucket ", index);
  return future;
}

at::Tensor Reducer::wait_bucket(size_t index) {
  Bucket& bucket = buckets_[index];
  bucket.future->wait();
  if (bucket.future->hasError()) {
    throw CommError(describe_comm_failure(hook_name() + " for bucket " + std::to_string(index), pg_->rank(),
                                          pg_->size(), bucket.future->exception_ptr()));
  }
  const c10::IValue& v = bucket.future->value();
  DDPKIT_CHECK(v.isTensor(), hook_name(), " completed bucket ", index, " with a ", v.tagKind(),
               ", expected one tensor");
  at::Tensor result = v.toTensor();
  const at::Tensor& ref = bucket.buffer;
  const bool ok = result.defined() && result.is_sparse() == ref.is_sparse() && result.scalar_type() == ref.scalar_type() &&
                  result.device() == ref.device() &&
                  (ref.is_sparse() ? result.sizes() == ref.sizes() : result.numel() == ref.numel());
  DDPKIT_CHECK(ok, hook_name(), " returned ", (result.defined() ? describe(result) : std::string("an undefined tensor")),
               " for bucket ", index, "; expected ", describe(ref), " (the bucket's buffer)");
  return result;
}

void Reducer::apply_used_map() {
  at::Tensor global = ProcessGroup::wait(used_map_future_).cpu();
  const auto* g = global.data_ptr<int32_t>();
  for (size_t i = 0; i < params_.size(); ++i) globally_unused_[i] = g[i] == 0;
  if (options_.static_graph) static_unused_known_ = true;
}

void Reducer::finalize_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  expect_hooks_ = false;
  if (next_bucket_ < buckets_.size()) {
    std::vector<std::string> missing;
    for (size_t i = 0; i < params_.size(); ++i)
      if (!var_ready_[i]) missing.push_back(names_[i]);
    reset_iteration_state();
    DDPKIT_CHECK(false, "backward finished but these parameters produced no gradient: ", join_names(missing),
                 ". If some parameters are unused in forward, construct DistributedDataParallel with "
                 "find_unused_parameters(true); make sure the loss depends on all forward outputs");
  }
  if (used_map_future_) {
    PhaseTimer timer(&times_.wait_ms);
    apply_used_map();
  }
  try {
    for (size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& bucket = buckets_[b];
      at::Tensor result;
      {
        PhaseTimer timer(&times_.wait_ms);
        result = wait_bucket(b);
      }
      PhaseTimer timer(&times_.copy_out_ms);
      if (bucket.sparse) {
        if (!globally_unused_[bucket.vars.front()]) params_[bucket.vars.front()].mutable_grad() = result;
        continue;
      }
      const at::Tensor flat = result.reshape({-1});
      const bool in_place = result.data_ptr() == bucket.buffer.data_ptr();
      const bool stayed_put = reduction_is_identity();
      for (size_t slot = 0; slot < bucket.vars.size(); ++slot) {
        const size_t var = bucket.vars[slot];
        if (globally_unused_[var]) continue;  // keeps no gradient, as in PyTorch
        at::Tensor& grad = params_[var].mutable_grad();
        if (stayed_put) {
          if (!grad.defined()) grad = at::zeros_like(params_[var], at::MemoryFormat::Contiguous);
          continue;
        }
        if (!bucket.parts.empty() && bucket.parts[slot].data_ptr() != bucket.views[slot].data_ptr())
          continue;  // the gradient itself was reduced
        if (options_.gradient_as_bucket_view) {
          if (!in_place) bucket.views[slot].copy_(flat.narrow(0, bucket.offsets[slot], bucket.views[slot].numel())
                                                      .view(bucket.shapes[slot]));
          grad = bucket.views[slot];
        } else {
          const at::Tensor src = in_place ? bucket.views[slot]
                                          : flat.narrow(0, bucket.offsets[slot], bucket.views[slot].numel())
                                                .view(bucket.shapes[slot]);
          if (grad.defined()) {
            grad.copy_(src);
          } else {
            grad = src.clone();
          }
        }
      }
    }
  } catch (...) {
    reset_iteration_state();
    throw;
  }
  reset_iteration_state();
  ++iterations_;
  ++times_.iterations;
  if (!rebuilt_) rebuild_pending_ = true;
}

void Reducer::shadow_backward() {
  std::unique_lock<std::mutex> lock(mutex_);
  DDPKIT_CHECK(!backward_started_, "shadow_backward during a backward pass");
  reset_iteration_state();
  const bool used_map_needed = options_.find_unused_parameters || (options_.static_graph && !static_unused_known_);
  if (used_map_needed) {
    at::Tensor zeros = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
    if (pg_->backend_name() == "nccl") zeros = zeros.to(params_.front().device());
    used_map_future_ = pg_->allreduce(zeros);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    if (bucket.sparse) {
      bucket.buffer = sparse_zeros_like(params_[bucket.vars.front()]);
    } else {
      bucket.buffer.zero_();
    }
    bucket.pending = 0;
    launch_bucket(b);
  }
  next_bucket_ = buckets_.size();
  if (used_map_future_) apply_used_map();
  for (size_t b = 0; b < buckets_.size(); ++b) wait_bucket(b);
  reset_iteration_state();
  ++iterations_;
  if (!rebuilt_) rebuild_pending_ = true;
}

void Reducer::reset_traffic() {
  std::lock_guard<std::mutex> lock(mutex_);
  allreduce_bytes_.clear();
  times_ = ReducerTimes{};
  pg_->reset_stats();
}

ReducerTimes Reducer::times() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return times_;
}

std::vector<BucketTraffic> Reducer::bucket_traffic() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<BucketTraffic> out;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    BucketTraffic t;
    t.index = i;
    t.numel = 0;
    for (const auto& shape : buckets_[i].shapes) t.numel += c10::multiply_integers(shape);
    t.traffic = pg_->traffic(static_cast<int64_t>(i));
    t.allreduce_bytes = i < allreduce_bytes_.size() ? allreduce_bytes_[i] : 0;
    out.push_back(t);
  }
  return out;
}

}  // namespace ddpkit
