// put_optimizer_tensors / load_optimizer_tensors (optimizer_tensors.h).
#include "optimizer_tensors.h"

#include <ddpkit/compat.h>
#include <ddpkit/error.h>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <vector>

namespace ddpkit {
namespace detail {

namespace {

std::vector<at::Tensor> all_params(torch::optim::Optimizer& o) {
  std::vector<at::Tensor> out;
  for (auto& g : o.param_groups())
    for (auto& p : g.params()) out.push_back(p);
  return out;
}

template <typename State>
void put_adam_like(TensorDict& d, const std::string& k, const State& s, const char* kind) {
  d[k + kind] = at::tensor({s.step()}, at::kLong);
  d[k + "exp_avg"] = s.exp_avg();
  d[k + "exp_avg_sq"] = s.exp_avg_sq();
  if (s.max_exp_avg_sq().defined()) d[k + "max_exp_avg_sq"] = s.max_exp_avg_sq();
}

const at::Tensor& entry(const TensorDict& d, const std::string& key, const at::Tensor& like, const std::string& what) {
  auto it = d.find(key);
  DDPKIT_CHECK(it != d.end(), what, ": no ", key);
  DDPKIT_CHECK(it->second.sizes() == like.sizes() && it->second.scalar_type() == like.scalar_type(), what, ": ", key,
               " is ", it->second.scalar_type(), it->second.sizes(), ", the parameter ", like.scalar_type(), like.sizes());
  return it->second;
}

template <typename State>
std::unique_ptr<State> take_adam_like(const TensorDict& d, const std::string& k, const at::Tensor& p,
                                      const char* kind, const std::string& what) {
  auto s = std::make_unique<State>();
  s->step(d.at(k + kind).item<int64_t>());
  s->exp_avg(entry(d, k + "exp_avg", p, what));
  s->exp_avg_sq(entry(d, k + "exp_avg_sq", p, what));
  if (d.count(k + "max_exp_avg_sq")) s->max_exp_avg_sq(entry(d, k + "max_exp_avg_sq", p, what));
  return s;
}

}  // namespace

bool put_optimizer_tensors(TensorDict& d, torch::optim::Optimizer& o, const std::string& prefix) {
  TensorDict out;
  auto& state = o.state();
  const auto params = all_params(o);
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = state.find(compat::optimizer_state_key(state, params[i]));
    if (it == state.end()) continue;
    const std::string k = prefix + std::to_string(i) + "/";
    const auto* st = it->second.get();
    if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(st)) {
      if (s->momentum_buffer().defined()) out[k + "momentum_buffer"] = s->momentum_buffer();
    } else if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(st)) {
      put_adam_like(out, k, *a, "adam_step");
    } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(st)) {
      put_adam_like(out, k, *w, "adamw_step");
    } else {
      return false;
    }
  }
  std::vector<double> lrs;
  for (auto& g : o.param_groups()) lrs.push_back(g.options().get_lr());
  out[prefix + "params"] = at::tensor({static_cast<int64_t>(params.size())}, at::kLong);
  out[prefix + "lr"] = at::tensor(lrs, at::kDouble);
  for (auto& kv : out) d[kv.first] = std::move(kv.second);
  return true;
}

bool load_optimizer_tensors(const TensorDict& d, torch::optim::Optimizer& o, const std::string& prefix,
                            const std::string& what) {
  auto count = d.find(prefix + "params");
  if (count == d.end()) return false;
  const auto params = all_params(o);
  DDPKIT_CHECK(count->second.item<int64_t>() == static_cast<int64_t>(params.size()), what, ": optimizer state for ",
               count->second.item<int64_t>(), " parameters, this optimizer has ", params.size());
  const at::Tensor lrs = d.at(prefix + "lr");
  DDPKIT_CHECK(lrs.numel() == static_cast<int64_t>(o.param_groups().size()), what, ": learning rates for ",
               lrs.numel(), " parameter groups, this optimizer has ", o.param_groups().size());
  const bool sgd = dynamic_cast<torch::optim::SGD*>(&o), adam = dynamic_cast<torch::optim::Adam*>(&o),
             adamw = dynamic_cast<torch::optim::AdamW*>(&o);
  auto& state = o.state();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string k = prefix + std::to_string(i) + "/";
    const auto key = compat::optimizer_state_key(state, params[i]);
    std::unique_ptr<torch::optim::OptimizerParamState> s;
    if (d.count(k + "momentum_buffer")) {
      DDPKIT_CHECK(sgd, what, ": holds SGD state, this optimizer is not SGD");
      auto m = std::make_unique<torch::optim::SGDParamState>();
      m->momentum_buffer(entry(d, k + "momentum_buffer", params[i], what));
      s = std::move(m);
    } else if (d.count(k + "adam_step")) {
      DDPKIT_CHECK(adam, what, ": holds Adam state, this optimizer is not Adam");
      s = take_adam_like<torch::optim::AdamParamState>(d, k, params[i], "adam_step", what);
    } else if (d.count(k + "adamw_step")) {
      DDPKIT_CHECK(adamw, what, ": holds AdamW state, this optimizer is not AdamW");
      s = take_adam_like<torch::optim::AdamWParamState>(d, k, params[i], "adamw_step", what);
    }
    if (s)
      state[key] = std::move(s);
    else
      state.erase(key);
  }
  for (size_t g = 0; g < o.param_groups().size(); ++g)
    o.param_groups()[g].options().set_lr(lrs[static_cast<int64_t>(g)].item<double>());
  return true;
}

}  // namespace detail
}  // namespace ddpkit
