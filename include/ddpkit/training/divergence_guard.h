// Stops a run whose loss has turned NaN/Inf or exploded, on every rank at the same step: a lossy
// hook at a bad setting otherwise trains on silently to a useless model.
//
//   ddpkit::DivergenceGuard guard(pg);
//   for (...) {
//     ... loss.backward(); optimizer.step();
//     if (auto d = guard.observe(loss.item<double>())) throw std::runtime_error(d->what);
//   }
#pragma once

#include <ddpkit/comm/process_group.h>

#include <torch/arg.h>

#include <limits>
#include <memory>
#include <optional>
#include <string>

namespace ddpkit {

struct DivergenceGuardOptions {
  // Steps per check. Each check is one allreduce of three doubles, so every rank decides alike.
  TORCH_ARG(int64_t, window) = 20;
  // Diverged: a window's mean loss (over all ranks) above this multiple of the lowest window mean
  // so far. Windows of thousands of samples do not triple while training works.
  TORCH_ARG(double, explode_factor) = 3.0;
  // ... and above this fraction of the first window's mean: a loss near zero triples on noise
  // alone (0.03 to 0.1 on a fitted training set) with nothing wrong.
  TORCH_ARG(double, explode_floor) = 0.5;
  // Diverged: a later window's mean above this multiple of the first window's, i.e. the run has
  // lost everything it learned (a lossy hook at too low a rank can leave the loss at chance).
  TORCH_ARG(double, regress_factor) = 1.25;
};

struct Divergence {
  int64_t step = 0;  // the last step (0-based) of the window that tripped the guard
  std::string what;  // e.g. "the loss became NaN or Inf (steps 320-339)"
};

class DivergenceGuard {
 public:
  // pg: the ranks that train together (null or size 1: this process alone).
  explicit DivergenceGuard(std::shared_ptr<ProcessGroup> pg = nullptr, DivergenceGuardOptions options = {});

  // Call once per step on every rank with this rank's loss. Returns the divergence (the same on
  // every rank, at the same step) or nothing.
  std::optional<Divergence> observe(double loss);

  // What a resumed run carries on from (each rank's checkpoint holds its own): the steps observed,
  // the first window's mean (where training started), the lowest window mean so far, and this
  // rank's part of the window under way. Without it a resumed, well-trained run's first window
  // became "where training started", and a loss of 0.005 that moved to 0.007 on noise read as
  // everything learned lost.
  struct History {
    int64_t steps = 0;
    double first_window_mean = -1;
    double best_window_mean = std::numeric_limits<double>::infinity();
    int64_t best_window_end = -1;
    double window_sum = 0, window_count = 0, window_nonfinite = 0;
  };
  History history() const;
  void restore(const History& h);

 private:
  std::shared_ptr<ProcessGroup> pg_;
  DivergenceGuardOptions options_;
  int64_t step_ = 0;
  double sum_ = 0;
  double count_ = 0;
  double nonfinite_ = 0;
  double first_ = -1;  // the first window's mean
  double best_ = std::numeric_limits<double>::infinity();
  int64_t best_end_ = -1;
};

}  // namespace ddpkit
