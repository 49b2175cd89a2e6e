#include <ddpkit/zero/zero_redundancy_optimizer.h>


#include <algorithm>
#include <atomic>
#include <iostream>
#include <numeric>
#include <sstream>

namespace ddpkit {

namespace {

using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamGroup;

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << t.sizes() << " on " << t.device();
  return os.str();
}

}  // namespace

// ---- construction --------------------------------------------------------------------------

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params, OptimizerFactory factory,
                                                 std::shared_ptr<ProcessGroup> pg, ZeroOptions options)
    : ZeroRedundancyOptimizer(std::vector<OptimizerParamGroup>{OptimizerParamGroup(std::move(params))},
                              std::move(factory), std::move(pg), options) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<OptimizerParamGroup> param_groups,
                                                 OptimizerFactory factory, std::shared_ptr<ProcessGroup> pg,
                                                 ZeroOptions options)
    : pg_(std::move(pg)), factory_(std::move(factory)), options_(options) {
  DDPKIT_CHECK(pg_, "ZeroRedundancyOptimizer: process group is null");
  DDPKIT_CHECK(factory_.create && factory_.new_state && factory_.new_options,
               "ZeroRedundancyOptimizer: the OptimizerFactory needs create, new_state and new_options "
               "(optimizer_factory<torch::optim::Adam>(...) fills them)");
  DDPKIT_CHECK(!param_groups.empty(), "ZeroRedundancyOptimizer: no parameter groups given");
  rank_sizes_.assign(pg_->size(), 0);
  size_t total = 0;
  for (const auto& g : param_groups) total += g.params().size();
  DDPKIT_CHECK(total > 0, "ZeroRedundancyOptimizer: the parameter list is empty");
  for (const auto& g : param_groups) {
    validate_new_params(g.params(), "ZeroRedundancyOptimizer");
    std::vector<size_t> indices;
    for (const auto& p : g.params()) {
      indices.push_back(params_.size());
      params_.push_back(p);
      group_of_.push_back(group_options_.size());
      owner_.push_back(-1);
    }
    group_options_.push_back(g.has_options() ? std::shared_ptr<OptimizerOptions>(g.options().clone()) : nullptr);
    assign_greedy(indices);
  }
  shadow_.assign(params_.size(), at::Tensor());
  build_units();
  rebuild_local_optimizer();
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

int ZeroRedundancyOptimizer::rank() const { return pg_->rank(); }
int ZeroRedundancyOptimizer::world_size() const { return pg_->size(); }

void ZeroRedundancyOptimizer::validate_new_params(const std::vector<at::Tensor>& params,
                                                  const std::string& where) const {
  const at::Tensor* reference = params_.empty() ? (params.empty() ? nullptr : &params.front()) : &params_.front();
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    DDPKIT_CHECK(p.defined(), where, ": parameter ", i, " of the group is an undefined tensor");
    DDPKIT_CHECK(!p.is_sparse(), where, ": parameter ", i, " is sparse; ZeRO shards dense parameters only");
    DDPKIT_CHECK(p.is_leaf(), where, ": parameter ", i, " is not a leaf tensor (can't optimize a non-leaf)");
    DDPKIT_CHECK(p.scalar_type() == reference->scalar_type() && p.device() == reference->device(), where,
                 ": all parameters must share one dtype and device (shards travel as one flat tensor); parameter ", i,
                 " of the group is ", describe(p), ", the first parameter is ", describe(*reference));
    for (size_t j = 0; j < params_.size(); ++j)
      DDPKIT_CHECK(!params_[j].is_same(p), where, ": parameter ", i, " of the group is already parameter ", j);
    for (size_t j = 0; j < i; ++j)
      DDPKIT_CHECK(!params[j].is_same(p), where, ": parameter ", i, " appears twice in the group");
  }
}

