// What `ddpkit train` builds for one rank, shared by the plain loop (train.cpp) and the
// fault-tolerant one (train_ft.cpp).
#pragma once

#include <ddpkit/training/divergence_guard.h>

#include "train_flags.h"
#include "training.h"

#include <ddpkit/ddpkit.h>
#include <ddpkit/hooks/post_local_sgd_hook.h>
#include <ddpkit/training/checkpoint.h>

#include <functional>
#include <memory>
#include <vector>

namespace ddpkit {
namespace cli {

// Everything one rank trains with: the model wrapped for its strategy, the optimizer (or ZeRO),
// and the checkpointable state.
struct Training {
  Model model;
  std::unique_ptr<FullyShardedDataParallelBase> sharded_model;
  std::unique_ptr<DistributedDataParallelBase> ddp;
  std::unique_ptr<hooks::PeriodicModelAverager> averager;
  std::shared_ptr<ZeroRedundancyOptimizer> zero;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  OptimizerChoice optimizer_choice;
  std::vector<at::Tensor> params;  // what the optimizer steps: the parameters, or FSDP's shards of them
  std::function<at::Tensor(const at::Tensor&)> forward;
  TrainingState state;
};


// This rank's process group, from the torchrun-style environment and the flags.
std::shared_ptr<ProcessGroup> join_group(const Flags& f, const TrainFlags& t);
// The model wrapped for the flags' strategy (DDP and its hook, ZeRO or FSDP) over `pg`, the
// optimizer, and the state a checkpoint or a heal holds. run.model must be built already.
void build_training(const Flags& f, const TrainFlags& t, const std::shared_ptr<ProcessGroup>& pg, Training& run);
// The data, the model and build_training, from --seed first: every rank (and every replica
// group) starts from the same parameters.
RunData build_rank(const Flags& f, const TrainFlags& t, const std::shared_ptr<ProcessGroup>& pg, Training& run);

// A rank's share of `n_train` samples split `data_world` ways, in --batch-size steps per epoch, and
// the steps the run takes (--steps, else --epochs of them). UsageError when a batch exceeds the share.
struct Schedule {
  int64_t per_rank = 0, steps_per_epoch = 0, total_steps = 0;
};
Schedule schedule_for(int64_t n_train, int data_world, const TrainFlags& t);

// Checkpoints (--checkpoint-dir): the flags a checkpoint must be resumed under (not those of how
// the job is run: ranks, replica groups, timeouts), what a checkpoint's `extra` holds, and where
// --resume starts: the newest checkpoint's global sample position over `data_world` ranks'
// batches (another world size or replica count: rounded down to a whole step). Collective over pg.
std::vector<std::string> checkpoint_settings(const Flags& f);
TensorDict checkpoint_extra(const std::vector<std::string>& settings, int64_t epoch, int64_t samples_in_epoch);
struct StartPoint {
  int64_t step = 0, epoch = 0, in_epoch = 0, resumed_from = -1;
  at::Tensor divergence_guard;  // the guard's history (guard_history_entry), undefined when none
  TensorDict common;            // the checkpoint's common entries (extras under "extra/")
  TensorDict local;             // and this rank's own
};
// DivergenceGuard's history as a checkpoint entry, and back.
at::Tensor guard_history_entry(const DivergenceGuard::History& h);
DivergenceGuard::History guard_history_of(const at::Tensor& entry);
StartPoint resume_point(const Flags& f, const TrainFlags& t, Training& run, ProcessGroup* pg,
                        const std::vector<std::string>& settings, int64_t steps_per_epoch, int data_world);

// `ddpkit train --fault-tolerant` (train_ft.cpp): the launcher of replica groups, or one rank of one.
int run_fault_tolerant(const Flags& f, const TrainFlags& t, const std::vector<std::string>& argv);
// One rank of one replica group under --diloco (train_diloco.cpp).
int run_diloco_rank(const Flags& f, const TrainFlags& t);

}  // namespace cli
}  // namespace ddpkit
