#include <ddpkit/ddp/online_tuning.h>

#include <ddpkit/comm/process_group.h>
#include <ddpkit/reducer/reducer.h>
#include <ddpkit/runtime/runtime.h>

#include <algorithm>
#include <cmath>

namespace ddpkit {

namespace {
constexpr double kMiB = 1024.0 * 1024.0;

size_t cap_bytes(double mb) { return static_cast<size_t>(std::llround(mb * kMiB)); }
}  // namespace

OnlineTuningOptions default_online_tuning(bool bucket_caps, bool pieces) {
  OnlineTuningOptions o;
  if (bucket_caps) o.bucket_caps_mb({1, 4, 10, 25, 64});
  if (pieces) o.piece_bytes({256 << 10, 4 << 20});
  return o;
}

OnlineTuner::OnlineTuner(OnlineTuningOptions options, Reducer& reducer, ProcessGroup& pg)
    : options_(std::move(options)), reducer_(reducer), pg_(pg) {
  DDPKIT_CHECK(options_.steps_per_trial() >= 1, "online tuning: steps_per_trial must be >= 1, got ",
               options_.steps_per_trial());
  DDPKIT_CHECK(options_.rounds() >= 1, "online tuning: rounds must be >= 1, got ", options_.rounds());
  DDPKIT_CHECK(options_.min_gain() >= 0 && options_.min_gain() < 1, "online tuning: min_gain must be in [0, 1), got ",
               options_.min_gain());
  for (double mb : options_.bucket_caps_mb())
    DDPKIT_CHECK(mb > 0 && std::isfinite(mb), "online tuning: bucket caps must be positive, got ", mb, " MiB");
  for (int64_t b : options_.piece_bytes())
    DDPKIT_CHECK(b >= 1, "online tuning: piece sizes must be >= 1 byte, got ", b);
  result_.bucket_cap_mb = static_cast<double>(reducer_.bucket_cap()) / kMiB;
  result_.piece_bytes = pg_.piece_bytes();
  result_.done = options_.bucket_caps_mb().empty() && options_.piece_bytes().empty();
}

void OnlineTuner::step(bool training, bool synchronized) {
  if (result_.done) return;
  const auto now = std::chrono::steady_clock::now();
  if (!training) {  // an evaluation forward: its time is no step's
    interval_clean_ = false;
    return;
  }
  if (!synchronized) return;  // an accumulation step: part of the next synchronized one
  if (!started_) {
    // Candidates rebucket the gradient-ready order, known once the buckets were rebuilt.
    if (!reducer_.buckets_rebuilt()) return;
    started_ = true;
    start();
    if (result_.done) return;
    begin_trial();
    last_ = now;
    interval_clean_ = true;
    return;
  }
  ++steps_in_trial_;
  // The first step of a trial settles (new buffers, caches); the rest are timed.
  if (steps_in_trial_ >= 2 && interval_clean_)
    samples_[trial_].push_back(std::chrono::duration<double, std::milli>(now - last_).count());
  last_ = now;
  interval_clean_ = true;
  ++result_.steps;
  if (steps_in_trial_ < 1 + options_.steps_per_trial()) return;
  if (++trial_ == result_.trials.size() && ++round_ < options_.rounds()) trial_ = stage_begin_;
  if (trial_ < result_.trials.size()) {
    begin_trial();
    return;
  }
  for (size_t i = stage_begin_; i < result_.trials.size(); ++i) result_.trials[i].median_step_ms = median(samples_[i]);
  finish_stage();
}

void OnlineTuner::start() {
  // A frozen or restored layout (ZeRO, a checkpoint's buckets) stays: only pieces are tuned.
  if (!options_.bucket_caps_mb().empty() && !reducer_.layout_fixed()) {
    std::vector<double> caps{result_.bucket_cap_mb};
    caps.insert(caps.end(), options_.bucket_caps_mb().begin(), options_.bucket_caps_mb().end());
    std::vector<std::vector<std::vector<size_t>>> layouts;
    for (double mb : caps) {
      auto layout = reducer_.bucket_indices_for_cap(cap_bytes(mb));
      if (std::find(layouts.begin(), layouts.end(), layout) != layouts.end()) continue;
      TuningTrial t;
      t.bucket_cap_mb = mb;
      t.piece_bytes = result_.piece_bytes;
      t.buckets = layout.size();
      result_.trials.push_back(t);
      layouts.push_back(std::move(layout));
    }
    if (result_.trials.size() > 1) {
      samples_.resize(result_.trials.size());
      return;
    }
    result_.trials.clear();  // one layout whatever the cap: nothing to try
  }
  start_pieces_stage();
}

void OnlineTuner::start_pieces_stage() {
  tuning_pieces_ = true;
  std::vector<int64_t> pieces{result_.piece_bytes};
  for (int64_t b : options_.piece_bytes())
    if (std::find(pieces.begin(), pieces.end(), b) == pieces.end()) pieces.push_back(b);
  if (pieces.size() < 2) {
    result_.done = true;
    return;
  }
  stage_begin_ = trial_ = result_.trials.size();
  round_ = 0;
  const size_t buckets = reducer_.bucket_indices().size();
  for (int64_t b : pieces) {
    TuningTrial t;
    t.bucket_cap_mb = result_.bucket_cap_mb;
    t.piece_bytes = b;
    t.buckets = buckets;
    result_.trials.push_back(t);
  }
  samples_.resize(result_.trials.size());
}

void OnlineTuner::apply(const TuningTrial& t) {
  // Piece trials carry the cap in force, so a fixed layout is never asked to change.
  if (cap_bytes(t.bucket_cap_mb) != reducer_.bucket_cap()) reducer_.set_bucket_cap(cap_bytes(t.bucket_cap_mb));
  if (t.piece_bytes != pg_.piece_bytes()) pg_.set_piece_bytes(t.piece_bytes);
}

void OnlineTuner::begin_trial() {
  apply(result_.trials[trial_]);
  steps_in_trial_ = 0;
}

size_t OnlineTuner::agree_on_best() {
  int64_t best = static_cast<int64_t>(stage_begin_);
  if (pg_.rank() == 0) {
    // The stage's first trial is the current setting; another replaces it only by min_gain.
    const double current = result_.trials[stage_begin_].median_step_ms;
    size_t fastest = stage_begin_;
    for (size_t i = stage_begin_ + 1; i < result_.trials.size(); ++i) {
      const double ms = result_.trials[i].median_step_ms;
      if (ms > 0 && (result_.trials[fastest].median_step_ms <= 0 || ms < result_.trials[fastest].median_step_ms))
        fastest = i;
    }
    if (current <= 0 || result_.trials[fastest].median_step_ms < current * (1 - options_.min_gain()))
      best = static_cast<int64_t>(fastest);
  }
  at::Tensor choice = at::full({1}, best, at::kLong);
  ProcessGroup::wait(pg_.broadcast(choice, 0));
  best = choice.item<int64_t>();
  DDPKIT_CHECK(best >= static_cast<int64_t>(stage_begin_) && best < static_cast<int64_t>(result_.trials.size()),
               "online tuning: rank 0 chose trial ", best, ", outside this stage's ", stage_begin_, "..",
               result_.trials.size() - 1, " (ranks disagree on the candidates)");
  return static_cast<size_t>(best);
}

void OnlineTuner::finish_stage() {
  const TuningTrial chosen = result_.trials[agree_on_best()];
  apply(chosen);
  result_.bucket_cap_mb = chosen.bucket_cap_mb;
  result_.piece_bytes = chosen.piece_bytes;
  if (!tuning_pieces_) {
    start_pieces_stage();
    if (!result_.done) begin_trial();
    return;
  }
  result_.done = true;
}

}  // namespace ddpkit
