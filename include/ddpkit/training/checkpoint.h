// Training checkpoints that resume a run bit for bit.
//
// One file per checkpoint, `DIR/checkpoint-<step>.ddpk`: rank 0 gathers every rank's own state
// (hook error feedback, and the replicas themselves when they differ, as under post-local SGD),
// writes the file to a temporary name, fsyncs it and renames it, so a checkpoint that exists is
// complete whatever moment the job died at. Rank 0 reads it back and broadcasts it, so only rank 0
// needs the directory (no shared file system across hosts).
//
//   ddpkit::TrainingState state;
//   state.module(model).optimizer(&sgd).ddp(&ddp).hook_state(built.state);
//   if (auto ck = state.restore(pg.get(), dir)) step = ck->step;   // collective
//   for (...; ++step) {
//     ... train one step ...
//     if (step % 100 == 0) state.save(pg.get(), dir, step);           // collective
//   }
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/hooks/hook_state.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ddpkit {

class DistributedDataParallelBase;
class FullyShardedDataParallelBase;
class ZeroRedundancyOptimizer;

// Named CPU tensors <-> bytes with a checksum. decode_tensors checks every length, dtype and the
// checksum, naming `what` and the first thing wrong; it never reads past `bytes`.
std::string encode_tensors(const TensorDict& dict);
// The dtypes encode_tensors stores (and a heal copies).
bool storable_dtype(at::ScalarType type);
TensorDict decode_tensors(const std::string& bytes, const std::string& what);

// The entries of `entries` whose names start with `prefix`, the prefix removed: a Checkpoint's
// extras are entries_under(ck.common, "extra/") (and of ck.local).
TensorDict entries_under(const TensorDict& entries, const std::string& prefix);

struct Checkpoint {
  int64_t step = 0;
  int world_size = 0;  // of the run that wrote it
  std::string path;
  TensorDict common;   // the same on every rank
  TensorDict local;    // this rank's own; empty when the world size differs from the writer's
};

// Complete checkpoints in `dir`, newest (highest step) first.
std::vector<std::string> list_checkpoints(const std::string& dir);

// Collective over `pg` (null: one process). Rank 0 writes `common` and every rank's `local` as
// DIR/checkpoint-<step>.ddpk (creating DIR), atomically, then removes all but the newest `keep`.
// A failure to write is an error on every rank. Returns the path.
std::string save_checkpoint(ProcessGroup* pg, const std::string& dir, int64_t step, const TensorDict& common,
                            const TensorDict& local, int keep = 3);
// Collective: the newest checkpoint in `dir` that reads back whole (a damaged one is skipped with a
// warning on stderr), or nullopt when there is none.
std::optional<Checkpoint> load_latest_checkpoint(ProcessGroup* pg, const std::string& dir);

// What a DDP training loop must save to resume bit for bit: the model (parameters and buffers), a
// plain optimizer or a ZeroRedundancyOptimizer (consolidated on rank 0: it reloads under any world
// size), DDP's bucket layout, the comm hook's state, and the default CPU generator. The loop's own
// position (step, epoch, data order) goes in `extra`.
class TrainingState {
 public:
  TrainingState& module(std::shared_ptr<torch::nn::Module> module);
  TrainingState& optimizer(torch::optim::Optimizer* optimizer);
  TrainingState& zero(std::shared_ptr<ZeroRedundancyOptimizer> zero);
  TrainingState& ddp(DistributedDataParallelBase* ddp);
  // FSDP: the model's full state (gathered on rank 0) and the optimizer's state gathered per unit
  // (SGD, Adam, AdamW), so the checkpoint reloads at any world size. Give the optimizer over the
  // shards with optimizer(), and no module().
  TrainingState& fsdp(FullyShardedDataParallelBase* fsdp);
  TrainingState& hook_state(std::shared_ptr<hooks::HookState> state);
  // Each rank's model and optimizer are its own (post-local SGD between averages): save them per rank.
  TrainingState& replicas_differ(bool differ);

  // Collective. `extra` entries are stored as they are, under "extra/".
  std::string save(ProcessGroup* pg, const std::string& dir, int64_t step, const TensorDict& extra = {},
                   const TensorDict& extra_local = {}, int keep = 3);
  // Collective: loads the newest checkpoint into every part registered above and returns it (its
  // `common`/`local` hold the extras, under "extra/"), or nullopt when `dir` has none. Under another
  // world size the per-rank state (hook state; replicas under replicas_differ) is left as it is.
  std::optional<Checkpoint> restore(ProcessGroup* pg, const std::string& dir);

  // This rank's whole state as the matching rank of an identical replica needs it (a heal in
  // fault-tolerant training, ddpkit/ft): the model (FSDP: this rank's shards), the optimizer
  // (ZeRO: this rank's partition), the bucket layout, the hook state and the CPU generator. Not
  // collective: nothing is gathered. `extra` entries are stored under "extra/". The tensors share
  // storage with the live state: encode (encode_tensors) or copy them before the next step.
  TensorDict snapshot(const TensorDict& extra = {}) const;
  // Loads what snapshot() returned on the matching rank of a replica built the same way; returns
  // its extras (without the prefix). `what` names the source in errors.
  TensorDict load_snapshot(const TensorDict& snapshot, const std::string& what);

 private:
  std::shared_ptr<torch::nn::Module> module_;
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::shared_ptr<ZeroRedundancyOptimizer> zero_;
  DistributedDataParallelBase* ddp_ = nullptr;
  FullyShardedDataParallelBase* fsdp_ = nullptr;
  std::shared_ptr<hooks::HookState> hook_state_;
  bool replicas_differ_ = false;
};

}  // namespace ddpkit
