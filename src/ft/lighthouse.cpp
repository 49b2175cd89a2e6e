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
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>

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

// A quorum call waits without holding a thread (gRPC's callback API): a lighthouse serves a
// thousand groups waiting at once. Its reactor is finished by whoever forms the quorum, by the
// ticker at its deadline, or by its own cancellation, whichever comes first (Waiter::finished).
struct QuorumWaiter {
  GroupInfo info;
  bool broken = false;
  Clock::time_point since, deadline;
  int64_t timeout_ms = 0;
  bool knows_quorum = false;  // the caller holds known_quorum_id of this lighthouse
  int64_t known_quorum_id = -1;
  bool finished = false;  // under Impl::mu: answered (or about to be); nobody else finishes it
  grpc::ServerUnaryReactor* reactor = nullptr;
  wire::QuorumReply* reply = nullptr;
};

// What to send a finished waiter, done outside Impl::mu: a reply built once per quorum for all
// the waiters it suits (a full quorum of many groups takes a while to build).
struct Answer {
  std::shared_ptr<QuorumWaiter> waiter;
  grpc::Status status;
  std::shared_ptr<const wire::QuorumReply> reply;  // set when status is OK
};

struct Lighthouse::Impl {
  explicit Impl(LighthouseOptions o) : options(std::move(o)), instance(new_instance_id()) {}

  struct Beats {
    std::string incarnation;
    int world_size = 0;
    std::map<int, Clock::time_point> last;  // rank -> last heartbeat
    Clock::time_point last_any;             // the newest of them (for forgetting long-dead groups)
    Clock::time_point oldest;               // the oldest of them (settle()): liveness in O(1)
    std::string host;                       // its rank 0's, once it asked (for naming a duplicate)
  };
  // A group that left after its last step (Leave): its incarnation and the steps it committed.
  struct Left {
    std::string incarnation;
    int64_t step = 0;
  };

  LighthouseOptions options;
  const std::string instance;  // QuorumReply.lighthouse
  mutable std::mutex mu;
  std::map<std::string, std::shared_ptr<QuorumWaiter>> waiting;  // by group id
  // Asks from a new incarnation of a group whose current one is still live: a restart whose old
  // processes have not yet been silent for heartbeat_timeout, or a second process given the same
  // group id. Admitted once the old one is not live; refused as a duplicate if it stays live.
  std::vector<std::shared_ptr<QuorumWaiter>> pretenders;
  std::map<std::string, Left> left;  // groups that left (Leave), until they ask again
  // Groups dropped from a quorum without leaving (lost), until they are in one again: once the
  // job has finished (finished_step), such a group asking from an older step is refused (JobFinished).
  std::set<std::string> lost_members;
  // By group id; hashed: the lost groups are recomputed a hundred times a second from a thousand lookups.
  std::unordered_map<std::string, Beats> beats;
  Quorum last;
  std::set<std::string> reported_lost;  // groups of `last` whose loss on_event has been told
  std::vector<std::string> events;       // for on_event, which the ticker calls outside mu
  int64_t formed = 0;
  bool stopping = false;
  // The lost groups heartbeat replies name, recomputed at most every kLostRefresh: a beat costs
  // O(1), not a pass over every group (a thousand groups beat ten thousand times a second).
  std::vector<std::string> lost_cache;
  Clock::time_point lost_cache_at;
  bool lost_cache_valid = false;
  Clock::time_point last_forget;

  // A TCPStore per quorum (its id), the newest last: the cross groups of a quorum meet in a store
  // of their own, and the store of the quorum before the last goes with its keys, so a job whose
  // groups come and go for weeks does not grow the lighthouse's memory. Two are kept: a group
  // still meeting in the last quorum's store gives up only once it learns of the newer quorum.
  std::deque<std::pair<int64_t, c10::intrusive_ptr<c10d::TCPStore>>> stores;
  std::string store_listen_host;
  std::string host;
  int bound_port = 0;
  std::unique_ptr<grpc::Service> service;
  std::unique_ptr<grpc::Server> server;
  std::thread ticker;
  std::condition_variable ticker_cv;

