// The Manager (include/ddpkit/ft/manager.h): quorum, cross-group process groups, heals, commits.
#include "manager_impl.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

namespace ddpkit {
namespace ft {

Manager::Manager(std::shared_ptr<ProcessGroup> group, TrainingState& state, ManagerOptions options)
    : Manager(std::move(group), &state, std::move(options), nullptr, nullptr) {}

Manager::Manager(std::shared_ptr<ProcessGroup> group, ManagerOptions options)
    : Manager(std::move(group), nullptr, std::move(options), nullptr, nullptr) {}

Manager::Manager(std::shared_ptr<ProcessGroup> group, TrainingState& state, ManagerOptions options,
                 std::function<TensorDict()> extra, std::function<void(const TensorDict&)> load_extra)
    : Manager(std::move(group), &state, std::move(options), std::move(extra), std::move(load_extra)) {}

Manager::Manager(std::shared_ptr<ProcessGroup> group, TrainingState* state, ManagerOptions options,
                 std::function<TensorDict()> extra, std::function<void(const TensorDict&)> load_extra) {
  DDPKIT_CHECK(group, "ft::Manager needs its replica group's process group");
  DDPKIT_CHECK(!options.lighthouse().empty(), "ft::Manager: no lighthouse address (host:port)");
  DDPKIT_CHECK(wire::valid_name(options.group_id()), "ft::Manager: group_id must be 1-128 characters of "
               "[A-Za-z0-9_.-], got '", options.group_id(), "'");
  DDPKIT_CHECK(options.heartbeat_interval().count() > 0, "ft::Manager: heartbeat_interval must be positive");
  DDPKIT_CHECK(options.heal_connections() >= 1, "ft::Manager: heal_connections must be >= 1");
  DDPKIT_CHECK(options.cross_gloo_threads() >= 0, "ft::Manager: cross_gloo_threads must be >= 0 (0: the replica group's), got ",
               options.cross_gloo_threads());
  impl_ = std::make_unique<Impl>(std::move(group), state, std::move(options));
  Impl& im = *impl_;
  im.owner = this;
  im.extra = std::move(extra);
  im.load_extra = std::move(load_extra);
  im.init_sync_pending = im.options.init_sync();
  ProcessGroup& pg = *im.group;
  im.incarnation = broadcast_string(pg, pg.rank() == 0 ? new_incarnation() : "");
  // Every rank of the group must be one group: the same id everywhere.
  const auto ids = allgather_strings(pg, im.options.group_id());
  for (int r = 0; r < pg.size(); ++r)
    DDPKIT_CHECK(ids[r] == im.options.group_id(), "ft::Manager: rank ", r, " of this group says group_id '", ids[r],
                 "', rank ", pg.rank(), " says '", im.options.group_id(), "'");
  if (pg.size() > 1 && pg.store()) {
    im.group_beats = std::make_unique<GroupBeats>(pg.store(), im.options.group_id(), pg.rank(), pg.size());
    im.group_beats->prepare();  // before the collectives below: every rank's first beat finds rank 0's reply key
  }
  if (im.options.quorum_mode() == QuorumMode::kAsync && pg.size() > 1) {
    // The round's collectives wait as long as rank 0 waits for the lighthouse, then a rebuild.
    ProcessGroupOptions o = pg.options();
    o.group_name("ft-control").timeout(im.options.quorum_timeout() + im.options.cross_group_timeout());
    im.control = pg.new_subgroup(pg.rank(), pg.size(), o);
  }
  im.server = std::make_unique<StateServer>(state_host_for(im.options), im.options.token(), im.pair_groups());
  im.addresses = allgather_strings(pg, im.server->address());
  im.hosts = allgather_strings(pg, host_name());
  im.client = std::make_unique<LighthouseClient>(LighthouseClientOptions()
                                                     .address(im.options.lighthouse())
                                                     .token(im.options.token())
                                                     .tls(im.options.lighthouse_tls()));
  im.heartbeats = std::thread([&im] { im.heartbeat_loop(); });
}

Manager::~Manager() { impl_->stop(/*leave=*/false, step_); }

void Manager::close(bool leave) { impl_->stop(leave, step_); }

void Manager::request_heal(const std::string& why) {
  if (!impl_->heal_requested && impl_->group->rank() == 0)
    std::cerr << "ddpkit: group " << impl_->options.group_id() << " asks to copy the others' state at its next quorum: "
              << why << std::endl;
  impl_->heal_requested = true;
}

const std::string& Manager::group_id() const { return impl_->options.group_id(); }
const std::shared_ptr<ProcessGroup>& Manager::group() const { return impl_->group; }
const Quorum& Manager::quorum() const {
  impl_->wait_round_quietly();
  return quorum_;
}
int Manager::replica_rank() const { return quorum().replica_rank(impl_->options.group_id()); }
int Manager::replica_count() const { return static_cast<int>(quorum().participants.size()); }

void Manager::register_state(const std::string& key, SaveState save, LoadState load, StateScope scope) {
  DDPKIT_CHECK(!impl_->closed, "ft::Manager::register_state: the Manager is closed");
  impl_->registry.add(key, std::move(save), std::move(load), scope);
}

void Manager::unregister_state(const std::string& key) { impl_->registry.remove(key); }

void Manager::checkpoint_state(TensorDict* common, TensorDict* local) const {
  impl_->registry.checkpoint_entries(common, local);
}

void Manager::load_checkpoint_state(const TensorDict& common, const TensorDict& local) {
  impl_->registry.load_checkpoint_entries(common, local, "the checkpoint");
}

std::string Manager::save_checkpoint(const std::string& dir, int keep) {
  TensorDict common, local;
  checkpoint_state(&common, &local);
  common["manager_step"] = int_entry(step_);
  return impl_->state.save(impl_->group.get(), dir, step_, common, local, keep);
}

int64_t Manager::restore_checkpoint(const std::string& dir) {
  Impl& im = *impl_;
  const auto loaded = im.state.restore(im.group.get(), dir);
  if (!loaded) return -1;
  const TensorDict common = entries_under(loaded->common, "extra/"), local = entries_under(loaded->local, "extra/");
  im.registry.load_checkpoint_entries(common, local, loaded->path);
  resume_at(int_of(common, "manager_step", loaded->path));
  return step_;
}

void Manager::resume_at(int64_t step) {
  DDPKIT_CHECK(stats_.quorums == 0, "ft::Manager::resume_at: before the first start_step");
  DDPKIT_CHECK(step >= 0, "ft::Manager::resume_at: step must be >= 0, got ", step);
  step_ = step;
  impl_->init_sync_pending = false;  // its state is its checkpoint's (a DiLoCo site's own, say)
}

void Manager::start_step() { start_step(impl_->options.quorum_mode()); }

void Manager::start_step(QuorumMode mode) {
  Impl& im = *impl_;
  DDPKIT_CHECK(!im.closed, "ft::Manager::start_step: the Manager is closed");
  if (mode == QuorumMode::kAsync)
    im.start_step_async();
  else
    start_step_sync();
}

void Manager::start_step_sync() {
  Impl& im = *impl_;
  im.join_round();  // a step of the other mode before: its round is over
  im.drop_heal();
  im.serve_at.reset();
  if (im.serving.joinable()) im.serving.join();
  ProcessGroup& pg = *im.group;
  const auto give_up = std::chrono::steady_clock::now() + im.options.quorum_timeout();
  for (;;) {
    GroupInfo self{im.options.group_id(), step_, pg.size(), im.addresses, im.hosts, im.incarnation};
    self.heal = im.heal_requested || im.init_sync_pending;
    const auto asked = std::chrono::steady_clock::now();
    quorum_ = im.take_quorum(self, give_up, pg);
    im.contribution = Contribution::of(quorum_, quorum_.replica_rank(im.options.group_id()), /*async=*/false);
    stats_.quorum_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count();
    const int me = quorum_.replica_rank(im.options.group_id());
    bool ok = true;
    std::string why;

    // A source publishes what its healers copy; a group behind the quorum (or asking) copies it.
    if (std::count(quorum_.heal_sources.begin(), quorum_.heal_sources.end(), me) > 0)
      im.served_seconds = im.served_seconds.load() + im.serve_healers(quorum_, me, step_);
    else
      im.server->clear();
    const int source = quorum_.heal_sources[me];
    if (source < 0) {  // up to date, or the source the others copy: an asked heal is answered either way
      im.quorum_done();
      return;
    }
    ok = copy_state_from(source, &why);
    if (all_of(pg, ok)) {
      // A copy at the quorum's step while the init sync is pending is the init sync; any other a heal.
      if (im.init_sync_pending && step_ == quorum_.max_step)
        ++stats_.init_syncs;
      else
        ++stats_.heals;
      step_ = quorum_.max_step;
      im.quorum_done();
      return;
    }
    // Some rank could not copy (its source died mid-heal): ask again; the new quorum names
    // another source, or none is left and it times out.
    stats_.last_error = why.empty() ? "a rank of this group could not heal" : why;
    im.broken = true;
    if (std::chrono::steady_clock::now() >= give_up) throw CommError("ddpkit: replica group " + im.options.group_id() + ": " + stats_.last_error);
  }
}

bool Manager::copy_state_from(int source, std::string* why) {
  Impl& im = *impl_;
  const GroupInfo& from = quorum_.participants[source];
  const std::string what = im.copy_what(from, quorum_.max_step);
  try {
    const auto start = std::chrono::steady_clock::now();
    Fetched got = fetch_state(from.state_addresses[im.group->rank()], quorum_.max_step,
                              im.fetch_options(from, quorum_.quorum_id, im.options.cross_group_timeout()));
    stats_.heal_fetch_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    im.load_copy(got, quorum_.max_step, what, stats_);
    stats_.heal_bytes += got.bytes;
    stats_.heal_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    stats_.heals_single_copy += got.single_copy ? 1 : 0;
    return true;
  } catch (const std::exception& e) {
    *why = "healing from " + what + ": " + e.what();
    return false;
  }
}

CrossReplicaReduction Manager::cross_group_reduction(const std::vector<at::Tensor>& parameters) {
  Impl* im = impl_.get();
  DDPKIT_CHECK(stats_.quorums == 0, "ft::Manager::cross_group_reduction: make it before the first start_step (every "
               "group's rank allocates the same staging when the cross-group process group is made)");
  int64_t numel = 0;
  im->arena_blocks.clear();
  for (const auto& p : parameters) {
    if (!p.requires_grad() || p.scalar_type() != at::kFloat) continue;
    numel += p.numel();
    // As DDP's own arena: gradients big enough to be worth a block (the same on every group).
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    if (im->group->size() == 1 && p.device().is_cpu() && p.is_contiguous() && bytes >= GradientArena::kMinBlockBytes)
      im->arena_blocks.push_back(bytes);
  }
  im->staging_numel = numel;
  std::function<void()> issued;
  if (im->options.on_phase()) issued = [this] { impl_->options.on_phase()("crossing", step_); };
  auto buckets = std::make_shared<CrossGroupBuckets>(
      [im](std::function<void(Crossing)> then) { im->when_round_done([im, then] { then(im->crossing()); }); },
      [im](const std::string& why) { im->fail(why); }, issued);
  CrossReplicaReduction reduction;
  reduction.reduce = [buckets](const BucketCrossing& bucket) { return (*buckets)(bucket); };
  reduction.gradient_arena = [im]() -> std::shared_ptr<GradientArena> {
    std::lock_guard<std::mutex> lock(im->cross_mu);
    return im->failed || !im->cross ? nullptr : im->arena;
  };
  return reduction;
}

void Manager::allreduce(const std::vector<at::Tensor>& tensors) {
  Impl& im = *impl_;
  const Crossing crossing = im.crossing();
  const std::shared_ptr<ProcessGroup>& cross = crossing.group;
  if (!cross || tensors.empty()) return;
  std::vector<at::Tensor> flat;
  for (const auto& t : tensors) {
    DDPKIT_CHECK(t.device().is_cpu() && t.scalar_type() == tensors[0].scalar_type(), "ft::Manager::allreduce: "
                 "every tensor must be on the CPU and of one dtype (", tensors[0].scalar_type(), "), got ", t.scalar_type());
    flat.push_back(t.reshape({-1}));
  }
  // A fresh buffer: an aborted collective may write into its tensor after the abort.
  at::Tensor all = at::cat(flat);
  const Contribution c = crossing.contribution;
  c.prepare(all);
  try {
    ProcessGroup::wait(cross->allreduce(all, c10d::ReduceOp::SUM));
  } catch (const std::exception& e) {
    im.fail(e.what());
    return;
  }
  c.average(all);
  int64_t offset = 0;
  for (const auto& t : tensors) {
    t.copy_(all.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

std::shared_ptr<ProcessGroup> Manager::cross_group() { return impl_->crossing().group; }

void Manager::fail_step(const std::string& why) { impl_->fail(why); }

const ManagerStats& Manager::stats() const {
  stats_.cross_bytes_sent = impl_->cross_bytes();
  stats_.serve_seconds = impl_->served_seconds.load();
  return stats_;
}

bool Manager::should_commit() { return impl_->commit_step(); }

}  // namespace ft
}  // namespace ddpkit
