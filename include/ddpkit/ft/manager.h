// Fault-tolerant training across replica groups: the per-step commit protocol.
//
// Every rank of every replica group makes one Manager over its own group's process group. Each
// step:
//
//   manager.start_step();                  // asks for the quorum and returns (QuorumMode::kAsync)
//   loss = train forward and backward;     // DDP / ZeRO / FSDP inside the group, as usual
//   manager.allreduce(grads);              // average across the groups of the quorum (DDP: set
//                                          //   cross_group_reduction() instead; it overlaps)
//   if (manager.should_commit())           // collective over the group: did every rank succeed?
//     optimizer.step();                    // (manager.step() has advanced)
//
// A replica group that dies (any of its ranks) is out of the quorum as soon as its heartbeats
// stop; a survivor blocked in the cross-group allreduce with it is released at once (the
// collective is aborted), does not commit that step, and the next quorum goes on without the lost
// group. A group that starts late, or restarts, joins at the next quorum and first copies the
// state the step depends on (TrainingState::snapshot) from a live group, rank by matching rank:
// no checkpoint is read. A group that did not commit a step the others did heals the same way, so
// the live replicas are identical after every step.
//
// The quorum is asynchronous by default (QuorumMode::kAsync, as torchft's async quorum, but safe
// under FSDP): start_step asks for it on a thread of its own and returns; forward and backward run
// meanwhile, and the step's first cross-group collective (DDP's first bucket crossing, allreduce,
// cross_group) waits for it. The cross-group process group of a new membership is made on that
// thread too. A group that must heal trains that step on the state it has, adds zeros to the
// step's cross-group sums (which every group divides by the groups that add their own, not by the
// quorum's size), copies the source's state on a thread of its own while it trains, and loads it in
// should_commit, before its optimizer step (which then applies the average of the others). The
// source never waits for it: at its next step boundary (its next start_step, when nothing in
// forward, a reshard or an optimizer step is changing the state) it copies its state once and
// serves that snapshot on the state service's threads until the healers have read it or are lost.
// A heal therefore lands one step after the quorum that names it: the healing group's should_commit
// returns false for the step in between (docs/fault_tolerance.md draws one step). A group asking to
// copy its state anyway (its first quorum under init_sync, request_heal) waits for its quorum in
// start_step, and so do the groups that start a job together: they copy the first group's state
// before their first forward, as under QuorumMode::kSync. Every group of a job takes one mode.
// kSync: start_step waits for the quorum, and a source serves its live tensors, holding its
// start_step until its healers have read them.
//
// Groups start from one group's state (init_sync, on by default, as torchft's): at a group's first
// quorum it copies the state from a group already running at the quorum's step or, when all of
// them start together, from the first by group id (which copies nothing). So groups seeded
// differently (separate jobs that each call manual_seed(site)) still train one model.
//
// After its last step each rank calls close(): its group leaves the quorums at once, and once
// every group has left, the job is finished: a group lost before the end and started again after
// it is refused with JobFinished instead of training on alone from its own old state.
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/ft/lighthouse.h>
#include <ddpkit/reducer/reducer.h>
#include <ddpkit/training/checkpoint.h>

