// The lighthouse (include/ddpkit/ft/lighthouse.h): heartbeats, the quorum rule, and the store
// the cross-group process groups meet through.
#include <ddpkit/ft/lighthouse.h>

#include <ddpkit/compat.h>
#include <ddpkit/error.h>

#include "../ps/grpc_common.h"
#include "lighthouse.grpc.pb.h"
#include "wire.h"

#include <grpcpp/grpcpp.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace ddpkit {
namespace ft {

using Clock = std::chrono::steady_clock;

int Quorum::replica_rank(const std::string& group_id) const {
  for (size_t i = 0; i < participants.size(); ++i)
    if (participants[i].group_id == group_id) return static_cast<int>(i);
  return -1;
}

namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

}  // namespace

struct Lighthouse::Impl {
  explicit Impl(LighthouseOptions o) : options(std::move(o)) {}

  struct Waiter {
    GroupInfo info;
    bool broken = false;
    Clock::time_point since;
    bool answered = false;
    Quorum quorum;
    std::string error;  // answered with an error (superseded, shutting down)
  };
  struct Beats {
    std::string incarnation;
    int world_size = 0;
    std::map<int, Clock::time_point> last;  // rank -> last heartbeat
  };

  LighthouseOptions options;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, std::shared_ptr<Waiter>> waiting;  // by group id
  std::map<std::string, Beats> beats;                      // by group id
  Quorum last;
  std::set<std::string> reported_lost;  // groups of `last` whose loss on_event has been told
  std::vector<std::string> events;       // for on_event, which the ticker calls outside mu
  int64_t formed = 0;
  bool stopping = false;

  c10::intrusive_ptr<c10d::TCPStore> store;
  std::string host;
  int bound_port = 0;
  std::unique_ptr<grpc::Service> service;
  std::unique_ptr<grpc::Server> server;
  std::thread ticker;

  // A group is live while every one of its ranks has heartbeated within heartbeat_timeout (ranks
  // that have not yet are given that long from when the group registered). A group whose rank 0
  // has not asked for a quorum yet (its size unknown) is live while the ranks heard from are.
  bool live(const std::string& group, Clock::time_point now) const {
    auto it = beats.find(group);
    if (it == beats.end()) return false;
    if (it->second.world_size <= 0) {
      for (const auto& kv : it->second.last)
        if (now - kv.second > options.heartbeat_timeout()) return false;
      return !it->second.last.empty();
    }
    for (int r = 0; r < it->second.world_size; ++r) {
      auto b = it->second.last.find(r);
      if (b == it->second.last.end() || now - b->second > options.heartbeat_timeout()) return false;
    }
    return true;
  }

  // The group's rank 0 asked for a quorum: (re)register its incarnation and ranks.
  void register_group(const GroupInfo& g, Clock::time_point now) {
    Beats& b = beats[g.group_id];
    if (b.incarnation != g.incarnation) b.last.clear();
    b.incarnation = g.incarnation;
    b.world_size = g.world_size;
    for (auto it = b.last.begin(); it != b.last.end();) it = it->first >= g.world_size ? b.last.erase(it) : std::next(it);
    for (int r = 0; r < g.world_size; ++r) b.last.emplace(r, now);  // not yet heard from: from now
    b.last[0] = now;
  }

  // The last quorum's participants that are gone: not live, or restarted since (the process
  // that took part is not the one heartbeating now, however soon its successor came).
  std::vector<std::string> lost_of_last(Clock::time_point now) const {
    std::vector<std::string> lost;
    for (const auto& p : last.participants) {
      auto it = beats.find(p.group_id);
      if (!live(p.group_id, now) || it == beats.end() || it->second.incarnation != p.incarnation)
        lost.push_back(p.group_id);
    }
    return lost;
  }