  // The last kRounds quorum rounds' times (round_times()): how long a quorum's asks took to come
  // in, and to hand its replies to gRPC, the part of a round that is the lighthouse's own.
  static constexpr size_t kRounds = 1024;
  // Rounds whose every reply was a delta; those where a caller got the whole quorum (the first, a
  // restarted group's) are counted apart: their replies are G members each.
  std::deque<std::pair<double, double>> rounds;  // (intake ms, replies ms)
  int64_t rounds_total = 0, whole_rounds = 0;
  double whole_replies_max_ms = 0;

  static constexpr auto kLostRefresh = std::chrono::milliseconds(10);
  static constexpr auto kTick = std::chrono::milliseconds(20);

  static std::string new_instance_id() {
    std::random_device rd;
    std::ostringstream os;
    os << std::hex << rd() << rd();
    return os.str();
  }

  // A group is live while every one of its ranks has heartbeated within heartbeat_timeout (ranks
  // that have not yet are given that long from when the group registered). A group whose rank 0
  // has not asked for a quorum yet (its size unknown) is live while the ranks heard from are.
  bool live(const std::string& group, Clock::time_point now) const {
    auto it = beats.find(group);
    return it != beats.end() && live(it->second, now);
  }
  // (`last` holds exactly ranks 0..world_size-1 once the size is known: register_group.)
  bool live(const Beats& b, Clock::time_point now) const {
    if (b.last.empty() || (b.world_size > 0 && static_cast<int>(b.last.size()) < b.world_size)) return false;
    return now - b.oldest <= options.heartbeat_timeout();
  }

  // Each change of `last` is followed by settle(b) (a group's beat names all its ranks at once).
  void heard(Beats& b, int rank, Clock::time_point when) {
    auto& t = b.last[rank];
    t = std::max(t, when);
    b.last_any = std::max(b.last_any, when);
  }
  static void settle(Beats& b) {
    b.oldest = Clock::time_point::max();
    for (const auto& kv : b.last) b.oldest = std::min(b.oldest, kv.second);
  }

  // The group's rank 0 asked for a quorum: (re)register its incarnation and ranks.
  void register_group(const GroupInfo& g, Clock::time_point now) {
    Beats& b = beats[g.group_id];
    if (b.incarnation != g.incarnation) {
      b.last.clear();
      lost_cache_valid = false;
    }
    b.incarnation = g.incarnation;
    b.world_size = g.world_size;
    b.host = g.hosts.empty() ? "" : g.hosts[0];
    left.erase(g.group_id);
    for (auto it = b.last.begin(); it != b.last.end();) it = it->first >= g.world_size ? b.last.erase(it) : std::next(it);
    for (int r = 0; r < g.world_size; ++r) b.last.emplace(r, now);  // not yet heard from: from now
    heard(b, 0, now);
    settle(b);
  }

  // The last quorum's participants that are gone: not live, or restarted since (the process
  // that took part is not the one heartbeating now, however soon its successor came).
  std::vector<std::string> lost_of_last(Clock::time_point now) const {
    std::vector<std::string> lost;
    for (const auto& p : last.participants) {
      if (has_left(p)) continue;  // done, not lost: its collectives are over
      auto it = beats.find(p.group_id);
      if (it == beats.end() || it->second.incarnation != p.incarnation || !live(it->second, now))
        lost.push_back(p.group_id);
    }
    return lost;
  }

  bool has_left(const GroupInfo& p) const {
    auto it = left.find(p.group_id);
    return it != left.end() && it->second.incarnation == p.incarnation;
  }

  // The step the job finished at: every group of the last quorum has left (the highest step they
  // left after), or -1. A new quorum (a new run: groups that left, resumed from a checkpoint, or new
  // ones), or a group of it asking again, ends that.
  int64_t finished_step() const {
    int64_t step = -1;
    for (const auto& p : last.participants) {
      if (!has_left(p)) return -1;
      step = std::max(step, left.at(p.group_id).step);
    }
    return step;
  }

  const std::vector<std::string>& lost_now(Clock::time_point now) {
    if (!lost_cache_valid || now - lost_cache_at >= kLostRefresh) {
      lost_cache = lost_of_last(now);
      lost_cache_at = now;
      lost_cache_valid = true;
    }
    return lost_cache;
  }

  // A quorum try_form formed, for the round's times: its intake (first ask to now), and whether
  // any caller got the whole quorum.
  struct Formed {
    double intake_ms = 0;
    bool whole = false;
  };

