// CrossGroupGradients (include/ddpkit/ft/cross_group_gradients.h).
#include <ddpkit/ft/cross_group_gradients.h>

#include <ddpkit/ddp/distributed_data_parallel.h>
#include <ddpkit/error.h>
#include <ddpkit/zero/zero_redundancy_optimizer.h>

namespace ddpkit {
namespace ft {

CrossGroupGradients::CrossGroupGradients(Manager& manager, std::vector<at::Tensor> parameters,
                                         DistributedDataParallelBase* ddp, ZeroRedundancyOptimizer* zero)
    : manager_(manager), parameters_(std::move(parameters)), zero_(zero) {
  DDPKIT_CHECK(!parameters_.empty(), "ft::CrossGroupGradients: no parameters");
  if (zero && zero->sharded_gradients()) {
    route_ = "zero2-shards";
  } else if (ddp) {
    ddp->reducer().set_cross_replica_reduction(manager.cross_group_reduction(parameters_));
    route_ = "ddp-buckets";
  } else {
    route_ = "gradients";
  }
}

void CrossGroupGradients::after_backward() {
  if (route_ == "ddp-buckets") return;
  if (route_ == "zero2-shards") {
    manager_.allreduce(zero_->gradient_shards());
    return;
  }
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters_)
    if (p.grad().defined()) grads.push_back(p.grad());
  manager_.allreduce(grads);
}

}  // namespace ft
}  // namespace ddpkit
