// Manager::Impl (internal): what the Manager holds, shared by manager.cpp (construction, the
// synchronous protocol, checkpoints, the cross-group collectives) and async_round.cpp (the
// asynchronous quorum: the round on a thread of its own, heals in flight, snapshots served).
#pragma once


#include <ddpkit/comm/gradient_arena.h>
#include <ddpkit/error.h>

#include "../comm/local_address.h"
#include "../comm/polling_store.h"
#include "cross_group_buckets.h"
#include "detached.h"
#include "group_beats.h"
#include "state_registry.h"
#include "state_transfer.h"
#include "wire.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

namespace ddpkit {
namespace ft {

namespace detail {

// ---- small collectives over the group (strings) ------------------------------------------------

inline std::string broadcast_string(ProcessGroup& pg, const std::string& s) {
  at::Tensor n = at::tensor({static_cast<int64_t>(s.size())}, at::kLong);
  ProcessGroup::wait(pg.broadcast(n, 0));
  at::Tensor bytes = at::empty({n.item<int64_t>()}, at::kByte);
  if (pg.rank() == 0 && !s.empty()) std::memcpy(bytes.data_ptr(), s.data(), s.size());
  if (bytes.numel() > 0) ProcessGroup::wait(pg.broadcast(bytes, 0));
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
}

inline std::vector<std::string> allgather_strings(ProcessGroup& pg, const std::string& mine) {
  constexpr int64_t kMax = 512;
  DDPKIT_CHECK(static_cast<int64_t>(mine.size()) < kMax, "fault tolerance: '", mine, "' is too long");
  at::Tensor in = at::zeros({kMax}, at::kByte);
  std::memcpy(in.data_ptr(), mine.data(), mine.size());
  at::Tensor out = at::empty({kMax * pg.size()}, at::kByte);
  ProcessGroup::wait(pg.allgather_into_tensor(out, in));
  std::vector<std::string> all;
  for (int r = 0; r < pg.size(); ++r) all.emplace_back(static_cast<const char*>(out[r * kMax].data_ptr()));
  return all;
}

// Every rank of the group passes `ok`: true only when all did.
inline bool all_of(ProcessGroup& pg, bool ok) {
  at::Tensor flag = at::tensor({ok ? 1 : 0}, at::kInt);
  ProcessGroup::wait(pg.allreduce(flag, c10d::ReduceOp::MIN));
  return flag.item<int>() == 1;
}

inline std::string host_name() {
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0 || !name[0]) return "localhost";
  return name;
}

// "host" of "host:port" (or "[v6]:port").
inline std::string host_of(const std::string& address) {
  const size_t colon = address.rfind(':');
  DDPKIT_CHECK(colon != std::string::npos && colon > 0, "fault tolerance: '", address, "' is not host:port");
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host;
}

// Where the other groups reach this rank's state service: the given host, else this host's address
// on the route to the lighthouse (they reach the lighthouse, so they reach that network).
inline std::string state_host_for(const ManagerOptions& o) {
  if (!o.state_host().empty()) return o.state_host();
  const std::string host = host_of(o.lighthouse());
  const std::string towards = local_address_towards(host, 1);
  DDPKIT_CHECK(!towards.empty(), "ft::Manager: no route to the lighthouse host '", host,
               "' to pick this rank's state service address from; set ManagerOptions::state_host");
  return towards;
}

// What a cross-group process group sent to the other groups: over the network and through shared memory.
inline uint64_t bytes_to_other_groups(const CommStats& s) { return s.bytes_sent + s.shm_bytes_sent; }

inline std::string new_incarnation() {
  std::random_device rd;
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%d-%08x%08x", static_cast<int>(getpid()), rd(), rd());
  return buf;
}

}  // namespace detail
using namespace detail;

struct Manager::Impl {
  std::shared_ptr<ProcessGroup> group;
  std::unique_ptr<TrainingState> owned_state;  // the Manager made without one
  TrainingState& state;
  ManagerOptions options;
  std::function<TensorDict()> extra;  // the deprecated constructor's
  std::function<void(const TensorDict&)> load_extra;
  StateRegistry registry;

  std::unique_ptr<LighthouseClient> client;
  std::unique_ptr<GroupBeats> group_beats;  // a group of several ranks beats through its rank 0
  std::unique_ptr<StateServer> server;
  std::string incarnation;
  std::vector<std::string> addresses, hosts;

