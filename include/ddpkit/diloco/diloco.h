// DiLoCo and Streaming DiLoCo across replica groups (arXiv 2311.08105, 2501.18512).
//
// Each replica group is a site: it trains alone for H inner steps (DDP with any hook, ZeRO or
// FSDP inside the group, its own inner optimizer), then the sites average their pseudo-gradients
// (global parameters at the last sync minus local ones) over the quorum and apply an outer
// optimizer (SGD with Nesterov momentum; its state in fp32) to the global parameters.
//
//   ft::Manager manager(group, state, options);   // DiLoCo registers its own state with it
//   diloco::DiLoCo diloco(manager, {parameters}, diloco::DiLoCoOptions().sync_every(64));
//   diloco.start();                       // the first quorum: a late or restarted site heals here
//   for (...) { loss.backward(); inner.step(); diloco.after_inner_step(); }
//   diloco.finish();                      // the fragment in flight, if any
//   manager.close();                      // the site leaves the job
//
// Streaming: with P fragments (lists of parameters), a fragment is synced every H / P inner
// steps, round robin (every site the same one: the schedule is part of state()); its average is started
// `fragment_delay` (tau) steps before it is applied, and runs while the training thread goes on.
// On applying, the fragment's parameters become lerp(global, local, fragment_alpha) (torchft's
// semantics: alpha 0 takes the global values).
//
// Failures lose no inner steps: a sync that fails (a site lost mid-average) is redone among the
// quorum's survivors with the same pseudo-gradient until it commits; each site's pseudo-gradient
// is weighted by its weight (1; 0 for a site that has just healed, which contributes nothing that
// round; a time-budgeted round weights each by its inner steps). A site that joins or comes back heals from a live one at the next sync point (global
// parameters, outer momentum, the schedule, with what TrainingState and the caller's extra carry:
// its inner optimizer, its data position) and takes part in that sync with weight 0. Sites that
// start together begin from the first site's state (the Manager's init sync). Each sync carries
// a checksum of the fragment's global parameters, and every site sees every site's: a site whose
// checksum differs from the one most sites sent is left out of that mean, and copies the others'
// state in a quorum right after it (stats().checksum_mismatches, last_checksum_mismatch).
//
// sync_every (H) is a multiple of the fragment count P; start() is itself a sync (the first
// quorum, and one exchange of weight 0 of the first fragment's size that applies no outer step).
//
// A site of several ranks: every rank makes its own Manager (over the site's group) and DiLoCo. When
// they hold the same parameters (DDP, ZeRO, PowerSGD inside the site) rank k carries the k-th 1/W
// of each pseudo-gradient across the sites and the site all-gathers the mean over its own group,
// so a site sends one copy whatever its size; under FSDP (parameters_sharded) each rank carries
// its own shards.
#pragma once

#include <ddpkit/codecs/codec.h>
#include <ddpkit/diloco/outer_allreduce.h>
#include <ddpkit/ft/manager.h>

#include <torch/arg.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit {
namespace diloco {

struct DiLoCoOptions {
  TORCH_ARG(int64_t, sync_every) = 100;  // H: inner steps between syncs of each fragment
  TORCH_ARG(double, outer_lr) = 0.7;
  TORCH_ARG(double, outer_momentum) = 0.9;
  TORCH_ARG(bool, nesterov) = true;
  // The pseudo-gradients' wire format: codecs::codec_names() (fp32, bf16, int8, int4, int2, ...).
  TORCH_ARG(std::string, codec) = "fp32";
  // Error feedback at both quantizations of the outer all-reduce: what a site's encoding of its
  // pseudo-gradient lost is added to its next one, and what an owner's encoding of the mean lost
  // to its next mean (MeanErrorFeedback), so the rounding cancels over rounds. Two float32 copies
  // of the parameters more per site, kept in site_state(). With the outer Nesterov momentum it
  // did not improve int2's loss in docs/diloco.md's runs (the momentum already averages it).
  TORCH_ARG(bool, error_feedback) = false;
  // tau: inner steps a fragment's average runs behind the training thread (< sync_every / fragments).
  TORCH_ARG(int64_t, fragment_delay) = 0;
  TORCH_ARG(double, fragment_alpha) = 0.0;  // in [0, 1]
  // Stragglers: > 0, a round lasts this many seconds (or sync_every inner steps, if sooner): each
  // site runs the inner steps it can, and its pseudo-gradient is weighted by them (Dynamic Local
  // Updates, arXiv 2401.09135), so a slow site slows no one. One fragment, no delay. In a site of
  // several ranks the round's end is one decision, rank 0's clock, broadcast over the site's group
  // after every inner step (a few microseconds over shared memory), so its ranks step alike.
  TORCH_ARG(double, round_seconds) = 0;
  // How the ranks of a site hold the fragments' parameters.
  // false (DDP, ZeRO, PowerSGD inside the site: every rank holds all of them, identical): rank k
  //   of a site of W carries the k-th 1/W of each pseudo-gradient across the sites, and the site
  //   all-gathers the mean over its own group (its fast network), so a site sends the bytes of a
  //   site of one rank whatever its W. start() checks that the ranks' parameters agree.
  // true (FSDP: each rank's parameters are its own shards): each rank carries all of its own.
  TORCH_ARG(bool, parameters_sharded) = false;
  // Pieces of the outer all-reduce, bytes per peer (set on the cross group before each sync; 0:
  // the group's own). Each piece waits a round trip for its peers, so a piece near one round
  // trip of a peer's share of the link keeps every connection busy: 256 KiB fits 100 Mbit/s x
  // 50 ms over 3 peers (bench/results/diloco-failures-goodput-2026-12-02.txt: 0.80-0.89 of the
  // link, against 0.43-0.74 at 1 MiB with 2 threads).
  // With ManagerOptions::cross_gloo_threads 4, enough pieces are in flight at once.
  TORCH_ARG(int64_t, piece_bytes) = 256 << 10;
  // Called with the Manager's step as each sync's average has been issued ("outer-issued": the
  // transfer is in flight). For tracing, and for tests that make a site die mid-sync.
  TORCH_ARG(std::function<void(const std::string& phase, int64_t step)>, on_phase) = nullptr;

