#include <ddpkit/optim/adam.h>

#include <ddpkit/compat.h>
#include <ddpkit/error.h>

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <memory>

namespace ddpkit {
namespace optim {
namespace {

constexpr int64_t kSlice = kAdamSliceElements;  // include/ddpkit/optim/adam.h says why

bool sliceable(const at::Tensor& p, std::initializer_list<const at::Tensor*> others) {
  if (!p.device().is_cpu() || p.layout() != at::kStrided || !p.is_contiguous() || p.numel() <= kSlice) return false;
  for (const at::Tensor* t : others)
    if (t->defined() && (!t->device().is_cpu() || t->layout() != at::kStrided || !t->is_contiguous() ||
                         t->numel() != p.numel() || t->scalar_type() != p.scalar_type()))
      return false;
  return true;
}

// libtorch's operations, on the whole tensors or on one slice of each. `scratch` holds the
// denominator; `decayed` (when decaying into the gradient) grad + weight_decay * param.
void update(const at::Tensor& p, at::Tensor g, const at::Tensor& m, const at::Tensor& v, at::Tensor vmax,
            const AdamHyper& h, double bias_correction1, double bias_correction2, at::Tensor scratch,
            at::Tensor decayed) {
  if (!h.decoupled && h.weight_decay != 0)
    g = decayed.defined() ? at::add_out(decayed, g, p, h.weight_decay) : g.add(p, h.weight_decay);
  m.mul_(h.beta1).add_(g, 1 - h.beta1);
  v.mul_(h.beta2).addcmul_(g, g, 1 - h.beta2);
  if (h.amsgrad) at::max_out(vmax, v, vmax);
  const at::Tensor& root_of = h.amsgrad ? vmax : v;
  at::Tensor denom = scratch.defined() ? at::sqrt_out(scratch, root_of).div_(std::sqrt(bias_correction2))
                                       : root_of.sqrt() / std::sqrt(bias_correction2);
  denom.add_(h.eps);
  p.addcdiv_(m, denom, -h.lr / bias_correction1);
}

}  // namespace

void adam_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, int64_t step, const AdamHyper& h) {
  at::NoGradGuard no_grad;
  at::Tensor p = param.detach();
  const double bias_correction1 = 1 - std::pow(h.beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(h.beta2, static_cast<double>(step));
  if (h.decoupled && h.weight_decay != 0) p.mul_(1 - h.lr * h.weight_decay);
  const at::Tensor vmax = h.amsgrad ? max_exp_avg_sq : at::Tensor();
  if (!sliceable(p, {&grad, &exp_avg, &exp_avg_sq, &vmax})) {
    update(p, grad, exp_avg, exp_avg_sq, vmax, h, bias_correction1, bias_correction2, {}, {});
    return;
  }
  const at::Tensor pf = p.view({-1}), gf = grad.view({-1}), mf = exp_avg.view({-1}), vf = exp_avg_sq.view({-1});
  const at::Tensor xf = h.amsgrad ? vmax.view({-1}) : at::Tensor();
  const int64_t n = pf.numel(), slices = (n + kSlice - 1) / kSlice;
  // Each task's scratch is its own; ATen's kernels inside a parallel region run on that thread.
  at::parallel_for(0, slices, 1, [&](int64_t first, int64_t last) {
    at::Tensor scratch = at::empty({kSlice}, pf.options());
    at::Tensor decayed = !h.decoupled && h.weight_decay != 0 ? at::empty({kSlice}, pf.options()) : at::Tensor();
    for (int64_t s = first; s < last; ++s) {
      const int64_t at = s * kSlice, len = std::min(kSlice, n - at);
      auto cut = [&](const at::Tensor& t) { return t.defined() ? t.narrow(0, at, len) : at::Tensor(); };
      update(cut(pf), cut(gf), cut(mf), cut(vf), cut(xf), h, bias_correction1, bias_correction2,
             scratch.narrow(0, 0, len), decayed.defined() ? decayed.narrow(0, 0, len) : at::Tensor());
    }
  });
}

namespace {

// Adam::step / AdamW::step of libtorch: the state each creates, the step each counts.
template <typename State, typename Options, typename Base>
at::Tensor step_all(Base& self, typename Base::LossClosure closure, bool decoupled, const char* name) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : self.param_groups()) {
    const auto& o = static_cast<const Options&>(group.options());
    const AdamHyper h{o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), o.amsgrad(),
                      decoupled};
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const at::Tensor& grad = p.grad();
      DDPKIT_CHECK(!grad.is_sparse(), name, " does not support sparse gradients");
      auto& states = self.state();
      const auto key = compat::optimizer_state_key(states, p);
      auto it = states.find(key);
      if (it == states.end()) {
        auto fresh = std::make_unique<State>();
        fresh->step(0);
        fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (o.amsgrad()) fresh->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        it = states.emplace(key, std::move(fresh)).first;
      }
      auto& s = static_cast<State&>(*it->second);
      s.step(s.step() + 1);
      adam_update(p, grad, s.exp_avg(), s.exp_avg_sq(), o.amsgrad() ? s.max_exp_avg_sq() : at::Tensor(), s.step(), h);
    }
  }
  return loss;
}

}  // namespace

at::Tensor Adam::step(LossClosure closure) {
  return step_all<torch::optim::AdamParamState, torch::optim::AdamOptions>(*this, std::move(closure), false, "Adam");
}

at::Tensor AdamW::step(LossClosure closure) {
  return step_all<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(*this, std::move(closure), true, "AdamW");
}

}  // namespace optim
}  // namespace ddpkit