  // Under mu: forms the next quorum if the rule allows; its participants' answers go to `out`.
  std::optional<Formed> try_form(Clock::time_point now, std::vector<Answer>& out) {
    report_losses(now);  // before a quorum without them replaces the one they were lost from
    if (waiting.empty()) return std::nullopt;  // nobody to answer: the ticker's pass costs nothing between steps
    std::vector<std::shared_ptr<QuorumWaiter>> joining;
    bool every_live_group_asked = true;
    for (const auto& kv : beats) {
      if (!live(kv.second, now)) continue;
      auto w = waiting.find(kv.first);
      if (w == waiting.end()) {
        every_live_group_asked = false;
      } else if (w->second->info.incarnation == kv.second.incarnation) {
        joining.push_back(w->second);
      }
    }
    if (joining.empty() || static_cast<int>(joining.size()) < options.min_replicas()) return std::nullopt;
    Clock::time_point first = now;
    for (const auto& w : joining) first = std::min(first, w->since);
    const bool waited = now - first >= options.join_timeout();
    if (!every_live_group_asked && !waited) return std::nullopt;
    if (formed == 0 && static_cast<int>(joining.size()) < options.expected_groups() && !waited) return std::nullopt;
    std::sort(joining.begin(), joining.end(),
              [](const auto& a, const auto& b) { return a->info.group_id < b->info.group_id; });
    Quorum q;
    bool broken = false;
    int64_t settled = -1;  // the highest step of the groups not healing (a healing group's is a claim)
    for (const auto& w : joining) {
      q.participants.push_back(w->info);
      q.max_step = std::max(q.max_step, w->info.step);
      if (!w->info.healing) settled = std::max(settled, w->info.step);
      broken = broken || w->broken;
    }
    if (settled >= 0) q.max_step = settled;
    // A healing group whose claim is not the quorum's step (its source did not commit the step
    // it serves from) copies again, from a source this quorum names.
    for (auto& p : q.participants)
      if (p.healing && p.step != q.max_step) {
        p.healing = false;
        p.step = std::min(p.step, q.max_step - 1);  // behind: a source is named for it
        if (p.step < 0) p.step = 0, p.heal = true;
      }
    bool same = !broken && last.participants.size() == q.participants.size();
    for (size_t i = 0; same && i < q.participants.size(); ++i)
      same = last.participants[i].group_id == q.participants[i].group_id &&
             last.participants[i].incarnation == q.participants[i].incarnation;
    q.quorum_id = same ? last.quorum_id : last.quorum_id + 1;
    q.store_address = host + ":" + std::to_string(store_of(q.quorum_id)->getPort());
    q.heal_sources = heal_sources_of(q);
    std::set<std::string> ids;
    for (const auto& p : q.participants) ids.insert(p.group_id);
    for (const auto& p : last.participants)
      if (!ids.count(p.group_id)) {
        q.dropped.push_back(p.group_id);
        if (!has_left(p)) lost_members.insert(p.group_id);
      }
    for (const auto& id : ids) lost_members.erase(id);
    // Each reply built once: a delta for a caller holding this quorum's predecessor (or this
    // quorum, when the participants are the same), the whole quorum for any other.
    std::shared_ptr<const wire::QuorumReply> full, from_last;
    for (const auto& w : joining) {
      w->finished = true;
      waiting.erase(w->info.group_id);
      std::shared_ptr<const wire::QuorumReply> reply;
      if (w->knows_quorum && w->known_quorum_id == last.quorum_id && last.quorum_id >= 0) {
        if (!from_last) from_last = std::make_shared<wire::QuorumReply>(wire::delta_reply(q, last));
        reply = from_last;
      } else {
        if (!full) {
          auto r = std::make_shared<wire::QuorumReply>();
          wire::to_wire(q, r.get());
          full = r;
        }
        reply = full;
      }
      out.push_back(Answer{w, grpc::Status::OK, reply});
    }
    if (options.on_event() && q.quorum_id != last.quorum_id) events.push_back(describe_change(q));
    last = std::move(q);
    lost_cache_valid = false;
    reported_lost.clear();
    ++formed;
    return Formed{std::chrono::duration<double, std::milli>(now - first).count(), full != nullptr};
  }

