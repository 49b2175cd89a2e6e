// FullyShardedDataParallel between steps: gradient-norm clipping, full and sharded state dicts,
// and the optimizer's state gathered and resharded (so a checkpoint reloads at another world size).
#include "fsdp_impl.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <limits>
#include <set>

namespace ddpkit {
namespace detail {

at::Tensor FsdpImpl::gather_full_fp32(FlatUnit& u, const at::Tensor& shard_like) {
  torch::NoGradGuard no_grad;
  at::Tensor in = shard_like.detach().to(at::kFloat).contiguous();
  if (shard_world == 1) return in.narrow(0, 0, u.numel).clone();
  at::Tensor full = at::empty({u.shard_numel * shard_world}, on_device(at::kFloat));
  ProcessGroup::wait(shard_pg->allgather_into_tensor(full, in));
  return full.narrow(0, 0, u.numel);
}

at::Tensor FsdpImpl::shard_of_full(const FlatUnit& u, const at::Tensor& full_flat) const {
  at::Tensor out = at::zeros({u.shard_numel}, on_device(at::kFloat));
  const int64_t begin = shard_rank * u.shard_numel;
  const int64_t end = std::min(begin + u.shard_numel, u.numel);
  if (end > begin) out.narrow(0, 0, end - begin).copy_(full_flat.reshape({-1}).narrow(0, begin, end - begin));
  return out;
}

}  // namespace detail

namespace {

std::string unit_key(const detail::FlatUnit& u) { return u.name.empty() ? "_root" : u.name; }

// The per-shard state tensors of the optimizers whose state can be resharded, by field name.
std::vector<std::pair<std::string, at::Tensor*>> state_fields(torch::optim::OptimizerParamState& s) {
  if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(&s)) return {{"momentum_buffer", &sgd->momentum_buffer()}};
  if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(&s))
    return {{"exp_avg", &adam->exp_avg()}, {"exp_avg_sq", &adam->exp_avg_sq()}, {"max_exp_avg_sq", &adam->max_exp_avg_sq()}};
  if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(&s))
    return {{"exp_avg", &adamw->exp_avg()}, {"exp_avg_sq", &adamw->exp_avg_sq()}, {"max_exp_avg_sq", &adamw->max_exp_avg_sq()}};
  DDPKIT_CHECK(false, "FullyShardedDataParallel: the optimizer's state is not SGD's, Adam's or AdamW's: its full "
               "state dict cannot be gathered (save each rank's optimizer instead, at the same world size)");
}

int64_t* state_step(torch::optim::OptimizerParamState& s) {
  if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(&s)) return &adam->step();
  if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(&s)) return &adamw->step();
  return nullptr;
}

// A fresh state of the optimizer's own kind, for a shard it has not stepped yet.
std::unique_ptr<torch::optim::OptimizerParamState> new_state_like(torch::optim::Optimizer& o) {
  if (dynamic_cast<torch::optim::SGD*>(&o)) return std::make_unique<torch::optim::SGDParamState>();
  if (dynamic_cast<torch::optim::Adam*>(&o)) return std::make_unique<torch::optim::AdamParamState>();
  if (dynamic_cast<torch::optim::AdamW*>(&o)) return std::make_unique<torch::optim::AdamWParamState>();
  DDPKIT_CHECK(false, "FullyShardedDataParallel: load_full_optimizer_state_dict knows SGD, Adam and AdamW only");
}

}  // namespace