#include <torch/arg.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit {
namespace ft {

// How start_step takes the quorum (see the top of this file).
enum class QuorumMode {
  kAsync,  // asked on a thread of its own while forward and backward run; heals overlap the step
  kSync,   // start_step waits for the quorum and any heal
};

struct ManagerOptions {
  TORCH_ARG(std::string, lighthouse) = "";  // host:port
  // This replica group's id: 1-128 characters of [A-Za-z0-9_.-], the same on its every rank.
  TORCH_ARG(std::string, group_id) = "";
  // For the lighthouse and the state services (a healing rank presents it to its source).
  TORCH_ARG(std::string, token) = "";
  TORCH_ARG(TlsFiles, lighthouse_tls) = {};  // root_certificate set: TLS to the lighthouse
  // How long start_step() waits for a quorum before failing (fewer live groups than the
  // lighthouse's min_replicas: the error names the live and the lost groups).
  TORCH_ARG(std::chrono::milliseconds, quorum_timeout) = std::chrono::seconds(60);
  TORCH_ARG(std::chrono::milliseconds, heartbeat_interval) = std::chrono::milliseconds(100);
  // The cross-group process groups' rendezvous and collective timeout (a lost group's heartbeat
  // releases a collective sooner).
  TORCH_ARG(std::chrono::milliseconds, cross_group_timeout) = std::chrono::seconds(30);
  // Gloo worker threads of the cross-group process groups (collectives in flight at once across
  // the groups); 0: the replica group's. Over a long round trip more in flight fill the link
  // (DiLoCo's outer all-reduce: `ddpkit train --diloco` takes 4).
  TORCH_ARG(int, cross_gloo_threads) = 0;
  // The cross-group process groups connect a pair of groups when a collective first needs it
  // (ProcessGroupOptions::lazy_connections), not all pairs when a quorum changes: at tens of
  // groups or sites a new quorum's group is ready in milliseconds instead of a full mesh's
  // seconds, and a small all-reduce is a tree (bench/cross_group_sites.cpp, docs/scale.md).
  // Off: Gloo's full mesh, whose collectives overlap (DDP's buckets across 2-8 groups).
  TORCH_ARG(bool, cross_lazy_connections) = false;
  // The address this rank's state service listens on, as the other groups reach it; empty: this
  // host's address on the route to the lighthouse (127.0.0.1 when the lighthouse is on loopback).
  TORCH_ARG(std::string, state_host) = "";
  // Connections of a heal's pair group, which its 4 MiB pieces take in turn. One TCP stream
  // fills a link unless the network caps each flow below it (as clouds do); each connection
  // costs Gloo a rendezvous of its own when the group is made (docs/fault_tolerance.md).
  TORCH_ARG(int, heal_connections) = 1;
  // Copy the state at this group's first quorum from another group at the quorum's step (see the
  // top of this file); false: the groups must start equal by construction (the same seed). A group
  // that resumed from a checkpoint (restore_checkpoint, resume_at) keeps its own: it is the job's
  // state already (a DiLoCo site's own inner model, say).
  TORCH_ARG(bool, init_sync) = true;
  // How start_step takes the quorum; every group of a job must take the same.
  TORCH_ARG(QuorumMode, quorum_mode) = QuorumMode::kAsync;
  // Called at each point of the protocol with the step: "quorum" (a quorum received),
  // "rendezvous" (the cross-group process group of a new membership about to be made),
  // "heal-publish" (this rank, a heal source, published its state), "heal-fetched" (this rank
  // copied a source's state, not yet loaded), "crossing" (the first bucket's cross-group
  // collective issued). For tracing, and for tests that make a process die at one of them
  // (`ddpkit train` reads DDPKIT_FT_FAULT).
  TORCH_ARG(std::function<void(const std::string& phase, int64_t step)>, on_phase) = nullptr;
};

// What a state registered with Manager::register_state is, which decides where it goes.
enum class StateScope {
  // The same on every rank of every group (the model and optimizer under DDP, DiLoCo's outer
  // state, the data position): a heal copies it, a checkpoint keeps one copy.
  kShared,
  // The same across groups rank by matching rank, each rank holding its own part (FSDP's shards,
  // a ZeRO partition, DiLoCo's outer state under FSDP): a heal copies it, a checkpoint keeps each rank's.
  kSharedPerRank,
  // This rank's (or site's) own (error-feedback residuals): a checkpoint keeps it per rank, a heal
  // never copies it (a healed rank starts with none).
  kLocal,
};
using SaveState = std::function<TensorDict()>;
using LoadState = std::function<void(const TensorDict&)>;

struct ManagerStats {
  int64_t quorums = 0;           // quorums taken part in
  int64_t reconfigurations = 0;  // cross-group process groups built (a group alone builds none)
  double reconfiguration_seconds = 0;       // building them (rendezvous over the lighthouse's store)
  double longest_reconfiguration_seconds = 0;
  int64_t heals = 0;             // times this rank copied its state from a peer: behind the quorum, or
                                 // asked to (request_heal: its state differed); not the first quorum's
  int64_t init_syncs = 0;        // 1 once the first quorum copied this rank's state from another group (init_sync)
  int64_t heal_bytes = 0;        // all copies, the init sync's included
  double heal_seconds = 0;       // fetch and load, all copies
  double heal_fetch_seconds = 0; // of which copying the bytes (kSync: waiting for the source included;
                                 // kAsync: not the wait for its step boundary, during which this group trains)
  double serve_seconds = 0;      // as a source: serving its state until the healers released it
  int64_t heals_single_copy = 0; // heals read from the source's memory (same host)
  std::string heal_route;        // how the last heal was read: "process_vm_readv", or the pair
                                 // group's transport ("gloo", "shared memory (single copy refused: ...)")
  int64_t steps_committed = 0;
  int64_t steps_not_committed = 0;   // failed steps (a lost group, an aborted collective, fail_step)
  int64_t steps_healing = 0;         // steps trained on a state being replaced by a heal (kAsync):
                                     // zeros added across the groups, should_commit false; not failures
  double quorum_wait_seconds = 0;    // the steps' waits for their quorum (kAsync: at the first
                                     // cross-group collective or should_commit; kSync: in start_step)
  double snapshot_seconds = 0;       // as a source (kAsync): copying the state it serves, at a step boundary
  std::string last_error;        // why the last step did not commit
  std::string cross_transport;   // what the last cross-group process group runs on
  // Bytes this rank sent to the other groups through its cross-group process groups (network
  // and shared memory, as their transports count them: CommStats), all quorums so far.
  uint64_t cross_bytes_sent = 0;
};

class Manager {
 public:
  // Collective over `group`: starts this rank's state service and heartbeats. `state` says what a
  // heal copies of the model, optimizer, DDP and hook; register_state adds the loop's own.
  Manager(std::shared_ptr<ProcessGroup> group, TrainingState& state, ManagerOptions options);
  // No TrainingState: everything a heal copies is registered with register_state (the Python
  // API's Manager: the module's and optimizer's state_dict()). A heal still copies the CPU generator.
  Manager(std::shared_ptr<ProcessGroup> group, ManagerOptions options);
  // Deprecated: register_state("key", save, load) replaces `extra` / `load_extra`, and needs no
  // object to exist before the Manager (this form keeps working for one release).
  [[deprecated("pass the loop's own state with Manager::register_state(key, save, load, scope)")]]
  Manager(std::shared_ptr<ProcessGroup> group, TrainingState& state, ManagerOptions options,
          std::function<TensorDict()> extra, std::function<void(const TensorDict&)> load_extra = nullptr);
  ~Manager();  // as close(), except that the group does not leave (it may be unwinding from a failure)
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;