// Sorted-greedy, continuing the running totals of earlier groups (so adding a group never moves
// an existing parameter). Ties: the earlier parameter first, the lower rank first.
void ZeroRedundancyOptimizer::assign_greedy(const std::vector<size_t>& indices) {
  std::vector<size_t> sorted = indices;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [&](size_t a, size_t b) { return params_[a].numel() > params_[b].numel(); });
  for (size_t i : sorted) {
    const int r = static_cast<int>(std::min_element(rank_sizes_.begin(), rank_sizes_.end()) - rank_sizes_.begin());
    owner_[i] = r;
    rank_sizes_[r] += params_[i].numel();
  }
}

std::vector<std::vector<size_t>> ZeroRedundancyOptimizer::partition() const {
  std::vector<std::vector<size_t>> out(pg_->size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (mode_ == Mode::kBucketShards) {
      for (auto& r : out) r.push_back(i);
    } else {
      out[owner_[i]].push_back(i);
    }
  }
  return out;
}

// One unit per rank (ZeRO-1 without overlap). With parameters_as_bucket_view, each unit's
// parameters become views into one flat buffer holding their current values.
void ZeroRedundancyOptimizer::build_units() {
  units_.clear();
  for (int r = 0; r < pg_->size(); ++r) {
    Unit u;
    u.owner = r;
    for (size_t i = 0; i < params_.size(); ++i)
      if (owner_[i] == r) u.params.push_back(i);
    units_.push_back(std::move(u));
  }
  if (!options_.parameters_as_bucket_view()) return;
  for (Unit& u : units_)
    if (!u.params.empty()) u.flat = lay_out_flat(u.params, 0);
  // Shadows follow the parameters to their new storage; set_data keeps each shadow's identity, so
  // the optimizer's state (keyed by it) stays attached.
  for (size_t i = 0; i < params_.size(); ++i)
    if (shadow_[i].defined()) shadow_[i].set_data(params_[i].detach());
}

// A flat buffer (zero-padded to at least `min_numel`) holding the current values of `params`, which
// become views into it.
at::Tensor ZeroRedundancyOptimizer::lay_out_flat(const std::vector<size_t>& params, int64_t min_numel) {
  at::NoGradGuard no_grad;
  int64_t n = 0;
  for (size_t i : params) n += params_[i].numel();
  at::Tensor flat = at::zeros({std::max(n, min_numel)}, params_.front().options().requires_grad(false));
  int64_t off = 0;
  for (size_t i : params) {
    at::Tensor view = flat.narrow(0, off, params_[i].numel()).view(params_[i].sizes());
    view.copy_(params_[i]);
    params_[i].set_data(view);
    off += params_[i].numel();
  }
  return flat;
}

std::unique_ptr<OptimizerParamGroup> ZeroRedundancyOptimizer::local_group(size_t group) const {
  std::vector<at::Tensor> shadows;
  for (size_t i = 0; i < params_.size(); ++i)
    if (group_of_[i] == group && shadow_[i].defined()) shadows.push_back(shadow_[i]);
  if (group_options_[group]) return std::make_unique<OptimizerParamGroup>(shadows, group_options_[group]->clone());
  return std::make_unique<OptimizerParamGroup>(shadows);
}

// A fresh wrapped optimizer over the shadows of this rank's parameters (or ZeRO-2 shards), one
// group per group given, empty groups included so group indices stay global.
void ZeroRedundancyOptimizer::rebuild_local_optimizer() {
  std::vector<OptimizerParamGroup> groups;
  if (mode_ == Mode::kBucketShards) {
    std::vector<at::Tensor> shards;
    for (auto& b : bucket_shards_) shards.push_back(b.shard);
    if (group_options_[0]) {
      groups.emplace_back(shards, group_options_[0]->clone());
    } else {
      groups.emplace_back(shards);
    }
  } else {
    for (size_t i = 0; i < params_.size(); ++i) {
      const bool mine = owner_[i] == pg_->rank();
      if (mine && !shadow_[i].defined()) shadow_[i] = params_[i].detach();
      if (!mine) shadow_[i] = at::Tensor();
    }
    for (size_t g = 0; g < group_options_.size(); ++g) groups.push_back(*local_group(g));
  }
  local_ = factory_.create(std::move(groups));
  DDPKIT_CHECK(local_, "ZeroRedundancyOptimizer: the factory returned no optimizer");
}

