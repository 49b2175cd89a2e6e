// FSDP-style communication hooks (torch.distributed.algorithms._comm_hooks.default_hooks): average
// a flat gradient by allreduce, or reduce-scatter it into this rank's shard, dividing by the world
// size in two steps (before and after the SUM) so neither fp16 overflow nor underflow bites.
//
//   ddpkit::fsdp::DefaultState state(pg);
//   ddpkit::fsdp::reduce_scatter_hook(state, flat_grad, my_shard)->wait();   // my_shard = mean shard
//
// Every hook works in place on the tensors it is given (grad, or output when given) and returns a
// future whose value is that tensor. They are asynchronous and follow the threading rules of
// docs/threading.md (collectives through the state's ProcessGroup, no blocking in callbacks), so
// DDP hooks and ZeRO-2 (zero/ddp_zero_hook.h) build on them. CPU (Gloo) and GPU (NCCL) alike.
#pragma once

#include <ddpkit/comm/process_group.h>

#include <memory>

namespace ddpkit {
namespace fsdp {

struct DefaultState {
  explicit DefaultState(std::shared_ptr<ProcessGroup> process_group);
  virtual ~DefaultState() = default;

  // f = 1; while world % f == 0 and world / f > f: f *= 2 (PyTorch's rule, kept bit for bit).
  static double predivide_factor(int world_size);

  std::shared_ptr<ProcessGroup> process_group;
  int world_size;
  double gradient_predivide_factor;
  double gradient_postdivide_factor;  // world_size / gradient_predivide_factor
};

// Communicates in fp16/bf16 and casts the result back to the parameters' dtype.
struct LowPrecisionState : DefaultState {
  explicit LowPrecisionState(std::shared_ptr<ProcessGroup> process_group,
                             at::ScalarType parameter_type = at::kFloat);
  at::ScalarType parameter_type;
};

// grad /= pre; SUM-allreduce; grad /= post.
FuturePtr allreduce_hook(const DefaultState& state, const at::Tensor& grad);
// grad /= pre (grad is modified); output = chunk rank() of the SUM; output /= post. grad must
// hold world_size * output.numel() elements.
FuturePtr reduce_scatter_hook(const DefaultState& state, const at::Tensor& grad, const at::Tensor& output);
// The same in float16 / bfloat16: a low-precision copy of grad is divided, communicated and
// divided again, and the result is cast into `output` when given (reduce-scatter), else into
// `grad` (allreduce). On Gloo the sum itself is accumulated in fp32 (ProcessGroup::allreduce /
// reduce_scatter), so only the inputs and the result are rounded.
FuturePtr fp16_compress_hook(const LowPrecisionState& state, const at::Tensor& grad,
                             const at::Tensor& output = {});
FuturePtr bf16_compress_hook(const LowPrecisionState& state, const at::Tensor& grad,
                             const at::Tensor& output = {});

}  // namespace fsdp
}  // namespace ddpkit