  // Under mu: forms the next quorum if the rule allows, answering its participants.
  void try_form(Clock::time_point now) {
    report_losses(now);  // before a quorum without them replaces the one they were lost from
    std::vector<std::shared_ptr<Waiter>> joining;
    bool every_live_group_asked = true;
    for (const auto& kv : beats) {
      if (!live(kv.first, now)) continue;
      auto w = waiting.find(kv.first);
      if (w == waiting.end()) {
        every_live_group_asked = false;
      } else if (w->second->info.incarnation == kv.second.incarnation) {
        joining.push_back(w->second);
      }
    }
    if (joining.empty() || static_cast<int>(joining.size()) < options.min_replicas()) return;
    Clock::time_point first = now;
    for (const auto& w : joining) first = std::min(first, w->since);
    const bool waited = now - first >= options.join_timeout();
    if (!every_live_group_asked && !waited) return;
    if (formed == 0 && static_cast<int>(joining.size()) < options.expected_groups() && !waited) return;
    std::sort(joining.begin(), joining.end(),
              [](const auto& a, const auto& b) { return a->info.group_id < b->info.group_id; });
    Quorum q;
    bool broken = false;
    for (const auto& w : joining) {
      q.participants.push_back(w->info);
      q.max_step = std::max(q.max_step, w->info.step);
      broken = broken || w->broken;
    }
    bool same = !broken && last.participants.size() == q.participants.size();
    for (size_t i = 0; same && i < q.participants.size(); ++i)
      same = last.participants[i].group_id == q.participants[i].group_id &&
             last.participants[i].incarnation == q.participants[i].incarnation;
    q.quorum_id = same ? last.quorum_id : last.quorum_id + 1;
    q.store_address = host + ":" + std::to_string(store->getPort());
    std::vector<int> sources;
    for (size_t i = 0; i < q.participants.size(); ++i)
      if (q.participants[i].step == q.max_step) sources.push_back(static_cast<int>(i));
    size_t next = 0;
    for (const auto& p : q.participants)
      q.heal_sources.push_back(p.step < q.max_step ? sources[next++ % sources.size()] : -1);
    for (const auto& p : last.participants)
      if (q.replica_rank(p.group_id) < 0) q.dropped.push_back(p.group_id);
    for (const auto& w : joining) {
      w->quorum = q;
      w->answered = true;
      waiting.erase(w->info.group_id);
    }
    if (options.on_event() && q.quorum_id != last.quorum_id) events.push_back(describe_change(q));
    last = std::move(q);
    reported_lost.clear();
    ++formed;
    cv.notify_all();
  }

  std::string describe_change(const Quorum& q) const {
    std::vector<std::string> groups, joining;
    for (const auto& p : q.participants) {
      groups.push_back(p.group_id);
      if (last.replica_rank(p.group_id) < 0) joining.push_back(p.group_id);
    }
    std::ostringstream os;
    os << "quorum " << q.quorum_id << ": groups [" << joined(groups) << "]";
    if (!q.dropped.empty()) os << ", dropped [" << joined(q.dropped) << "]";
    if (formed > 0 && !joining.empty()) os << ", joined [" << joined(joining) << "]";
    return os.str();
  }

  // Under mu (try_form): queues for on_event each group of the last quorum that has just become
  // lost (its heartbeats stopped, or it restarted), once per quorum.
  void report_losses(Clock::time_point now) {
    if (!options.on_event()) return;
    for (const auto& id : lost_of_last(now)) {
      if (!reported_lost.insert(id).second) continue;
      std::ostringstream os;
      os << "group " << id << " lost: ";
      auto it = beats.find(id);
      const GroupInfo& was = last.participants[static_cast<size_t>(last.replica_rank(id))];  // lost_of_last's
      if (it != beats.end() && it->second.incarnation != was.incarnation) {
        os << "restarted (incarnation " << it->second.incarnation << ")";
      } else if (it != beats.end()) {
        int rank = -1;
        Clock::duration silent{0};
        for (const auto& kv : it->second.last)
          if (now - kv.second > silent) {
            silent = now - kv.second;
            rank = kv.first;
          }
        os << "rank " << rank << " silent for "
           << std::chrono::duration_cast<std::chrono::milliseconds>(silent).count() << " ms";
      } else {
        os << "never heartbeated";
      }
      events.push_back(os.str());
    }
  }

  grpc::Status check_token(const grpc::ServerContext* ctx) const {
    const std::string refusal = ps::token_refusal(ctx->client_metadata(), options.token(), "lighthouse");
    return refusal.empty() ? grpc::Status::OK : grpc::Status(grpc::StatusCode::UNAUTHENTICATED, refusal);
  }

