// ZeRO with DDP: the optimizer step overlapped with backward (ddp_comm_hooks/ddp_zero_hook.py), and
// ZeRO-2, where buckets are reduce-scattered so each rank keeps only its shard's gradients.
//
//   auto zero = std::make_shared<ZeroRedundancyOptimizer>(params, optimizer_factory<torch::optim::Adam>(...), pg,
//                                                        ZeroOptions().overlap_with_ddp(true));
//   ddp.register_comm_hook(hook_with_zero_step_interleaved(hooks::allreduce_hook(pg), ddp, zero), "zero");
//   for (...) { zero->zero_grad(); loss(ddp.forward(x)).backward(); }   // parameters updated on return
//
// Unlike PyTorch these run on Gloo and update the parameters from the first iteration. PyTorch
// needs warm-up iterations because DDP rebuilds its buckets after the first one and the
// assignment of buckets to ranks can only be made afterwards; here the hook freezes DDP's bucket
// layout when it is created (Reducer::freeze_bucket_layout) and partitions by it at once. The cost:
// buckets keep the reverse-registration order instead of the observed gradient-ready order.
//
// Ordering (docs/threading.md): the step and the broadcasts of bucket b run as one job on the
// process group's sequencer, posted from the hook in bucket order, so every rank issues the same
// collectives in the same order even though buckets complete on different threads. That is what
// makes Gloo safe; PyTorch issues them from future callbacks and refuses Gloo because it hangs.
#pragma once

#include <ddpkit/ddp/distributed_data_parallel.h>
#include <ddpkit/zero/zero_redundancy_optimizer.h>

#include <memory>
#include <string>

namespace ddpkit {

enum class ZeroOverlap {
  kNone,         // ZeRO-2 only: buckets are reduce-scattered; ZeroRedundancyOptimizer::step() steps
  kStep,         // after the last bucket's hook: step bucket by bucket while its successors communicate
  kInterleaved,  // bucket b steps as soon as bucket b+1 has started communicating
};
// "none" | "step" | "interleaved".
ZeroOverlap parse_zero_overlap(const std::string& name);

// Run `hook` (any DDP hook that averages), then, once all buckets' hooks have been called, step
// this rank's part of each bucket and broadcast it. `zero` needs overlap_with_ddp and the same
// parameters as `ddp`. shard_buckets: buckets are split among ranks at parameter boundaries, by
// the sorted-greedy partition of the parameters (the best balance of state and work); else each
// bucket goes whole to one rank, largest first to the least loaded.
CommHook hook_with_zero_step(CommHook hook, DistributedDataParallelBase& ddp,
                             std::shared_ptr<ZeroRedundancyOptimizer> zero, bool shard_buckets = false);
// The same, stepping bucket b while later buckets are still being computed and communicated.
CommHook hook_with_zero_step_interleaved(CommHook hook, DistributedDataParallelBase& ddp,
                                         std::shared_ptr<ZeroRedundancyOptimizer> zero, bool shard_buckets = false);

// ZeRO-2's reduction: average `grad` (world * shard.numel() elements) into this rank's `shard`.
using ShardedReduce = std::function<FuturePtr(const at::Tensor& grad, const at::Tensor& shard)>;
// The FSDP hooks as a ShardedReduce: precision "fp32" (fsdp::reduce_scatter_hook), "fp16" or
// "bf16" (fsdp::fp16/bf16_compress_hook with LowPrecisionState(pg, parameter_type)).
ShardedReduce fsdp_sharded_reduce(std::shared_ptr<ProcessGroup> pg, const std::string& precision = "fp32",
                                  at::ScalarType parameter_type = at::kFloat);

// ZeRO-2: lays the parameters of each DDP bucket out flat, split into world equal shards (the
// optimizer state follows: this rank's optimizer steps its shards only), and returns the hook that
// reduce-scatters each bucket into this rank's gradient shard. After backward, .grad holds the
// averaged gradient on this rank's shard and zeros elsewhere. overlap kNone: call zero->step()
// (overlap_with_ddp false); kStep/kInterleaved: the hook steps (overlap_with_ddp true). After each
// shard's step an allgather brings every rank the updated parameters. One parameter group only.
CommHook zero2_hook(DistributedDataParallelBase& ddp, std::shared_ptr<ZeroRedundancyOptimizer> zero,
                    ShardedReduce reduce, ZeroOverlap overlap = ZeroOverlap::kInterleaved);

}  // namespace ddpkit
