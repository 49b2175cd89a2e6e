// `ddpkit tune`: short `ddpkit train` trials of the configurations `ddpkit plan` ranks best, side by
// side with the prediction (plan_cli.h holds what it shares with plan.cpp).
#include "cli.h"
#include "plan_cli.h"
#include "training.h"

#include <algorithm>
#include <iomanip>
#include <iostream>

#include <nlohmann/json.hpp>

namespace ddpkit {
namespace cli {

const char* kTuneUsage = R"(usage: ddpkit tune [--top 4] [--trial-steps 30] [--trial-rounds 3] [ddpkit plan's flags]

Runs short `ddpkit train` trials of the configurations `ddpkit plan` ranks best among those that
fit (--top of them), on this host, and prints each one's measured step and peak memory next to the
prediction, then the fastest with the command line that runs it. Lossy hooks train with the
divergence guard on: a trial that diverges or fails is reported and left out. DDP and ZeRO-1
trials run at the bucket cap the plan predicts fastest (plan's --bucket-cap-mb auto) unless
--bucket-cap-mb is given. The job must run on this host (--hosts 1).

  --top K                 configurations to try (default 4)
  --trial-steps N         steps per trial; its median step is what is compared (default 30)
  --trial-rounds R        every configuration tried once per round, R rounds; each is scored by
                          the median of its trials (default 3: a slow spell of a shared machine
                          then lands on one trial of several configurations, not on one's only)
  --json                  one JSON array in the table's order, for scripts (progress on stderr):
                          strategy, hook, bucket_cap_mb, predicted_step_ms, measured_step_ms (the
                          median; null unless ok), trial_step_ms, peak_rss_bytes, trial ("ok",
                          "diverged", "failed"), fastest, train_args (the `ddpkit train` arguments)
)";

// One configuration's trials: its median step over the rounds, its highest peak.
struct Trials {
  plan::Prediction row;
  std::vector<double> step_ms;
  int64_t peak_rss_bytes = 0;
  std::string failed;  // "diverged" or "failed": left out from then on
};

int run_tune(const std::vector<std::string>& all_args) {
  int top = 4, trial_steps = 30, rounds = 3;
  std::vector<std::string> args;
  for (size_t i = 0; i < all_args.size(); ++i) {
    const std::string& a = all_args[i];
    auto value = [&](const std::string& name) {
      if (a.rfind(name + "=", 0) == 0) return a.substr(name.size() + 1);
      if (i + 1 >= all_args.size()) throw UsageError(name + " needs a value");
      return all_args[++i];
    };
    auto number = [&](const std::string& name) {
      const std::string v = value(name);
      try {
        size_t used = 0;
        const int n = std::stoi(v, &used);
        if (used == v.size()) return n;
      } catch (const std::exception&) {
      }
      throw UsageError(name + " must be an integer, got '" + v + "'");
    };
    auto is = [&](const std::string& name) { return a == name || a.rfind(name + "=", 0) == 0; };
    if (is("--top")) top = number("--top");
    else if (is("--trial-steps")) trial_steps = number("--trial-steps");
    else if (is("--trial-rounds")) rounds = number("--trial-rounds");
    else args.push_back(a);
  }
  if (top < 1) throw UsageError("--top must be >= 1");
  if (trial_steps < 10) throw UsageError("--trial-steps must be >= 10 (a median of fewer steps is mostly warm-up)");
  if (rounds < 1) throw UsageError("--trial-rounds must be >= 1");
  const Flags f = plan_flags(args);
  if (f.on("calibrate")) throw UsageError("tune takes no --calibrate (ddpkit plan does)");
  const bool json = f.on("json");
  // With --json, stdout carries the JSON alone.
  std::ostream& progress = json ? std::cerr : std::cout;
  if (f.integer("hosts") != 1) throw UsageError("tune runs its trials on this host: --hosts must be 1");
  if (!f.str("describe").empty())
    throw UsageError("tune trains the CLI's models; a described model is for ddpkit plan (--describe)");
  // Trials at the cap the plan predicts best (--bucket-cap-mb auto unless a cap is given).
  const Planned p = make_plan(f, args, "auto");
  std::vector<Trials> tried;
  for (const auto& r : p.rows) {
    if (!r.fits || static_cast<int>(tried.size()) == top) break;
    tried.push_back(Trials{r, {}, 0, ""});
  }
  for (int round = 1; round <= rounds; ++round) {
    for (auto& t : tried) {
      if (!t.failed.empty()) continue;
      std::vector<std::string> train = train_args(args, p.job, t.row.candidate);
      train.insert(train.end(), {"--steps", std::to_string(trial_steps)});
      train.insert(train.end(), kHooksFromTheThirdStep.begin(), kHooksFromTheThirdStep.end());
      progress << "# round " << round << " of " << rounds << ": " << plan::to_string(t.row.candidate.strategy) << " "
               << t.row.candidate.label() << " " << std::flush;
      try {
        const TrainResult result = train_result(train);
        t.step_ms.push_back(result.median_step_ms);
        t.peak_rss_bytes = std::max(t.peak_rss_bytes, result.peak_rss_bytes);
        progress << std::fixed << std::setprecision(1) << result.median_step_ms << " ms\n";
      } catch (const std::exception& e) {
        t.failed = std::string(e.what()).find("training diverged") != std::string::npos ? "diverged" : "failed";
        progress << t.failed << "\n";
      }
    }
  }
  const Trials* fastest = nullptr;
  for (const auto& t : tried)
    if (t.failed.empty() && (!fastest || median(t.step_ms) < median(fastest->step_ms))) fastest = &t;
  if (json) {
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& t : tried) {
      const plan::Candidate& c = t.row.candidate;
      nlohmann::json row = {{"strategy", plan::to_string(c.strategy)},
                            {"hook", c.label()},
                            {"bucket_cap_mb", c.has_bucket_cap() ? nlohmann::json(c.bucket_cap_mb.value_or(0)) : nlohmann::json()},
                            {"predicted_step_ms", t.row.step_ms},
                            {"measured_step_ms", t.failed.empty() ? nlohmann::json(median(t.step_ms)) : nlohmann::json()},
                            {"trial_step_ms", t.step_ms},
                            {"peak_rss_bytes", t.peak_rss_bytes},
                            {"trial", t.failed.empty() ? "ok" : t.failed},
                            {"fastest", &t == fastest},
                            {"train_args", train_args(args, p.job, c)}};
      rows.push_back(row);
    }
    std::cout << rows.dump(1) << "\n";
    return fastest ? 0 : 1;
  }
  const int hook_column = hook_width(p.rows);
  std::cout << std::left << std::setw(15) << "strategy" << std::setw(hook_column) << "hook" << std::right << std::setw(7)
            << "cap_MB" << std::setw(14) << "predicted_ms" << std::setw(12) << "measured_ms" << std::setw(12) << "memory_MB" << "  trial\n";
  for (const auto& t : tried) {
    std::cout << std::left << std::setw(15) << plan::to_string(t.row.candidate.strategy) << std::setw(hook_column) << t.row.candidate.label()
              << std::right << std::setw(7) << cap_column(t.row.candidate) << std::fixed << std::setprecision(1)
              << std::setw(14) << t.row.step_ms;
    if (!t.failed.empty()) {
      std::cout << std::setw(12) << "-" << std::setw(12) << "-" << "  " << t.failed << "\n";
      continue;
    }
    const double step = median(t.step_ms);
    std::cout << std::setw(12) << step << std::setw(12) << mb(t.peak_rss_bytes) << "  ok\n";
  }
  if (!fastest) {
    std::cout << "# no trial completed\n";
    return 1;
  }
  std::cout << "# fastest: ddpkit train " << joined(train_args(args, p.job, fastest->row.candidate)) << "\n";
  return 0;
}

}  // namespace cli
}  // namespace ddpkit
