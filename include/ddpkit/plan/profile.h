// What the cost model measures (include/ddpkit/plan/cost_model.h): a model's step run alone, and
// this machine's constants.
#pragma once

#include <ddpkit/plan/cost_model.h>

#include <torch/nn/module.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>

namespace ddpkit {
namespace plan {

// One replica of the model to time: its module, FSDP units, the loss of one batch (forward
// included) and the optimizer's step over its parameters.
struct ProfileTarget {
  std::shared_ptr<torch::nn::Module> module;
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  std::function<at::Tensor()> loss;
  std::function<void()> optimizer_step;
};

struct ProfileOptions {
  int warmup = 3;
  int steps = 8;
  int threads = 1;     // intra-op threads per replica
  // Replicas stepping at once while this one is timed, this one included: the caller runs the
  // others (in processes of their own, as ranks are), so compute is timed under the job's sharing
  // of cores and memory bandwidth.
  int busy_replicas = 1;
  // More steps than `steps` where they are short, so that the timed ones span this long: a few
  // milliseconds' steps are otherwise timed within one slow spell of a shared machine.
  double min_timed_ms = 1000;
  // Called between backward and the optimizer's step of every step. With
  // StepBarrier::arrive_and_wait the replicas meet where a DDP job's ranks do, at the gradients'
  // last allreduce: backward then lasts until the slowest replica's has ended, and every
  // optimizer step starts at once, as in the job.
  std::function<void()> after_backward;
};

// The replicas of a profile stepping together as a job's ranks do (ProfileOptions::after_backward):
// their optimizer steps start at once, and so, nearly, do their forwards. Memory-bound phases
// then contend with each other as they will in the job; replicas left to drift apart time those
// phases faster than the job runs them.
// A barrier in memory the processes share (an unnamed memfd, found through /proc).
class StepBarrier {
 public:
  explicit StepBarrier(int parties);                 // the timing process creates it
  explicit StepBarrier(const std::string& address);  // a busy replica joins it by address()
  ~StepBarrier();
  StepBarrier(const StepBarrier&) = delete;
  StepBarrier& operator=(const StepBarrier&) = delete;
  std::string address() const { return address_; }
  // Returns once every party has arrived; false when `stop` was set first. Throws after
  // `timeout` without the others (a replica gone: nothing waits forever).
  bool arrive_and_wait(const std::atomic<bool>* stop = nullptr,
                       std::chrono::seconds timeout = std::chrono::seconds(300));

 private:
  struct Shared;
  Shared* shared_ = nullptr;
  int fd_ = -1;
  std::string address_;
};

// Steps a replica from `make`: the medians of forward, backward and optimizer time, each
// parameter's gradient-ready time within backward, and the heap a forward leaves for backward. ModelProfile::name,
// batch and data_bytes are the caller's.
ModelProfile profile_model(const std::function<ProfileTarget()>& make, const ProfileOptions& options);

// Bytes malloc has handed out and not had back, every arena and mmapped block included.
int64_t heap_in_use();

// Times shared-memory collectives (ranks as threads), Gloo's loopback latency, copies, codecs
// and PowerSGD-shaped products on this machine. process_bytes is left 0: the CLI measures a
// training process (it knows how to start one).
MachineConstants calibrate_machine(int world_size = 2);

// Steps a replica from `make` until `stop` is set (a busy replica for profile_model's caller);
// `started` is called once the first step is done, `after_backward` (may be empty) as in
// ProfileOptions from then on.
void step_until(const std::function<ProfileTarget()>& make, int threads, const std::atomic<bool>& stop,
                const std::function<void()>& started, const std::function<void()>& after_backward = {});

}  // namespace plan
}  // namespace ddpkit
