// `ddpkit lighthouse`: the quorum service of fault-tolerant jobs, on its own (a job spread over
// hosts points every group at it with --lighthouse HOST:PORT).
#include "cli.h"

#include <ddpkit/ft/lighthouse.h>

#include <chrono>
#include <ctime>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace ddpkit {
namespace cli {

namespace {

// "2026-12-02T03:40:01.123Z": events from several hosts line up on one clock.
std::string utc_now_ms() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(now);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  std::ostringstream os;
  os << std::put_time(&tm, "%Y-%m-%dT%H:%M:%S") << '.' << std::setw(3) << std::setfill('0') << ms << 'Z';
  return os.str();
}

// Prints the lighthouse's events, a line each, but only after its address line: the lighthouse's
// thread may report a quorum before start() returns, and scripts read the first line for the
// address. Events that come earlier wait here and follow it.
class EventPrinter {
 public:
  void print(const std::string& event) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string line = utc_now_ms() + " " + event;
    if (open_)
      std::cout << line << std::endl;
    else
      held_.push_back(line);
  }
  void open_after(const std::string& first_line) {
    std::lock_guard<std::mutex> lock(mu_);
    std::cout << first_line << std::endl;
    for (const auto& line : held_) std::cout << line << std::endl;
    held_.clear();
    open_ = true;
  }

 private:
  std::mutex mu_;
  bool open_ = false;
  std::vector<std::string> held_;
};

}  // namespace

const char* kLighthouseUsage = R"(usage: ddpkit lighthouse [flags]

The quorum service of fault-tolerant training (ddpkit train --fault-tolerant --lighthouse
HOST:PORT; docs/fault_tolerance.md). Runs until SIGINT or SIGTERM.

flags:
  --address HOST:PORT      listen here (default 0.0.0.0:29510; port 0 picks one)
  --advertise-host HOST    the host the groups reach this machine at (default: this host's name)
  --min-replicas M         fewest replica groups a step may run with (default 1)
  --heartbeat-timeout-ms T a group whose rank has not heartbeated for T ms is lost (default 1000)
  --join-timeout-ms T      how long a quorum waits for a live group that has not asked (default 10000)
  --expected-groups R      the first quorum waits up to the join timeout for R groups (default 0)
  --token-file PATH        require this shared secret (also DDPKIT_FT_TOKEN) from every caller
  --tls-cert PATH          PEM certificate chain; with --tls-key, serve TLS
  --tls-key PATH           PEM private key
  --quiet                  do not print the quorum changes and lost groups (printed by default,
                           a line each: UTC time, then "quorum Q: groups [...]" or "group G lost: ...")
)";

int run_lighthouse(const std::vector<std::string>& args) {
  Flags f(args,
          {{"address", "0.0.0.0:29510"}, {"advertise-host", ""}, {"min-replicas", "1"}, {"heartbeat-timeout-ms", "1000"},
           {"join-timeout-ms", "10000"}, {"expected-groups", "0"}, {"token-file", ""}, {"tls-cert", ""}, {"tls-key", ""}},
          {"quiet"});
  if (f.integer("min-replicas") < 1) throw UsageError("--min-replicas must be >= 1");
  if (f.integer("heartbeat-timeout-ms") < 1) throw UsageError("--heartbeat-timeout-ms must be >= 1");
  if (f.integer("join-timeout-ms") < 0) throw UsageError("--join-timeout-ms must be >= 0");
  if (f.integer("expected-groups") < 0) throw UsageError("--expected-groups must be >= 0");
  if (f.str("address").rfind(':') == std::string::npos) throw UsageError("--address must be HOST:PORT");
  if (f.str("tls-cert").empty() != f.str("tls-key").empty()) throw UsageError("--tls-cert and --tls-key go together");
  const std::string token = read_token(f.str("token-file"), "DDPKIT_FT_TOKEN");
  catch_stop_signals();
  auto printer = std::make_shared<EventPrinter>();
  std::function<void(const std::string&)> print_event;
  if (!f.on("quiet")) print_event = [printer](const std::string& event) { printer->print(event); };
  ft::Lighthouse lighthouse(ft::LighthouseOptions()
                                .address(f.str("address"))
                                .advertise_host(f.str("advertise-host"))
                                .min_replicas(f.integer("min-replicas"))
                                .heartbeat_timeout(std::chrono::milliseconds(f.integer("heartbeat-timeout-ms")))
                                .join_timeout(std::chrono::milliseconds(f.integer("join-timeout-ms")))
                                .expected_groups(f.integer("expected-groups"))
                                .token(token)
                                .tls(ft::TlsFiles().certificate(f.str("tls-cert")).private_key(f.str("tls-key")))
                                .on_event(print_event));
  lighthouse.start();
  std::ostringstream listening;
  listening << "ddpkit lighthouse: listening on " << lighthouse.address() << " (min replicas "
            << f.integer("min-replicas") << (f.str("tls-cert").empty() ? ", plaintext" : ", TLS") << ")";
  printer->open_after(listening.str());
  const int sig = wait_for_stop_signal();
  const int64_t formed = lighthouse.quorums_formed();
  const auto stores = lighthouse.store_use();
  const auto rounds = lighthouse.round_times();
  lighthouse.shutdown();
  std::cout << "ddpkit lighthouse: stopped by signal " << sig << " after " << formed << " quorums (" << stores.keys
            << " keys in the last " << stores.stores << " quorums' stores)" << std::endl;
  if (rounds.rounds > 0)
    std::cout << std::fixed << std::setprecision(2) << "ddpkit lighthouse: last " << rounds.sampled
              << " rounds: asks in p50 " << rounds.intake_p50_ms << " p99 " << rounds.intake_p99_ms
              << " ms, replies out p50 " << rounds.replies_p50_ms << " p99 " << rounds.replies_p99_ms << " max "
              << rounds.replies_max_ms << " ms; " << rounds.whole_rounds << " rounds with whole quorums, replies out max "
              << rounds.whole_replies_max_ms << " ms" << std::endl;
  return 0;
}

}  // namespace cli
}  // namespace ddpkit