  // Who heals from whom (Quorum::heal_sources): a participant behind max_step, or one that asked
  // (GroupInfo::heal), from the participants at max_step that did not ask and are not healing, in turn; when all at
  // max_step asked (a job's first quorum under init sync), from the first of them, which keeps its own.
  static std::vector<int> heal_sources_of(const Quorum& q) {
    std::vector<int> sources;
    int keeper = -1;
    for (size_t i = 0; i < q.participants.size(); ++i) {
      const GroupInfo& p = q.participants[i];
      if (p.step != q.max_step || p.healing) continue;  // a healing group's state is not yet its step's
      if (!p.heal)
        sources.push_back(static_cast<int>(i));
      else if (keeper < 0)
        keeper = static_cast<int>(i);
    }
    if (!sources.empty()) keeper = -1;
    else sources.push_back(keeper);
    std::vector<int> out;
    size_t next = 0;
    for (size_t i = 0; i < q.participants.size(); ++i) {
      const GroupInfo& p = q.participants[i];
      const bool heals = p.step < q.max_step || (p.heal && static_cast<int>(i) != keeper);
      out.push_back(heals ? sources[next++ % sources.size()] : -1);
    }
    return out;
  }

  // Under mu: the store of quorum `id`, made when the id is new (the oldest but one goes).
  c10::intrusive_ptr<c10d::TCPStore> store_of(int64_t id) {
    if (!stores.empty() && stores.back().first == id) return stores.back().second;
    c10d::TCPStoreOptions so = compat::tcp_store_options();
    so.port = 0;
    so.isServer = true;
    so.waitWorkers = false;
    stores.emplace_back(id, c10::make_intrusive<c10d::TCPStore>(store_listen_host, so));
    while (stores.size() > 2) stores.pop_front();
    return stores.back().second;
  }

