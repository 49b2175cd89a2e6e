// FullyShardedDataParallel's per-step path: each unit's gathers, the forward and backward schedule
// around them, and the reduction of its gradients (docs/fsdp.md, "Threading and collective
// order"). Construction and the public API are in fully_sharded_data_parallel.cpp.
#include "fsdp_impl.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <sstream>

namespace ddpkit {
namespace detail {

namespace {

// FSDP's own buffers, allocated in its autograd hooks, never come from the arena of the unit whose
// backward runs (a block of a parameter's size would take that parameter's place); the arena is
// back in use, or the one the hook chose, when the hook returns.
class OwnAllocations {
 public:
  explicit OwnAllocations(FsdpImpl& impl) : impl_(impl) {
    if (impl_.active_arena) GradientArena::use(nullptr);
  }
  ~OwnAllocations() {
    if (impl_.active_arena) GradientArena::use(impl_.active_arena);
  }
  OwnAllocations(const OwnAllocations&) = delete;
  OwnAllocations& operator=(const OwnAllocations&) = delete;

 private:
  FsdpImpl& impl_;
};

}  // namespace

// ---- gathering ----

void FsdpImpl::start_gather(FlatUnit& u) {
  if (u.state != FlatUnit::State::kSharded) return;
  torch::NoGradGuard no_grad;
  if (u.index != 0) max_gathered = std::max(max_gathered, ++gathered_units);
  if (u.aliases_shard) {  // the shard is the whole unit
    u.state = FlatUnit::State::kGathered;
    point_params_at_full(u);
    return;
  }
  attach_full(u);
  if (u.host_full.defined()) {  // every rank's shard already lies in place
    u.state = FlatUnit::State::kGathered;
    point_params_at_full(u);
    return;
  }
  at::Tensor input = u.shard.detach();
  if (compute_dtype != at::kFloat) input = pool.take(u.shard_numel, compute_dtype, device).copy_(input);
  if (shard_world == 1) {
    u.full.copy_(input);
    u.state = FlatUnit::State::kGathered;
    point_params_at_full(u);
    return;
  }
  u.gather_input = input;
  u.gather = shard_pg->allgather_into_tensor(u.full, input);
  u.state = FlatUnit::State::kGathering;
}

void FsdpImpl::wait_gather(FlatUnit& u) {
  if (u.state != FlatUnit::State::kGathering) return;
  FuturePtr f = std::move(u.gather);
  u.gather.reset();
  u.gather_input = at::Tensor();
  u.state = FlatUnit::State::kGathered;  // even on error: reshard must free the memory
  ProcessGroup::wait(f);
  point_params_at_full(u);
}

void FsdpImpl::gather_now(FlatUnit& u) {
  start_gather(u);
  wait_gather(u);
}

void FsdpImpl::point_params_at_full(FlatUnit& u) {
  for (auto& fp : u.params) fp.param.set_data(u.full.narrow(0, fp.offset, fp.numel).view(fp.shape));
}

// `full` keeps its own storage object for life; only the memory behind it comes and goes.
void FsdpImpl::attach_full(FlatUnit& u) {
  u.full_block = u.host_full.defined() ? u.host_full : pool.take(u.shard_numel * shard_world, compute_dtype, device);
  c10::StorageImpl* storage = u.full.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(u.full_block.data_ptr(), u.full_block.device()));  // not owning
  storage->set_nbytes(static_cast<size_t>(u.full_block.nbytes()));
}

void FsdpImpl::detach_full(FlatUnit& u) {
  c10::StorageImpl* storage = u.full.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, device));
  storage->set_nbytes(0);
  u.full_block = at::Tensor();
}

void FsdpImpl::prefetch(int unit) {
  if (unit <= 0) return;
  FlatUnit& u = units[unit];
  if (u.state != FlatUnit::State::kSharded) return;
  if (options.limit_all_gathers() && gathered_units >= 2) return;  // gathered when needed instead
  start_gather(u);
}

void FsdpImpl::reshard(FlatUnit& u) {
  if (u.stays_gathered || u.state == FlatUnit::State::kSharded) return;
  if (u.state == FlatUnit::State::kGathering) {
    try {
      wait_gather(u);  // the collective writes into this memory
    } catch (...) {
    }
  }
  for (auto& fp : u.params) fp.param.set_data(at::empty({0}, on_device(compute_dtype)));
  if (!u.aliases_shard) detach_full(u);
  u.state = FlatUnit::State::kSharded;
  if (u.index != 0) --gathered_units;
}