double FullyShardedDataParallelBase::clip_grad_norm_(double max_norm, double norm_type) {
  DDPKIT_CHECK(max_norm >= 0 && norm_type > 0, "clip_grad_norm_: max_norm must be >= 0 and norm_type > 0, got ",
               max_norm, " and ", norm_type);
  torch::NoGradGuard no_grad;
  detail::FsdpImpl& d = *impl_;
  const bool inf = std::isinf(norm_type);
  double local = 0;
  std::vector<at::Tensor> grads;
  for (auto& u : d.units) {
    const at::Tensor& g = u.shard.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    const double n = g.norm(norm_type).item<double>();
    local = inf ? std::max(local, n) : local + std::pow(n, norm_type);
  }
  // Shards partition the gradient over the shard group (its copies across replicas are equal).
  const bool sharded = d.options.sharding_strategy() != ShardingStrategy::kNoShard;
  if (sharded && d.shard_pg->size() > 1) {
    at::Tensor t = at::tensor({local}, at::kDouble).to(d.device);
    ProcessGroup::wait(d.shard_pg->allreduce(t, inf ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM));
    local = t.item<double>();
  }
  const double total = inf ? local : std::pow(local, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1)
    for (auto& g : grads) g.mul_(coef);
  return total;
}

torch::OrderedDict<std::string, at::Tensor> FullyShardedDataParallelBase::full_state_dict(bool rank0_only) {
  detail::FsdpImpl& d = *impl_;
  const bool keep = !rank0_only || d.pg->rank() == 0;
  std::map<std::string, at::Tensor> params;
  for (auto& u : d.units) {
    if (u.numel == 0) continue;
    at::Tensor full = d.gather_full_fp32(u, u.shard);
    if (!keep) continue;
    for (const auto& fp : u.params)
      for (const auto& name : fp.names) params[name] = full.narrow(0, fp.offset, fp.numel).view(fp.shape).clone();
  }
  torch::OrderedDict<std::string, at::Tensor> out;
  if (!keep) return out;
  for (const auto& p : d.module->named_parameters(/*recurse=*/true)) out.insert(p.key(), params.at(p.key()));
  std::map<std::string, at::ScalarType> original(d.buffer_dtypes.begin(), d.buffer_dtypes.end());
  for (const auto& b : d.module->named_buffers(/*recurse=*/true)) {
    if (!b.value().defined()) continue;
    auto it = original.find(b.key());
    out.insert(b.key(), it == original.end() ? b.value().detach().clone() : b.value().detach().to(it->second));
  }
  return out;
}

void FullyShardedDataParallelBase::load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& dict) {
  detail::FsdpImpl& d = *impl_;
  torch::NoGradGuard no_grad;
  std::set<std::string> used;
  auto entry = [&](const std::string& name, at::IntArrayRef shape) -> const at::Tensor& {
    const at::Tensor* t = dict.find(name);
    DDPKIT_CHECK(t && t->defined(), "load_full_state_dict: no entry '", name, "'");
    DDPKIT_CHECK(t->sizes() == shape, "load_full_state_dict: '", name, "' has shape ", t->sizes(), ", the model's is ",
                 shape);
    used.insert(name);
    return *t;
  };
  for (auto& u : d.units) {
    if (u.numel == 0) continue;
    at::Tensor flat = at::zeros({u.numel}, d.on_device(at::kFloat));
    for (const auto& fp : u.params) {
      flat.narrow(0, fp.offset, fp.numel).copy_(entry(fp.names.front(), fp.shape).reshape({-1}));
      for (size_t k = 1; k < fp.names.size(); ++k) entry(fp.names[k], fp.shape);
    }
    u.shard.detach().copy_(d.shard_of_full(u, flat));
  }
  for (auto& b : d.module->named_buffers(/*recurse=*/true)) {
    if (!b.value().defined()) continue;
    b.value().detach().copy_(entry(b.key(), b.value().sizes()));
  }
  for (const auto& kv : dict.items())
    DDPKIT_CHECK(used.count(kv.key()), "load_full_state_dict: unexpected entry '", kv.key(),
                 "': the model has no such parameter or buffer");
}

TensorDict FullyShardedDataParallelBase::sharded_state_dict() const {
  const detail::FsdpImpl& d = *impl_;
  TensorDict out;
  std::string layout;
  for (const auto& u : d.units) {
    layout += unit_key(u) + ":" + std::to_string(u.numel) + ";";
    out["shard/" + unit_key(u)] = u.shard.detach().clone();
  }
  out["layout/units"] = bytes_entry(layout);
  out["layout/shard_world"] = int_entry(d.shard_world);
  out["layout/shard_rank"] = int_entry(d.shard_rank);
  for (const auto& b : d.module->named_buffers(/*recurse=*/true))
    if (b.value().defined()) out["buffer/" + b.key()] = b.value().detach().clone();
  return out;
}