  std::string describe_change(const Quorum& q) const {
    std::vector<std::string> groups, joining;
    std::set<std::string> before;
    for (const auto& p : last.participants) before.insert(p.group_id);
    for (const auto& p : q.participants) {
      groups.push_back(p.group_id);
      if (!before.count(p.group_id)) joining.push_back(p.group_id);
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
    for (const auto& id : lost_now(now)) {
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

  // Under mu: why a waiter's quorum did not form within its timeout.
  std::string no_quorum(const QuorumWaiter& w, Clock::time_point now) const {
    std::vector<std::string> live_groups, asked;
    for (const auto& kv : beats)
      if (live(kv.second, now)) live_groups.push_back(kv.first);
    std::sort(live_groups.begin(), live_groups.end());
    for (const auto& kv : waiting) asked.push_back(kv.first);
    std::ostringstream os;
    os << "no quorum within " << w.timeout_ms << " ms: live groups [" << joined(live_groups) << "], asking ["
       << joined(asked) << "], min_replicas " << options.min_replicas() << "; lost since the last quorum ["
       << joined(lost_of_last(now)) << "]";
    return os.str();
  }

  // Under mu, on the ticker: the waiters past their deadline; groups dead long enough to forget
  // (a job whose groups come and go under new ids must not grow the lighthouse without bound).
  void expire(Clock::time_point now, std::vector<Answer>& out) {
    for (auto it = waiting.begin(); it != waiting.end();) {
      if (now < it->second->deadline) {
        ++it;
        continue;
      }
      it->second->finished = true;
      out.push_back(Answer{it->second, grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, no_quorum(*it->second, now)), {}});
      it = waiting.erase(it);
    }
    const auto forget_after = std::max<Clock::duration>(10 * options.heartbeat_timeout(), options.join_timeout());
    if (now - last_forget < std::chrono::seconds(1)) return;
    last_forget = now;
    for (auto it = beats.begin(); it != beats.end();) {
      const bool in_last = last.replica_rank(it->first) >= 0;
      if (!in_last && !waiting.count(it->first) && now - it->second.last_any > forget_after) {
        it = beats.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Outside mu: sends the answers.
  void send(std::vector<Answer>& answers) const {
    for (auto& a : answers) {
      if (a.status.ok()) {
        a.waiter->reply->CopyFrom(*a.reply);
        a.waiter->reply->set_lighthouse(instance);
      }
      a.waiter->reactor->Finish(a.status);
    }
    answers.clear();
  }

  // Outside mu: sends the answers, among them those of the quorum try_form formed under mu (if it
  // did), and records that round.
  void send_round(std::vector<Answer>& answers, const std::optional<Formed>& formed_now) {
    const auto start = Clock::now();
    send(answers);
    if (!formed_now) return;
    const double replies_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    std::lock_guard<std::mutex> lock(mu);
    if (formed_now->whole) {
      ++whole_rounds;
      whole_replies_max_ms = std::max(whole_replies_max_ms, replies_ms);
      return;
    }
    rounds.emplace_back(formed_now->intake_ms, replies_ms);
    if (rounds.size() > kRounds) rounds.pop_front();
    ++rounds_total;
  }

  grpc::Status check_token(const grpc::CallbackServerContext* ctx) const {
    const std::string refusal = ps::token_refusal(ctx->client_metadata(), options.token(), "lighthouse");
    return refusal.empty() ? grpc::Status::OK : grpc::Status(grpc::StatusCode::UNAUTHENTICATED, refusal);
  }

  // Under mu: takes `w`'s ask into the quorum being formed (its incarnation becomes the group's);
  // forms the quorum when this ask completes it.
  std::optional<Formed> admit(const std::shared_ptr<QuorumWaiter>& w, Clock::time_point now, std::vector<Answer>& out) {
    const std::string& id = w->info.group_id;
    if (refuse_if_finished(w, out)) return std::nullopt;
    auto it = waiting.find(id);
    if (it != waiting.end() && it->second->info.incarnation == w->info.incarnation) {
      w->finished = true;
      out.push_back(Answer{w, grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "group " + id + " (incarnation " +
                                                                           w->info.incarnation + ") already waits for a quorum"), {}});
      return std::nullopt;
    }
    if (it != waiting.end()) {
      it->second->finished = true;
      out.push_back(Answer{it->second,
                           grpc::Status(grpc::StatusCode::ABORTED, "superseded: group " + id + " (incarnation " +
                                                                       it->second->info.incarnation +
                                                                       ") asked again as incarnation " + w->info.incarnation),
                           {}});
      waiting.erase(it);
    }
    register_group(w->info, now);
    waiting[id] = w;
    // Only when every group the lighthouse knows has asked (or is lost) can this ask complete a
    // quorum at once; otherwise the ticker decides (a lost group's timeout, join_timeout): one
    // pass over the groups per quorum, not one per ask.
    if (waiting.size() + lost_now(now).size() >= beats.size()) return try_form(now, out);
    return std::nullopt;
  }

  // Under mu: a group of the job that was lost (not left), asking from a step older than the one
  // the job finished at, has nobody to heal from: refused (JobFinished) rather than left to train
  // on alone from its own old state. True when refused.
  bool refuse_if_finished(const std::shared_ptr<QuorumWaiter>& w, std::vector<Answer>& out) {
    if (!lost_members.count(w->info.group_id)) return false;
    const int64_t finished = finished_step();
    if (finished < 0 || w->info.step >= finished) return false;
    w->finished = true;
    std::vector<std::string> groups;
    for (const auto& p : last.participants) groups.push_back(p.group_id);
    std::ostringstream os;
    os << "the job has finished: groups [" << joined(groups) << "] left after step " << finished
       << ", and no live group holds that step's state for group " << w->info.group_id << " (at step "
       << w->info.step << ", lost before the end) to heal from: its work is done. To train on, resume it from a "
          "checkpoint of step "
       << finished << "; a new job needs a lighthouse of its own";
    out.push_back(Answer{w, grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, os.str()), {}});
    if (options.on_event()) events.push_back("group " + w->info.group_id + " refused: " + os.str());
    return true;
  }

  // Under mu, on the ticker: each pretender (an ask of a group's new incarnation while the old one
  // was live) is admitted once the old one is not live: a restart, whose old processes stopped
  // beating. If the old one is still live a heartbeat timeout (and two ticks) after the ask, it is
  // running: the ask is a second process given the same group id, refused as such; the running
  // group is never displaced.
  void review_pretenders(Clock::time_point now, std::vector<Answer>& out) {
    for (auto it = pretenders.begin(); it != pretenders.end();) {
      const std::shared_ptr<QuorumWaiter> w = *it;
      auto b = beats.find(w->info.group_id);
      if (w->finished) {
        it = pretenders.erase(it);
      } else if (b == beats.end() || b->second.incarnation == w->info.incarnation || !live(b->second, now)) {
        it = pretenders.erase(it);
        admit(w, now, out);
      } else if (now - w->since > options.heartbeat_timeout() + 2 * kTick + std::chrono::milliseconds(100)) {
        it = pretenders.erase(it);
        w->finished = true;
        const auto heard = std::chrono::duration_cast<std::chrono::milliseconds>(now - b->second.last_any).count();
        std::ostringstream os;
        os << "duplicate group id '" << w->info.group_id << "': incarnation " << b->second.incarnation;
        if (!b->second.host.empty()) os << " on host " << b->second.host;
        os << " is running (heard from " << heard << " ms ago); this process (incarnation " << w->info.incarnation
           << (w->info.hosts.empty() ? "" : " on host " + w->info.hosts[0]) << ") waited "
           << std::chrono::duration_cast<std::chrono::milliseconds>(now - w->since).count()
           << " ms for it to stop and is refused. Every replica group needs an id of its own; a restart of a group is "
              "taken once its old processes have been silent for the heartbeat timeout ("
           << options.heartbeat_timeout().count() << " ms)";
        out.push_back(Answer{w, grpc::Status(grpc::StatusCode::ALREADY_EXISTS, os.str()), {}});
        if (options.on_event())
          events.push_back("group " + w->info.group_id + ": refused a second process (incarnation " + w->info.incarnation +
                           ") while incarnation " + b->second.incarnation + " is running: a duplicate group id");
      } else if (now >= w->deadline) {
        it = pretenders.erase(it);
        w->finished = true;
        out.push_back(Answer{w, grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                             "no quorum within " + std::to_string(w->timeout_ms) + " ms: incarnation " +
                                                 b->second.incarnation + " of group " + w->info.group_id +
                                                 " was still live"), {}});
      } else {
        ++it;
      }
    }
  }

  // A group that ran its last step leaves (Manager::close): out of every quorum from now on, not
  // lost (the others' collectives with it are over); once every group of the last quorum has
  // left, the job has finished at their step.
  grpc::Status leave(const grpc::CallbackServerContext* ctx, const wire::LeaveRequest& req) {
    if (auto s = check_token(ctx); !s.ok()) return s;
    if (!wire::valid_name(req.group_id()) || !wire::valid_name(req.incarnation()) || req.step() < 0)
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "leave: a group id, its incarnation and a step >= 0");
    std::vector<std::string> told;
    std::vector<Answer> answers;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto b = beats.find(req.group_id());
      if (b == beats.end() || b->second.incarnation != req.incarnation()) return grpc::Status::OK;  // not the live one
      beats.erase(b);
      left[req.group_id()] = Left{req.incarnation(), req.step()};
      lost_members.erase(req.group_id());
      lost_cache_valid = false;
      told.push_back("group " + req.group_id() + " left after step " + std::to_string(req.step()));
      const int64_t finished = finished_step();
      if (finished >= 0)
        told.push_back("job finished at step " + std::to_string(finished) + ": every group of quorum " +
                       std::to_string(last.quorum_id) + " left");
      if (options.on_event()) events.insert(events.end(), told.begin(), told.end());
      if (finished >= 0)  // a lost group already asking again is answered now
        for (auto it = waiting.begin(); it != waiting.end();)
          it = refuse_if_finished(it->second, answers) ? waiting.erase(it) : std::next(it);
    }
    send(answers);
    ticker_cv.notify_all();  // quorums waiting for the group go on without it
    return grpc::Status::OK;
  }