  // Collective over the group: joins the quorum for the next step (rebuilding the cross-group
  // process group when the participants changed); a group behind heals (see the top of this file:
  // under kAsync the quorum, the rebuild and the heal go on while the step runs).
  void start_step();
  // This step in `mode` whatever the options say: DiLoCo takes its syncs' quorums with kSync, as
  // it weighs a site's pseudo-gradient by whether the site healed in the quorum.
  void start_step(QuorumMode mode);
  // DDP's gradients averaged across the groups of the quorum bucket by bucket, while backward goes
  // on: register it with ddp.reducer().set_cross_replica_reduction(...) before the first
  // start_step, passing DDP's parameters (float32 ones get a staging area in shared memory on one
  // host, allocated with each cross-group process group; in groups of one rank their gradients are
  // born in that group's shared memory and summed where they lie), and do not also call allreduce() for
  // those gradients. Each bucket is reduced inside the group
  // first (DDP's allreduce or its comm hook), then across. Every group must have the same buckets:
  // the same model and bucket cap (a heal copies the source's layout). A crossing that fails marks
  // the step, as allreduce() does.
  CrossReplicaReduction cross_group_reduction(const std::vector<at::Tensor>& parameters);
  // Averages `tensors` (CPU) across the replica groups of the quorum, in place. A failure (a lost
  // group, an aborted collective) leaves them as they were and marks the step not to commit.
  void allreduce(const std::vector<at::Tensor>& tensors);
  // Collective over the group: true when every rank's step succeeded, and then step() advances.
  // Waits for the step's quorum if nothing did yet, and loads a heal due this step (kAsync). False
  // also while this group is healing (stats().steps_healing): skip the optimizer step then.
  bool should_commit();
  // This step's process group across the quorum's groups (this rank and the matching rank of
  // each), for a caller's own cross-group collectives (DiLoCo's outer average); null when this
  // group is alone in the quorum or the step has already failed. A collective on it that fails
  // must be reported with fail_step, which keeps the step from committing. Under kAsync it waits
  // for the step's quorum, and a group healing this step is in it too: average gradients with
  // allreduce (which adds its zeros and divides by the contributors), not with a mean of your own.
  std::shared_ptr<ProcessGroup> cross_group();
  void fail_step(const std::string& why);
  // This group's state differs from the others' (a check found it: DiLoCo's checksums): its next
  // start_step copies the state from a group at the quorum's step that did not ask, as a group
  // behind does. Call it on every rank of the group.
  void request_heal(const std::string& why);

