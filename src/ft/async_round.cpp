// The quorum behind the step (QuorumMode::kAsync, include/ddpkit/ft/manager.h): the round on a
// thread of its own, a heal copied while the healing group trains and loaded before its optimizer
// step, a source's snapshot taken at its step boundary and served on threads of its own, and the
// commit, which every mode shares.
#include "manager_impl.h"

namespace ddpkit {
namespace ft {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

// The quorum for `self` and, when its membership changed, this rank's cross-group process group for
// it; asked again while some rank of the group could not build that group, until `give_up`.
// Collective over `pg`.
Quorum Manager::Impl::take_quorum(const GroupInfo& self, Clock::time_point give_up, ProcessGroup& pg) {
  ManagerStats& stats = owner->stats_;
  for (;;) {
    Quorum q = ask_quorum(self, give_up, pg);
    ++stats.quorums;
    phase("quorum", owner->step_);
    const int me = q.replica_rank(options.group_id());
    DDPKIT_CHECK(me >= 0, "fault tolerance: the quorum does not include group ", options.group_id());
    bool ok = true;
    std::string why;
    if (broken || q.quorum_id != cross_quorum || q.store_address != cross_store) {
      try {
        phase("rendezvous", owner->step_);
        const auto began = Clock::now();
        if (rebuild(q, me)) {
          const double took = seconds_since(began);
          ++stats.reconfigurations;
          stats.reconfiguration_seconds += took;
          stats.longest_reconfiguration_seconds = std::max(stats.longest_reconfiguration_seconds, took);
        }
        std::lock_guard<std::mutex> lock(cross_mu);
        if (cross) stats.cross_transport = cross->transport_name();
      } catch (const std::exception& e) {
        ok = false;
        why = std::string("rebuilding the cross-group process group: ") + e.what();
      }
    }
    if (all_of(pg, ok)) {
      broken = false;
      return q;
    }
    retire_cross();
    broken = true;
    stats.last_error = why.empty() ? "a rank of this group could not rebuild its cross-group process group" : why;
    if (Clock::now() >= give_up) throw CommError("ddpkit: replica group " + options.group_id() + ": " + stats.last_error);
  }
}

void Manager::Impl::start_step_async() {
  Manager& m = *owner;
  join_round();  // a start_step without a should_commit before it: that round is over by now
  // A source named by the last quorum serves from this boundary: nothing changes the state now.
  if (serve_at) {
    if (serve_at->step == m.step_) publish_snapshot(m.step_, serve_at->healers, serve_at->quorum_id);
    serve_at.reset();  // else that step did not commit: a new quorum forms, and names the heals again
  }
  GroupInfo self{options.group_id(), m.step_, group->size(), addresses, hosts, incarnation};
  if (heal) {
    self.step = heal->target;  // what it holds once the copy is loaded, at the end of this step
    self.healing = true;
    heal_requested = false;  // asked again meanwhile: the copy replaces all of the state anyway
  } else {
    self.heal = heal_requested || init_sync_pending;
  }
  const auto asked = Clock::now();
  const auto give_up = asked + options.quorum_timeout();
  {
    std::lock_guard<std::mutex> lock(round_mu);
    round_done = false;
    round_error = nullptr;
    round_needed.reset();
  }
  if (!self.heal) {
    round_thread = std::thread([this, self, give_up] { run_round(self, give_up, /*at_boundary=*/false); });
    return;
  }
  // This group drops its state at this quorum: it waits for it (and, where its source asked too,
  // as groups starting together do, loads the copy before its forward, as under kSync).
  run_round(self, give_up, /*at_boundary=*/true);
  m.stats_.quorum_wait_seconds += seconds_since(asked);
  join_round();
}

void Manager::Impl::run_round(GroupInfo self, Clock::time_point give_up, bool at_boundary) {
  std::exception_ptr error;
  try {
    Quorum q = take_quorum(self, give_up, round_group());
    {
      std::lock_guard<std::mutex> lock(round_mu);
      contribution = Contribution::of(q, q.replica_rank(options.group_id()), /*async=*/true);
      owner->quorum_ = q;
    }
    assign_roles(owner->quorum_, self, at_boundary);
  } catch (...) {
    error = std::current_exception();
  }
  std::vector<std::function<void()>> waiters;
  {
    std::lock_guard<std::mutex> lock(round_mu);
    round_error = error;
    round_done = true;
    if (round_needed) owner->stats_.quorum_wait_seconds += seconds_since(*round_needed);
    waiters.swap(round_waiters);
  }
  round_cv.notify_all();
  for (auto& w : waiters) w();
}

void Manager::Impl::when_round_done(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(round_mu);
    if (!round_done) {
      if (!round_needed) round_needed = Clock::now();
      round_waiters.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

void Manager::Impl::assign_roles(const Quorum& q, const GroupInfo& self, bool at_boundary) {
  const int me = q.replica_rank(options.group_id());
  std::set<std::string> healers;
  for (size_t j = 0; j < q.heal_sources.size(); ++j)
    if (q.heal_sources[j] == me) healers.insert(q.participants[j].group_id);
  if (!healers.empty()) {
    if (at_boundary)  // it asked too (groups starting together): its state is this boundary's
      publish_snapshot(owner->step_, healers, q.quorum_id);
    else
      serve_at = ServeAt{q.max_step + 1, q.quorum_id, healers};
  }
  const GroupInfo& mine = q.participants[static_cast<size_t>(me)];
  if (mine.healing) return;  // its copy, named by an earlier quorum, is on its way
  // The lighthouse gave a copy in flight up (its source did not commit the step it serves from).
  if (heal) drop_heal();
  const int source = q.heal_sources[me];
  if (source < 0) {
    // Up to date, or the group the others copy: an asked copy is answered. (Behind with no
    // source in this quorum: the step adds zeros, is not committed, and the next quorum names one.)
    if (mine.step == q.max_step) heal_requested = init_sync_pending = false;
    return;
  }
  const bool init = init_sync_pending && self.step == q.max_step;
  heal_requested = init_sync_pending = false;
  // A source that asked too (the first quorum of groups starting together) published at this
  // boundary already; any other serves from its next one.
  const int64_t target = q.participants[static_cast<size_t>(source)].heal ? q.max_step : q.max_step + 1;
  start_fetch(q, source, target);
  heal->init_sync = init;
  if (at_boundary && contribution.contributes && !finish_heal()) {
    // The others count this group's gradients this step, and it holds no copy: the step fails for
    // all of them at once rather than averaging a state nobody else holds.
    std::lock_guard<std::mutex> lock(cross_mu);
    if (cross) cross->abort("replica group " + options.group_id() + " could not load the state it copied at its quorum");
  }
}

bool Manager::Impl::wait_round_quietly() {
  std::unique_lock<std::mutex> lock(round_mu);
  if (!round_done) {
    if (!round_needed) round_needed = Clock::now();
    round_cv.wait(lock, [this] { return round_done; });
  }
  if (!round_error) return true;
  lock.unlock();
  fail("no quorum for this step");  // should_commit throws why
  return false;
}

void Manager::Impl::join_round() {
  if (round_thread.joinable()) round_thread.join();
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(round_mu);
    std::swap(error, round_error);
  }
  if (error) std::rethrow_exception(error);
}

void Manager::Impl::publish_snapshot(int64_t step, const std::set<std::string>& healers, int64_t quorum_id) {
  if (serving.joinable()) serving.join();  // one state served at a time: the last heal's is read or given up
  const auto t0 = Clock::now();
  TensorDict published = extra ? extra() : TensorDict{};
  for (auto& [name, value] : registry.heal_entries()) published[name] = std::move(value);
  TensorDict snapshot = state.snapshot(published);
  // A copy: this step's forward (buffers, an FSDP reshard) and optimizer step change the live ones.
  for (auto& kv : snapshot) kv.second = kv.second.detach().clone(at::MemoryFormat::Contiguous);
  owner->stats_.snapshot_seconds += seconds_since(t0);
  server->publish(step, snapshot, healers);
  phase("heal-publish", step);
  const int64_t since = beats_now();
  serving = std::thread([this, quorum_id, since] {
    const auto start = Clock::now();
    server->wait_released(start + options.cross_group_timeout(),
                          [&](const std::string& h) { return !given_up({h}, quorum_id, since).empty(); });
    served_seconds = served_seconds.load() + seconds_since(start);
  });
}

void Manager::Impl::start_fetch(const Quorum& q, int source, int64_t target) {
  drop_heal();
  auto h = std::make_unique<HealInFlight>();
  const GroupInfo& from = q.participants[static_cast<size_t>(source)];
  h->target = target;
  h->what = copy_what(from, target);
  HealInFlight* raw = h.get();
  // The source serves from its next step boundary: a step of its own, then the copy.
  FetchOptions fo = fetch_options(from, q.quorum_id, options.quorum_timeout() + options.cross_group_timeout(), [raw] {
    return std::string(raw->cancel ? "the heal was given up (the Manager closed, or the quorum moved past it)" : "");
  });
  const std::string address = from.state_addresses[static_cast<size_t>(group->rank())];
  h->started = std::chrono::steady_clock::now();
  h->thread = std::thread([raw, address, target, fo] {
    try {
      raw->got = fetch_state(address, target, fo);
      raw->fetched_seconds = seconds_since(raw->started);
      raw->ok = true;
    } catch (const std::exception& e) {
      raw->why = "healing from " + raw->what + ": " + e.what();
    }
  });
  heal = std::move(h);
}

void Manager::Impl::drop_heal() {
  if (!heal) return;
  heal->cancel = true;
  if (heal->thread.joinable()) heal->thread.join();
  if (heal->got.pair) reap(std::move(heal->got.pair));
  heal.reset();
}

bool Manager::Impl::finish_heal() {
  ManagerStats& stats = owner->stats_;
  HealInFlight& h = *heal;
  if (h.thread.joinable()) h.thread.join();
  bool ok = all_of(*group, h.ok);
  std::string why = h.why;
  if (ok) {
    try {
      // The copy and the load, as a synchronous heal counts them; not the wait for the source's
      // boundary (this group trained meanwhile).
      const double copying = std::max(0.0, h.fetched_seconds - h.got.waited_seconds);
      stats.heal_fetch_seconds += copying;
      const auto loading = Clock::now();
      load_copy(h.got, h.target, h.what, stats);
      stats.heal_seconds += copying + seconds_since(loading);
    } catch (const std::exception& e) {
      ok = false;
      why = "loading " + h.what + ": " + e.what();
    }
    ok = all_of(*group, ok);  // every rank loaded its part
  }
  if (ok) {
    ++(h.init_sync ? stats.init_syncs : stats.heals);
    stats.heal_bytes += h.got.bytes;
    stats.heals_single_copy += h.got.single_copy ? 1 : 0;
    owner->step_ = h.target;
  } else {
    heal_requested = true;  // what was loaded may be torn: copy again at the next quorum
    fail(why.empty() ? "a rank of this group could not heal" : why);
  }
  heal.reset();
  return ok;
}

bool Manager::Impl::commit_step() {
  Manager& m = *owner;
  ManagerStats& stats = m.stats_;
  join_round();  // no quorum: the CommError (or JobFinished) start_step throws under kSync
  bool loaded = false;
  if (heal && heal->target == m.quorum_.max_step) {
    loaded = finish_heal();
  } else if (heal && heal->target < m.quorum_.max_step) {
    drop_heal();  // the quorum went past it (a group ahead): the next one names a heal again
    heal_requested = true;
  }
  // A group that trained on a state it is replacing (it added zeros) applies nothing of its own.
  const bool stale = !contribution.contributes && !loaded;
  const bool failed_now = failed;
  const bool commit = all_of(*group, !failed_now && !stale);
  if (commit) {
    ++m.step_;
    ++stats.steps_committed;
  } else if (!failed_now && stale) {
    ++stats.steps_healing;
  } else {
    ++stats.steps_not_committed;
    std::lock_guard<std::mutex> lock(failure_mu);
    stats.last_error = failure.empty() ? "another rank of this group failed its step" : failure;
    broken = true;
  }
  clear_failure();
  // A failure that comes back the same step after step (the groups' collectives do not match:
  // another model, bucket layout or dtype) is not one a new quorum mends: stop, naming it.
  if (commit || (stale && !failed_now)) {
    failures_in_a_row = 0;
  } else {
    failures_in_a_row = stats.last_error == last_repeated_error ? failures_in_a_row + 1 : 1;
    last_repeated_error = stats.last_error;
    if (failures_in_a_row >= kFailuresInARow)
      throw CommError("ddpkit: replica group " + options.group_id() + ": " + std::to_string(failures_in_a_row) +
                      " steps in a row failed the same way, which a new quorum does not mend: " + stats.last_error);
  }
  return commit;
}

void Manager::Impl::finish_async() {
  try {
    join_round();
  } catch (const std::exception&) {
    // Closing: a round that found no quorum has nothing left to free.
  }
  drop_heal();
  if (serving.joinable()) serving.join();  // its healers read the last state served, or are lost
  serve_at.reset();
}

}  // namespace ft
}  // namespace ddpkit