  // Starts a quorum call: answered now (a bad request, or the quorum it completes) or later.
  void quorum(const grpc::CallbackServerContext* ctx, const wire::QuorumRequest& req,
              const std::shared_ptr<QuorumWaiter>& w) {
    auto refuse = [&](const grpc::Status& s) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (w->finished) return;  // cancelled meanwhile
        w->finished = true;
      }
      w->reactor->Finish(s);
    };
    if (auto s = check_token(ctx); !s.ok()) return refuse(s);
    const std::string bad = wire::check_member(req.member());
    if (!bad.empty()) return refuse(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "quorum request: " + bad));
    if (req.timeout_ms() <= 0 || req.timeout_ms() > 24 * 3600 * 1000)
      return refuse(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 "quorum request: timeout_ms must be in 1..86400000, got " + std::to_string(req.timeout_ms())));
    w->info = wire::from_wire(req.member());
    w->broken = req.broken();
    w->timeout_ms = req.timeout_ms();
    w->knows_quorum = req.has_known_quorum_id() && req.known_lighthouse() == instance;
    w->known_quorum_id = req.known_quorum_id();
    const std::string& id = w->info.group_id;
    std::vector<Answer> answers;
    std::optional<Formed> formed_now;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) {
        w->finished = true;
        answers.push_back(Answer{w, grpc::Status(grpc::StatusCode::UNAVAILABLE, "the lighthouse is shutting down"), {}});
      } else if (w->finished) {
        return;  // cancelled before it was registered (on_cancel finished it)
      } else {
        const auto now = Clock::now();
        w->since = now;
        w->deadline = now + std::chrono::milliseconds(req.timeout_ms());
        auto b = beats.find(id);
        if (b != beats.end() && !b->second.incarnation.empty() && b->second.incarnation != w->info.incarnation &&
            live(b->second, now)) {
          pretenders.push_back(w);  // another incarnation is live: a restart too soon, or a duplicate
        } else {
          formed_now = admit(w, now, answers);
        }
      }
    }
    send_round(answers, formed_now);
  }

  // The caller went away (a killed process's connection closes): its wait ends.
  void cancelled(const std::shared_ptr<QuorumWaiter>& w) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (w->finished) return;
      w->finished = true;
      auto it = waiting.find(w->info.group_id);
      if (it != waiting.end() && it->second == w) waiting.erase(it);
      pretenders.erase(std::remove(pretenders.begin(), pretenders.end(), w), pretenders.end());
    }
    w->reactor->Finish(grpc::Status::CANCELLED);
  }

  grpc::Status heartbeat(const grpc::CallbackServerContext* ctx, const wire::HeartbeatRequest& req,
                         wire::HeartbeatReply* reply) {
    if (auto s = check_token(ctx); !s.ok()) return s;
    const std::string bad = wire::check_heartbeat(req);
    if (!bad.empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "heartbeat: " + bad);
    std::lock_guard<std::mutex> lock(mu);
    const auto now = Clock::now();
    auto gone = left.find(req.group_id());
    if (gone != left.end() && gone->second.incarnation == req.incarnation()) {  // a beat that crossed its Leave
      reply->set_quorum_id(last.quorum_id);
      return grpc::Status::OK;
    }
    Beats& b = beats[req.group_id()];
    if (!b.incarnation.empty() && b.incarnation != req.incarnation() && live(b, now))
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                          "heartbeat: group " + req.group_id() + " is live as incarnation " + b.incarnation +
                              "; incarnation " + req.incarnation() + " is not counted (a restart is, once the old one "
                              "has been silent for the heartbeat timeout; two running groups need two ids)");
    if (b.incarnation != req.incarnation()) {
      // A new incarnation (the group restarted) replaces the old one's ranks. Its size is known
      // once its rank 0 asks for a quorum.
      b.incarnation = req.incarnation();
      b.world_size = 0;
      b.last.clear();
      lost_cache_valid = false;
    }
    const int ranks = req.rank_ages_ms_size() > 0 ? req.rank_ages_ms_size() : req.rank() + 1;
    if (b.world_size > 0 && ranks > b.world_size)
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "heartbeat: rank " + std::to_string(ranks - 1) + " is outside group " + req.group_id() +
                              " of " + std::to_string(b.world_size) + " ranks");
    if (req.rank_ages_ms_size() > 0) {
      for (int r = 0; r < req.rank_ages_ms_size(); ++r) heard(b, r, now - std::chrono::milliseconds(req.rank_ages_ms(r)));
    } else {
      heard(b, req.rank(), now);
    }
    settle(b);
    reply->set_quorum_id(last.quorum_id);
    for (const auto& g : lost_now(now)) reply->add_lost(g);
    return grpc::Status::OK;
  }
};