  grpc::Status quorum(const grpc::ServerContext* ctx, const wire::QuorumRequest& req, wire::QuorumReply* reply) {
    if (auto s = check_token(ctx); !s.ok()) return s;
    const std::string bad = wire::check_member(req.member());
    if (!bad.empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "quorum request: " + bad);
    if (req.timeout_ms() <= 0 || req.timeout_ms() > 24 * 3600 * 1000)
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "quorum request: timeout_ms must be in 1..86400000, got " + std::to_string(req.timeout_ms()));
    auto w = std::make_shared<Waiter>();
    w->info = wire::from_wire(req.member());
    w->broken = req.broken();
    const std::string& id = w->info.group_id;
    std::unique_lock<std::mutex> lock(mu);
    const auto now = Clock::now();
    w->since = now;
    if (auto it = waiting.find(id); it != waiting.end()) {
      if (it->second->info.incarnation == w->info.incarnation)
        return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                            "group " + id + " (incarnation " + w->info.incarnation + ") already waits for a quorum");
      it->second->answered = true;
      it->second->error = "superseded: group " + id + " (incarnation " + it->second->info.incarnation +
                          ") asked again as incarnation " + w->info.incarnation;
      waiting.erase(it);
    }
    register_group(w->info, now);
    waiting[id] = w;
    try_form(now);
    const auto deadline = now + std::chrono::milliseconds(req.timeout_ms());
    cv.wait_until(lock, deadline, [&] { return w->answered || stopping || ctx->IsCancelled(); });
    if (w->answered && w->error.empty()) {
      wire::to_wire(w->quorum, reply);
      return grpc::Status::OK;
    }
    if (auto it = waiting.find(id); it != waiting.end() && it->second == w) waiting.erase(it);
    if (!w->error.empty()) return grpc::Status(grpc::StatusCode::ABORTED, w->error);
    if (stopping) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the lighthouse is shutting down");
    std::vector<std::string> live_groups, asked;
    for (const auto& kv : beats)
      if (live(kv.first, Clock::now())) live_groups.push_back(kv.first);
    for (const auto& kv : waiting) asked.push_back(kv.first);
    asked.push_back(id);
    std::ostringstream os;
    os << "no quorum within " << req.timeout_ms() << " ms: live groups [" << joined(live_groups)
       << "], asking [" << joined(asked) << "], min_replicas " << options.min_replicas() << "; lost since the last quorum ["
       << joined(lost_of_last(Clock::now())) << "]";
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, os.str());
  }

  grpc::Status heartbeat(const grpc::ServerContext* ctx, const wire::HeartbeatRequest& req,
                         wire::HeartbeatReply* reply) {
    if (auto s = check_token(ctx); !s.ok()) return s;
    const std::string bad = wire::check_heartbeat(req);
    if (!bad.empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "heartbeat: " + bad);
    std::lock_guard<std::mutex> lock(mu);
    const auto now = Clock::now();
    Beats& b = beats[req.group_id()];
    if (b.incarnation != req.incarnation()) {
      // A new incarnation (the group restarted) replaces the old one's ranks. Its size is known
      // once its rank 0 asks for a quorum.
      b.incarnation = req.incarnation();
      b.world_size = 0;
      b.last.clear();
    }
    if (b.world_size > 0 && req.rank() >= b.world_size)
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "heartbeat: rank " + std::to_string(req.rank()) + " is outside group " + req.group_id() +
                              " of " + std::to_string(b.world_size) + " ranks");
    b.last[req.rank()] = now;
    reply->set_quorum_id(last.quorum_id);
    for (const auto& g : lost_of_last(now)) reply->add_lost(g);
    return grpc::Status::OK;
  }
};

namespace {

class Service final : public wire::Lighthouse::Service {
 public:
  explicit Service(Lighthouse::Impl* impl) : impl_(impl) {}
  grpc::Status Quorum(grpc::ServerContext* ctx, const wire::QuorumRequest* req, wire::QuorumReply* reply) override {
    return impl_->quorum(ctx, *req, reply);
  }
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const wire::HeartbeatRequest* req,
                         wire::HeartbeatReply* reply) override {
    return impl_->heartbeat(ctx, *req, reply);
  }

 private:
  Lighthouse::Impl* impl_;
};

std::string this_host_name() {
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0 || !name[0]) return "127.0.0.1";
  return name;
}

}  // namespace

Lighthouse::Lighthouse(LighthouseOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  ps::hold_grpc_runtime();
  const auto& o = impl_->options;
  DDPKIT_CHECK(o.min_replicas() >= 1, "lighthouse: min_replicas must be >= 1, got ", o.min_replicas());
  DDPKIT_CHECK(o.heartbeat_timeout().count() > 0, "lighthouse: heartbeat_timeout must be positive");
  DDPKIT_CHECK(o.join_timeout().count() >= 0, "lighthouse: join_timeout must be >= 0");
  DDPKIT_CHECK(o.tls().certificate().empty() == o.tls().private_key().empty(),
               "lighthouse: TLS needs both a certificate and a private key");
  DDPKIT_CHECK(o.address().rfind(':') != std::string::npos, "lighthouse: address must be host:port, got '",
               o.address(), "'");
}

Lighthouse::~Lighthouse() { shutdown(); }