void ZeroRedundancyOptimizer::require_no_state(const std::string& what) const {
  DDPKIT_CHECK(local_->state().empty(), what,
               " must happen before the first optimizer step (this rank already holds optimizer state)");
}

void ZeroRedundancyOptimizer::add_param_group(const OptimizerParamGroup& group) {
  DDPKIT_CHECK(!overlap_partitioned_ && mode_ == Mode::kParameters,
               "add_param_group: not supported once a DDP hook has re-partitioned the parameters by bucket");
  DDPKIT_CHECK(!group.params().empty(), "add_param_group: the group has no parameters");
  validate_new_params(group.params(), "add_param_group");
  std::vector<size_t> indices;
  const size_t g = group_options_.size();
  for (const auto& p : group.params()) {
    indices.push_back(params_.size());
    params_.push_back(p);
    group_of_.push_back(g);
    owner_.push_back(-1);
    shadow_.emplace_back();
  }
  group_options_.push_back(group.has_options() ? std::shared_ptr<OptimizerOptions>(group.options().clone()) : nullptr);
  assign_greedy(indices);
  for (size_t i : indices)
    if (owner_[i] == pg_->rank()) shadow_[i] = params_[i].detach();
  build_units();  // re-lays out flat buffers; existing shadows follow
  local_->add_param_group(*local_group(g));
  consolidated_.reset();
}

// ---- step ----------------------------------------------------------------------------------

void ZeroRedundancyOptimizer::step_local(const std::vector<std::pair<at::Tensor, at::Tensor>>& shadow_grads) {
  for (const auto& sg : shadow_grads) sg.first.mutable_grad() = sg.second;
  try {
    local_->step();
  } catch (...) {
    for (const auto& sg : shadow_grads) sg.first.mutable_grad() = at::Tensor();
    throw;
  }
  // Shadows hold a gradient only while stepping: the wrapped optimizer then steps exactly the
  // parameters given here.
  for (const auto& sg : shadow_grads) sg.first.mutable_grad() = at::Tensor();
}

FuturePtr ZeroRedundancyOptimizer::sync_unit(Unit& unit) {
  if (unit.params.empty()) return completed_future(at::Tensor());
  if (unit.flat.defined()) return pg_->broadcast(unit.flat, unit.owner);
  const bool mine = unit.owner == pg_->rank();
  std::vector<at::Tensor> params;
  int64_t n = 0;
  for (size_t i : unit.params) {
    params.push_back(params_[i]);
    n += params_[i].numel();
  }
  // A unit syncs once per step and every sync completes within it, so the buffer is free again.
  if (!unit.staging.defined() || unit.staging.numel() != n)
    unit.staging = at::empty({n}, params.front().options().requires_grad(false));
  at::Tensor flat = unit.staging;
  if (mine) {
    at::NoGradGuard no_grad;
    int64_t off = 0;
    for (const auto& p : params) {
      flat.narrow(0, off, p.numel()).copy_(p.detach().reshape({-1}));
      off += p.numel();
    }
  }
  auto done = pg_->broadcast(flat, unit.owner);
  if (mine) return done;
  return done->then(
      [flat, params](c10::ivalue::Future& f) -> c10::IValue {
        f.value();
        at::NoGradGuard no_grad;
        int64_t off = 0;
        for (const auto& p : params) {
          p.detach().view({-1}).copy_(flat.narrow(0, off, p.numel()));
          off += p.numel();
        }
        return c10::IValue(flat);
      },
      c10::TensorType::get());
}

