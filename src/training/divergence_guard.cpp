#include <ddpkit/training/divergence_guard.h>

#include <ddpkit/error.h>

#include <cmath>
#include <iomanip>
#include <sstream>

namespace ddpkit {

DivergenceGuard::DivergenceGuard(std::shared_ptr<ProcessGroup> pg, DivergenceGuardOptions options)
    : pg_(std::move(pg)), options_(std::move(options)) {
  DDPKIT_CHECK(options_.window() >= 1, "DivergenceGuard: window must be >= 1, got ", options_.window());
  DDPKIT_CHECK(options_.explode_factor() > 1, "DivergenceGuard: explode_factor must be > 1, got ",
               options_.explode_factor());
  DDPKIT_CHECK(options_.explode_floor() >= 0, "DivergenceGuard: explode_floor must be >= 0, got ",
               options_.explode_floor());
  DDPKIT_CHECK(options_.regress_factor() > 1, "DivergenceGuard: regress_factor must be > 1, got ",
               options_.regress_factor());
}

std::optional<Divergence> DivergenceGuard::observe(double loss) {
  const int64_t step = step_++;
  if (std::isfinite(loss)) {
    sum_ += loss;
    count_ += 1;
  } else {
    nonfinite_ += 1;
  }
  if (step_ % options_.window() != 0) return std::nullopt;

  double totals[3] = {sum_, count_, nonfinite_};
  if (pg_ && pg_->size() > 1) {
    at::Tensor t = at::tensor({sum_, count_, nonfinite_}, at::kDouble);
    ProcessGroup::wait(pg_->allreduce(t));
    for (int i = 0; i < 3; ++i) totals[i] = t[i].item<double>();
  }
  sum_ = count_ = nonfinite_ = 0;
  const int64_t first = step + 1 - options_.window();
  std::ostringstream os;
  os << std::setprecision(4);
  if (totals[2] > 0) {
    os << "the loss became NaN or Inf (steps " << first << "-" << step << ")";
    return Divergence{step, os.str()};
  }
  const double mean = totals[0] / totals[1];
  if (std::isfinite(best_) && mean > options_.explode_factor() * best_ && mean > options_.explode_floor() * first_) {
    os << "the mean loss over steps " << first << "-" << step << " is " << mean << ", " << std::setprecision(2)
       << mean / best_ << "x the lowest window mean so far (" << std::setprecision(4) << best_ << ", steps "
       << best_end_ + 1 - options_.window() << "-" << best_end_ << ")";
    return Divergence{step, os.str()};
  }
  if (first_ >= 0 && mean > options_.regress_factor() * first_) {
    os << "the mean loss over steps " << first << "-" << step << " is " << mean << ", above where training started ("
       << first_ << " over steps 0-" << options_.window() - 1 << "): what was learned is lost";
    return Divergence{step, os.str()};
  }
  if (first_ < 0) first_ = mean;
  if (mean < best_) {
    best_ = mean;
    best_end_ = step;
  }
  return std::nullopt;
}

DivergenceGuard::History DivergenceGuard::history() const {
  return History{step_, first_, best_, best_end_, sum_, count_, nonfinite_};
}

void DivergenceGuard::restore(const History& h) {
  DDPKIT_CHECK(h.steps >= 0, "DivergenceGuard::restore: steps must be >= 0, got ", h.steps);
  step_ = h.steps;
  first_ = h.first_window_mean;
  best_ = h.best_window_mean;
  best_end_ = h.best_window_end;
  sum_ = h.window_sum;
  count_ = h.window_count;
  nonfinite_ = h.window_nonfinite;
}

}  // namespace ddpkit