  // After the last step, on every rank: the group leaves the quorums at once (rank 0 tells the
  // lighthouse; the others are not held for its heartbeat timeout), and heartbeats, the state
  // service and the cross-group process groups are stopped and freed, and the registered state's
  // callbacks dropped, before it returns. When
  // every group of the last quorum has left, the job is finished (JobFinished for a group of it
  // lost before the end asking later from an older step). Nothing else may be called after it; calling it again does nothing.
  // `leave` false: the same teardown for a group that stops on a failure (an exception unwinding
  // its loop): it does not leave, so the others see it lost and it may come back.
  void close(bool leave = true);

  // The loop's own state, beside TrainingState's: `save` gives its tensors (CPU; shared with the
  // live state is fine, a heal source holds still until read), `load` takes back what a save gave
  // on a matching rank. Called back only when a heal or a checkpoint needs them, so any object may
  // register at any time before it is needed (DiLoCo registers itself, as "diloco" and
  // "diloco_site"). Loaded in the order registered, after TrainingState. `key`: no '/'.
  void register_state(const std::string& key, SaveState save, LoadState load, StateScope scope = StateScope::kShared);
  void unregister_state(const std::string& key);
  // Collective over the group: TrainingState's checkpoint (save_checkpoint, DIR/checkpoint-<step>)
  // with every registered state and this Manager's step; keeps the newest `keep`. Which rank writes
  // is the caller's choice: replicas that are equal (DDP across groups) need one group to write
  // (replica_rank() == 0); DiLoCo sites differ, each writes its own directory.
  std::string save_checkpoint(const std::string& dir, int keep = 3);
  // Collective: the newest checkpoint in `dir` into TrainingState and the registered state, and
  // resume_at its step (before the first start_step). Returns that step, or -1 when `dir` has none.
  int64_t restore_checkpoint(const std::string& dir);
  // The registered state as a checkpoint holds it (`common`: kShared; `local`: the others), and
  // back, for a loop that writes its own checkpoints (TrainingState::save's extras).
  void checkpoint_state(TensorDict* common, TensorDict* local) const;
  void load_checkpoint_state(const TensorDict& common, const TensorDict& local);

  int64_t step() const { return step_; }
  // This rank starts at `step` committed steps (its state loaded from a checkpoint of that step):
  // before the first start_step, on every rank of the group. The quorum takes the highest step
  // of its groups; a group behind it heals.
  void resume_at(int64_t step);
  // The current quorum (these wait for the step's, under kAsync).
  int replica_rank() const;   // in the current quorum
  int replica_count() const;  // groups in the current quorum
  const Quorum& quorum() const;
  const ManagerStats& stats() const;  // cross_bytes_sent as of this call
  const std::string& group_id() const;
  // The replica group's own process group (the one the Manager was made over): its ranks' fast network.
  const std::shared_ptr<ProcessGroup>& group() const;

 private:
  Manager(std::shared_ptr<ProcessGroup> group, TrainingState* state, ManagerOptions options,
          std::function<TensorDict()> extra, std::function<void(const TensorDict&)> load_extra);
  // This rank's state from the matching rank of participant `source`; false with `why` on failure.
  bool copy_state_from(int source, std::string* why);
  void start_step_sync();

  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t step_ = 0;
  Quorum quorum_;
  mutable ManagerStats stats_;  // stats() brings cross_bytes_sent up to date
};

}  // namespace ft
}  // namespace ddpkit