 public:
  // Throws, naming the option, when these options cannot run over `fragments` fragments (DiLoCo's
  // constructor calls it; a CLI or config loader can call it first).
  void validate(int64_t fragments = 1) const;
};

struct DiLoCoStats {
  int64_t inner_steps = 0;
  int64_t syncs = 0;              // committed (the first quorum's, of weight 0 everywhere, included)
  int64_t sync_retries = 0;       // attempts redone among survivors after a failure
  int64_t heals = 0;              // times this site's state was copied from another
  // Syncs that found sites whose global parameters differed from the others' (should be 0): their
  // pseudo-gradients were left out of that mean, and they copied the others' state at once (a
  // heal; on a tie between two sites, the one of the lower replica rank is kept). Each is named in
  // last_checksum_mismatch and printed to stderr.
  int64_t checksum_mismatches = 0;
  std::string last_checksum_mismatch;
  int last_sites = 0;             // sites in the last committed sync, and those of weight > 0
  int last_sites_weighted = 0;
  double blocked_seconds = 0;     // the training thread waiting in syncs (quorum, transfer, commit)
  double longest_blocked_seconds = 0;  // the longest such wait of one sync (retries included)
  // The same over the syncs after this site's first, which waits for every site to start (or heals).
  double longest_later_blocked_seconds = 0;
  double transfer_seconds = 0;    // from issuing each average to its completion (all attempts)
  double site_gather_seconds = 0; // all-gathering the mean's shards inside the site (W > 1)
  double wait_seconds = 0;        // of blocked_seconds, waiting for averages in flight (the rest:
                                  // quorums, commits, the outer step): 1 - wait / transfer is the
                                  // share of the transfers hidden behind inner steps
  std::string last_error;         // why the last failed attempt failed
};

class DiLoCo {
 public:
  // `fragments`: the parameters each fragment holds (one list: plain DiLoCo), the tensors the
  // inner optimizer steps (float32 or lower; the same lists on every site).
  DiLoCo(ft::Manager& manager, std::vector<std::vector<at::Tensor>> fragments, DiLoCoOptions options);
  ~DiLoCo();
  DiLoCo(const DiLoCo&) = delete;
  DiLoCo& operator=(const DiLoCo&) = delete;

  // Before the first inner step: a sync of weight 0 (the first quorum); a site that starts late
  // heals in it. Collective over the replica group, like every call below.
  void start();
  // After each inner optimizer step: starts and completes fragment syncs on their schedule.
  // Returns true when it applied an outer step.
  bool after_inner_step();
  // Waits for the fragment in flight (if any) and applies it. For the end of training.
  void finish();

  // The outer state (global parameters, momentum, schedule) for a heal or a checkpoint, under
  // "diloco/"; load_state takes it back (after a heal: the local parameters become the global).
  TensorDict state() const;
  void load_state(const TensorDict& state);
  // This rank's own outer state (the error-feedback residuals of the part it carries; empty
  // without error_feedback): a checkpoint keeps it beside state(), a heal does not copy it (a
  // healed site starts with none).
  TensorDict site_state() const;
  void load_site_state(const TensorDict& state);

  // The fragments' global parameters, flattened (equal on every site after each sync).
  at::Tensor global_parameters(size_t fragment) const;
  size_t fragments() const;
  // Outer steps applied to the first fragment: the job's round count, the same on every site.
  int64_t outer_steps() const;
  const DiLoCoStats& stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A model's parameters as layers, in model order, for fragments_of. With `units` (FSDP's units, or
// the blocks a model is made of): each unit's parameters are one layer, and the parameters between
// units (embeddings, a final norm, a head) a layer per run. Without: each direct child of
// `module` is a layer, and its own parameters (if any) one before them.
std::vector<std::vector<at::Tensor>> layers_of(const torch::nn::Module& module,
                                               const std::vector<std::shared_ptr<torch::nn::Module>>& units = {});

// Splits `layers` (each a list of parameters, in model order) into `count` fragments:
// "strided" (layer i to fragment i % count, Streaming DiLoCo's choice) or "sequential" (consecutive runs).
std::vector<std::vector<at::Tensor>> fragments_of(const std::vector<std::vector<at::Tensor>>& layers, int64_t count,
                                                  const std::string& layout);

}  // namespace diloco
}  // namespace ddpkit
