#include <ddpkit/metrics/metrics_logger.h>

#include <ddpkit/error.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <iomanip>

namespace ddpkit {
namespace metrics {

namespace {
int64_t wall_now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace

void MetricsLogger::record_start(const std::string& type, const std::string& key, const std::string& name) {
  const auto now = Clock::now();
  const int64_t wall = wall_now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  auto [it, inserted] = open_.emplace(std::make_pair(type, key), Open{name, now, wall});
  DDPKIT_CHECK(inserted, "metrics: event ", type, "/", key, " started twice (still open as '", it->second.name, "')");
}

void MetricsLogger::record_end(const std::string& type, const std::string& key) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = open_.find({type, key});
  DDPKIT_CHECK(it != open_.end(), "metrics: event ", type, "/", key, " ended without a start");
  const double ms = std::chrono::duration<double, std::milli>(now - it->second.start).count();
  done_[it->second.name].push_back(ms);
  if (keep_events_) events_.push_back(Event{type, key, it->second.name, it->second.wall_start_us, ms * 1000});
  open_.erase(it);
}

Series MetricsLogger::processed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

std::vector<Event> MetricsLogger::events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_;
}

void MetricsLogger::keep_events(bool keep) {
  std::lock_guard<std::mutex> lock(mutex_);
  keep_events_ = keep;
  if (!keep) events_.clear();
}

std::vector<std::string> MetricsLogger::open_events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> out;
  for (const auto& [k, v] : open_) out.push_back(k.first + "/" + k.second);
  return out;
}

void MetricsLogger::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  open_.clear();
  done_.clear();
  events_.clear();
}

namespace {
double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.size() == 1) return sorted[0];
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}
}  // namespace

std::vector<Summary> summarize(const Series& series) {
  std::vector<Summary> out;
  for (const auto& [name, values] : series) {
    if (values.empty()) continue;
    Summary s;
    s.name = name;
    s.count = values.size();
    std::vector<double> sorted = values;
    std::sort(sorted.begin(), sorted.end());
    s.min = sorted.front();
    s.max = sorted.back();
    double sum = 0;
    for (double v : sorted) sum += v;
    s.mean = sum / static_cast<double>(s.count);
    double sq = 0;
    for (double v : sorted) sq += (v - s.mean) * (v - s.mean);
    s.variance = sq / static_cast<double>(s.count);
    s.stdev = std::sqrt(s.variance);
    s.p50 = percentile(sorted, 0.5);
    s.p90 = percentile(sorted, 0.9);
    out.push_back(s);
  }
  return out;
}

Series merge(const std::vector<Series>& parts) {
  Series out;
  for (const auto& p : parts)
    for (const auto& [name, values] : p) out[name].insert(out[name].end(), values.begin(), values.end());
  return out;
}

void write_table(std::ostream& os, const std::string& title, const std::vector<Summary>& rows) {
  os << title << "\n";
  os << std::left << std::setw(34) << "metric" << std::right << std::setw(7) << "count";
  for (const char* h : {"min_ms", "max_ms", "mean_ms", "p50_ms", "p90_ms", "var_ms2", "stdev_ms"}) os << std::setw(11) << h;
  os << "\n";
  for (const auto& r : rows) {
    os << std::left << std::setw(34) << r.name << std::right << std::setw(7) << r.count << std::fixed
       << std::setprecision(3);
    for (double v : {r.min, r.max, r.mean, r.p50, r.p90, r.variance, r.stdev}) os << std::setw(11) << v;
    os << "\n";
  }
  os.unsetf(std::ios::fixed);
}

void write_csv(std::ostream& os, const std::vector<std::pair<std::string, std::vector<Summary>>>& tables) {
  os << "source,metric,count,min_ms,max_ms,mean_ms,p50_ms,p90_ms,variance_ms2,stdev_ms\n";
  os << std::setprecision(9);
  for (const auto& [source, rows] : tables)
    for (const auto& r : rows)
      os << source << "," << r.name << "," << r.count << "," << r.min << "," << r.max << "," << r.mean << "," << r.p50
         << "," << r.p90 << "," << r.variance << "," << r.stdev << "\n";
}

void write_json(std::ostream& os, const std::vector<std::pair<std::string, std::vector<Summary>>>& tables) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [source, rows] : tables) {
    auto& t = j[source] = nlohmann::ordered_json::object();
    for (const auto& r : rows)
      t[r.name] = {{"count", r.count}, {"min_ms", r.min},          {"max_ms", r.max},  {"mean_ms", r.mean},
                   {"p50_ms", r.p50},  {"p90_ms", r.p90},          {"variance_ms2", r.variance},
                   {"stdev_ms", r.stdev}};
  }
  os << j.dump(2) << "\n";
}

std::string series_to_json(const Series& series) { return nlohmann::json(series).dump(); }

Series series_from_json(const std::string& json) {
  try {
    return nlohmann::json::parse(json).get<Series>();
  } catch (const nlohmann::json::exception& e) {
    DDPKIT_CHECK(false, "metrics: not a metric series JSON object: ", e.what());
  }
  return {};
}

std::string events_to_json(const std::vector<Event>& events) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& e : events)
    j.push_back({{"type", e.type}, {"key", e.key}, {"name", e.name}, {"start_us", e.start_us}, {"duration_us", e.duration_us}});
  return j.dump();
}

std::vector<Event> events_from_json(const std::string& json) {
  std::vector<Event> out;
  try {
    for (const auto& e : nlohmann::json::parse(json))
      out.push_back(Event{e.at("type"), e.at("key"), e.at("name"), e.at("start_us"), e.at("duration_us")});
  } catch (const nlohmann::json::exception& e) {
    DDPKIT_CHECK(false, "metrics: not an event list JSON array: ", e.what());
  }
  return out;
}

}  // namespace metrics
}  // namespace ddpkit
