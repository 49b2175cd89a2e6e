// Preemption: a signal that says "this job is about to be stopped" (Slurm's --signal=USR1@T,
// scancel's and Kubernetes' SIGTERM, a time limit) turns into one decision every rank takes at
// the same step: checkpoint there, then exit with kPreemptedExitCode so the engine runs the job
// again (requeue, restartPolicy, --max-restarts) and it resumes from that checkpoint.
//
//   ddpkit::PreemptionWatch watch;       // catches SIGTERM and SIGUSR1 from here on: early,
//   auto pg = ddpkit::init_process_group();   // so a signal during start-up is kept too
//   for (...) {
//     train_step(...);
//     if (watch.stop_now(pg.get())) { save_checkpoint(step); return ddpkit::kPreemptedExitCode; }
//   }
#pragma once

#include <ddpkit/comm/process_group.h>

#include <signal.h>

#include <memory>
#include <vector>

namespace ddpkit {

// 128 + SIGTERM: what a process ended by SIGTERM reports, which the engines already read as
// "stopped, may run again" (Kubeflow's restartPolicy ExitCode retries 128-255; 1-127 are
// permanent errors there). docs/launching.md.
constexpr int kPreemptedExitCode = 143;

class PreemptionWatch {
 public:
  // Catches `signals` (default SIGTERM and SIGUSR1) for this process until destroyed, when the
  // previous dispositions come back. One watch at a time per process.
  explicit PreemptionWatch(std::vector<int> signals = {});
  ~PreemptionWatch();
  PreemptionWatch(const PreemptionWatch&) = delete;
  PreemptionWatch& operator=(const PreemptionWatch&) = delete;

  // Collective (every rank calls it at the same step): true on every rank when any rank has
  // received one of the signals. One allreduce of one integer.
  // `pg` null: this process alone decides.
  bool stop_now(ProcessGroup* pg);
  // The signal this process received (0 if none, or only another rank did).
  int received() const;

 private:
  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
};

}  // namespace ddpkit
