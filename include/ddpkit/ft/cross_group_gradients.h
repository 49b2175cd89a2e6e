// How one step's gradients cross the replica groups, chosen from what the group trains with.
//
//   DDP (plain optimizer, ZeRO-1): bucket by bucket inside backward, each bucket averaged in the
//     group and then across the groups while backward goes on (Manager::cross_group_reduction).
//   ZeRO-2 (sharded gradients): after backward, each rank's gradient shards (rank r of every
//     group holds the same elements).
//   FSDP, or no wrapper: after backward, the gradients of `parameters` (FSDP's: the shards).
//
//   ft::Manager manager(pg, state, options);
//   ft::CrossGroupGradients crossing(manager, optimizer_params, &ddp, zero.get());  // before start_step
//   for (...) {
//     manager.start_step();
//     loss.backward();
//     crossing.after_backward();      // nothing under DDP: done inside backward
//     if (manager.should_commit()) optimizer.step();
//   }
#pragma once

#include <ddpkit/ft/manager.h>

#include <string>
#include <vector>

namespace ddpkit {

class DistributedDataParallelBase;
class ZeroRedundancyOptimizer;

namespace ft {

class CrossGroupGradients {
 public:
  // `parameters`: what the optimizer steps (FSDP: its shards). `ddp` / `zero`: the group's DDP and
  // ZeRO, if any. Make it before the Manager's first start_step (the DDP route registers with DDP's
  // reducer there, and sizes the cross groups' staging from it).
  CrossGroupGradients(Manager& manager, std::vector<at::Tensor> parameters, DistributedDataParallelBase* ddp = nullptr,
                      ZeroRedundancyOptimizer* zero = nullptr);
  // After backward, before should_commit: the crossing that does not happen inside backward. A
  // failure marks the step not to commit (Manager::allreduce).
  void after_backward();
  // "ddp-buckets", "zero2-shards" or "gradients".
  const std::string& route() const { return route_; }

 private:
  Manager& manager_;
  std::vector<at::Tensor> parameters_;
  ZeroRedundancyOptimizer* zero_;
  std::string route_;
};

}  // namespace ft
}  // namespace ddpkit
