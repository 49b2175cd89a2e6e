// MetricsLogger and its summaries, CSV and JSON.
#include "harness.h"

#include <ddpkit/metrics/metrics_logger.h>

#include <nlohmann/json.hpp>

#include <sstream>

namespace ddpkit {
namespace {

using metrics::MetricsLogger;
using testing::error_of;

TEST(Metrics, SummaryStatistics) {
  metrics::Series s{{"step", {4, 1, 3, 2, 10}}};
  auto rows = metrics::summarize(s);
  ASSERT_EQ(rows.size(), 1u);
  const auto& r = rows[0];
  EXPECT_EQ(r.count, 5u);
  EXPECT_DOUBLE_EQ(r.min, 1);
  EXPECT_DOUBLE_EQ(r.max, 10);
  EXPECT_DOUBLE_EQ(r.mean, 4);
  EXPECT_DOUBLE_EQ(r.p50, 3);
  EXPECT_DOUBLE_EQ(r.p90, 7.6);  // numpy.percentile([1,2,3,4,10], 90)
  EXPECT_DOUBLE_EQ(r.variance, 10);  // numpy.var
  EXPECT_DOUBLE_EQ(r.stdev, std::sqrt(10.0));
}

TEST(Metrics, EventsPairByTypeAndKey) {
  MetricsLogger log(3);
  log.record_start("forward_metric", "0", "forward_pass");
  log.record_start("backward_metric", "0", "backward");
  log.record_end("forward_metric", "0");
  EXPECT_EQ(log.open_events(), std::vector<std::string>{"backward_metric/0"});
  log.record_end("backward_metric", "0");
  auto s = log.processed();
  EXPECT_EQ(s["forward_pass"].size(), 1u);
  EXPECT_GE(s["forward_pass"][0], 0.0);
  EXPECT_THAT(error_of([&] { log.record_end("forward_metric", "0"); }), ::testing::HasSubstr("ended without a start"));
  log.record_start("x", "1", "a");
  EXPECT_THAT(error_of([&] { log.record_start("x", "1", "b"); }), ::testing::HasSubstr("started twice"));
  log.clear();
  EXPECT_TRUE(log.processed().empty());
  EXPECT_TRUE(log.open_events().empty());
}

TEST(Metrics, CsvAndJsonParse) {
  metrics::Series s{{"batch_all", {1, 2, 3}}, {"backward", {0.5}}};
  std::vector<std::pair<std::string, std::vector<metrics::Summary>>> tables{{"trainer0", metrics::summarize(s)},
                                                                             {"all_trainers", metrics::summarize(metrics::merge({s, s}))}};
  std::ostringstream csv, json;
  metrics::write_csv(csv, tables);
  metrics::write_json(json, tables);
  std::istringstream lines(csv.str());
  std::string line;
  std::getline(lines, line);
  EXPECT_EQ(line, "source,metric,count,min_ms,max_ms,mean_ms,p50_ms,p90_ms,variance_ms2,stdev_ms");
  int rows = 0;
  while (std::getline(lines, line)) {
    ++rows;
    EXPECT_EQ(std::count(line.begin(), line.end(), ','), 9) << line;
  }
  EXPECT_EQ(rows, 4);
  auto j = nlohmann::json::parse(json.str());
  EXPECT_EQ(j["all_trainers"]["batch_all"]["count"], 6);
  EXPECT_DOUBLE_EQ(j["trainer0"]["batch_all"]["mean_ms"].get<double>(), 2.0);
  EXPECT_EQ(metrics::series_from_json(metrics::series_to_json(s)), s);
  EXPECT_THAT(error_of([] { metrics::series_from_json("{oops"); }), ::testing::HasSubstr("not a metric series JSON"));
}

}  // namespace
}  // namespace ddpkit
