// int8 communication hooks.
//
// quantization_pertensor_hook / quantization_perchannel_hook reproduce PyTorch's
// ddp_comm_hooks.quantization_hooks (uint8, MinMaxObserver scale and zero point, channels of
// `bucket_size` elements) on any device; PyTorch's run only on CUDA. Like PyTorch's they gather
// every rank's quantized bucket, so each rank receives (n-1) buckets: use them for parity. The
// parameters come from the whole bucket, as PyTorch's, but the codes travel in blocks of about
// ProcessGroupOptions::piece_bytes (whole channels, or a column range of the one per-tensor row),
// one allgather each: block k+1 is quantized while block k travels and k is decoded as it lands.
// The result is PyTorch's whole-bucket arithmetic bit for bit.
//
// int8_allreduce_hook scales: it reduce-scatters quantized chunks with an alltoall (each rank
// dequantizes, sums and requantizes its chunk), then all-gathers the quantized results, so each
// rank sends and receives 2(n-1)/n of the int8 bucket whatever the world size (a quarter of the
// fp32 allreduce). Every rank decodes the same bytes, so results are bit-identical across ranks.
// Error bound (per element, blocks of `block` elements, world n):
//   |result - mean_r g_r| <= (1/n) sum_r max_block|g_r| / 254 + max_block|mean| / 254
// plus fp32 rounding. With error_feedback, each rank adds its previous quantization error to the
// next gradient (and the chunk owner its requantization error), so no gradient is lost over time.
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/hooks/hook_state.h>
#include <ddpkit/reducer/grad_bucket.h>

#include <torch/arg.h>

#include <memory>

namespace ddpkit {
namespace hooks {

CommHook quantization_pertensor_hook(std::shared_ptr<ProcessGroup> pg);
CommHook quantization_perchannel_hook(std::shared_ptr<ProcessGroup> pg, int64_t bucket_size = 512);

struct Int8Options {
  // Elements per quantization block (one float32 scale each: 0.8% overhead at 512).
  TORCH_ARG(int64_t, block) = 512;
  TORCH_ARG(bool, error_feedback) = false;
};
// The int8 hook's buffers and, with error_feedback, its per-bucket error memory.
class Int8State : public HookState {
 public:
  Int8State(std::shared_ptr<ProcessGroup> pg, Int8Options options = {});
  // Each bucket's error feedback (empty without error_feedback).
  TensorDict state_dict() const override;
  void load_state_dict(const TensorDict& state) override;

 private:
  friend CommHook int8_allreduce_hook(std::shared_ptr<Int8State> state);
  class Impl;
  std::shared_ptr<Impl> impl_;
};
CommHook int8_allreduce_hook(std::shared_ptr<Int8State> state);
CommHook int8_allreduce_hook(std::shared_ptr<ProcessGroup> pg, Int8Options options = {});

}  // namespace hooks
}  // namespace ddpkit
