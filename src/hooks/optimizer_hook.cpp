#include <ddpkit/hooks/optimizer_hook.h>

#include <ddpkit/optim/adam.h>
#include <ddpkit/optim/sgd.h>

#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace ddpkit {
namespace hooks {
namespace {

// Per-parameter state, created on first use. The map is locked only to find or insert an entry;
// the update itself touches that parameter's state alone.
template <typename State>
class StateTable {
 public:
  State& get(const at::Tensor& param, bool& created) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = table_.find(param.unsafeGetTensorImpl());
    created = it == table_.end();
    if (created) it = table_.emplace(param.unsafeGetTensorImpl(), std::make_unique<State>()).first;
    return *it->second;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, std::unique_ptr<State>> table_;
};

// ddpkit::optim::SGD (torch::optim::SGD's results), per parameter.
class FunctionalSGD : public FunctionalOptimizer {
 public:
  explicit FunctionalSGD(torch::optim::SGDOptions o) : o_(std::move(o)) {
    DDPKIT_CHECK(o_.lr() >= 0, "functional_sgd: invalid learning rate ", o_.lr());
    DDPKIT_CHECK(!o_.nesterov() || (o_.momentum() > 0 && o_.dampening() == 0),
                 "functional_sgd: nesterov momentum requires a momentum and zero dampening");
  }
  std::string name() const override { return "sgd"; }
  void step_param(const at::Tensor& param, const at::Tensor& grad) override {
    if (o_.momentum() == 0) {
      at::Tensor none;
      optim::sgd_update(param, grad, none, o_);
      return;
    }
    bool created;
    optim::sgd_update(param, grad, momentum_.get(param, created), o_);
  }

 private:
  torch::optim::SGDOptions o_;
  StateTable<at::Tensor> momentum_;
};

struct AdamState {
  int64_t step = 0;
  at::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq;
};

// ddpkit::optim::Adam / AdamW (libtorch's results), per parameter (decoupled: AdamW's weight decay).
class FunctionalAdam : public FunctionalOptimizer {
 public:
  FunctionalAdam(double lr, std::tuple<double, double> betas, double eps, double weight_decay, bool amsgrad,
                 bool decoupled)
      : lr_(lr), betas_(betas), eps_(eps), weight_decay_(weight_decay), amsgrad_(amsgrad), decoupled_(decoupled) {
    const char* n = decoupled ? "functional_adamw" : "functional_adam";
    DDPKIT_CHECK(lr >= 0, n, ": invalid learning rate ", lr);
    DDPKIT_CHECK(eps >= 0, n, ": invalid epsilon ", eps);
    DDPKIT_CHECK(std::get<0>(betas) >= 0 && std::get<0>(betas) < 1 && std::get<1>(betas) >= 0 && std::get<1>(betas) < 1,
                 n, ": betas must be in [0, 1)");
    DDPKIT_CHECK(weight_decay >= 0, n, ": invalid weight_decay ", weight_decay);
  }
  std::string name() const override { return decoupled_ ? "adamw" : "adam"; }
  void step_param(const at::Tensor& param, const at::Tensor& grad_in) override {
    DDPKIT_CHECK(!grad_in.is_sparse(), name(), " does not support sparse gradients");
    at::NoGradGuard no_grad;
    at::Tensor p = param.detach();
    bool created;
    AdamState& s = state_.get(param, created);
    if (created) {
      s.exp_avg = at::zeros_like(p, at::MemoryFormat::Preserve);
      s.exp_avg_sq = at::zeros_like(p, at::MemoryFormat::Preserve);
      if (amsgrad_) s.max_exp_avg_sq = at::zeros_like(p, at::MemoryFormat::Preserve);
    }
    s.step += 1;
    optim::adam_update(p, grad_in, s.exp_avg, s.exp_avg_sq, s.max_exp_avg_sq, s.step,
                       {lr_, std::get<0>(betas_), std::get<1>(betas_), eps_, weight_decay_, amsgrad_, decoupled_});
  }

 private:
  double lr_;
  std::tuple<double, double> betas_;
  double eps_, weight_decay_;
  bool amsgrad_, decoupled_;
  StateTable<AdamState> state_;
};

}  // namespace

std::shared_ptr<FunctionalOptimizer> functional_sgd(torch::optim::SGDOptions options) {
  return std::make_shared<FunctionalSGD>(std::move(options));
}

std::shared_ptr<FunctionalOptimizer> functional_adam(torch::optim::AdamOptions o) {
  return std::make_shared<FunctionalAdam>(o.lr(), o.betas(), o.eps(), o.weight_decay(), o.amsgrad(), false);
}

std::shared_ptr<FunctionalOptimizer> functional_adamw(torch::optim::AdamWOptions o) {
  return std::make_shared<FunctionalAdam>(o.lr(), o.betas(), o.eps(), o.weight_decay(), o.amsgrad(), true);
}

CommHook optimizer_after_hook(CommHook hook, std::shared_ptr<FunctionalOptimizer> optimizer,
                              std::vector<at::Tensor> params_to_optimize) {
  DDPKIT_CHECK(hook, "optimizer_after_hook: the wrapped hook is empty");
  DDPKIT_CHECK(optimizer, "optimizer_after_hook: optimizer is null");
  auto only = std::make_shared<std::unordered_set<const c10::TensorImpl*>>();
  for (const auto& p : params_to_optimize) only->insert(p.unsafeGetTensorImpl());
  return [hook = std::move(hook), optimizer = std::move(optimizer), only](GradBucket& bucket) -> FuturePtr {
    // Outlives the call (offsets, shapes, parameters); held by pointer because 2.x calls then()'s
    // callback as const.
    auto view = std::make_shared<GradBucket>(bucket);
    return hook(bucket)->then(
        [view, optimizer, only](c10::ivalue::Future& f) -> c10::IValue {
          at::Tensor result = f.value().toTensor();
          DDPKIT_CHECK(!view->is_sparse(), "optimizer_after_hook: bucket ", view->index(),
                       " holds a sparse gradient; use the optimizer after backward for sparse parameters");
          view->set_buffer(result.reshape({-1}));
          const auto grads = view->gradients();
          const auto& params = view->parameters();
          for (size_t i = 0; i < params.size(); ++i)
            if (only->empty() || only->count(params[i].unsafeGetTensorImpl())) optimizer->step_param(params[i], grads[i]);
          return c10::IValue(result);
        },
        c10::TensorType::get());
  };
}

}  // namespace hooks
}  // namespace ddpkit
