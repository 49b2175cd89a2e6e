// The default communication hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks).
// Each factory returns a CommHook bound to a process group; register it with
// DistributedDataParallel::register_comm_hook(hook, name).
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/hooks/powersgd_hook.h>
#include <ddpkit/hooks/quantization_hooks.h>
#include <ddpkit/reducer/grad_bucket.h>

#include <memory>
#include <string>
#include <vector>

namespace ddpkit {
namespace hooks {

// Divide by world size, then SUM-allreduce (dividing first keeps fp16 from overflowing).
// Sparse buckets are allreduced sparse.
CommHook allreduce_hook(std::shared_ptr<ProcessGroup> pg);
// Cast to float16 and divide in one pass, allreduce in float16, cast back into the bucket.
CommHook fp16_compress_hook(std::shared_ptr<ProcessGroup> pg);
// The same with bfloat16; runs on CPU/Gloo too (PyTorch's needs CUDA + NCCL). Each rank's g_r/n
// is rounded once to bf16 (8 significant bits) and the fp32-accumulated sum once more, so the
// result differs from the exact average by at most 2^-8 |average| + 2^-8 max_r |g_r|
// (tests/ddp_test.cpp, Hooks.Bf16WithinDocumentedBound). fp16: 2^-11 in place of 2^-8 within its
// range (|x| < 65504; below 6.1e-5 the absolute error can reach 2^-25).
CommHook bf16_compress_hook(std::shared_ptr<ProcessGroup> pg);
// Run any hook on a float16 (bfloat16) copy of the bucket and cast its result back.
CommHook fp16_compress_wrapper(CommHook hook);
CommHook bf16_compress_wrapper(CommHook hook);
// Returns the local gradients unchanged: measures the cost of everything but communication.
CommHook noop_hook();

// Options of the hooks make_hook can build.
struct HookOptions {
  TORCH_ARG(Int8Options, int8) = {};
  TORCH_ARG(PowerSGDOptions, powersgd) = {};
  TORCH_ARG(int64_t, perchannel_bucket_size) = 512;
};

// By name, for command lines: allreduce, fp16, bf16, noop, fp16_wrapper, bf16_wrapper (the
// wrappers around allreduce_hook), int8 (int8_allreduce_hook), quantize_per_tensor,
// quantize_per_channel, powersgd, batched_powersgd. Unknown names are an error listing the known
// ones. (post-local SGD and the optimizer-after-hook need more than a name: see their headers.)
CommHook make_hook(const std::string& name, std::shared_ptr<ProcessGroup> pg, const HookOptions& options = {});
// The same, with the state the hook keeps between steps, for checkpoints (null for the stateless
// hooks; int8's holds nothing without error feedback).
struct BuiltHook {
  CommHook hook;
  std::shared_ptr<HookState> state;
};
BuiltHook build_hook(const std::string& name, std::shared_ptr<ProcessGroup> pg, const HookOptions& options = {});
std::vector<std::string> hook_names();
// The bucket cap (MiB) to use with a hook when the user names none: kCompressingHookBucketCapMb for
// hooks that compress each element (fp16/bf16 and their wrappers, int8, quantize_*),
// kDefaultBucketCapMb (PyTorch's) otherwise; DistributedDataParallel applies it when the hook is
// registered under that name and no cap was given. A
// small bucket starts its codec and transfer earlier in backward and leaves a short last
// transfer; measured at 1 Gbit/s on a 12-layer MLP, 6 MiB buckets cut the int8 step by 10-22%
// and fp16's by 1-5% (docs/performance.md). PowerSGD compresses per matrix (batched: per bucket,
// where a larger bucket compresses more) and gains nothing.
constexpr double kCompressingHookBucketCapMb = 6.0;
double default_bucket_cap_mb(const std::string& hook);
// The PowerSGD rank `ddpkit train` uses unless told: 4, batched_powersgd 32 (one square per bucket).
int default_powersgd_rank(const std::string& hook);
// The hook moves its data in two-phase pieces (ProcessGroupOptions::piece_bytes): the codecs above.
bool moves_pieces(const std::string& hook);

}  // namespace hooks
}  // namespace ddpkit
