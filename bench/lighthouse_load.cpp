// Load generator for a lighthouse: G replica groups of W ranks with no model behind them, each
// speaking the real protocol to a real lighthouse over gRPC. bench/lighthouse_scale.py runs it
// against `ddpkit lighthouse` and torchft's Rust lighthouse and prints the table.
//
//   build/lighthouse_load --protocol ddpkit|torchft --address HOST:PORT [--pid PID]
//       --groups G [--ranks W] [--step-rate R] [--seconds S] [--warmup S] [--heartbeat-ms 100]
//       [--heartbeat rank|group] [--kills K] [--restart-after-s X] [--seed N]
//
// The load, as each system's clients make it:
// - steps: a global clock ticks R times a second; at each tick every live group whose previous
//   quorum has come back asks for the next one (its rank 0 does: one Quorum call per group per
//   step, as ddpkit's Manager and torchft's ManagerServer do). A group still waiting at a tick
//   skips it: the quorums lag.
// - heartbeats: a synchronous loop per sender, the next beat `heartbeat-ms` after the last reply
//   (ddpkit's Manager and torchft's ManagerServer both loop so). ddpkit's Manager beats from every
//   rank (--heartbeat rank); torchft beats once per group (--heartbeat group).
// - kills: a group goes silent at K moments spread over the measured window (its heartbeats stop,
//   its waiting quorum call is cancelled as a dead process's connection is), drawn from --seed;
//   with --restart-after-s it comes back that much later as a new incarnation at step 0.
// One channel (one TCP connection) per group. Replies are received whole but parsed only where
// a measure needs them: one observer group's quorums and ddpkit's heartbeat replies, so the
// driver's own CPU (it shares this machine with the lighthouse) stays small; it is printed.
//
// Prints one JSON line: quorum latency p50/p99 (from a group's ask to its reply), the ticks
// skipped, heartbeat latency and rate, per kill the detection time (the first heartbeat reply
// that names the group lost, ddpkit's, or the survivors' quorum without it, whichever is first)
// and the survivors' quorum (the observer's first quorum without it), the join time of a
// restarted group, and the lighthouse's CPU (cores) and memory.
#include "lighthouse.pb.h"
#include "torchft_lighthouse.pb.h"

#include <absl/synchronization/mutex.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct Config {
  std::string protocol = "ddpkit";
  std::string address;
  long pid = 0;
  int groups = 10;
  int ranks = 1;
  double step_rate = 5;
  double seconds = 10;
  double warmup = 3;
  int heartbeat_ms = 100;
  bool rank_heartbeats = true;
  int kills = 0;
  double restart_after_s = 0;
  uint64_t seed = 1;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "lighthouse_load: " << why << "\n"
            << "usage: lighthouse_load --protocol ddpkit|torchft --address HOST:PORT [--pid PID] --groups G [--ranks W]\n"
               "         [--step-rate R] [--seconds S] [--warmup S] [--heartbeat-ms 100] [--heartbeat rank|group]\n"
               "         [--kills K] [--restart-after-s X] [--seed N]\n";
  std::exit(2);
}

