// Named start/end timing events, as the parameter-server benchmark's MetricsLogger, and the
// summaries (min, max, mean, p50, p90, variance, stdev) printed, and exported as CSV and JSON.
//
//   MetricsLogger log(rank);
//   log.record_start("forward_metric", "7", "forward_pass");   // type, key, name
//   ...
//   log.record_end("forward_metric", "7");
//   auto table = summarize(log.processed());                  // one row per name
//
// Times are CPU wall clock (steady_clock). For CUDA work, synchronize before record_end: CUDA
// events are not used (Debian's libtorch has no CUDA; see docs/parameter_server.md).
#pragma once

#include <chrono>
#include <map>
#include <mutex>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace ddpkit {
namespace metrics {

// Elapsed milliseconds per metric name, in the order the events ended.
using Series = std::map<std::string, std::vector<double>>;

// One ended event, for timelines (Chrome/Perfetto traces): wall-clock start in microseconds since
// the Unix epoch (comparable across the processes of one host), duration from the steady clock.
struct Event {
  std::string type, key, name;
  int64_t start_us = 0;
  double duration_us = 0;
};

// Thread-safe: hooks record from communication threads.
class MetricsLogger {
 public:
  explicit MetricsLogger(int rank = 0) : rank_(rank) {}
  // `key` identifies one event within `type` (e.g. "batch,bucket"); starting a key that is
  // already open is an error, as is ending one that is not.
  void record_start(const std::string& type, const std::string& key, const std::string& name);
  void record_end(const std::string& type, const std::string& key);
  Series processed() const;
  // Every ended event, in the order they ended (kept unless keep_events(false)).
  std::vector<Event> events() const;
  void keep_events(bool keep);
  // Events started but not ended (e.g. a call that failed), "type/key" each.
  std::vector<std::string> open_events() const;
  void clear();
  int rank() const { return rank_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Open {
    std::string name;
    Clock::time_point start;
    int64_t wall_start_us;
  };
  int rank_;
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, std::string>, Open> open_;
  Series done_;
  bool keep_events_ = true;
  std::vector<Event> events_;
};

struct Summary {
  std::string name;
  size_t count = 0;
  double min = 0, max = 0, mean = 0, p50 = 0, p90 = 0, variance = 0, stdev = 0;
};
// One row per name; percentiles by linear interpolation, variance over the population (as numpy's
// default, which the seed benchmark uses).
std::vector<Summary> summarize(const Series& series);
// Concatenates series (for "all trainers" / "all servers" tables).
Series merge(const std::vector<Series>& parts);

// A fixed-width table with a title line.
void write_table(std::ostream& os, const std::string& title, const std::vector<Summary>& rows);
// CSV: header "source,metric,count,min_ms,max_ms,mean_ms,p50_ms,p90_ms,variance_ms2,stdev_ms".
void write_csv(std::ostream& os, const std::vector<std::pair<std::string, std::vector<Summary>>>& tables);
// {"<source>": {"<metric>": {"count": n, "min_ms": ..., ...}}}
void write_json(std::ostream& os, const std::vector<std::pair<std::string, std::vector<Summary>>>& tables);
// Series as JSON ({"name": [ms, ...]}) and back, for handing raw series between processes.
std::string series_to_json(const Series& series);
Series series_from_json(const std::string& json);
// Events as JSON ([{"type", "key", "name", "start_us", "duration_us"}, ...]) and back.
std::string events_to_json(const std::vector<Event>& events);
std::vector<Event> events_from_json(const std::string& json);

}  // namespace metrics
}  // namespace ddpkit
