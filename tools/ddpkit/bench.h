// Pieces of `ddpkit bench`: the seed's JSON configurations, the workloads they name, and the
// report written after the runs.
#pragma once

#include "cli.h"

#include <ddpkit/metrics/metrics_logger.h>
#include <ddpkit/reducer/reducer.h>

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace ddpkit {
namespace cli {
namespace bench {

// One entry of a configuration file in the seed's shape:
//   {"<id>": {"<kind>_class": "<class>", "configurations": {...}}}
struct ConfigEntry {
  std::string file, kind, id, cls;
  nlohmann::json conf;
};
// kind: data | model | trainer | server. Every problem is a UsageError naming the file, and the
// id, class or key at fault: a missing or unreadable file, bad JSON, an unknown id (the known ones
// are listed), an unknown class, a missing, unknown or mistyped configuration key.
ConfigEntry load_entry(const std::string& file, const std::string& kind, const std::string& id);

// A model with its training data: batches are slices of `inputs` / `targets`.
struct Workload {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)> loss;
  at::Tensor inputs, targets;
  bool sparse_gradients = false;
  std::string description;
};
// Builds the model from `seed` and loads/generates the data; a model that cannot train on the
// data (vocabulary, classes, input size) is a UsageError naming both.
Workload make_workload(const ConfigEntry& data, const ConfigEntry& model, uint64_t seed);

struct TrainerConfig {
  double lr = 1e-4, bucket_cap_mb = kDefaultBucketCapMb;
  std::string criterion, iteration_step;
  int powersgd_rank = 4, powersgd_start_iter = 2;
};
TrainerConfig trainer_config(const ConfigEntry& entry);
struct ServerConfig {
  std::string server_class;  // AverageParameterServer | AverageBatchParameterServer
  double bucket_timeout_s = 120, max_message_mb = 1024;
};
ServerConfig server_config(const ConfigEntry& entry);
// Known values of the trainer's criterion and iteration_step (the seed's maps).
const std::vector<std::string>& criteria();
const std::vector<std::string>& iteration_steps();

// ---- report ----
// Chrome / Perfetto trace ("traceEvents", complete events, one process per rank).
nlohmann::json trace_json(const std::vector<std::pair<std::string, std::vector<metrics::Event>>>& ranks);
// Wall-clock seconds of training (the sum of step times) until the mean loss of the last
// kTargetWindow iterations first reaches the run's target_loss; none without a target or when
// never reached.
constexpr int kTargetWindow = 20;
std::optional<double> time_to_target_s(const nlohmann::json& run);
// Comparison of runs (each run's summary.json) as a fixed-width table; a column that does not
// apply to a run (server rates without a server, time to an unreached target) shows "-".
void write_comparison(std::ostream& os, const std::vector<nlohmann::json>& runs);
// A self-contained HTML page (fits a 1280-pixel window): the comparison table and SVG charts of
// step time and bytes per step by hook, loss per iteration, and loss against wall-clock time.
void write_html_report(std::ostream& os, const std::vector<nlohmann::json>& runs, const std::string& title);

}  // namespace bench
}  // namespace cli
}  // namespace ddpkit