// ---- forward ----

void FsdpImpl::root_pre_forward() {
  DDPKIT_CHECK(!in_forward, "FullyShardedDataParallel: forward called again inside its own forward");
  DDPKIT_CHECK(t_active == nullptr, "FullyShardedDataParallel: forward called inside another FullyShardedDataParallel's "
               "forward: nest units with unit_modules/auto_wrap_policy instead of nesting instances");
  if (backward_queued) finish_backward();  // not expected; keeps state consistent
  stop_gradient_places();                  // a backward that stopped half way
  // A forward whose backward never ran (evaluation with gradients on, or an exception) leaves
  // units gathered: free them.
  for (auto& u : units) {
    if (u.index != 0) reshard(u);
    u.grads_in = 0;
    u.used_in_backward = false;
  }
  in_forward = true;
  t_active = this;
  order_this_iteration.clear();
  try {
    // No rank reads a unit in place before every rank has stepped its shard of it. (A rank steps
    // only after its reduce-scatters, which its peers join once their backward is past each unit,
    // so no rank writes while a peer still reads.)
    if (gathers_in_place) ProcessGroup::wait(shard_pg->barrier());
    gather_now(units[0]);
  } catch (...) {
    in_forward = false;
    t_active = nullptr;
    throw;
  }
}

void FsdpImpl::root_post_forward(const std::vector<at::Tensor>& outputs) {
  in_forward = false;
  t_active = nullptr;
  check_forward_order();
  ++iteration;
  if (!at::GradMode::is_enabled()) {
    for (auto& u : units) reshard(u);
    return;
  }
  register_pre_backward(0, outputs);
}

void FsdpImpl::check_forward_order() {
  if (iteration == 0) {
    forward_order = order_this_iteration;
    for (size_t i = 0; i < forward_order.size(); ++i)
      if (position_in_order[forward_order[i]] < 0) position_in_order[forward_order[i]] = static_cast<int>(i);
    if (pg->size() > 1) {
      // The same units in the same order on every rank, or collectives would pair wrongly.
      uint64_t digest = 17;  // unsigned: it wraps
      for (int u : forward_order) digest = digest * 1000003 + static_cast<uint64_t>(u);
      at::Tensor mine =
          at::tensor({static_cast<int64_t>(digest >> 1), static_cast<int64_t>(forward_order.size())}, at::kLong)
              .to(device);
      at::Tensor all = at::empty({pg->size() * 2}, on_device(at::kLong));
      ProcessGroup::wait(pg->allgather_into_tensor(all, mine));
      for (int r = 0; r < pg->size(); ++r)
        DDPKIT_CHECK(all.view({-1, 2})[r].equal(mine), "FullyShardedDataParallel: rank ", r, " ran ",
                     all.view({-1, 2})[r][1].item<int64_t>(), " unit calls in its first forward, rank ", pg->rank(),
                     " ran ", forward_order.size(), " (or the same number in another order): every rank must call the "
                     "same units in the same order");
    }
  }
}

// Which units held no parameters when the forward failed, and in which unit it failed: taken when
// the innermost unit's scope unwinds (before it frees its own), else when the root's does.
std::string FsdpImpl::failure_context() const {
  std::vector<std::string> sharded;
  for (const auto& u : units)
    if (u.index != 0 && u.state == FlatUnit::State::kSharded) sharded.push_back("'" + u.name + "'");
  if (sharded.empty()) return "";
  std::ostringstream os;
  os << "If it called a unit's module directly (not through its Sequential or ddpkit::fsdp::forward_unit), that "
        "module's parameters were empty: units ";
  for (size_t i = 0; i < sharded.size() && i < 8; ++i) os << (i ? ", " : "") << sharded[i];
  if (sharded.size() > 8) os << " and " << sharded.size() - 8 << " more";
  os << " were sharded outside their calls. ";
  return os.str();
}

std::string FsdpImpl::describe_forward_failure(const std::string& what) {
  in_forward = false;
  t_active = nullptr;
  std::string where = failed_in_unit_ < 0 ? std::string("") : " in unit " + unit_label(units[failed_in_unit_]);
  std::string context = failed_in_unit_ < 0 ? failure_context() : failed_context_;
  failed_in_unit_ = -1;
  failed_context_.clear();
  return "FullyShardedDataParallel: the forward failed" + where + ". " + context + "The error: " + what;
}