namespace {

class QuorumReactor final : public grpc::ServerUnaryReactor {
 public:
  QuorumReactor(Lighthouse::Impl* impl, std::shared_ptr<QuorumWaiter> waiter) : impl_(impl), waiter_(std::move(waiter)) {}
  void OnCancel() override { impl_->cancelled(waiter_); }
  void OnDone() override { delete this; }

 private:
  Lighthouse::Impl* impl_;
  std::shared_ptr<QuorumWaiter> waiter_;
};

class Service final : public wire::Lighthouse::CallbackService {
 public:
  explicit Service(Lighthouse::Impl* impl) : impl_(impl) {}
  grpc::ServerUnaryReactor* Quorum(grpc::CallbackServerContext* ctx, const wire::QuorumRequest* req,
                                   wire::QuorumReply* reply) override {
    auto waiter = std::make_shared<QuorumWaiter>();
    waiter->reply = reply;
    auto* reactor = new QuorumReactor(impl_, waiter);
    waiter->reactor = reactor;
    impl_->quorum(ctx, *req, waiter);
    return reactor;
  }
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const wire::HeartbeatRequest* req,
                                      wire::HeartbeatReply* reply) override {
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(impl_->heartbeat(ctx, *req, reply));
    return reactor;
  }
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx, const wire::LeaveRequest* req,
                                  wire::LeaveReply*) override {
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(impl_->leave(ctx, *req));
    return reactor;
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
  im.store_listen_host = listen_host == "[::]" ? "0.0.0.0" : listen_host;

  const auto& tls = im.options.tls();
  const auto creds = ps::server_credentials(tls.certificate(), tls.private_key());
  auto service = std::make_unique<Service>(&im);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(a, creds, &im.bound_port);
  builder.RegisterService(service.get());
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  im.server = builder.BuildAndStart();
  DDPKIT_CHECK(im.server && im.bound_port > 0, "lighthouse: cannot listen on '", a,
               "' (address in use, or not an address of this host)");
  im.service = std::move(service);
  im.ticker = std::thread([&im] {
    std::unique_lock<std::mutex> lock(im.mu);
    std::vector<Answer> answers;
    while (!im.stopping) {
      const auto now = Clock::now();
      im.review_pretenders(now, answers);
      const auto formed_now = im.try_form(now, answers);
      im.expire(now, answers);
      if (!answers.empty() || !im.events.empty()) {
        std::vector<std::string> events;
        events.swap(im.events);
        lock.unlock();
        im.send_round(answers, formed_now);
        for (const auto& e : events) im.options.on_event()(e);
        lock.lock();
        continue;
      }
      im.ticker_cv.wait_for(lock, Impl::kTick);
    }
  });
}