void ZeroRedundancyOptimizer::step() {
  if (options_.overlap_with_ddp()) {
    if (!warned_step_) {
      std::cerr << "ddpkit: ZeroRedundancyOptimizer::step() does nothing with overlap_with_ddp: the DDP hook steps "
                   "during backward\n";
      warned_step_ = true;
    }
    return;
  }
  if (mode_ == Mode::kBucketShards) {
    std::vector<std::pair<at::Tensor, at::Tensor>> grads;
    for (auto& b : bucket_shards_) grads.emplace_back(b.shard, b.grad_shard);
    step_local(grads);
    std::vector<FuturePtr> syncs;
    for (auto& b : bucket_shards_) syncs.push_back(sync_bucket_shard(b));
    for (auto& f : syncs) ProcessGroup::wait(f);
    return;
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> grads;
  for (size_t i = 0; i < params_.size(); ++i)
    if (shadow_[i].defined()) grads.emplace_back(shadow_[i], params_[i].grad());
  step_local(grads);
  std::vector<FuturePtr> syncs;
  for (Unit& u : units_) syncs.push_back(sync_unit(u));
  for (auto& f : syncs) ProcessGroup::wait(f);
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  for (auto& p : params_) {
    at::Tensor& g = p.mutable_grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      g = at::Tensor();
    } else {
      g = g.detach();
      g.zero_();
    }
  }
  for (auto& b : bucket_shards_) b.grad_shard.zero_();
}

// ---- DDP integration (ddp_zero_hook.h) -----------------------------------------------------

void ZeroRedundancyOptimizer::overlap_partition(const std::vector<std::vector<size_t>>& buckets, bool shard_buckets) {
  require_no_state("overlapping ZeRO with DDP");
  const int world = pg_->size();
  std::vector<int64_t> bucket_numel;
  int64_t total = 0;
  for (const auto& b : buckets) {
    int64_t n = 0;
    for (size_t i : b) n += params_[i].numel();
    bucket_numel.push_back(n);
    total += n;
  }
  if (!shard_buckets) {
    // Whole buckets, sorted-greedy by size.
    std::vector<size_t> order(buckets.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bucket_numel[a] > bucket_numel[b]; });
    std::vector<int64_t> load(world, 0);
    for (size_t b : order) {
      const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      load[r] += bucket_numel[b];
      for (size_t i : buckets[b]) owner_[i] = r;
    }
  } else {
    // Buckets split at parameter boundaries: the constructor's sorted-greedy partition by
    // parameter, which balances best; a bucket's parameters may then belong to several ranks.
    rank_sizes_.assign(world, 0);
    for (size_t g = 0; g < group_options_.size(); ++g) {
      std::vector<size_t> indices;
      for (size_t i = 0; i < params_.size(); ++i)
        if (group_of_[i] == g) indices.push_back(i);
      assign_greedy(indices);
    }
  }
  rank_sizes_.assign(world, 0);
  for (size_t i = 0; i < params_.size(); ++i) rank_sizes_[owner_[i]] += params_[i].numel();

  // Units: per bucket, the run of parameters of each owner, in bucket order.
  units_.clear();
  units_of_bucket_.assign(buckets.size(), {});
  for (size_t b = 0; b < buckets.size(); ++b) {
    for (int r = 0; r < world; ++r) {
      Unit u;
      u.owner = r;
      for (size_t i : buckets[b])
        if (owner_[i] == r) u.params.push_back(i);
      if (u.params.empty()) continue;
      units_of_bucket_[b].push_back(units_.size());
      units_.push_back(std::move(u));
    }
  }
  if (options_.parameters_as_bucket_view())
    for (Unit& u : units_) u.flat = lay_out_flat(u.params, 0);
  for (auto& s : shadow_) s = at::Tensor();
  rebuild_local_optimizer();
  overlap_partitioned_ = true;
  consolidated_.reset();
}