Config parse(int argc, char** argv) {
  Config c;
  bool heartbeat_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage("flag " + a + " needs a value");
    const std::string v = argv[++i];
    try {
      if (a == "--protocol") c.protocol = v;
      else if (a == "--address") c.address = v;
      else if (a == "--pid") c.pid = std::stol(v);
      else if (a == "--groups") c.groups = std::stoi(v);
      else if (a == "--ranks") c.ranks = std::stoi(v);
      else if (a == "--step-rate") c.step_rate = std::stod(v);
      else if (a == "--seconds") c.seconds = std::stod(v);
      else if (a == "--warmup") c.warmup = std::stod(v);
      else if (a == "--heartbeat-ms") c.heartbeat_ms = std::stoi(v);
      else if (a == "--heartbeat") {
        if (v != "rank" && v != "group") usage("--heartbeat must be rank or group, got " + v);
        c.rank_heartbeats = v == "rank";
        heartbeat_given = true;
      } else if (a == "--kills") c.kills = std::stoi(v);
      else if (a == "--restart-after-s") c.restart_after_s = std::stod(v);
      else if (a == "--seed") c.seed = std::stoull(v);
      else usage("unknown flag " + a);
    } catch (const std::logic_error&) {
      usage("flag " + a + ": '" + v + "' is not a number");
    }
  }
  if (c.protocol != "ddpkit" && c.protocol != "torchft") usage("--protocol must be ddpkit or torchft");
  if (c.address.rfind(':') == std::string::npos) usage("--address must be HOST:PORT");
  if (c.groups < 1 || c.groups > 100000) usage("--groups must be in 1..100000");
  if (c.ranks < 1 || c.ranks > 1024) usage("--ranks must be in 1..1024");
  if (c.step_rate <= 0 || c.seconds <= 0 || c.warmup < 0 || c.heartbeat_ms < 1) usage("rates and times must be positive");
  if (c.kills < 0 || (c.kills > 0 && c.kills >= c.groups)) usage("--kills must be in 0..groups-1");
  if (c.protocol == "torchft" && heartbeat_given && c.rank_heartbeats)
    usage("torchft beats once per group (its ManagerServer): --heartbeat rank is not its protocol");
  if (c.protocol == "torchft") c.rank_heartbeats = false;
  return c;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  return v[i];
}

// CPU seconds (user + system) of a process, from /proc/<pid>/stat.
double cpu_seconds(long pid) {
  std::ifstream f("/proc/" + (pid > 0 ? std::to_string(pid) : std::string("self")) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return -1;
  std::istringstream rest(line.substr(line.rfind(')') + 2));
  std::string field;
  double utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14) utime = std::stod(field);
    if (i == 15) stime = std::stod(field);
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// A /proc/<pid>/status field in MiB (VmRSS, VmHWM).
double status_mib(long pid, const std::string& key) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind(key + ":", 0) == 0) return std::stod(line.substr(key.size() + 1)) / 1024.0;
  return -1;
}