std::string Lighthouse::address() const { return impl_->host + ":" + std::to_string(impl_->bound_port); }
int Lighthouse::port() const { return impl_->bound_port; }

int64_t Lighthouse::quorums_formed() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->formed;
}

Lighthouse::RoundTimes Lighthouse::round_times() const {
  std::vector<double> intake, replies;
  RoundTimes t;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    t.rounds = impl_->rounds_total;
    t.sampled = static_cast<int64_t>(impl_->rounds.size());
    t.whole_rounds = impl_->whole_rounds;
    t.whole_replies_max_ms = impl_->whole_replies_max_ms;
    for (const auto& r : impl_->rounds) {
      intake.push_back(r.first);
      replies.push_back(r.second);
    }
  }
  if (intake.empty()) return t;
  auto at = [](std::vector<double>& v, double q) {
    const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i), v.end());
    return v[i];
  };
  t.intake_p50_ms = at(intake, 0.5);
  t.intake_p99_ms = at(intake, 0.99);
  t.replies_p50_ms = at(replies, 0.5);
  t.replies_p99_ms = at(replies, 0.99);
  t.replies_max_ms = *std::max_element(replies.begin(), replies.end());
  return t;
}

Lighthouse::StoreUse Lighthouse::store_use() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  StoreUse use;
  use.stores = static_cast<int>(impl_->stores.size());
  for (const auto& s : impl_->stores) use.keys += s.second->getNumKeys();
  return use;
}

void Lighthouse::shutdown() {
  Impl& im = *impl_;
  std::vector<Answer> answers;
  {
    std::lock_guard<std::mutex> lock(im.mu);
    if (im.stopping) return;
    im.stopping = true;
    for (auto& kv : im.waiting) {
      kv.second->finished = true;
      answers.push_back(Answer{kv.second, grpc::Status(grpc::StatusCode::UNAVAILABLE, "the lighthouse is shutting down"), {}});
    }
    im.waiting.clear();
    for (auto& w : im.pretenders) {
      if (w->finished) continue;
      w->finished = true;
      answers.push_back(Answer{w, grpc::Status(grpc::StatusCode::UNAVAILABLE, "the lighthouse is shutting down"), {}});
    }
    im.pretenders.clear();
  }
  im.ticker_cv.notify_all();
  if (im.ticker.joinable()) im.ticker.join();
  im.send(answers);
  if (im.server) im.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

}  // namespace ft
}  // namespace ddpkit
