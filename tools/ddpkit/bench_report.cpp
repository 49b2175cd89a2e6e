// `ddpkit bench` report: comparison table, Chrome/Perfetto trace, self-contained HTML with SVG.
#include "bench.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>
#include <tuple>

namespace ddpkit {
namespace cli {
namespace bench {
namespace {

const char* kColors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7"};

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string fmt(double v, int precision = 1) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(precision) << v;
  return os.str();
}

// A "nice" axis maximum: 1, 2 or 5 times a power of ten at or above v.
double nice_max(double v) {
  if (!(v > 0)) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(v)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= v) return m * p;
  return 10 * p;
}

const int kWidth = 560, kHeight = 300, kLeft = 78, kRight = 16, kTop = 36, kBottom = 48;

// Tick labels with as many decimals as the axis step needs.
std::string tick(double v, double step) {
  int decimals = 0;
  for (double scaled = step; decimals < 6 && std::abs(scaled - std::round(scaled)) > 1e-6 * std::max(1.0, scaled);
       scaled *= 10)
    ++decimals;
  return fmt(v, decimals);
}

void axes(std::ostream& os, const std::string& title, const std::string& unit, double ymin, double ymax) {
  os << "<svg xmlns='http://www.w3.org/2000/svg' width='" << kWidth << "' height='" << kHeight
     << "' font-family='sans-serif' font-size='12'>\n";
  os << "<text x='" << kWidth / 2 << "' y='20' text-anchor='middle' font-size='14' font-weight='bold'>" << escape(title)
     << "</text>\n";
  const int plot_h = kHeight - kTop - kBottom;
  for (int i = 0; i <= 4; ++i) {
    const double v = ymin + (ymax - ymin) * i / 4;
    const int y = kTop + plot_h - plot_h * i / 4;
    os << "<line x1='" << kLeft << "' x2='" << kWidth - kRight << "' y1='" << y << "' y2='" << y
       << "' stroke='#ddd'/>\n<text x='" << kLeft - 6 << "' y='" << y + 4 << "' text-anchor='end'>"
       << tick(v, (ymax - ymin) / 4) << "</text>\n";
  }
  os << "<text x='14' y='" << kTop + plot_h / 2 << "' transform='rotate(-90 14 " << kTop + plot_h / 2
     << ")' text-anchor='middle'>" << escape(unit) << "</text>\n";
}

void bar_chart(std::ostream& os, const std::string& title, const std::string& unit,
               const std::vector<std::pair<std::string, double>>& bars) {
  double top = 0;
  for (const auto& [label, v] : bars) top = std::max(top, v);
  const double ymax = 4 * nice_max(top / 4);  // four equal, round ticks
  axes(os, title, unit, 0, ymax);
  const int plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  const int n = std::max<int>(1, static_cast<int>(bars.size()));
  const int slot = plot_w / n, bar = std::max(8, slot * 3 / 5);
  for (int i = 0; i < static_cast<int>(bars.size()); ++i) {
    const double v = bars[i].second;
    const int h = static_cast<int>(plot_h * v / ymax);
    const int x = kLeft + i * slot + (slot - bar) / 2;
    os << "<rect x='" << x << "' y='" << kTop + plot_h - h << "' width='" << bar << "' height='" << h << "' fill='"
       << kColors[i % 8] << "'><title>" << escape(bars[i].first) << ": " << fmt(v, 2) << " " << escape(unit)
       << "</title></rect>\n";
    os << "<text x='" << x + bar / 2 << "' y='" << kTop + plot_h - h - 4 << "' text-anchor='middle'>" << fmt(v, v < 10 ? 2 : 0)
       << "</text>\n<text x='" << x + bar / 2 << "' y='" << kHeight - kBottom + 16 << "' text-anchor='middle'>"
       << escape(bars[i].first) << "</text>\n";
  }
  os << "</svg>\n";
}

// Four round ticks from ymin to ymax covering [lo, hi] with some padding, so a loss that barely
// moves is still visible.
std::pair<double, double> fitted_range(double lo, double hi) {
  if (!(lo <= hi)) lo = 0, hi = 1;
  const double pad = std::max((hi - lo) * 0.1, std::max(std::abs(hi), 1.0) * 1e-4);
  double step = nice_max((hi - lo + 2 * pad) / 4);
  while (std::floor((lo - pad) / step) * step + 4 * step < hi) step = nice_max(step * 1.01);  // the floor lowered the top
  const double ymin = std::floor((lo - pad) / step) * step;
  return {ymin, ymin + 4 * step};
}

// Series i as a polyline through `points` (pixel coordinates), and its legend entry in the top
// right corner.
void series_line(std::ostream& os, size_t i, const std::string& label, const std::vector<std::pair<double, double>>& points) {
  os << "<polyline fill='none' stroke-width='2' stroke='" << kColors[i % 8] << "' points='";
  for (const auto& [x, y] : points) os << fmt(x) << "," << fmt(y) << " ";
  os << "'><title>" << escape(label) << "</title></polyline>\n";
  const int ly = kTop + 8 + 14 * static_cast<int>(i);
  os << "<rect x='" << kWidth - kRight - 100 << "' y='" << ly << "' width='10' height='10' fill='" << kColors[i % 8]
     << "'/><text x='" << kWidth - kRight - 86 << "' y='" << ly + 9 << "'>" << escape(label) << "</text>\n";
}

// Lines over a y range fitted to the data, one point per measured iteration.
void line_chart(std::ostream& os, const std::string& title, const std::string& unit,
                const std::vector<std::pair<std::string, std::vector<double>>>& lines) {
  double lo = INFINITY, hi = -INFINITY;
  size_t longest = 1;
  for (const auto& [label, ys] : lines) {
    for (double y : ys)
      if (std::isfinite(y)) {
        lo = std::min(lo, y);
        hi = std::max(hi, y);
      }
    longest = std::max(longest, ys.size());
  }
  const auto [ymin, ymax] = fitted_range(lo, hi);
  axes(os, title, unit, ymin, ymax);
  const int plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto& ys = lines[i].second;
    std::vector<std::pair<double, double>> points;
    for (size_t k = 0; k < ys.size(); ++k)
      points.emplace_back(kLeft + (longest > 1 ? plot_w * static_cast<double>(k) / (longest - 1) : 0),
                          kTop + plot_h - plot_h * (std::clamp(ys[k], ymin, ymax) - ymin) / (ymax - ymin));
    series_line(os, i, lines[i].first, points);
  }
  os << "<text x='" << kLeft + plot_w / 2 << "' y='" << kHeight - kBottom + 20
     << "' text-anchor='middle' fill='#666'>measured iteration (1.." << longest << ")</text>\n";
  os << "</svg>\n";
}

double num(const nlohmann::json& j, const char* key) { return j.contains(key) && j.at(key).is_number() ? j.at(key).get<double>() : 0.0; }

std::vector<double> series(const nlohmann::json& run, const char* key) { return run.value(key, std::vector<double>{}); }

// Trailing mean over kTargetWindow iterations (fewer at the start).
std::vector<double> smoothed(const std::vector<double>& v) {
  std::vector<double> out;
  double sum = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    sum += v[i];
    if (i >= static_cast<size_t>(kTargetWindow)) sum -= v[i - kTargetWindow];
    out.push_back(sum / static_cast<double>(std::min<size_t>(i + 1, kTargetWindow)));
  }
  return out;
}