void FsdpImpl::unit_pre_forward(int unit) {
  FlatUnit& u = units[unit];
  order_this_iteration.push_back(unit);
  gather_now(u);
  if (options.forward_prefetch() && iteration > 0) {
    const size_t next = order_this_iteration.size();
    if (next < forward_order.size()) prefetch(forward_order[next]);
  }
}

void FsdpImpl::unit_post_forward(int unit, const std::vector<at::Tensor>& outputs) {
  FlatUnit& u = units[unit];
  if (at::GradMode::is_enabled()) register_pre_backward(unit, outputs);
  if (frees_after_forward(u)) reshard(u);
}

void FsdpImpl::unit_forward_aborted(int unit) {
  if (failed_in_unit_ < 0) {
    failed_in_unit_ = unit;
    failed_context_ = failure_context();
  }
  reshard(units[unit]);
}

// ---- backward ----

void FsdpImpl::register_pre_backward(int unit, const std::vector<at::Tensor>& outputs) {
  std::weak_ptr<int> token = alive;  // a graph that outlives this instance calls nothing
  for (const auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    t.register_hook([this, unit, token](const at::Tensor&) {
      if (token.lock()) unit_pre_backward(unit);
    });
  }
}

void FsdpImpl::queue_finish_backward() {
  if (backward_queued) return;
  backward_queued = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
}

void FsdpImpl::unit_pre_backward(int unit) {
  queue_finish_backward();
  FlatUnit& u = units[unit];
  if (u.used_in_backward) return;
  OwnAllocations own(*this);
  u.used_in_backward = true;
  gather_now(u);
  if (options.backward_prefetch() == BackwardPrefetch::kBackwardPre) {
    const int pos = position_in_order[unit];
    if (pos > 0) prefetch(forward_order[pos - 1]);
  }
  prepare_gradient_places(u);
}

// The unit's flat gradient, taken as its backward begins, with a place per parameter: autograd's
// gradient of each is born there while this unit's backward runs (until the next unit's begins),
// so the reduce-scatter reads it where it lies instead of from a copy. CPU only (the CUDA caching
// allocator is not ours to steer), and only where the gradients' dtype is the reduction's.
void FsdpImpl::prepare_gradient_places(FlatUnit& u) {
  if (!device.is_cpu() || !require_sync || !u.trainable || u.numel == 0 || compute_dtype != reduce_dtype ||
      u.grad_arena)
    return;
  u.grad_block = new_gradient_block(u);
  const size_t elt = c10::elementSize(reduce_dtype);
  std::vector<GradientArena::Place> places;
  for (const auto& fp : u.params)
    places.push_back({static_cast<size_t>(fp.numel) * elt, static_cast<size_t>(fp.offset) * elt});
  u.grad_arena = std::make_shared<GradientArena>(std::make_shared<at::Tensor>(u.grad_block),
                                                 static_cast<uint8_t*>(u.grad_block.data_ptr()),
                                                 static_cast<size_t>(u.grad_block.nbytes()), places);
  active_arena = u.grad_arena;  // in use from when this hook returns (OwnAllocations)
}

// The block the unit's gradients were born in, unless something else autograd allocated at a
// parameter's size still lives there (it must not be overwritten): then a fresh one.
at::Tensor FsdpImpl::take_gradient_block(FlatUnit& u) {
  at::Tensor block;
  if (u.grad_arena) {
    std::set<const void*> gradients;
    for (const auto& fp : u.params)
      if (fp.grad_in) gradients.insert(fp.param.grad().data_ptr());
    bool only_gradients = true;
    for (const void* p : u.grad_arena->blocks_in_use()) only_gradients = only_gradients && gradients.count(p) > 0;
    u.grad_arena->retire();
    if (active_arena == u.grad_arena) active_arena.reset();
    if (only_gradients) block = u.grad_block;
    u.grad_arena.reset();
    u.grad_block = at::Tensor();
  }
  return block.defined() ? block : new_gradient_block(u);
}

// kNoShard's flat gradient, reduced in place, becomes the shard's gradient (finish_backward): a
// tensor of its own rather than a pool block, which .grad would keep from the pool.
at::Tensor FsdpImpl::new_gradient_block(const FlatUnit& u) {
  const int64_t numel = u.shard_numel * shard_world;
  if (options.sharding_strategy() == ShardingStrategy::kNoShard)
    return at::empty({numel}, at::TensorOptions().dtype(reduce_dtype).device(device));
  return pool.take(numel, reduce_dtype, device);
}