void ZeroRedundancyOptimizer::shard_gradients(const std::vector<std::vector<size_t>>& buckets) {
  require_no_state("sharding gradients (ZeRO-2)");
  DDPKIT_CHECK(group_options_.size() == 1,
               "ZeRO-2 shards DDP buckets element-wise, so a shard can span parameters of different groups: it "
               "needs a single parameter group, got ", group_options_.size());
  const int world = pg_->size(), me = pg_->rank();
  at::NoGradGuard no_grad;
  bucket_shards_.clear();
  for (const auto& params : buckets) {
    BucketShard b;
    b.params = params;
    for (size_t i : params) b.numel += params_[i].numel();
    b.shard_numel = (b.numel + world - 1) / world;
    const auto opts = params_.front().options().requires_grad(false);
    b.flat_params = lay_out_flat(params, b.shard_numel * world);
    b.shard = b.flat_params.narrow(0, me * b.shard_numel, b.shard_numel);
    b.grad_shard = at::zeros({b.shard_numel}, opts);
    b.padded_grad = at::zeros({b.shard_numel * world}, opts);
    bucket_shards_.push_back(std::move(b));
  }
  for (auto& s : shadow_) s = at::Tensor();
  units_.clear();
  mode_ = Mode::kBucketShards;
  rebuild_local_optimizer();
  consolidated_.reset();
}

std::vector<at::Tensor> ZeroRedundancyOptimizer::gradient_shards() const {
  DDPKIT_CHECK(mode_ == Mode::kBucketShards, "gradient_shards: this optimizer does not shard gradients (ZeRO-2 "
               "lays them out in zero2_hook)");
  std::vector<at::Tensor> out;
  for (const auto& b : bucket_shards_) out.push_back(b.grad_shard);
  return out;
}

ZeroRedundancyOptimizer::BucketShard& ZeroRedundancyOptimizer::bucket_shard(size_t bucket) {
  DDPKIT_CHECK(bucket < bucket_shards_.size(), "ZeRO-2: bucket ", bucket, " is beyond the ", bucket_shards_.size(),
               " buckets the gradients were sharded by");
  return bucket_shards_[bucket];
}

FuturePtr ZeroRedundancyOptimizer::sync_bucket_shard(BucketShard& b) {
  const int world = pg_->size();
  std::vector<at::Tensor> chunks;
  for (int r = 0; r < world; ++r) chunks.push_back(b.flat_params.narrow(0, r * b.shard_numel, b.shard_numel));
  return pg_->allgather(chunks, b.shard.clone());
}

FuturePtr ZeroRedundancyOptimizer::step_bucket(size_t bucket, const at::Tensor& reduced,
                                               const std::vector<at::Tensor>& reduced_grads) {
  if (mode_ == Mode::kBucketShards) {
    BucketShard& b = bucket_shard(bucket);
    step_local({{b.shard, b.grad_shard}});
    return when_all({sync_bucket_shard(b)}, reduced);
  }
  DDPKIT_CHECK(bucket < units_of_bucket_.size(), "ZeRO overlap: bucket ", bucket, " is beyond the ",
               units_of_bucket_.size(), " buckets the parameters were partitioned by");
  std::vector<std::pair<at::Tensor, at::Tensor>> grads;
  std::vector<FuturePtr> syncs;
  for (size_t u : units_of_bucket_[bucket]) {
    if (units_[u].owner != pg_->rank()) continue;
    for (size_t i : units_[u].params) {
      DDPKIT_CHECK(i < reduced_grads.size() && reduced_grads[i].defined(), "ZeRO overlap: no gradient for parameter ",
                   i, " in bucket ", bucket);
      grads.emplace_back(shadow_[i], reduced_grads[i]);
    }
  }
  if (!grads.empty()) step_local(grads);
  for (size_t u : units_of_bucket_[bucket]) syncs.push_back(sync_unit(units_[u]));
  return when_all(syncs, reduced);
}

}  // namespace ddpkit