std::vector<double> elapsed_s(const nlohmann::json& run) {
  std::vector<double> out;
  double t = 0;
  for (double ms : series(run, "step_ms")) out.push_back(t += ms / 1000);
  return out;
}

// The table's cells: hook, then numbers, "-" where a column does not apply.
// peak_MB: the largest trainer's VmHWM; pss_MB: the trainers' mean peak with every page counted once
// across the host's processes (runtime/memory_sampler.h).
const std::vector<std::string> kColumns{"hook",    "step_ms", "p50_ms",     "vs_first",   "MB/step",    "peak_MB",
                                        "pss_MB",  "server_g/s", "final_loss", "to_target_s"};

std::vector<std::vector<std::string>> table_rows(const std::vector<nlohmann::json>& runs) {
  std::vector<std::vector<std::string>> rows;
  const double base = runs.empty() ? 0 : num(runs.front(), "step_ms_p50");
  for (const auto& r : runs) {
    const double p50 = num(r, "step_ms_p50");
    const bool served = num(r, "server_gradients_averaged") > 0;  // only rpc-style hooks use the servers
    const auto to_target = time_to_target_s(r);
    rows.push_back({r.value("hook", "?"), fmt(num(r, "step_ms_mean")), fmt(p50), base > 0 ? fmt(p50 / base, 2) : "-",
                    fmt(num(r, "bytes_sent_per_step") / 1e6, 2),
                    num(r, "peak_rss_bytes") > 0 ? fmt(num(r, "peak_rss_bytes") / 1048576.0) : "-",
                    num(r, "mean_peak_pss_bytes") > 0 ? fmt(num(r, "mean_peak_pss_bytes") / 1048576.0) : "-",
                    served ? fmt(num(r, "server_gradients_per_s")) : "-",
                    fmt(num(r, "final_loss"), 4), to_target ? fmt(*to_target, 2) : "-"});
  }
  return rows;
}