void FsdpImpl::stop_gradient_places() {
  if (active_arena && GradientArena::in_use() == active_arena) GradientArena::use(nullptr);
  active_arena.reset();
  for (auto& u : units) {
    if (!u.grad_arena) continue;
    u.grad_arena->retire();
    u.grad_arena.reset();
    u.grad_block = at::Tensor();
  }
}

void FsdpImpl::param_grad_ready(int unit, int param) {
  if (!require_sync) return;  // no_sync: the unsharded gradient stays in .grad
  OwnAllocations own(*this);
  FlatUnit& u = units[unit];
  FlatParam& fp = u.params[param];
  if (!fp.param.grad().defined() || fp.grad_in) return;
  // Gradients wait in .grad until the unit's last lands: the unit's parameters are then not needed
  // again in this backward, and the flat gradient takes their freed pool block instead of a new one.
  fp.grad_in = true;
  if (++u.grads_in < u.trainable_params) return;
  if (u.index != 0) reshard(u);
  launch_reduce(u);
  if (options.backward_prefetch() == BackwardPrefetch::kBackwardPost) {
    const int pos = position_in_order[unit];
    if (pos > 0) prefetch(forward_order[pos - 1]);
  }
}

void FsdpImpl::launch_reduce(FlatUnit& u) {
  if (u.reduce_launched) return;
  u.reduce_launched = true;
  torch::NoGradGuard no_grad;
  at::Tensor grad_flat = take_gradient_block(u);
  // The unsharded gradients are not kept. One born in its place is there already. One born in
  // another's place (a parameter of the same size), or laid out otherwise, is moved out before any
  // place is written, so that filling the places in turn overwrites none of them.
  const auto* base = static_cast<const uint8_t*>(grad_flat.data_ptr());
  const auto* end = base + grad_flat.nbytes();
  const size_t elt = c10::elementSize(reduce_dtype);
  std::vector<at::Tensor> to_copy(u.params.size());
  for (size_t i = 0; i < u.params.size(); ++i) {
    FlatParam& fp = u.params[i];
    if (!fp.grad_in) continue;
    at::Tensor g = fp.param.grad();
    fp.param.mutable_grad() = at::Tensor();
    const auto* at = static_cast<const uint8_t*>(g.data_ptr());
    if (at == base + static_cast<size_t>(fp.offset) * elt && g.is_contiguous() && g.scalar_type() == reduce_dtype)
      continue;
    to_copy[i] = at >= base && at < end ? g.clone() : g;
  }
  // Gradients that never came (parameters unused this step) and the padding are zeros.
  for (size_t i = 0; i < u.params.size(); ++i) {
    FlatParam& fp = u.params[i];
    at::Tensor flat = grad_flat.narrow(0, fp.offset, fp.numel);
    if (to_copy[i].defined()) {
      flat.copy_(to_copy[i].reshape({-1}));
      ++copied_this_backward;
    } else if (!fp.grad_in) {
      flat.zero_();
    }
  }
  if (grad_flat.numel() > u.numel) grad_flat.narrow(0, u.numel, grad_flat.numel() - u.numel).zero_();
  const bool sharded = options.sharding_strategy() != ShardingStrategy::kNoShard;
  // Into the shard's gradient itself where there is none to add to (zero_grad(set_to_none)).
  u.reduces_into_grad = sharded && reduce_dtype == at::kFloat && !u.shard.grad().defined();
  if (u.reduces_into_grad) {
    u.grad_out = at::empty({u.shard_numel}, on_device(at::kFloat));
  } else if (sharded) {
    u.grad_out = pool.take(u.shard_numel, reduce_dtype, device);
  }
  if (hook) {
    u.reduce = hook(grad_flat, sharded ? u.grad_out : at::Tensor());
  } else if (sharded) {
    u.reduce = fsdp::reduce_scatter_hook(*default_state, grad_flat, u.grad_out);
  } else {
    u.reduce = fsdp::allreduce_hook(*default_state, grad_flat);
  }
  // The collective holds the flat gradient while it needs it; it returns to the pool after.
  if (!sharded) u.grad_out = grad_flat;
}

