// PowerSGD (Vogels et al., NeurIPS 2019), as torch.distributed.algorithms.ddp_comm_hooks.
// powerSGD_hook, with every PowerSGDState option, on CPU/Gloo and GPU.
//
// Unlike PyTorch's, the hooks never wait inside a future callback and issue their collectives
// from the process group's sequencer, so they neither hang with default buckets on Gloo nor issue
// collectives in different orders on different ranks: parameters stay bit-identical.
//
//   auto state = std::make_shared<ddpkit::hooks::PowerSGDState>(pg,
//       ddpkit::hooks::PowerSGDOptions().matrix_approximation_rank(4).start_powerSGD_iter(10));
//   ddp.register_comm_hook(ddpkit::hooks::powerSGD_hook(state), "powerSGD");
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/hooks/hook_state.h>
#include <ddpkit/reducer/grad_bucket.h>

#include <torch/arg.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <tuple>

namespace ddpkit {
namespace hooks {

struct PowerSGDOptions {
  // Rank r of the approximation M ~ P Q^T (per matrix, at most min(rows, cols)).
  TORCH_ARG(int64_t, matrix_approximation_rank) = 1;
  // Plain allreduce for the first iterations (bucket rebuilding happens after the first one).
  // Must be > 1 with error feedback or warm start.
  TORCH_ARG(int64_t, start_powerSGD_iter) = 1000;
  // A matrix n x m is compressed only if (n + m) r * min_compression_rate < n m; others (and all
  // vectors) are allreduced uncompressed, together.
  TORCH_ARG(double, min_compression_rate) = 2.0;
  // Keep input - approximation per bucket and add it to the next gradient.
  TORCH_ARG(bool, use_error_feedback) = true;
  // Reuse last iteration's Q (orthogonalized) instead of a fresh random one.
  TORCH_ARG(bool, warm_start) = true;
  // Added to column norms in Gram-Schmidt; with 0, all-zero columns stay zero.
  TORCH_ARG(double, orthogonalization_epsilon) = 0.0;
  // Seeds the random Q (the same on every rank).
  TORCH_ARG(uint64_t, random_seed) = 0;
  // Every this many iterations, report compression statistics to `stats_logger` (if set; they
  // are always available from PowerSGDState::compression_stats()).
  TORCH_ARG(int64_t, compression_stats_logging_frequency) = 10000;
  // Compress same-shaped matrices of a bucket as one batched matrix multiply.
  TORCH_ARG(bool, batch_tensors_with_same_shape) = false;
  // Receives (compression rate, numel before, numel after).
  TORCH_ARG(std::function<void(double, int64_t, int64_t)>, stats_logger) = nullptr;
};

class PowerSGDState : public HookState {
 public:
  PowerSGDState(std::shared_ptr<ProcessGroup> pg, PowerSGDOptions options = {});

  const PowerSGDOptions& options() const { return options_; }
  ProcessGroup& process_group() { return *pg_; }
  // Completed iterations (counted when the last bucket is handed to the hook; if a wrapper never
  // hands it the last bucket, when the next iteration's first bucket arrives).
  int64_t iteration() const;
  // (numel before / numel after, numel before, numel after), summed over compressed iterations.
  std::tuple<double, int64_t, int64_t> compression_stats() const;
  // Error-feedback memory of a bucket: what the last compressed step left out (undefined if none);
  // a copy.
  at::Tensor error(size_t bucket_index) const;
  // Iteration counters, the random-Q sequence and each bucket's error feedback and P/Q memory.
  TensorDict state_dict() const override;
  void load_state_dict(const TensorDict& state) override;

 private:
  friend class PowerSGDHook;
  friend class BatchedPowerSGDHook;
  struct Bucket {
    at::Tensor error, p, q;  // error feedback; warm-start P and Q memory
    at::Tensor padded;       // batched hook: the bucket as a square matrix
    // Batched hook with error feedback: the compensated input, kept until the approximation is
    // known. Reused, as is `error`, updated in place: two fresh bucket-sized allocations per step
    // cost more in page faults than the arithmetic.
    at::Tensor input;
  };
  std::shared_ptr<Bucket> bucket(size_t index);
  // Counts the iteration on the last bucket; before start_powerSGD_iter, allreduces the bucket and
  // returns its future (else null). Refuses sparse buckets, naming `hook`.
  FuturePtr allreduce_phase(GradBucket& bucket, const char* hook);
  void add_stats(int64_t before, int64_t after);
  // A fresh random seed for Q, from random_seed's sequence (the same on every rank).
  uint64_t next_seed();

  std::shared_ptr<ProcessGroup> pg_;
  PowerSGDOptions options_;
  mutable std::mutex mutex_;
  int64_t iter_ = 0;
  bool seen_bucket_ = false, pass_counted_ = false;
  int64_t last_index_ = -1;
  int64_t numel_before_ = 0, numel_after_ = 0;
  int64_t next_report_ = 0;
  std::mt19937_64 rng_;
  std::map<size_t, std::shared_ptr<Bucket>> buckets_;
};

CommHook powerSGD_hook(std::shared_ptr<PowerSGDState> state);
// Treats the whole bucket, zero-padded, as one square matrix: far fewer, larger collectives and
// matrix products than powerSGD_hook, at the cost of a coarser approximation.
CommHook batched_powerSGD_hook(std::shared_ptr<PowerSGDState> state);

}  // namespace hooks
}  // namespace ddpkit