std::vector<std::string> footnotes(const std::vector<nlohmann::json>& runs) {
  std::vector<std::string> out{
      "vs_first: p50 step time relative to the first hook.",
      "MB/step: bytes trainer 0 sent per step; collectives count bus bytes (2(n-1)/n of the bucket for an "
      "allreduce), plus parameter-server requests.",
      "server_g/s: gradients the parameter servers averaged per second (hooks that use them)."};
  if (!runs.empty() && runs.front().contains("target_loss"))
    out.push_back("to_target_s: seconds of training (summed step times) until the mean loss of the last " +
                  std::to_string(kTargetWindow) + " iterations is at most " + fmt(num(runs.front(), "target_loss"), 3) +
                  "; - if it never was.");
  return out;
}

// Loss (trailing mean) against wall-clock seconds, with the target as a dashed line.
void loss_time_chart(std::ostream& os, const std::vector<nlohmann::json>& runs) {
  double tmax = 0, lo = INFINITY, hi = -INFINITY;
  std::vector<std::pair<std::vector<double>, std::vector<double>>> lines;
  for (const auto& r : runs) {
    lines.emplace_back(elapsed_s(r), smoothed(series(r, "loss")));
    if (!lines.back().first.empty()) tmax = std::max(tmax, lines.back().first.back());
    for (double y : lines.back().second)
      if (std::isfinite(y)) lo = std::min(lo, y), hi = std::max(hi, y);
  }
  const double target = runs.empty() ? 0 : num(runs.front(), "target_loss");
  if (target > 0) lo = std::min(lo, target), hi = std::max(hi, target);
  double ymin, ymax;  // plain variables: the lambdas below capture them
  std::tie(ymin, ymax) = fitted_range(lo, hi);
  const double xmax = 4 * nice_max(std::max(tmax, 1e-3) / 4);
  axes(os, "Loss against wall-clock time (trainer 0, mean of " + std::to_string(kTargetWindow) + ")", "loss", ymin, ymax);
  const int plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  auto px = [&](double x) { return kLeft + plot_w * x / xmax; };
  auto py = [&](double y) { return kTop + plot_h - plot_h * (std::clamp(y, ymin, ymax) - ymin) / (ymax - ymin); };
  for (int i = 0; i <= 4; ++i)
    os << "<text x='" << fmt(px(xmax * i / 4)) << "' y='" << kHeight - kBottom + 16 << "' text-anchor='middle'>"
       << tick(xmax * i / 4, xmax / 4) << "</text>\n";
  if (target > 0)
    os << "<line x1='" << kLeft << "' x2='" << kWidth - kRight << "' y1='" << fmt(py(target)) << "' y2='" << fmt(py(target))
       << "' stroke='#888' stroke-dasharray='6 4'><title>target loss " << fmt(target, 3) << "</title></line>\n";
  for (size_t i = 0; i < lines.size(); ++i) {
    std::vector<std::pair<double, double>> points;
    for (size_t k = 0; k < lines[i].first.size() && k < lines[i].second.size(); ++k)
      points.emplace_back(px(lines[i].first[k]), py(lines[i].second[k]));
    series_line(os, i, runs[i].value("hook", "?"), points);
  }
  os << "<text x='" << kLeft + plot_w / 2 << "' y='" << kHeight - kBottom + 34
     << "' text-anchor='middle' fill='#666'>seconds of training (summed step times)</text>\n</svg>\n";
}

}  // namespace

nlohmann::json trace_json(const std::vector<std::pair<std::string, std::vector<metrics::Event>>>& ranks) {
  int64_t t0 = INT64_MAX;
  for (const auto& [name, events] : ranks)
    for (const auto& e : events) t0 = std::min(t0, e.start_us);
  if (t0 == INT64_MAX) t0 = 0;
  nlohmann::json events = nlohmann::json::array();
  for (size_t pid = 0; pid < ranks.size(); ++pid) {
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"tid", 0}, {"args", {{"name", ranks[pid].first}}}});
    events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", 0}, {"args", {{"sort_index", pid}}}});
    std::map<std::string, int> tids;  // one row per metric type: batch, forward, backward, hooks, ...
    for (const auto& e : ranks[pid].second) {
      auto [it, added] = tids.emplace(e.type, static_cast<int>(tids.size()));
      if (added)
        events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", it->second}, {"args", {{"name", e.type}}}});
      events.push_back({{"name", e.name}, {"cat", e.type}, {"ph", "X"}, {"pid", pid}, {"tid", it->second},
                        {"ts", e.start_us - t0}, {"dur", e.duration_us}, {"args", {{"key", e.key}}}});
    }
  }
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