void FullyShardedDataParallelBase::load_sharded_state_dict(const TensorDict& dict) {
  detail::FsdpImpl& d = *impl_;
  const std::string what = "load_sharded_state_dict";
  std::string layout;
  for (const auto& u : d.units) layout += unit_key(u) + ":" + std::to_string(u.numel) + ";";
  DDPKIT_CHECK(bytes_of(dict, "layout/units", what) == layout, what,
               ": the dict was saved with other units (", bytes_of(dict, "layout/units", what), ") than these (", layout, ")");
  const int64_t world = int_of(dict, "layout/shard_world", what), rank = int_of(dict, "layout/shard_rank", what);
  DDPKIT_CHECK(world == d.shard_world && rank == d.shard_rank, what, ": the dict holds shard ", rank, " of ", world,
               ", this rank keeps shard ", d.shard_rank, " of ", d.shard_world,
               ": load a full state dict to change the world size");
  torch::NoGradGuard no_grad;
  for (auto& u : d.units) u.shard.detach().copy_(entry_of(dict, "shard/" + unit_key(u), what));
  for (auto& b : d.module->named_buffers(/*recurse=*/true))
    if (b.value().defined()) b.value().detach().copy_(entry_of(dict, "buffer/" + b.key(), what));
}

TensorDict FullyShardedDataParallelBase::full_optimizer_state_dict(torch::optim::Optimizer& optimizer) {
  detail::FsdpImpl& d = *impl_;
  TensorDict out;
  auto& state = optimizer.state();
  for (auto& u : d.units) {
    if (u.numel == 0) continue;
    // Every rank takes part in each gather, stepped or not: a shard never stepped has no state
    // on any rank (all ranks step the same shards).
    auto it = state.find(compat::optimizer_state_key(state, u.shard));
    if (it == state.end()) continue;
    const std::string key = "optim/" + unit_key(u) + "/";
    for (auto& field : state_fields(*it->second))
      if (field.second->defined()) out[key + field.first] = d.gather_full_fp32(u, *field.second).clone();
    if (int64_t* step = state_step(*it->second)) out[key + "step"] = int_entry(*step);
  }
  return out;
}

void FullyShardedDataParallelBase::load_full_optimizer_state_dict(torch::optim::Optimizer& optimizer,
                                                                 const TensorDict& dict) {
  detail::FsdpImpl& d = *impl_;
  auto& state = optimizer.state();
  std::set<std::string> used;
  for (auto& u : d.units) {
    if (u.numel == 0) continue;
    const std::string key = "optim/" + unit_key(u) + "/";
    bool any = false;
    for (const auto& kv : dict) any = any || kv.first.rfind(key, 0) == 0;
    if (!any) continue;
    auto& slot = state[compat::optimizer_state_key(state, u.shard)];
    if (!slot) slot = new_state_like(optimizer);
    for (auto& field : state_fields(*slot)) {
      auto it = dict.find(key + field.first);
      if (it == dict.end()) continue;
      DDPKIT_CHECK(it->second.numel() == u.numel, "load_full_optimizer_state_dict: '", it->first, "' has ",
                   it->second.numel(), " elements, unit ", unit_key(u), " has ", u.numel);
      *field.second = d.shard_of_full(u, it->second);
      used.insert(it->first);
    }
    if (int64_t* step = state_step(*slot)) {
      *step = int_of(dict, key + "step", "load_full_optimizer_state_dict");
      used.insert(key + "step");
    }
  }
  for (const auto& kv : dict)
    DDPKIT_CHECK(used.count(kv.first), "load_full_optimizer_state_dict: unexpected entry '", kv.first, "'");
}

}  // namespace ddpkit