grpc::ByteBuffer to_buffer(const google::protobuf::Message& m) {
  const std::string bytes = m.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

std::string to_string(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!b.Dump(&slices).ok()) return out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

struct Group {
  int index = 0;
  std::string id;           // ddpkit: group_id; torchft: replica_id (a new one per incarnation)
  std::string incarnation;  // new each time the group starts
  int generation = 0;
  bool alive = true;
  bool waiting = false;
  bool joining = false;  // restarted, no quorum yet
  Clock::time_point started, killed_at;
  int64_t step = 0;
  // ddpkit: the quorum this group holds and its lighthouse, named in the next ask (as
  // LighthouseClient does), so that a step with the same participants gets a reply without them.
  int64_t known_quorum_id = -1;
  std::string known_lighthouse;
  std::vector<std::string> known_ids;  // its participants (the observer's only)
  std::shared_ptr<grpc::ClientContext> quorum_call;
  std::unique_ptr<grpc::GenericStub> stub;
};

struct Kill {
  std::string id;
  Clock::time_point at;
  double detected_ms = -1;   // first heartbeat reply naming it lost (ddpkit)
  double survivors_ms = -1;  // the observer's first quorum without it
};

class Driver {
 public:
  explicit Driver(Config c) : cfg_(std::move(c)), rng_(cfg_.seed) {
    const std::string prefix = cfg_.protocol == "ddpkit" ? "/ddpkit.ft.wire.Lighthouse/" : "/torchft.LighthouseService/";
    quorum_method_ = prefix + "Quorum";
    heartbeat_method_ = prefix + "Heartbeat";
    groups_.resize(static_cast<size_t>(cfg_.groups));
    for (int g = 0; g < cfg_.groups; ++g) {
      Group& gr = groups_[static_cast<size_t>(g)];
      gr.index = g;
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own, as a process has
      gr.stub = std::make_unique<grpc::GenericStub>(
          grpc::CreateCustomChannel(cfg_.address, grpc::InsecureChannelCredentials(), args));
      start_incarnation(gr, Clock::now());
    }
  }

  void run() {
    const auto t0 = Clock::now();
    measure_from_ = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg_.warmup));
    const auto end = measure_from_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg_.seconds));
    const auto period = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(1.0 / cfg_.step_rate));
    std::vector<std::pair<Clock::time_point, int>> kill_plan;  // (when, -1: kill / g: restart g)
    for (int k = 0; k < cfg_.kills; ++k)
      kill_plan.emplace_back(measure_from_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                                                 (k + 0.5) * cfg_.seconds / cfg_.kills)),
                             -1);
    auto next_tick = t0;
    double server_cpu0 = 0, self_cpu0 = 0;
    bool measuring = false;
    for (;;) {
      const auto now = Clock::now();
      if (now >= end) break;
      if (!measuring && now >= measure_from_) {
        measuring = true;
        server_cpu0 = cfg_.pid > 0 ? cpu_seconds(cfg_.pid) : -1;
        self_cpu0 = cpu_seconds(0);
      }
      std::vector<std::function<void()>> issue;
      bool ticked = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<std::pair<Clock::time_point, int>> restarts;
        for (auto it = kill_plan.begin(); it != kill_plan.end();) {
          if (it->first > now) {
            ++it;
            continue;
          }
          if (it->second < 0) {
            const int victim = pick_victim();
            if (victim >= 0) {
              kill(groups_[static_cast<size_t>(victim)], now);
              if (cfg_.restart_after_s > 0)
                restarts.emplace_back(now + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(cfg_.restart_after_s)),
                                      victim);
            }
          } else {
            Group& g = groups_[static_cast<size_t>(it->second)];
            start_incarnation(g, now);
          }
          it = kill_plan.erase(it);
        }
        kill_plan.insert(kill_plan.end(), restarts.begin(), restarts.end());
        if (now >= next_tick) {
          ++tick_;
          ticked = true;
          for (auto& g : groups_) {
            if (!g.alive) continue;
            if (now >= measure_from_) ++ticks_;
            if (g.waiting) {
              if (now >= measure_from_) ++skipped_;
              continue;
            }
            g.waiting = true;
            issue.push_back(quorum_call(g, now));
          }
          next_tick += period;
          if (next_tick < now) next_tick = now + period;  // far behind: do not burst
        }
        while (!beats_due_.empty() && beats_due_.top().due <= now) {
          const Due d = beats_due_.top();
          beats_due_.pop();
          Group& g = groups_[static_cast<size_t>(d.group)];
          if (!g.alive || g.generation != d.generation) continue;
          issue.push_back(heartbeat_call(g, d.rank, now));
        }
      }
      for (auto& f : issue) f();
      if (ticked) {
        std::lock_guard<std::mutex> lock(mu_);
        rounds_[tick_].first = Clock::now();  // every ask of this step is with gRPC now
      }
      Clock::time_point wake = next_tick;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!beats_due_.empty()) wake = std::min(wake, beats_due_.top().due);
      }
      for (const auto& k : kill_plan) wake = std::min(wake, k.first);
      wake = std::min(wake, Clock::now() + std::chrono::milliseconds(2));
      std::this_thread::sleep_until(wake);
    }
    const double wall = std::chrono::duration<double>(Clock::now() - measure_from_).count();
    server_cores_ = cfg_.pid > 0 ? (cpu_seconds(cfg_.pid) - server_cpu0) / wall : -1;
    self_cores_ = (cpu_seconds(0) - self_cpu0) / wall;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      for (auto& g : groups_)
        if (g.quorum_call) g.quorum_call->TryCancel();
    }
    // Let cancelled calls finish before the stubs go.
    for (int i = 0; i < 500 && in_flight() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    report(wall);
  }

 private:
  struct Due {
    Clock::time_point due;
    int group, rank, generation;
    bool operator<(const Due& o) const { return due > o.due; }  // min-heap
  };

  int in_flight() {
    std::lock_guard<std::mutex> lock(mu_);
    return in_flight_;
  }

  std::string random_hex(int n) {
    static const char* digits = "0123456789abcdef";
    std::string s;
    for (int i = 0; i < n; ++i) s += digits[rng_() % 16];
    return s;
  }

  // Under mu_ (or before the run): a group (re)starts: a new incarnation, heartbeats from now.
  void start_incarnation(Group& g, Clock::time_point now) {
    g.incarnation = random_hex(16);
    g.id = cfg_.protocol == "ddpkit" ? "group_" + std::to_string(g.index)
                                     : "group_" + std::to_string(g.index) + ":" + g.incarnation;
    ++g.generation;
    g.alive = true;
    g.waiting = false;
    g.joining = g.generation > 1;
    g.started = now;
    g.step = 0;
    g.known_quorum_id = -1;
    g.known_lighthouse.clear();
    const int senders = cfg_.rank_heartbeats ? cfg_.ranks : 1;
    std::uniform_int_distribution<int> phase(0, cfg_.heartbeat_ms - 1);
    for (int r = 0; r < senders; ++r)
      beats_due_.push({now + std::chrono::milliseconds(g.generation > 1 ? 0 : phase(rng_)), g.index, r, g.generation});
  }

  int pick_victim() {
    std::vector<int> alive;
    for (const auto& g : groups_)
      if (g.alive && g.index != observer_) alive.push_back(g.index);
    if (alive.empty()) return -1;
    return alive[rng_() % alive.size()];
  }

  void kill(Group& g, Clock::time_point now) {
    g.alive = false;
    g.killed_at = now;
    if (g.quorum_call) g.quorum_call->TryCancel();
    kills_.push_back(Kill{g.id, now});
  }

  std::function<void()> quorum_call(Group& g, Clock::time_point now) {
    auto request = std::make_shared<grpc::ByteBuffer>();
    if (cfg_.protocol == "ddpkit") {
      ddpkit::ft::wire::QuorumRequest req;
      auto* m = req.mutable_member();
      m->set_group_id(g.id);
      m->set_step(g.step);
      m->set_world_size(cfg_.ranks);
      m->set_incarnation(g.incarnation);
      for (int r = 0; r < cfg_.ranks; ++r) {
        m->add_state_addresses("10.0." + std::to_string(g.index / 250) + "." + std::to_string(g.index % 250) + ":" +
                               std::to_string(40000 + r));
        m->add_hosts("host-" + std::to_string(g.index));
      }
      req.set_timeout_ms(60000);
      if (!g.known_lighthouse.empty()) {
        req.set_known_quorum_id(g.known_quorum_id);
        req.set_known_lighthouse(g.known_lighthouse);
      }
      *request = to_buffer(req);
    } else {
      torchft::LighthouseQuorumRequest req;
      auto* m = req.mutable_requester();
      m->set_replica_id(g.id);
      m->set_address("http://host-" + std::to_string(g.index) + ":29512");
      m->set_store_address("host-" + std::to_string(g.index) + ":29500");
      m->set_step(g.step);
      m->set_world_size(static_cast<uint64_t>(cfg_.ranks));
      *request = to_buffer(req);
    }
    auto ctx = std::make_shared<grpc::ClientContext>();
    g.quorum_call = ctx;
    const int index = g.index, generation = g.generation;
    const int64_t tick = tick_;
    return call(g, quorum_method_, std::move(ctx), std::chrono::seconds(65), std::move(request),
                [this, index, generation, now, tick](const grpc::Status& s, const grpc::ByteBuffer& reply) {
                  on_quorum(index, generation, now, tick, s, reply);
                });
  }

  // Under mu_: a call of `method` for group `g`, to issue outside the lock; `done` runs on gRPC's
  // thread with the reply.
  std::function<void()> call(Group& g, const std::string& method, std::shared_ptr<grpc::ClientContext> ctx,
                             std::chrono::seconds deadline, std::shared_ptr<grpc::ByteBuffer> request,
                             std::function<void(const grpc::Status&, const grpc::ByteBuffer&)> done) {
    ctx->set_deadline(std::chrono::system_clock::now() + deadline);
    ++in_flight_;
    auto response = std::make_shared<grpc::ByteBuffer>();
    grpc::GenericStub* stub = g.stub.get();
    return [stub, &method, ctx, request, response, done] {
      stub->UnaryCall(ctx.get(), method, grpc::StubOptions(), request.get(), response.get(),
                      [ctx, request, response, done](grpc::Status s) { done(s, *response); });
    };
  }

  std::function<void()> heartbeat_call(Group& g, int rank, Clock::time_point now) {
    auto request = std::make_shared<grpc::ByteBuffer>();
    if (cfg_.protocol == "ddpkit") {
      ddpkit::ft::wire::HeartbeatRequest req;
      req.set_group_id(g.id);
      req.set_rank(rank);
      req.set_incarnation(g.incarnation);
      // Through the group: rank 0 beats for every rank, each heard from just now.
      if (!cfg_.rank_heartbeats)
        for (int r = 0; r < cfg_.ranks; ++r) req.add_rank_ages_ms(0);
      *request = to_buffer(req);
    } else {
      torchft::LighthouseHeartbeatRequest req;
      req.set_replica_id(g.id);
      *request = to_buffer(req);
    }
    const int index = g.index, generation = g.generation;
    return call(g, heartbeat_method_, std::make_shared<grpc::ClientContext>(), std::chrono::seconds(5), std::move(request),
                [this, index, generation, rank, now](const grpc::Status& s, const grpc::ByteBuffer& reply) {
                  on_heartbeat(index, generation, rank, now, s, reply);
                });
  }

  void on_quorum(int index, int generation, Clock::time_point sent, int64_t tick, const grpc::Status& s,
                 const grpc::ByteBuffer& reply) {
    const auto now = Clock::now();
    // Parsed only for the observer, and for a restarted group's first quorum (its step).
    std::string parsed_ids;  // '\n'-joined participant ids
    bool parse = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      --in_flight_;
      Group& g = groups_[static_cast<size_t>(index)];
      if (stopping_ || g.generation != generation || !g.alive) return;
      g.waiting = false;
      g.quorum_call.reset();
      if (!s.ok()) {
        if (sent >= measure_from_) ++quorum_errors_;
        if (quorum_errors_ <= 3) std::cerr << "lighthouse_load: quorum of " << g.id << ": " << s.error_message() << "\n";
        return;
      }
      // A group behind the others (it skipped a tick, or restarted) heals to the highest step,
      // as a Manager does from the quorum's max_step.
      g.step = std::max(g.step + 1, max_step_);
      if (sent >= measure_from_) {
        quorum_ms_.push_back(ms(now - sent));
        auto& round = rounds_[tick];
        round.second = std::max(round.second, now);
      }
      if (g.joining) {
        g.joining = false;
        join_ms_.push_back(ms(now - g.started));
      }
      max_step_ = std::max(max_step_, g.step);
      // ddpkit's client reads every reply (the quorum it holds); torchft's replies are read only
      // where a measure needs them (the driver shares the cores with the lighthouse).
      parse = index == observer_ || cfg_.protocol == "ddpkit";
    }
    if (!parse) return;
    const std::string bytes = to_string(reply);
    std::vector<std::string> ids;
    int64_t quorum_id = -1;
    if (cfg_.protocol == "ddpkit") {
      ddpkit::ft::wire::QuorumReply r;
      if (!r.ParseFromString(bytes)) return;
      quorum_id = r.quorum_id();
      {
        std::lock_guard<std::mutex> lock(mu_);
        Group& g = groups_[static_cast<size_t>(index)];
        if (g.generation == generation) {
          g.known_quorum_id = quorum_id;
          if (r.delta() && r.participants_size() == 0 && sent >= measure_from_) ++compact_replies_;
          g.known_lighthouse = r.lighthouse();
          if (index == observer_) {
            if (!r.delta()) g.known_ids.clear();
            for (const auto& d : r.dropped())
              if (r.delta()) g.known_ids.erase(std::remove(g.known_ids.begin(), g.known_ids.end(), d), g.known_ids.end());
            for (const auto& p : r.participants())
              if (std::find(g.known_ids.begin(), g.known_ids.end(), p.group_id()) == g.known_ids.end())
                g.known_ids.push_back(p.group_id());
            ids = g.known_ids;
          }
        }
      }
      if (index != observer_) return;
    } else {
      torchft::LighthouseQuorumResponse r;
      if (!r.ParseFromString(bytes)) return;
      quorum_id = r.quorum().quorum_id();
      for (const auto& p : r.quorum().participants()) ids.push_back(p.replica_id());
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (quorum_id != last_quorum_id_) ++quorum_changes_;
    last_quorum_id_ = quorum_id;
    observed_size_ = static_cast<int>(ids.size());
    for (auto& k : kills_) {
      if (k.survivors_ms >= 0 || sent < k.at) continue;
      if (std::find(ids.begin(), ids.end(), k.id) == ids.end()) k.survivors_ms = ms(now - k.at);
    }
  }

  void on_heartbeat(int index, int generation, int rank, Clock::time_point sent, const grpc::Status& s,
                    const grpc::ByteBuffer& reply) {
    const auto now = Clock::now();
    std::vector<std::string> lost;
    if (s.ok() && cfg_.protocol == "ddpkit") {
      ddpkit::ft::wire::HeartbeatReply r;
      if (r.ParseFromString(to_string(reply)))
        for (const auto& g : r.lost()) lost.push_back(g);
    }
    std::lock_guard<std::mutex> lock(mu_);
    --in_flight_;
    if (stopping_) return;
    if (sent >= measure_from_) {
      if (s.ok()) {
        beat_ms_.push_back(ms(now - sent));
      } else {
        ++beat_errors_;
      }
    }
    for (const auto& name : lost) {
      bool killed = false;
      for (auto& k : kills_) {
        if (k.id != name) continue;
        killed = true;
        if (k.detected_ms < 0 && sent >= k.at) k.detected_ms = ms(now - k.at);
      }
      if (!killed && sent >= measure_from_) ++false_losses_;
    }
    Group& g = groups_[static_cast<size_t>(index)];
    if (!g.alive || g.generation != generation) return;
    beats_due_.push({now + std::chrono::milliseconds(cfg_.heartbeat_ms), index, rank, generation});
  }

  void report(double wall) {
    std::lock_guard<std::mutex> lock(mu_);
    // A step's round at the lighthouse: from the moment every ask of it was with gRPC to the last
    // reply (the driver's own time to issue a thousand asks left out).
    std::vector<double> round_ms;
    for (const auto& kv : rounds_)
      if (kv.second.second > kv.second.first && kv.second.first > measure_from_)
        round_ms.push_back(ms(kv.second.second - kv.second.first));
    std::vector<double> detected, survivors;
    // Detection: when the lighthouse first acts on the loss, whichever comes first: a heartbeat
    // reply naming the group lost (ddpkit; what releases survivors blocked in a collective with
    // it) or the survivors' quorum without it (both systems).
    for (const auto& k : kills_) {
      double first = -1;
      for (double t : {k.detected_ms, k.survivors_ms})
        if (t >= 0 && (first < 0 || t < first)) first = t;
      if (first >= 0) detected.push_back(first);
      if (k.survivors_ms >= 0) survivors.push_back(k.survivors_ms);
    }
    const int senders = cfg_.rank_heartbeats ? cfg_.ranks : 1;
    std::ostringstream o;
    o.setf(std::ios::fixed);
    o.precision(2);
    o << "{\"protocol\": \"" << cfg_.protocol << "\", \"groups\": " << cfg_.groups << ", \"ranks\": " << cfg_.ranks
      << ", \"heartbeat\": \"" << (cfg_.rank_heartbeats ? "rank" : "group") << "\", \"step_rate\": " << cfg_.step_rate
      << ", \"seconds\": " << wall << ", \"quorums\": " << quorum_ms_.size()
      << ", \"quorum_p50_ms\": " << percentile(quorum_ms_, 0.5) << ", \"quorum_p99_ms\": " << percentile(quorum_ms_, 0.99)
      << ", \"round_p50_ms\": " << percentile(round_ms, 0.5) << ", \"round_p99_ms\": " << percentile(round_ms, 0.99)
      << ", \"quorums_per_group_s\": " << static_cast<double>(quorum_ms_.size()) / cfg_.groups / wall
      << ", \"ticks_skipped\": " << (ticks_ ? static_cast<double>(skipped_) / static_cast<double>(ticks_) : 0.0)
      << ", \"quorum_errors\": " << quorum_errors_ << ", \"heartbeat_p50_ms\": " << percentile(beat_ms_, 0.5)
      << ", \"heartbeat_p99_ms\": " << percentile(beat_ms_, 0.99)
      << ", \"heartbeats_per_sender_s\": " << static_cast<double>(beat_ms_.size()) / (cfg_.groups * senders) / wall
      << ", \"heartbeat_errors\": " << beat_errors_ << ", \"false_losses\": " << false_losses_
      << ", \"kills\": " << kills_.size() << ", \"detected\": " << detected.size()
      << ", \"detect_p50_ms\": " << percentile(detected, 0.5) << ", \"detect_max_ms\": " << percentile(detected, 1.0)
      << ", \"survivors_p50_ms\": " << percentile(survivors, 0.5) << ", \"survivors_max_ms\": " << percentile(survivors, 1.0)
      << ", \"joins\": " << join_ms_.size() << ", \"join_p50_ms\": " << percentile(join_ms_, 0.5)
      << ", \"compact_replies\": " << compact_replies_ << ", \"quorum_changes\": " << quorum_changes_ << ", \"observed_participants\": " << observed_size_
      << ", \"lighthouse_cores\": " << server_cores_
      << ", \"lighthouse_rss_mib\": " << (cfg_.pid > 0 ? status_mib(cfg_.pid, "VmRSS") : -1.0)
      << ", \"lighthouse_peak_rss_mib\": " << (cfg_.pid > 0 ? status_mib(cfg_.pid, "VmHWM") : -1.0)
      << ", \"driver_cores\": " << self_cores_ << "}";
    std::cout << o.str() << std::endl;
  }

  Config cfg_;
  std::mt19937_64 rng_;
  std::string quorum_method_, heartbeat_method_;
  std::mutex mu_;
  std::vector<Group> groups_;
  std::priority_queue<Due> beats_due_;
  std::vector<Kill> kills_;
  Clock::time_point measure_from_;
  const int observer_ = 0;
  bool stopping_ = false;
  int in_flight_ = 0;
  std::map<int64_t, std::pair<Clock::time_point, Clock::time_point>> rounds_;  // tick -> (asked, last reply)
  int64_t tick_ = 0;
  int64_t max_step_ = 0, ticks_ = 0, skipped_ = 0, quorum_errors_ = 0, beat_errors_ = 0, false_losses_ = 0;
  int64_t last_quorum_id_ = -1, quorum_changes_ = 0, compact_replies_ = 0;
  int observed_size_ = 0;
  std::vector<double> quorum_ms_, beat_ms_, join_ms_;
  double server_cores_ = -1, self_cores_ = -1;
};

}  // namespace

int main(int argc, char** argv) {
  const Config cfg = parse(argc, argv);
  // As ddpkit's own gRPC processes (src/ps/grpc_common.h): Debian's Abseil records a lock graph on
  // every gRPC mutex acquisition unless told not to; the driver's CPU is shared with either lighthouse.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // A connection per group: room for them all.
  struct rlimit files;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }
  Driver driver(cfg);
  driver.run();
  return 0;
}