std::optional<double> time_to_target_s(const nlohmann::json& run) {
  const double target = num(run, "target_loss");
  if (!(target > 0)) return std::nullopt;
  const auto loss = smoothed(series(run, "loss"));
  const auto t = elapsed_s(run);
  for (size_t i = static_cast<size_t>(kTargetWindow) - 1; i < loss.size() && i < t.size(); ++i)
    if (loss[i] <= target) return t[i];
  return std::nullopt;
}

void write_comparison(std::ostream& os, const std::vector<nlohmann::json>& runs) {
  const std::vector<int> widths{12, 10, 10, 9, 10, 9, 9, 12, 12, 13};
  DDPKIT_CHECK(widths.size() == kColumns.size(), "bench report: ", widths.size(), " widths for ", kColumns.size(), " columns");
  for (size_t c = 0; c < kColumns.size(); ++c)
    os << (c == 0 ? std::left : std::right) << std::setw(widths[c]) << kColumns[c];
  os << "\n";
  for (const auto& row : table_rows(runs)) {
    for (size_t c = 0; c < row.size(); ++c) os << (c == 0 ? std::left : std::right) << std::setw(widths[c]) << row[c];
    os << "\n";
  }
  for (const auto& note : footnotes(runs)) os << "  " << note << "\n";
}

void write_html_report(std::ostream& os, const std::vector<nlohmann::json>& runs, const std::string& title) {
  std::vector<std::pair<std::string, double>> step, bytes;
  std::vector<std::pair<std::string, std::vector<double>>> loss;
  for (const auto& r : runs) {
    const std::string hook = r.value("hook", "?");
    step.emplace_back(hook, num(r, "step_ms_p50"));
    bytes.emplace_back(hook, num(r, "bytes_sent_per_step") / 1e6);
    loss.emplace_back(hook, series(r, "loss"));
  }
  // Two 560-pixel charts per row and a table narrower than that: no horizontal scrolling in a
  // 1280-pixel window.
  os << "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>" << escape(title) << "</title>\n"
     << "<style>body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}"
        "table{border-collapse:collapse;font-size:14px}th,td{padding:4px 10px;border-bottom:1px solid #ddd;"
        "text-align:right}th:first-child,td:first-child{text-align:left}.notes{font-size:13px;color:#555}"
        ".charts{display:flex;flex-wrap:wrap;gap:16px}svg{max-width:100%;height:auto}</style></head><body>\n"
     << "<h1>" << escape(title) << "</h1>\n";
  if (!runs.empty()) {
    const auto& r = runs.front();
    os << "<p>" << escape(r.value("workload", "")) << "; " << r.value("trainers", 0) << " trainers, "
       << r.value("servers", 0) << " servers, batch " << r.value("batch_size", 0) << " per trainer, "
       << r.value("iterations", 0) << " measured iterations after " << r.value("warmup", 0) << " warm-up.</p>\n";
  }
  os << "<table><tr>";
  for (const auto& c : kColumns) os << "<th>" << escape(c) << "</th>";
  os << "</tr>\n";
  for (const auto& row : table_rows(runs)) {
    os << "<tr>";
    for (const auto& cell : row) os << "<td>" << escape(cell) << "</td>";
    os << "</tr>\n";
  }
  os << "</table>\n<div class='notes'>\n";
  for (const auto& note : footnotes(runs)) os << "<p>" << escape(note) << "</p>\n";
  os << "</div>\n<div class='charts'>\n";
  bar_chart(os, "Step time by hook (p50)", "ms", step);
  bar_chart(os, "Bytes sent per step by hook (trainer 0)", "MB", bytes);
  line_chart(os, "Loss per iteration (trainer 0)", "loss", loss);
  loss_time_chart(os, runs);
  os << "</div>\n<p class='notes'>Per-run tables: &lt;hook&gt;/metrics.csv, metrics.json; timelines: "
        "&lt;hook&gt;/trace.json (open in https://ui.perfetto.dev or chrome://tracing).</p>\n</body></html>\n";
}

}  // namespace bench
}  // namespace cli
}  // namespace ddpkit