void FsdpImpl::finish_backward() {
  OwnAllocations own(*this);
  struct Reset {
    FsdpImpl* self;
    ~Reset() {
      self->backward_queued = false;
      for (auto& u : self->units) {
        u.grads_in = 0;
        u.used_in_backward = false;
        u.reduce_launched = false;
        u.reduces_into_grad = false;
        u.reduce.reset();
        u.grad_out = at::Tensor();
        for (auto& fp : u.params) fp.grad_in = false;
      }
    }
  } reset{this};
  // Units whose gradients did not all come (some parameters unused): reduced now, in one order
  // on every rank (reverse of the forward's). Units that got none on this rank stay as they are.
  if (require_sync) {
    std::vector<int> order;
    for (auto it = forward_order.rbegin(); it != forward_order.rend(); ++it)
      if (std::find(order.begin(), order.end(), *it) == order.end()) order.push_back(*it);
    order.push_back(0);
    for (auto& u : units)
      if (std::find(order.begin(), order.end(), u.index) == order.end()) order.push_back(u.index);
    for (int i : order) {
      FlatUnit& u = units[i];
      if (u.grads_in > 0 && !u.reduce_launched) launch_reduce(u);
    }
  }
  stop_gradient_places();  // units that got no gradient on this rank
  gradients_copied = copied_this_backward;
  copied_this_backward = 0;
  for (auto& u : units) reshard(u);
  if (!require_sync) {
    // No reduce-scatter keeps an optimizer step after this backward from writing shards a peer's
    // backward still reads in place: a barrier does.
    if (gathers_in_place) ProcessGroup::wait(shard_pg->barrier());
    return;
  }
  // Hybrid: each host's average is averaged across hosts, launched in unit order from this thread.
  std::vector<FuturePtr> across(units.size());
  for (auto& u : units) {
    if (!u.reduce) continue;
    ProcessGroup::wait(u.reduce);
    if (replicate_pg && replicate_pg->size() > 1) across[u.index] = fsdp::allreduce_hook(fsdp::DefaultState(replicate_pg), u.grad_out);
  }
  torch::NoGradGuard no_grad;
  const bool no_shard = options.sharding_strategy() == ShardingStrategy::kNoShard;
  for (auto& u : units) {
    if (!u.reduce) continue;
    if (across[u.index]) ProcessGroup::wait(across[u.index]);
    at::Tensor result = u.grad_out.narrow(0, 0, u.shard_numel);
    at::Tensor& g = u.shard.mutable_grad();
    if (u.reduces_into_grad) {
      g = u.grad_out;  // itself, not a view of it: zero_grad() detaches gradients in place
    } else if (!g.defined() && no_shard && u.grad_out.scalar_type() == at::kFloat &&
               u.grad_out.numel() == u.shard_numel) {
      g = u.grad_out;  // kNoShard: the flat gradient, reduced in place, is the gradient
    } else if (!g.defined()) {
      g = result.scalar_type() == at::kFloat ? result.clone() : result.to(at::kFloat);
    } else {
      g.add_(result);
    }
  }
}
}  // namespace detail

namespace fsdp {

UnitScope::UnitScope(const torch::nn::Module& module) {
  ddpkit::detail::FsdpImpl* impl = ddpkit::detail::t_active;
  if (!impl) {
    std::lock_guard<std::mutex> lock(ddpkit::detail::registry_mutex());
    auto it = ddpkit::detail::registry().find(&module);
    DDPKIT_CHECK(it == ddpkit::detail::registry().end(), "module '", it->second,
                 "' is a unit of a FullyShardedDataParallel, whose parameters are sharded: call the model through "
                 "that FullyShardedDataParallel's forward, not directly");
    return;
  }
  const int unit = impl->unit_of(module);
  if (unit < 0) return;  // not a unit: a plain call inside the enclosing unit
  impl->unit_pre_forward(unit);
  impl_ = impl;
  unit_ = unit;
}

UnitScope::~UnitScope() {
  if (impl_ && !finished_) impl_->unit_forward_aborted(unit_);
}

at::Tensor UnitScope::cast(const at::Tensor& t) const { return impl_ ? impl_->cast_input(t) : t; }

void UnitScope::finish(const std::vector<at::Tensor>& outputs) {
  if (!impl_ || finished_) return;
  finished_ = true;
  impl_->unit_post_forward(unit_, outputs);
}

}  // namespace fsdp
}  // namespace ddpkit