  // The cross-group process group of this rank (the matching ranks of every group in the quorum).
  std::mutex cross_mu;
  std::shared_ptr<ProcessGroup> cross;
  std::set<std::string> cross_groups;  // the other groups it spans
  int64_t staging_numel = 0;           // float32 elements of DDP's gradients (cross_group_reduction)
  at::Tensor staging;                  // the cross group's allreduce_buffer of them
  // Groups of one rank: the block sizes of DDP's float32 gradients, and the memory of the cross
  // group they are born in, so that its allreduce sums them where they lie (as DDP's own arena
  // does inside a group of several ranks).
  std::vector<int64_t> arena_blocks;
  std::shared_ptr<GradientArena> arena;
  int64_t cross_quorum = -1;
  std::string cross_store;
  uint64_t retired_bytes = 0;  // sent through cross groups since retired

  uint64_t cross_bytes() {
    std::lock_guard<std::mutex> lock(cross_mu);
    return retired_bytes + (cross ? bytes_to_other_groups(cross->stats()) : 0);
  }
  // Groups destroyed off the training path (an aborted group's Gloo work ends by its timeout, and
  // even a finished group's teardown takes a while), and rendezvous given up on.
  DetachedThreads detached;

  void reap(std::shared_ptr<ProcessGroup> pg) {
    detached.start([pg = std::move(pg)]() mutable { pg.reset(); });
  }

  // Set from collective callbacks too (DDP's buckets cross on the transports' threads).
  std::atomic<bool> failed{false};  // this step cannot commit
  std::atomic<bool> broken{false};  // the cross-group group must be rebuilt
  std::mutex failure_mu;
  std::string failure;  // why the step cannot commit

