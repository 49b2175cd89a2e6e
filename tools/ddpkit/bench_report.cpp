// `ddpkit bench` report: comparison table, Chrome/Perfetto trace, self-contained HTML with SVG.
#include "bench.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

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

// Lines over a y range fitted to the data (a loss that barely moves is still visible), legend in
// the top right corner.
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
  if (!(lo <= hi)) lo = 0, hi = 1;
  const double pad = std::max((hi - lo) * 0.1, std::max(std::abs(hi), 1.0) * 1e-4);
  const double step = nice_max((hi - lo + 2 * pad) / 4);
  const double ymin = std::floor((lo - pad) / step) * step, ymax = ymin + 4 * step;
  axes(os, title, unit, ymin, ymax);
  const int plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto& ys = lines[i].second;
    os << "<polyline fill='none' stroke-width='2' stroke='" << kColors[i % 8] << "' points='";
    for (size_t k = 0; k < ys.size(); ++k) {
      const double x = kLeft + (longest > 1 ? plot_w * static_cast<double>(k) / (longest - 1) : 0);
      const double y = kTop + plot_h - plot_h * (std::clamp(ys[k], ymin, ymax) - ymin) / (ymax - ymin);
      os << fmt(x) << "," << fmt(y) << " ";
    }
    os << "'><title>" << escape(lines[i].first) << "</title></polyline>\n";
    const int ly = kTop + 8 + 14 * static_cast<int>(i);
    os << "<rect x='" << kWidth - kRight - 100 << "' y='" << ly << "' width='10' height='10' fill='" << kColors[i % 8]
       << "'/><text x='" << kWidth - kRight - 86 << "' y='" << ly + 9 << "'>" << escape(lines[i].first) << "</text>\n";
  }
  os << "<text x='" << kLeft + plot_w / 2 << "' y='" << kHeight - kBottom + 20
     << "' text-anchor='middle' fill='#666'>measured iteration (1.." << longest << ")</text>\n";
  os << "</svg>\n";
}

double num(const nlohmann::json& j, const char* key) { return j.contains(key) && j.at(key).is_number() ? j.at(key).get<double>() : 0.0; }

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

void write_comparison(std::ostream& os, const std::vector<nlohmann::json>& runs) {
  os << std::left << std::setw(12) << "hook" << std::right << std::setw(10) << "step_ms" << std::setw(10) << "p50_ms"
     << std::setw(9) << "vs_first" << std::setw(13) << "MB/step" << std::setw(12) << "server_g/s" << std::setw(12)
     << "final_loss" << "\n";
  const double base = runs.empty() ? 0 : num(runs.front(), "step_ms_p50");
  for (const auto& r : runs) {
    const double p50 = num(r, "step_ms_p50");
    os << std::left << std::setw(12) << r.value("hook", "?") << std::right << std::setw(10) << fmt(num(r, "step_ms_mean"))
       << std::setw(10) << fmt(p50) << std::setw(9) << (base > 0 ? fmt(p50 / base, 2) : "-") << std::setw(13)
       << fmt(num(r, "bytes_sent_per_step") / 1e6, 2) << std::setw(12) << fmt(num(r, "server_gradients_per_s"))
       << std::setw(12) << fmt(num(r, "final_loss"), 4) << "\n";
  }
  os << "(vs_first: p50 step time relative to the first hook; MB/step: bytes trainer 0 sent per step, "
        "collectives counted as bus bytes 2(n-1)/n for allreduce, plus parameter-server requests)\n";
}

void write_html_report(std::ostream& os, const std::vector<nlohmann::json>& runs, const std::string& title) {
  std::vector<std::pair<std::string, double>> step, bytes;
  std::vector<std::pair<std::string, std::vector<double>>> loss;
  for (const auto& r : runs) {
    const std::string hook = r.value("hook", "?");
    step.emplace_back(hook, num(r, "step_ms_p50"));
    bytes.emplace_back(hook, num(r, "bytes_sent_per_step") / 1e6);
    loss.emplace_back(hook, r.value("loss", std::vector<double>{}));
  }
  std::ostringstream table;
  write_comparison(table, runs);
  os << "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>" << escape(title) << "</title>\n"
     << "<style>body{font-family:sans-serif;margin:24px;color:#222}pre{background:#f6f6f6;padding:12px}"
        ".charts{display:flex;flex-wrap:wrap;gap:16px}</style></head><body>\n"
     << "<h1>" << escape(title) << "</h1>\n";
  if (!runs.empty()) {
    const auto& r = runs.front();
    os << "<p>" << escape(r.value("workload", "")) << "; " << r.value("trainers", 0) << " trainers, "
       << r.value("servers", 0) << " servers, batch " << r.value("batch_size", 0) << " per trainer, "
       << r.value("iterations", 0) << " measured iterations after " << r.value("warmup", 0) << " warm-up.</p>\n";
  }
  os << "<pre>" << escape(table.str()) << "</pre>\n<div class='charts'>\n";
  bar_chart(os, "Step time by hook (p50)", "ms", step);
  bar_chart(os, "Bytes sent per step by hook (trainer 0)", "MB", bytes);
  line_chart(os, "Loss (trainer 0)", "loss", loss);
  os << "</div>\n<p>Per-run tables: &lt;hook&gt;/metrics.csv, metrics.json; timelines: &lt;hook&gt;/trace.json "
        "(open in https://ui.perfetto.dev or chrome://tracing).</p>\n</body></html>\n";
}

}  // namespace bench
}  // namespace cli
}  // namespace ddpkit
