// Online tuning of DistributedDataParallel's bucket cap and the piece size of two-phase
// collectives, during the first steps of training (Horovod's autotune of fusion size, done as
// short trials instead of a Bayesian search: a handful of candidates each).
//
// After the buckets are rebuilt in gradient-ready order, each candidate bucket cap runs for one
// settling step and `steps_per_trial` timed steps, the candidates in turn for `rounds` rounds (so a
// machine that drifts, or warms up, favours none); then, at the best cap, each candidate piece
// size the same way. A step is the time from one synchronized forward to the next on rank 0 (data loading and
// the optimizer included, the same for every candidate). Rank 0 picks the fastest by median and
// broadcasts it, so every rank takes the same layout at the same step; a candidate replaces the
// current setting only when its median beats it by `min_gain`. Results change only through the
// summation order of the reduction. See docs/plan.md ("Online tuning").
#pragma once

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace ddpkit {

class ProcessGroup;
class Reducer;

struct OnlineTuningOptions {
  // Candidate bucket caps in MiB (the configured cap is always among them). Caps that give the
  // same buckets as an earlier one are not tried again. Empty, with piece_bytes empty: no tuning.
  TORCH_ARG(std::vector<double>, bucket_caps_mb) = {};
  // Candidate piece sizes of two-phase collectives (fp16/bf16 allreduce, the int8 hook), bytes per
  // peer; the group's current piece size is always among them. Empty: not tuned.
  TORCH_ARG(std::vector<int64_t>, piece_bytes) = {};
  TORCH_ARG(int, steps_per_trial) = 3;
  TORCH_ARG(int, rounds) = 2;
  // A candidate must be this much faster (fraction of the step) than the one it replaces.
  TORCH_ARG(double, min_gain) = 0.03;
};

// What `ddpkit train --bucket-cap-mb auto` and `--piece-kb auto` try: caps of 1-64 MiB, pieces
// of 256 KiB and 4 MiB (each beside the configured value).
OnlineTuningOptions default_online_tuning(bool bucket_caps, bool pieces);

// One candidate as rank 0 timed it.
struct TuningTrial {
  double bucket_cap_mb = 0;
  int64_t piece_bytes = 0;
  size_t buckets = 0;
  double median_step_ms = 0;  // as this rank timed it (rank 0's times decide); 0: none timed
};

struct OnlineTuningResult {
  bool done = false;
  double bucket_cap_mb = 0;
  int64_t piece_bytes = 0;
  std::vector<TuningTrial> trials;
  int64_t steps = 0;  // synchronized steps spent in trials
};

// Driven by DistributedDataParallel: step() at every forward, on every rank.
class OnlineTuner {
 public:
  OnlineTuner(OnlineTuningOptions options, Reducer& reducer, ProcessGroup& pg);
  // At every forward, on every rank (collective on the steps where a choice is made).
  // `training`: grad mode is on; `synchronized`: its backward reduces gradients (not no_sync).
  void step(bool training, bool synchronized);
  const OnlineTuningResult& result() const { return result_; }
  bool done() const { return result_.done; }

 private:
  void start();
  void start_pieces_stage();
  void apply(const TuningTrial& t);  // its cap and piece size, where they differ from those in force
  void begin_trial();
  void finish_stage();
  size_t agree_on_best();

  OnlineTuningOptions options_;
  Reducer& reducer_;
  ProcessGroup& pg_;
  bool started_ = false;
  bool tuning_pieces_ = false;
  size_t stage_begin_ = 0;  // first trial of the current stage (caps, then pieces)
  size_t trial_ = 0;        // index into result_.trials
  int round_ = 0;
  int steps_in_trial_ = 0;  // synchronized forwards since the trial began
  std::vector<std::vector<double>> samples_;  // per trial: timed steps (ms)
  std::chrono::steady_clock::time_point last_;
  bool interval_clean_ = false;  // no grad-free forward (evaluation) since last_
  OnlineTuningResult result_;
};

}  // namespace ddpkit