void Lighthouse::start() {
  Impl& im = *impl_;
  DDPKIT_CHECK(!im.server, "lighthouse: start() called twice");
  const std::string& a = im.options.address();
  const std::string listen_host = a.substr(0, a.rfind(':'));
  im.host = !im.options.advertise_host().empty() ? im.options.advertise_host()
            : (listen_host == "0.0.0.0" || listen_host == "[::]") ? this_host_name()
                                                                    : listen_host;
  c10d::TCPStoreOptions so = compat::tcp_store_options();
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  im.store = c10::make_intrusive<c10d::TCPStore>(listen_host == "[::]" ? "0.0.0.0" : listen_host, so);

  const auto& tls = im.options.tls();
  const auto creds = ps::server_credentials(tls.certificate(), tls.private_key());
  auto service = std::make_unique<Service>(&im);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(a, creds, &im.bound_port);
  builder.RegisterService(service.get());
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Every waiting quorum call holds a thread: room for many groups.
  grpc::ResourceQuota quota("lighthouse");
  quota.SetMaxThreads(1024);
  builder.SetResourceQuota(quota);
  im.server = builder.BuildAndStart();
  DDPKIT_CHECK(im.server && im.bound_port > 0, "lighthouse: cannot listen on '", a,
               "' (address in use, or not an address of this host)");
  im.service = std::move(service);
  im.ticker = std::thread([&im] {
    std::unique_lock<std::mutex> lock(im.mu);
    while (!im.stopping) {
      im.try_form(Clock::now());
      if (!im.events.empty()) {
        std::vector<std::string> events;
        events.swap(im.events);
        lock.unlock();
        for (const auto& e : events) im.options.on_event()(e);
        lock.lock();
        continue;
      }
      im.cv.wait_for(lock, std::chrono::milliseconds(20));
    }
  });
}

std::string Lighthouse::address() const { return impl_->host + ":" + std::to_string(impl_->bound_port); }
int Lighthouse::port() const { return impl_->bound_port; }

int64_t Lighthouse::quorums_formed() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->formed;
}

void Lighthouse::shutdown() {
  Impl& im = *impl_;
  {
    std::lock_guard<std::mutex> lock(im.mu);
    if (im.stopping) return;
    im.stopping = true;
  }
  im.cv.notify_all();
  if (im.ticker.joinable()) im.ticker.join();
  if (im.server) im.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

// ---- client ------------------------------------------------------------------------------------

struct LighthouseClient::Impl {
  LighthouseClientOptions options;
  std::unique_ptr<wire::Lighthouse::Stub> stub;

  void prepare(grpc::ClientContext& ctx, std::chrono::milliseconds deadline) const {
    ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    ps::add_token(ctx, options.token());
  }
  [[noreturn]] void fail(const char* what, const grpc::Status& s) const {
    throw CommError("ddpkit: lighthouse " + options.address() + ": " + what + " failed (" +
                    std::to_string(static_cast<int>(s.error_code())) + "): " + s.error_message());
  }
};

LighthouseClient::LighthouseClient(LighthouseClientOptions options) : impl_(std::make_unique<Impl>()) {
  ps::hold_grpc_runtime();
  DDPKIT_CHECK(!options.address().empty(), "lighthouse client: no address given (host:port)");
  impl_->options = std::move(options);
  const auto creds = ps::channel_credentials(impl_->options.tls().root_certificate());
  grpc::ChannelArguments args;
  // Heartbeats must not wait out a reconnect backoff after the lighthouse restarts.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  impl_->stub = wire::Lighthouse::NewStub(grpc::CreateCustomChannel(impl_->options.address(), creds, args));
}

LighthouseClient::~LighthouseClient() = default;

Quorum LighthouseClient::quorum(const GroupInfo& self, std::chrono::milliseconds timeout, bool broken) {
  wire::QuorumRequest req;
  wire::to_wire(self, req.mutable_member());
  req.set_broken(broken);
  wire::QuorumReply reply;
  // A lighthouse that is away (restarting) is asked again until the timeout.
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    grpc::ClientContext ctx;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
    req.set_timeout_ms(std::max<int64_t>(1, left.count()));
    impl_->prepare(ctx, std::max(left, std::chrono::milliseconds(1)) + impl_->options.rpc_timeout());
    const grpc::Status s = impl_->stub->Quorum(&ctx, req, &reply);
    if (s.ok()) break;
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE || std::chrono::steady_clock::now() >= give_up)
      impl_->fail("quorum", s);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const std::string bad = wire::check_reply(reply);
  DDPKIT_CHECK(bad.empty(), "lighthouse ", impl_->options.address(), " sent a malformed quorum: ", bad);
  Quorum q = wire::from_wire(reply);
  DDPKIT_CHECK(q.replica_rank(self.group_id) >= 0, "lighthouse ", impl_->options.address(),
               " sent a quorum without group ", self.group_id, " in it");
  return q;
}

LighthouseClient::Beat LighthouseClient::heartbeat(const std::string& group_id, int rank, const std::string& incarnation) {
  wire::HeartbeatRequest req;
  req.set_group_id(group_id);
  req.set_rank(rank);
  req.set_incarnation(incarnation);
  wire::HeartbeatReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(ctx, impl_->options.rpc_timeout());
  const grpc::Status s = impl_->stub->Heartbeat(&ctx, req, &reply);
  if (!s.ok()) impl_->fail("heartbeat", s);
  Beat b;
  b.quorum_id = reply.quorum_id();
  for (const auto& g : reply.lost()) b.lost.push_back(g);
  return b;
}

}  // namespace ft
}  // namespace ddpkit
