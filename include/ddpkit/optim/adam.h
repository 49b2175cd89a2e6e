// torch::optim::Adam and AdamW without whole-tensor temporaries.
//
//   ddpkit::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
//
// libtorch's Adam builds its denominator as whole tensors: sqrt(exp_avg_sq), then that divided by
// sqrt(bias_correction2), two temporaries the size of the largest parameter, live at once (and
// one more for grad + weight_decay * param). On a CPU those blocks come and go every step and
// leave the heap's layout, and so the peak, to chance. These run the same operations, in the same
// order, over slices of 64K elements with one scratch slice per thread: no temporary beyond it,
// and every pass over a slice in cache.
//
// The results are libtorch's bit for bit (the same ATen kernels on each element; slices are
// multiples of the kernels' vector width). Options, param groups and state (AdamParamState /
// AdamWParamState) are libtorch's, so state_dict() and checkpoints move between the two.
// Non-contiguous, sparse or mismatched tensors take libtorch's whole-tensor operations.
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

namespace ddpkit {
namespace optim {

class Adam : public torch::optim::Adam {
 public:
  using torch::optim::Adam::Adam;
  at::Tensor step(LossClosure closure = nullptr) override;
};

class AdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  at::Tensor step(LossClosure closure = nullptr) override;
};

// Elements per slice: a multiple of every vector width ATen's kernels step by (2 x 16 floats),
// so each element takes the path (vector or scalar tail) it takes over the whole tensor. A step
// holds at most two scratch slices per thread (the denominator, and grad + weight_decay * param).
constexpr int64_t kAdamSliceElements = 65536;

// One parameter's update as Adam::step (decoupled = false) or AdamW::step (true) makes it, the
// step count already advanced to `step`. max_exp_avg_sq is used when `amsgrad`. Used by the
// classes above and by the optimizer-after-hook's functional_adam/functional_adamw.
struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, decoupled;
};
void adam_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, int64_t step, const AdamHyper& h);

}  // namespace optim
}  // namespace ddpkit