  void fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(failure_mu);
      if (!failed) failure = why;
    }
    failed = true;
    broken = true;
  }

  void phase(const char* name, int64_t step) {
    if (options.on_phase()) options.on_phase()(name, step);
  }

  void clear_failure() {
    std::lock_guard<std::mutex> lock(failure_mu);
    failure.clear();
    failed = false;
  }

  // What this step's cross-group collectives use; no group when none is to be issued. Waits for
  // the step's quorum (kAsync): this is where a step first needs it.
  Crossing crossing() {
    if (!wait_round_quietly()) return Crossing{};
    std::lock_guard<std::mutex> lock(cross_mu);
    if (failed) return Crossing{};
    if (cross && contribution.contributors < 1) {
      fail("no group of quorum " + std::to_string(cross_quorum) + " adds gradients of its own this step (every one heals)");
      return Crossing{};
    }
    return Crossing{cross, staging, contribution};
  }

  // Why a group the lighthouse reports lost is: its heartbeats stopped, or it restarted since the quorum.
  std::string lost_reason(const std::string& g) const {
    return "replica group " + g + " is lost (no heartbeat at the lighthouse " + options.lighthouse() +
           ", or it restarted since the quorum formed)";
  }

  // What the last heartbeat said: the newest quorum's lost groups, and its id; heartbeats answered.
  std::mutex seen_mu;
  std::set<std::string> lost_now;
  int64_t newest_quorum = -1;
  int64_t beats = 0;
  int64_t beats_now() {
    std::lock_guard<std::mutex> lock(seen_mu);
    return beats;
  }
  // Why work of quorum `quorum` with `groups` is given up: one of them is lost, or a newer quorum
  // formed; "" if neither. Only heartbeats answered after the `since`-th count (the one in flight
  // then may have been answered before the quorum formed, naming a group since restarted).
  std::string given_up(const std::set<std::string>& groups, int64_t quorum, int64_t since) {
    std::lock_guard<std::mutex> lock(seen_mu);
    if (beats < since + 2) return "";
    for (const auto& g : groups)
      if (lost_now.count(g)) return lost_reason(g);
    if (newest_quorum > quorum)
      return "a newer quorum (" + std::to_string(newest_quorum) + ") replaced quorum " + std::to_string(quorum);
    return "";
  }

  // This group asks its next quorum to copy its state from another (GroupInfo::heal): for its
  // first quorum under init_sync (unless it resumed from a checkpoint: its state is the job's
  // already), and after request_heal; cleared by the next quorum that succeeds.
  bool init_sync_pending = false;
  bool heal_requested = false;
  bool closed = false;

  // A quorum went through (healed or not): what this group asked of it is answered.
  void quorum_done() {
    heal_requested = init_sync_pending = false;
    clear_failure();
  }

  // Rank 0 asks the lighthouse for the quorum of `self`; every rank of the group gets the answer
  // (or the error: JobFinished, or a CommError naming what the lighthouse said) from it.
  Quorum ask_quorum(const GroupInfo& self, std::chrono::steady_clock::time_point give_up, ProcessGroup& pg) {
    std::string payload;
    if (pg.rank() == 0) {
      try {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
        const Quorum q = client->quorum(self, std::max(left, std::chrono::milliseconds(1)), broken);
        wire::QuorumReply reply;
        wire::to_wire(q, &reply);
        payload = "Q" + reply.SerializeAsString();
      } catch (const JobFinished& e) {
        payload = std::string("F") + e.what();
      } catch (const std::exception& e) {
        payload = std::string("E") + e.what();
      }
    }
    payload = broadcast_string(pg, payload);
    if (!payload.empty() && payload[0] == 'F') throw JobFinished(payload.substr(1));
    if (payload.empty() || payload[0] != 'Q')
      throw CommError("ddpkit: replica group " + options.group_id() + " has no quorum: " +
                      (payload.empty() ? std::string("(no answer)") : payload.substr(1)));
    wire::QuorumReply reply;
    DDPKIT_CHECK(reply.ParseFromString(payload.substr(1)), "fault tolerance: a malformed quorum from rank 0");
    return wire::from_wire(reply);
  }

  // As a heal source of quorum `q` (participant `me`): publishes this rank's state from the live
  // tensors (nothing changes them until read) and holds until its healers have read it or are
  // lost. Returns the seconds it served.
  double serve_healers(const Quorum& q, int me, int64_t step) {
    const auto start = std::chrono::steady_clock::now();
    std::set<std::string> healers;
    for (size_t j = 0; j < q.heal_sources.size(); ++j)
      if (q.heal_sources[j] == me) healers.insert(q.participants[j].group_id);
    TensorDict published = extra ? extra() : TensorDict{};
    for (auto& [name, value] : registry.heal_entries()) published[name] = std::move(value);
    server->publish(step, state.snapshot(published), healers);
    phase("heal-publish", step);
    const int64_t serving = q.quorum_id, since = beats_now();
    server->wait_released(start + options.cross_group_timeout(),
                          [&](const std::string& h) { return !given_up({h}, serving, since).empty(); });
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  // ---- copying a source's state (both modes) ------------------------------------------------------
  // "the state of group G rank R (address), step S": what errors name.
  std::string copy_what(const GroupInfo& from, int64_t step) const {
    const size_t r = static_cast<size_t>(group->rank());
    return "the state of group " + from.group_id + " rank " + std::to_string(r) + " (" + from.state_addresses[r] +
           "), step " + std::to_string(step);
  }
  // How this rank fetches from `from`, named by quorum `quorum_id`: given up at once when the
  // source is lost or a newer quorum forms, or when `cancelled` gives a reason.
  FetchOptions fetch_options(const GroupInfo& from, int64_t quorum_id, std::chrono::milliseconds timeout,
                             std::function<std::string()> cancelled = nullptr) {
    const size_t r = static_cast<size_t>(group->rank());
    FetchOptions fo;
    fo.token = options.token();
    fo.healer = options.group_id();
    fo.source = from.group_id;
    fo.same_host = from.hosts[r] == hosts[r];
    fo.pair_group = pair_groups();
    const int64_t since = beats_now();
    fo.stop = [this, source = from.group_id, quorum_id, since, cancelled]() -> std::string {
      const std::string why = cancelled ? cancelled() : "";
      return why.empty() ? given_up({source}, quorum_id, since) : why;
    };
    fo.timeout = timeout;
    return fo;
  }
  // Loads a fetched copy into TrainingState and the registered state, and notes how it came.
  void load_copy(Fetched& got, int64_t step, const std::string& what, ManagerStats& stats) {
    stats.heal_route = got.single_copy ? "process_vm_readv" : got.pair->transport_name();
    if (!got.single_copy_refused.empty()) stats.heal_route += " (single copy refused: " + got.single_copy_refused + ")";
    if (got.pair) reap(std::move(got.pair));
    phase("heal-fetched", step);
    const TensorDict extras = state.load_snapshot(got.state, what);
    if (load_extra) load_extra(StateRegistry::without_registered(extras));
    registry.load_heal_entries(extras, what);
  }

  // ---- the asynchronous quorum (QuorumMode::kAsync; async_round.cpp) ------------------------------
  Manager* owner = nullptr;  // step_, quorum_ and stats_ are the Manager's
  // The round's own collectives over the group (the quorum's broadcast, the rebuild's vote), over
  // the group's ranks apart from `group`, so that they never interleave with the training's. Null
  // for a group of one rank.
  std::shared_ptr<ProcessGroup> control;
  ProcessGroup& round_group() { return control ? *control : *group; }
  // The step's quorum (and its cross-group process group), taken by round_thread while forward
  // and backward run. round_done and round_error under round_mu.
  std::thread round_thread;
  std::mutex round_mu;
  std::condition_variable round_cv;
  bool round_done = true;
  std::exception_ptr round_error;  // why the step has no quorum: should_commit rethrows it
  Contribution contribution;       // this step's (the round's quorum)
  // When the step first needed its quorum before it came (the first cross-group collective):
  // the quorum's lateness there is what quorum_wait_seconds counts. Unset: not needed yet.
  std::optional<std::chrono::steady_clock::time_point> round_needed;
  std::vector<std::function<void()>> round_waiters;  // when_round_done's, run as the round ends
  // A copy of another group's state on a thread of its own while this group trains on its old one:
  // loaded in the should_commit of the step whose quorum is at `target`.
  struct HealInFlight {
    int64_t target = 0;
    int64_t quorum_id = -1;
    std::string what;  // the source, rank and step, for errors
    std::thread thread;
    std::atomic<bool> cancel{false};
    bool init_sync = false;  // the copy a group's first quorum makes (init_sync), not a heal
    bool ok = false;         // set by the thread before it ends
    std::string why;
    Fetched got;
    std::chrono::steady_clock::time_point started;
    double fetched_seconds = 0;  // from started to the copy's end (the wait for the source's boundary included)
  };
  std::unique_ptr<HealInFlight> heal;
  // The heal this group serves from its state at its next step boundary (its start_step at `step`).
  struct ServeAt {
    int64_t step = 0;
    int64_t quorum_id = -1;
    std::set<std::string> healers;
  };
  std::optional<ServeAt> serve_at;
  std::thread serving;  // until the served snapshot's healers release it (or are lost)
  std::atomic<double> served_seconds{0};

  void run_round(GroupInfo self, std::chrono::steady_clock::time_point give_up, bool at_boundary);
  Quorum take_quorum(const GroupInfo& self, std::chrono::steady_clock::time_point give_up, ProcessGroup& pg);
  void assign_roles(const Quorum& q, const GroupInfo& self, bool at_boundary);
  bool wait_round_quietly();  // false when the step has no quorum (and marks it not to commit)
  // Runs `fn` once the step's round has ended: now, or on the round's thread as it ends (DDP's
  // buckets wait there for their crossing, not in backward).
  void when_round_done(std::function<void()> fn);
  void join_round();          // the main thread's; rethrows the round's error
  void publish_snapshot(int64_t step, const std::set<std::string>& healers, int64_t quorum_id);
  void start_fetch(const Quorum& q, int source, int64_t target);  // into `heal`
  bool finish_heal();  // collective over the group: loads the heal in flight; true when every rank did
  void drop_heal();
  // Failed steps in a row with the same error (commit_step stops at kFailuresInARow of them).
  static constexpr int kFailuresInARow = 20;
  int failures_in_a_row = 0;
  std::string last_repeated_error;

  void start_step_async();
  bool commit_step();  // should_commit, every mode's
  void finish_async();  // close(): the round, the heal and the serving end

  std::thread heartbeats;
  std::mutex beat_mu;
  std::condition_variable beat_cv;
  bool stopping = false;

  Impl(std::shared_ptr<ProcessGroup> g, TrainingState* s, ManagerOptions o)
      : group(std::move(g)),
        owned_state(s ? nullptr : std::make_unique<TrainingState>()),
        state(s ? *s : *owned_state),
        options(std::move(o)) {}

  void retire_cross() {
    std::lock_guard<std::mutex> lock(cross_mu);
    if (!cross) return;
    retired_bytes += bytes_to_other_groups(cross->stats());
    reap(std::move(cross));
    cross.reset();
    staging = at::Tensor();
    // A gradient born in it may still be written by an aborted collective: none is born there again.
    if (arena) arena->retire();
    arena.reset();
    cross_groups.clear();
    cross_quorum = -1;
  }

  void heartbeat_loop() {
    std::unique_lock<std::mutex> lock(beat_mu);
    while (!stopping) {
      lock.unlock();
      try {
        const std::optional<LighthouseClient::Beat> fresh =
            group_beats ? group_beats->beat(*client, incarnation)
                        : client->heartbeat(options.group_id(), group->rank(), incarnation);
        if (fresh) {
          const LighthouseClient::Beat& beat = *fresh;
          {
            std::lock_guard<std::mutex> guard(seen_mu);
            lost_now = std::set<std::string>(beat.lost.begin(), beat.lost.end());
            newest_quorum = beat.quorum_id;
            ++beats;
          }
          std::lock_guard<std::mutex> guard(cross_mu);
          // Only what the lighthouse says of the quorum the cross group was made for: a reply about
          // an older one may name a group since restarted and back in this one.
          for (const auto& lost : beat.lost) {
            if (!cross || beat.quorum_id != cross_quorum || !cross_groups.count(lost)) continue;
            cross->abort(lost_reason(lost));
            break;
          }
        }
      } catch (const std::exception&) {
        // The lighthouse is away (restarting): the next quorum waits for it; collectives go on.
      }
      lock.lock();
      beat_cv.wait_for(lock, options.heartbeat_interval(), [&] { return stopping; });
    }
  }

  // A connection of its own to the store at `address`, under `prefix`: a TCPStore client holds its
  // lock through a blocking wait, so a rendezvous given up on must not share one with the next.
  // Its waits end at once when `abandoned` is set (run_unless sets it when it gives the rendezvous
  // up), so a given-up rendezvous's thread does not outlive it by the store's timeout. Static: the
  // thread making the group holds only what it was given, never this Impl.
  static c10::intrusive_ptr<c10d::Store> store_at(const std::string& address, const std::string& prefix,
                                                  std::chrono::milliseconds timeout,
                                                  std::shared_ptr<std::atomic<bool>> abandoned) {
    const int port = std::stoi(address.substr(address.rfind(':') + 1));
    return c10::make_intrusive<c10d::PrefixStore>(
        prefix, c10::make_intrusive<PollingStore>(compat::tcp_store_client(host_of(address), port, timeout),
                                                      std::move(abandoned)));
  }

  // The options of the groups this rank makes across the replica groups: Gloo listens on the
  // address the other groups reach this host at, the one on the route to the store they meet at
  // (the group's own address may be loopback: its ranks share a host).
  ProcessGroupOptions across_options(const std::string& name, const std::string& store_address) const {
    ProcessGroupOptions o = group->options();
    o.group_name(name).timeout(options.cross_group_timeout()).abortable(true).check_collectives(false);
    if (options.cross_gloo_threads() > 0) o.gloo_threads(options.cross_gloo_threads());
    o.lazy_connections(options.cross_lazy_connections());
    const std::string towards = local_address_towards(host_of(store_address), 1);
    if (!towards.empty()) o.gloo_hostname(towards);
    return o;
  }

  // pair_group as the state service and fetch_state take it.
  PairGroupFactory pair_groups() {
    return [this](const std::string& name, int rank, const std::string& peer) { return pair_group(name, rank, peer); };
  }

  // The group of one heal (StateServer / fetch_state): this rank and the matching rank of `peer`,
  // the source or healer group, met under `name` on the store of the current quorum's cross
  // groups. Given up (CommError) when the peer is lost or a newer quorum forms meanwhile.
  std::shared_ptr<ProcessGroup> pair_group(const std::string& name, int rank, const std::string& peer) {
    std::string address;
    int64_t quorum = -1;
    {
      std::lock_guard<std::mutex> lock(cross_mu);
      address = cross_store;
      quorum = cross_quorum;
    }
    DDPKIT_CHECK(quorum >= 0, "fault tolerance: no cross-group store to meet a heal's pair group at");
    const std::string prefix =
        "ddpkit-ft/q" + std::to_string(quorum) + "/heal/" + name + "/r" + std::to_string(group->rank());
    ProcessGroupOptions o = across_options("ft-heal", address);
    o.gloo_connections(options.heal_connections()).lazy_connections(false);  // one pair, made at once
    const int64_t since = beats_now();
    auto abandoned = std::make_shared<std::atomic<bool>>(false);
    const auto timeout = options.cross_group_timeout();
    return run_unless<std::shared_ptr<ProcessGroup>>(
        [address, prefix, rank, o, timeout, abandoned] {
          return std::make_shared<ProcessGroup>(store_at(address, prefix, timeout, abandoned), rank, 2, o);
        },
        [this, peer, quorum, since] { return given_up({peer}, quorum, since); }, detached, abandoned);
  }

  // This rank's cross-group group for quorum `q` (none when this group is alone in it). Its
  // rendezvous is given up (CommError) when a participant is lost or a newer quorum forms
  // meanwhile: a group that stopped before joining holds the others for a heartbeat timeout,
  // not for the rendezvous's.
  // True when it built one.
  bool rebuild(const Quorum& q, int replica) {
    retire_cross();
    if (q.participants.size() < 2) {  // alone: nothing to build, and nothing again until the quorum changes
      std::lock_guard<std::mutex> lock(cross_mu);
      cross_quorum = q.quorum_id;
      cross_store = q.store_address;
      return false;
    }
    const std::string prefix = "ddpkit-ft/q" + std::to_string(q.quorum_id) + "/r" + std::to_string(group->rank());
    struct Made {
      std::shared_ptr<ProcessGroup> pg;
      at::Tensor staging;
      std::shared_ptr<GradientArena> arena;
    };
    const ProcessGroupOptions o = across_options("ft-cross", q.store_address);
    const int size = static_cast<int>(q.participants.size());
    const int64_t numel = staging_numel;
    const std::vector<int64_t> blocks = arena_blocks;
    std::set<std::string> others;
    for (const auto& p : q.participants)
      if (p.group_id != options.group_id()) others.insert(p.group_id);
    const int64_t since = beats_now();
    auto abandoned = std::make_shared<std::atomic<bool>>(false);
    const auto timeout = options.cross_group_timeout();
    Made made = run_unless<Made>(
        [address = q.store_address, prefix, replica, size, o, numel, blocks, timeout, abandoned] {
          Made m;
          m.pg = std::make_shared<ProcessGroup>(store_at(address, prefix, timeout, abandoned), replica, size, o);
          // Collective over the new group: every participant made its reduction before its first quorum.
          if (numel > 0) m.staging = m.pg->allreduce_buffer(numel, at::kFloat);
          if (!blocks.empty()) m.arena = m.pg->gradient_arena(blocks);
          return m;
        },
        [this, others, &q, since] { return given_up(others, q.quorum_id, since); }, detached, abandoned);
    std::lock_guard<std::mutex> lock(cross_mu);
    cross = std::move(made.pg);
    staging = std::move(made.staging);
    arena = std::move(made.arena);
    cross_groups = others;
    cross_quorum = q.quorum_id;
    cross_store = q.store_address;
    return true;
  }

  // Stops the heartbeats, the state service and the cross-group process groups, and waits for
  // their threads; `leave`: rank 0 first tells the lighthouse that the group ran its last step.
  void stop(bool leave, int64_t step) {
    finish_async();  // before the heartbeats stop: a served heal ends when its healers are done or lost
    {
      std::lock_guard<std::mutex> lock(beat_mu);
      if (closed) return;
      closed = true;
      stopping = true;
    }
    beat_cv.notify_all();
    if (heartbeats.joinable()) heartbeats.join();
    if (leave && group->rank() == 0 && client) {
      try {
        client->leave(options.group_id(), incarnation, step);
      } catch (const std::exception& e) {
        // Not fatal: the group is then out of the quorums at its heartbeat timeout, as if lost.
        std::cerr << "ddpkit: group " << options.group_id() << " could not tell the lighthouse it left: " << e.what()
                  << std::endl;
      }
    }
    server.reset();  // first: its streams' threads make their groups through this Impl
    retire_cross();
    detached.join_all();
    registry.clear();  // the loop's callbacks (and what they hold: a Python object, say) go now
  }
};

}  // namespace ft
}  // namespace ddpkit
