// Optimizer-after-hook: each bucket's parameters are updated as soon as that bucket's
// communication completes, so the optimizer runs during the rest of backward instead of after it
// (PyTorch's _hook_then_optimizer / DDP._register_fused_optim).
//
//   auto opt = ddpkit::hooks::functional_adam(torch::optim::AdamOptions(1e-3));
//   ddp.register_comm_hook(ddpkit::hooks::optimizer_after_hook(allreduce_hook(pg), opt), "allreduce+adam");
//   ... zero the gradients, forward, loss.backward();   // parameters are updated on return
//
// Do not call an optimizer's step() as well. The results match torch::optim::SGD / Adam / AdamW
// bit for bit: the same float operations run per parameter (SGD's in one pass, as
// ddpkit::optim::SGD, include/ddpkit/optim/sgd.h). Updates happen on a communication
// thread under a no-grad guard, on parameters whose gradients are final: autograd no longer reads
// them in this backward (a parameter used twice in one forward is updated only after its last use,
// because DDP marks it ready then).
#pragma once

#include <ddpkit/reducer/grad_bucket.h>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <string>
#include <vector>

namespace ddpkit {
namespace hooks {

// An optimizer that updates one parameter at a time. step_param may run concurrently for
// different parameters (different buckets complete on different threads), never for the same one.
class FunctionalOptimizer {
 public:
  virtual ~FunctionalOptimizer() = default;
  virtual void step_param(const at::Tensor& param, const at::Tensor& grad) = 0;
  virtual std::string name() const = 0;
};

std::shared_ptr<FunctionalOptimizer> functional_sgd(torch::optim::SGDOptions options);
std::shared_ptr<FunctionalOptimizer> functional_adam(torch::optim::AdamOptions options);
std::shared_ptr<FunctionalOptimizer> functional_adamw(torch::optim::AdamWOptions options);

// Runs `hook`, then steps `optimizer` on every parameter of the bucket (or only those in
// `params_to_optimize`, when given) with the communicated gradients.
CommHook optimizer_after_hook(CommHook hook, std::shared_ptr<FunctionalOptimizer> optimizer,
                              std::vector<at::Tensor> params_to_optimize = {});

}  // namespace hooks
}  // namespace ddpkit
