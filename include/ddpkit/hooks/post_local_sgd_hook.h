// Post-local SGD (Lin et al., ICLR 2020): global gradient allreduce for a warm-up, then local SGD
// (gradients allreduced within a subgroup, or not at all), with a PeriodicModelAverager that
// averages the parameters over the whole group every `period` steps.
//
//   auto state = std::make_shared<PostLocalSGDState>(pg, /*subgroup=*/nullptr, /*start=*/100);
//   ddp.register_comm_hook(post_localSGD_hook(state), "post_localSGD");
//   PeriodicModelAverager averager(/*period=*/4, /*warmup_steps=*/100, pg);
//   ... loss.backward(); optimizer.step(); averager.average_parameters(model->parameters());
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/hooks/hook_state.h>
#include <ddpkit/reducer/grad_bucket.h>

#include <memory>
#include <mutex>
#include <vector>

namespace ddpkit {
namespace hooks {

class PostLocalSGDState : public HookState {
 public:
  // subgroup: where gradients are allreduced after start_localSGD_iter (e.g. new_subgroups(*pg,
  // ranks_per_host)); nullptr: no gradient communication then (pure local SGD).
  PostLocalSGDState(std::shared_ptr<ProcessGroup> pg, std::shared_ptr<ProcessGroup> subgroup,
                    int64_t start_localSGD_iter);
  int64_t iteration() const;
  TensorDict state_dict() const override;  // the iteration counter
  void load_state_dict(const TensorDict& state) override;

 private:
  friend CommHook post_localSGD_hook(std::shared_ptr<PostLocalSGDState> state);
  std::shared_ptr<ProcessGroup> pg_, subgroup_;
  int64_t start_;
  mutable std::mutex mutex_;
  int64_t iter_ = 0;
};

CommHook post_localSGD_hook(std::shared_ptr<PostLocalSGDState> state);

// Averages parameters across `pg` on step warmup_steps, warmup_steps + period, ... of its own step
// counter (one average_parameters call = one step). Call it on every rank after the optimizer.
class PeriodicModelAverager {
 public:
  PeriodicModelAverager(int64_t period, int64_t warmup_steps, std::shared_ptr<ProcessGroup> pg);
  // Returns true if it averaged on this call.
  bool average_parameters(const std::vector<at::Tensor>& params);
  int64_t step() const { return step_; }
  // For resuming from a checkpoint: the step counter it held then.
  void set_step(int64_t step);

 private:
  int64_t period_, warmup_;
  std::shared_ptr<ProcessGroup> pg_;
  int64_t step_ = 0;
  // The flat buffers, one per dtype, kept from one average to the next: a fresh one per average
  // grew a 2-rank job's heap by about 3 parameter sizes over a few dozen averages.
  std::vector<at::Tensor> flat_;
};

// Averages `params` across `pg` in place (one flattened allreduce per dtype), blocking. `flat`,
// if given, keeps the flat buffers between calls (reused while the sizes match).
void average_parameters(const std::vector<at::Tensor>& params, ProcessGroup& pg,
                        std::vector<at::Tensor>* flat = nullptr);

}  // namespace hooks
}  // namespace ddpkit
