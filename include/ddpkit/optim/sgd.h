// torch::optim::SGD with each parameter's update in one pass over memory.
//
//   ddpkit::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
//
// libtorch's SGD (like PyTorch 1.13's Python one) updates a parameter with three whole-tensor
// operations: buf.mul_(momentum), buf.add_(grad, 1 - dampening), param.add_(buf, -lr): eight reads
// and writes of the tensor's size. A DDP step on CPU is memory-bound, and on a 100 MB model those
// passes cost as much as the allreduce. This SGD reads param, grad and buffer once and writes param
// and buffer once (PyTorch 2.4+ calls the same thing `fused=True`).
//
// The results are torch::optim::SGD's bit for bit: the same float operations in the same order,
// with a fused multiply-add where ATen's kernels use one. The options, param groups and state
// (SGDParamState's momentum_buffer) are torch::optim::SGD's, so state_dict() and checkpoints move
// between the two. Anything the one-pass kernel does not cover (sparse or non-contiguous gradients,
// dtypes other than float, other devices, the first step, a CPU where ATen itself runs without FMA)
// takes libtorch's own operations.
#pragma once

#include <torch/optim/sgd.h>

#include <vector>

namespace ddpkit {
namespace optim {

class SGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  at::Tensor step(LossClosure closure = nullptr) override;
};

// One parameter's update, as SGD::step makes it. `momentum_buffer` is the parameter's buffer:
// undefined before its first step (created here when options.momentum() != 0). Used by step() and
// by the optimizer-after-hook's functional_sgd.
void sgd_update(const at::Tensor& param, const at::Tensor& grad, at::Tensor& momentum_buffer,
                const torch::optim::SGDOptions& options);

}  // namespace optim
}  // namespace ddpkit
