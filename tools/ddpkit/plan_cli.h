// What `ddpkit plan` (plan.cpp) and `ddpkit tune` (tune.cpp) share: the plan's flags, a plan made
// from them, the `ddpkit train` arguments of a candidate and a short run of them, and the
// table's columns.
#pragma once

#include "cli.h"

#include <ddpkit/plan/cost_model.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ddpkit {
namespace cli {

// `ddpkit plan`'s flags: its own and train's model and data flags.
Flags plan_flags(const std::vector<std::string>& args);

struct Planned {
  plan::JobSpec job;
  plan::ModelProfile profile;
  std::vector<plan::Prediction> rows;  // best first
  std::string constants_path;
};
// The job, the model's profile (measured, or described) and every candidate that matches the
// flags, ranked; the bucket cap is the flag's or, without one, `cap_by_default` ("": the hook's
// default, or "auto").
Planned make_plan(const Flags& f, const std::vector<std::string>& args, const std::string& cap_by_default = "");

// The `ddpkit train` arguments that run `c` on this host: the model and data flags given to plan
// (`args`), then the candidate's.
std::vector<std::string> train_args(const std::vector<std::string>& args, const plan::JobSpec& job,
                                    const plan::Candidate& c);

struct TrainResult {
  double median_step_ms = 0;
  int64_t peak_rss_bytes = 0;
};
// Runs `ddpkit train --quiet --no-eval` with these flags (and `env`, "NAME=VALUE ..." before the
// command) and reads its JSON line.
TrainResult train_result(const std::vector<std::string>& flags, const std::string& env = "");

// PowerSGD and local SGD begin with plain allreduces (train's defaults: 10 and 100 steps): a short
// job (calibration, a tune trial) starts them at its third step, to time and hold their own.
inline const std::vector<std::string> kHooksFromTheThirdStep = {"--powersgd-start-iter", "2",
                                                                "--local-sgd-start-iter", "2"};

std::string joined(const std::vector<std::string>& words);  // with single spaces
// A row's bucket cap; "-" where the strategy has no DDP buckets (FSDP).
std::string cap_column(const plan::Candidate& c);
// The hook column's width: the longest label ("quantize_per_channel+optimizer") and a space.
int hook_width(const std::vector<plan::Prediction>& rows);
std::string mb(int64_t bytes);  // MiB, no decimals

}  // namespace cli
}  // namespace ddpkit
