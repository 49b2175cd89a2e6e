// DiLoCo across replica groups (include/ddpkit/diloco/diloco.h): the schedule, the pseudo-
// gradients, the outer Nesterov step and the retry among survivors.
#include <ddpkit/diloco/diloco.h>
#include <ddpkit/error.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iostream>

namespace ddpkit {
namespace diloco {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A 64-bit hash of the tensor's bytes (equal globals give equal hashes), at memory speed.
uint64_t checksum_of(const at::Tensor& t) {
  const auto* p = static_cast<const unsigned char*>(t.data_ptr());
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  uint64_t lanes[4] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull, 0x27D4EB2F165667C5ull};
  size_t i = 0;
  for (; i + 32 <= bytes; i += 32)
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lanes[k] = (lanes[k] ^ w) * 0x100000001B3ull;
    }
  uint64_t h = lanes[0] ^ (lanes[1] << 1) ^ (lanes[2] << 2) ^ (lanes[3] << 3);
  for (; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  return h ^ bytes;
}

}  // namespace

// (Named, not in the anonymous namespace: DiLoCo::Impl holds them, and an internal-linkage member
// type of an external class draws -Wsubobject-linkage.)
struct DiLoCoFragment {
  std::vector<at::Tensor> params;
  int64_t numel = 0;
  at::Tensor global;    // float32, flat
  at::Tensor momentum;  // float32, flat; meaningful once outer_steps > 0
  int64_t outer_steps = 0;
  // The part of the values this rank carries across sites: [shard_offset, + shard_numel), padded
  // with zeros to shard_size (the same on every rank of the site). All of them (shard_size ==
  // numel) unless the site's ranks hold the same parameters and split the carrying.
  int64_t shard_offset = 0, shard_numel = 0, shard_size = 0;
  // Error feedback (DiLoCoOptions::error_feedback): what this rank's last committed encodings lost,
  // of its shard of the pseudo-gradient and of the mean at the positions it owned (float32, flat).
  at::Tensor sent_residual, mean_residual;

  bool split_across_site() const { return shard_size != numel; }
  // This rank's shard of `full` (numel values), as a tensor of its own.
  at::Tensor shard_of(const at::Tensor& full) const {
    if (!split_across_site()) return full;
    at::Tensor out = at::zeros({shard_size}, at::kFloat);
    if (shard_numel > 0) out.narrow(0, 0, shard_numel).copy_(full.narrow(0, shard_offset, shard_numel));
    return out;
  }

  at::Tensor local_flat() const {
    std::vector<at::Tensor> flat;
    for (const auto& p : params) flat.push_back(p.detach().reshape({-1}).to(at::kFloat));
    return flat.empty() ? at::zeros({0}, at::kFloat) : at::cat(flat);
  }
  // The parameters := lerp(global, local, alpha).
  void merge(double alpha) {
    at::NoGradGuard no_grad;
    int64_t offset = 0;
    for (auto& p : params) {
      at::Tensor g = global.narrow(0, offset, p.numel()).view(p.sizes());
      if (alpha == 0)
        p.detach().copy_(g);
      else
        p.detach().copy_(g + alpha * (p.detach().to(at::kFloat) - g));
      offset += p.numel();
    }
  }
};

// One sync of one fragment: started (prepare) and applied (perform).
struct DiLoCoSync {
  bool active = false;
  size_t fragment = 0;
  at::Tensor delta;  // this rank's shard of the site's pseudo-gradient, sent again on a retry
  float weight = 0;
  uint64_t checksum = 0;
  at::Tensor mean;   // the average, once the future completes
  FuturePtr future;
  std::shared_ptr<WeightedMeanResult> result;
  std::shared_ptr<MeanErrorFeedback> feedback;  // this attempt's residuals, kept if it commits
  Clock::time_point issued;
  double blocked = 0;  // the training thread's wait in this sync so far
  // Seconds from issue to completion, stored before `future` completes (it is a then() of the
  // average's own future, so whoever waits on it reads the figure).
  std::shared_ptr<std::atomic<double>> done_after;
};

struct DiLoCo::Impl {
  ft::Manager& manager;
  DiLoCoOptions options;
  std::shared_ptr<const codecs::Codec> codec;
  std::vector<DiLoCoFragment> fragments;
  int64_t period = 0;      // inner steps between syncs (of successive fragments)
  int64_t local_step = 0;  // inner steps since the last sync point
  // The fragment the next sync carries: advanced by each sync that applied an outer step, the
  // same on every site (a healed one copies it), so a weightless sync (the first quorum, or the
  // one after a resume) leaves the schedule where it was.
  int64_t next_fragment = 0;
  Clock::time_point round_start = Clock::now();  // time-budgeted rounds
  DiLoCoSync sync;
  DiLoCoStats stats;

  // The site's own group (its ranks' fast network) and this rank's place in it.
  std::shared_ptr<ProcessGroup> site;
  int site_world = 1, site_rank = 0;

  Impl(ft::Manager& m, DiLoCoOptions o) : manager(m), options(std::move(o)) {
    site = manager.group();
    if (site) {
      site_world = site->size();
      site_rank = site->rank();
    }
  }

  // Whether this time-budgeted round ends now: rank 0's clock decides for the whole site, so its
  // ranks enter the sync at the same inner step (each deciding alone, one rank could start the
  // sync's collectives while another ran DDP's allreduce of one more step on the same group).
  bool round_ends() {
    bool ends = local_step >= period || seconds_since(round_start) >= options.round_seconds();
    if (site_world > 1) {
      at::Tensor decision = at::full({1}, ends ? 1 : 0, at::kInt);
      ProcessGroup::wait(site->broadcast(decision, 0));
      ends = decision.item<int>() != 0;
    }
    return ends;
  }

  // The site's ranks must hold the same parameters when they split the carrying (a model under
  // FSDP does not: its ranks hold their own shards).
  void check_site_agrees() {
    if (site_world == 1 || options.parameters_sharded()) return;
    const auto count = static_cast<int64_t>(fragments.size());
    at::Tensor mine = at::empty({count}, at::kLong), all = at::empty({count * site_world}, at::kLong);
    for (int64_t i = 0; i < count; ++i) {
      const uint64_t sum = checksum_of(fragments[static_cast<size_t>(i)].global);
      std::memcpy(mine.data_ptr<int64_t>() + i, &sum, sizeof sum);
    }
    ProcessGroup::wait(site->allgather_into_tensor(all, mine));
    for (int r = 1; r < site_world; ++r)
      DDPKIT_CHECK(at::equal(all.narrow(0, r * count, count), all.narrow(0, 0, count)), "DiLoCo: rank ", r,
                   " of this site holds other parameters than rank 0, and DiLoCoOptions::parameters_sharded is "
                   "false (every rank of a site carries 1/", site_world,
                   " of the whole model's pseudo-gradient): under FSDP, where each rank holds its own shards, "
                   "set parameters_sharded(true); under DDP or ZeRO, start DiLoCo after the model is replicated");
  }

  // The fragment's whole mean from the ranks' shards of it (all-gathered inside the site).
  at::Tensor whole_mean(const DiLoCoFragment& f) {
    if (!f.split_across_site()) return sync.mean;
    const auto t0 = Clock::now();
    at::Tensor all = at::empty({f.shard_size * site_world}, at::kFloat);
    ProcessGroup::wait(site->allgather_into_tensor(all, sync.mean));
    stats.site_gather_seconds += seconds_since(t0);
    return all.narrow(0, 0, f.numel);
  }

  // Joins the quorum; true when this site healed in it (its state was replaced).
  bool join_quorum() {
    const ft::ManagerStats& m = manager.stats();
    const int64_t heals_before = m.heals, copies_before = m.heals + m.init_syncs;
    // Synchronous whatever the Manager's mode: a site that heals sends weight 0 in this very sync.
    manager.start_step(ft::QuorumMode::kSync);
    if (m.heals + m.init_syncs == copies_before) return false;
    if (m.heals != heals_before) ++stats.heals;  // the first quorum's copy (init sync) is not a heal
    // A fresh local copy: what this site sends from now on is its own progress only; what it had
    // not yet sent belonged to the progress it has just dropped.
    for (auto& f : fragments) {
      f.merge(0.0);
      if (options.error_feedback()) {
        f.sent_residual.zero_();
        f.mean_residual.zero_();
      }
    }
    return true;
  }

  // Issues this sync's average over the step's cross-group process group (alone: its own).
  void issue() {
    sync.mean = sync.delta.clone();  // averaged in place; the delta stays for a retry
    sync.result = std::make_shared<WeightedMeanResult>();
    sync.feedback = nullptr;
    if (options.error_feedback()) {
      const DiLoCoFragment& f = fragments[sync.fragment];
      sync.feedback = std::make_shared<MeanErrorFeedback>();
      sync.feedback->sent = at::empty({f.shard_size}, at::kFloat);
      sync.feedback->mean = f.mean_residual.clone();  // a failed attempt leaves the fragment's as it was
    }
    sync.issued = Clock::now();
    sync.done_after = std::make_shared<std::atomic<double>>(0.0);
    std::shared_ptr<ProcessGroup> cross = manager.cross_group();  // null: alone in the quorum
    try {
      if (cross && options.piece_bytes() > 0 && cross->piece_bytes() != options.piece_bytes())
        cross->set_piece_bytes(options.piece_bytes());
      sync.future =
          weighted_mean(cross.get(), sync.mean, sync.weight, codec, sync.checksum, sync.result, sync.feedback);
    } catch (const std::exception& e) {
      manager.fail_step(e.what());
      sync.future = completed_future(sync.mean);
      return;
    }
    // A future wakes its waiters before it runs its callbacks: the time is stamped in a then(),
    // whose future completes only after it.
    auto done = sync.done_after;
    const auto issued = sync.issued;
    sync.future = sync.future->then(
        [done, issued](c10::ivalue::Future& average) {
          done->store(seconds_since(issued));
          return average.value();
        },
        sync.future->elementType());
    if (options.on_phase()) options.on_phase()("outer-issued", manager.step());
  }

  // Starts the sync of the next fragment in turn, with this site's pseudo-gradient
  // (weight 0 when `weightless` or when it has just healed).
  void prepare(bool weightless) {
    const auto t0 = Clock::now();
    const bool healed = join_quorum();
    sync.active = true;
    sync.fragment = static_cast<size_t>(next_fragment);
    DiLoCoFragment& f = fragments[sync.fragment];
    // Equal rounds weigh alike; time-budgeted ones by the inner steps each site ran.
    sync.weight = (weightless || healed) ? 0.f : options.round_seconds() > 0 ? static_cast<float>(local_step) : 1.f;
    sync.delta = sync.weight > 0 ? f.shard_of(f.global - f.local_flat()) : at::zeros({f.shard_size}, at::kFloat);
    if (options.error_feedback() && sync.weight > 0) sync.delta.add_(f.sent_residual);
    sync.checksum = checksum_of(f.global);
    issue();
    sync.blocked = seconds_since(t0);
    stats.blocked_seconds += sync.blocked;
  }

  void apply(DiLoCoFragment& f, const at::Tensor& mean) {
    const double mu = options.outer_momentum(), lr = options.outer_lr();
    // torch.optim.SGD(lr, momentum, nesterov): the first step's buffer is the gradient itself.
    at::Tensor direction = mean;
    if (mu != 0) {
      if (f.outer_steps == 0)
        f.momentum.copy_(mean);
      else
        f.momentum.mul_(mu).add_(mean);
      direction = options.nesterov() ? mean.add(f.momentum, mu) : f.momentum;
    }
    f.global.add_(direction, -lr);
    ++f.outer_steps;
  }

  // Waits for the sync and applies it (applied: whether an outer step was taken); redoes it
  // among the survivors until it commits. False when this site healed into a sync that another
  // site had started earlier in its schedule: it is left in flight, to be applied at this site's
  // (now that site's) sync point.
  bool applied = false;
  bool perform() {
    const auto t0 = Clock::now();
    for (;;) {
      const auto waiting = Clock::now();
      try {
        ProcessGroup::wait(sync.future);
      } catch (const std::exception& e) {
        manager.fail_step(e.what());
      }
      stats.wait_seconds += seconds_since(waiting);
      stats.transfer_seconds += sync.done_after->load();
      if (manager.should_commit()) break;
      // Not committed: a site was lost mid-average (or this one failed). The next quorum is the
      // survivors; the same pseudo-gradient goes again.
      ++stats.sync_retries;
      stats.last_error = manager.stats().last_error;
      const bool healed = join_quorum();
      if (healed) {
        sync.fragment = static_cast<size_t>(next_fragment);
        DiLoCoFragment& f = fragments[sync.fragment];
        sync.weight = 0.f;
        sync.delta = at::zeros({f.shard_size}, at::kFloat);
        sync.checksum = checksum_of(f.global);
      }
      issue();
      if (healed && options.round_seconds() == 0 && local_step < period) {
        sync.blocked += seconds_since(t0);
        stats.blocked_seconds += seconds_since(t0);
        return false;
      }
    }
    sync.active = false;
    DiLoCoFragment& f = fragments[sync.fragment];
    const WeightedMeanResult r = *sync.result;
    if (!r.checksums_agree) ++stats.checksum_mismatches;
    if (r.total_weight > 0) {
      if (sync.feedback) {
        if (sync.weight > 0) f.sent_residual = sync.feedback->sent;
        f.mean_residual = sync.feedback->mean;  // owners encode the mean whatever their weight
      }
      apply(f, whole_mean(f));
      f.merge(options.fragment_alpha());
      next_fragment = (next_fragment + 1) % static_cast<int64_t>(fragments.size());
    }
    ++stats.syncs;
    stats.last_sites = manager.replica_count();
    stats.last_sites_weighted = r.ranks_weighted;
    sync.delta = at::Tensor();
    sync.mean = at::Tensor();
    sync.feedback = nullptr;
    stats.blocked_seconds += seconds_since(t0);
    sync.blocked += seconds_since(t0);
    stats.longest_blocked_seconds = std::max(stats.longest_blocked_seconds, sync.blocked);
    if (stats.syncs > 1) stats.longest_later_blocked_seconds = std::max(stats.longest_later_blocked_seconds, sync.blocked);
    applied = r.total_weight > 0;
    if (!r.disagreeing.empty()) heal_disagreeing(r.disagreeing);
    return true;
  }

  // A sync found sites whose global parameters differ from the others' (their pseudo-gradients
  // were left out of the mean): every site joins a quorum now, in which those sites copy the
  // others' state (outer state, model, inner optimizer) before their next inner step. Every site
  // names the same ones (each sees every site's checksum), so all of them take this quorum.
  void heal_disagreeing(const std::vector<int>& disagreeing) {
    const int me = manager.replica_rank();
    bool mine = std::find(disagreeing.begin(), disagreeing.end(), me) != disagreeing.end();
    if (site_world > 1) {  // under FSDP each rank compares its own shards: the site heals as one
      at::Tensor flag = at::tensor({mine ? 1 : 0}, at::kInt);
      ProcessGroup::wait(site->allreduce(flag, c10d::ReduceOp::MAX));
      mine = flag.item<int>() == 1;
    }
    std::string names;
    const auto& p = manager.quorum().participants;
    for (int r : disagreeing)
      names += (names.empty() ? "" : ", ") + (r < static_cast<int>(p.size()) ? p[static_cast<size_t>(r)].group_id
                                                                            : "replica " + std::to_string(r));
    stats.last_checksum_mismatch = "outer step " + std::to_string(fragments[0].outer_steps) + " (Manager step " +
                                   std::to_string(manager.step()) + "): the global parameters of [" + names +
                                   "] differed from the other sites'; left out of that mean and healed from them";
    if (site_rank == 0)
      std::cerr << "ddpkit DiLoCo: site " << manager.group_id() << ": " << stats.last_checksum_mismatch << std::endl;
    if (mine) manager.request_heal(stats.last_checksum_mismatch);
    const auto t0 = Clock::now();
    join_quorum();
    stats.blocked_seconds += seconds_since(t0);
  }
};

DiLoCo::DiLoCo(ft::Manager& manager, std::vector<std::vector<at::Tensor>> fragments, DiLoCoOptions options)
    : impl_(std::make_unique<Impl>(manager, std::move(options))) {
  Impl& im = *impl_;
  const DiLoCoOptions& o = im.options;
  DDPKIT_CHECK(!fragments.empty(), "DiLoCo: no fragments (give at least one list of parameters)");
  const auto count = static_cast<int64_t>(fragments.size());
  o.validate(count);
  im.period = o.sync_every() / count;
  im.codec = codecs::make_codec(o.codec());
  for (size_t i = 0; i < fragments.size(); ++i) {
    DiLoCoFragment f;
    f.params = std::move(fragments[i]);
    DDPKIT_CHECK(!f.params.empty(), "DiLoCo: fragment ", i, " holds no parameters");
    for (const auto& p : f.params) {
      DDPKIT_CHECK(p.defined() && p.device().is_cpu() && at::isFloatingType(p.scalar_type()), "DiLoCo: fragment ", i,
                   " holds a parameter that is not a floating-point CPU tensor");
      f.numel += p.numel();
    }
    f.global = f.local_flat().clone();
    f.momentum = at::zeros({f.numel}, at::kFloat);
    f.shard_size = f.numel;
    f.shard_numel = f.numel;
    if (!o.parameters_sharded() && im.site_world > 1) {
      f.shard_size = (f.numel + im.site_world - 1) / im.site_world;
      f.shard_offset = std::min<int64_t>(f.numel, f.shard_size * im.site_rank);
      f.shard_numel = std::min<int64_t>(f.shard_size, f.numel - f.shard_offset);
    }
    if (o.error_feedback()) {
      f.sent_residual = at::zeros({f.shard_size}, at::kFloat);
      f.mean_residual = at::zeros({f.shard_size}, at::kFloat);
    }
    im.fragments.push_back(std::move(f));
  }
  // A heal carries the outer state (under FSDP each rank's part, rank to rank); a checkpoint keeps
  // it and this rank's residuals. Registered here, so a loop passes nothing along for DiLoCo.
  manager.register_state(
      "diloco", [this] { return state(); }, [this](const TensorDict& d) { load_state(d); },
      o.parameters_sharded() ? ft::StateScope::kSharedPerRank : ft::StateScope::kShared);
  manager.register_state(
      "diloco_site", [this] { return site_state(); }, [this](const TensorDict& d) { load_site_state(d); },
      ft::StateScope::kLocal);
}

DiLoCo::~DiLoCo() {
  impl_->manager.unregister_state("diloco");
  impl_->manager.unregister_state("diloco_site");
}

void DiLoCo::start() {
  Impl& im = *impl_;
  DDPKIT_CHECK(!im.sync.active && im.stats.syncs == 0, "DiLoCo::start: call it once, before the first inner step");
  im.check_site_agrees();
  im.prepare(/*weightless=*/true);
  // A site that healed into another's sync in flight (tau > 0) applies it at that site's sync point.
  if (im.stats.heals > 0 && im.options.round_seconds() == 0 && im.local_step < im.period) return;
  if (im.perform()) im.local_step = 0;
  im.round_start = Clock::now();
}

bool DiLoCo::after_inner_step() {
  Impl& im = *impl_;
  ++im.stats.inner_steps;
  ++im.local_step;
  if (im.options.round_seconds() > 0) {
    // A time-budgeted round ends at its deadline (each site's rank 0's clock, within one of its steps).
    if (!im.round_ends()) return false;
    im.prepare(false);
    im.applied = false;
    if (im.perform()) im.local_step = 0;
    im.round_start = Clock::now();
    return im.applied;
  }
  if (im.local_step == im.period - im.options.fragment_delay() && !im.sync.active) im.prepare(false);
  if (im.local_step < im.period) return false;
  im.applied = false;
  if (!im.sync.active || im.perform()) im.local_step = 0;
  return im.applied;
}

void DiLoCo::finish() {
  Impl& im = *impl_;
  while (im.sync.active) im.perform();
}

TensorDict DiLoCo::state() const {
  const Impl& im = *impl_;
  TensorDict d;
  for (size_t i = 0; i < im.fragments.size(); ++i) {
    const std::string k = std::to_string(i);
    d["diloco/global/" + k] = im.fragments[i].global;
    d["diloco/momentum/" + k] = im.fragments[i].momentum;
    d["diloco/outer_steps/" + k] = at::tensor({im.fragments[i].outer_steps}, at::kLong);
  }
  d["diloco/local_step"] = at::tensor({im.local_step}, at::kLong);
  d["diloco/next_fragment"] = at::tensor({im.next_fragment}, at::kLong);
  return d;
}

void DiLoCo::load_state(const TensorDict& state) {
  Impl& im = *impl_;
  auto get = [&state](const std::string& key) -> const at::Tensor& {
    auto it = state.find(key);
    DDPKIT_CHECK(it != state.end(), "DiLoCo::load_state: no '", key, "' (a state of another model or fragment count?)");
    return it->second;
  };
  for (size_t i = 0; i < im.fragments.size(); ++i) {
    DiLoCoFragment& f = im.fragments[i];
    const std::string k = std::to_string(i);
    const at::Tensor& g = get("diloco/global/" + k);
    const at::Tensor& m = get("diloco/momentum/" + k);
    DDPKIT_CHECK(g.numel() == f.numel && m.numel() == f.numel, "DiLoCo::load_state: fragment ", i, " holds ", f.numel,
                 " values here, ", g.numel(), " in the state");
    f.global.copy_(g.reshape({-1}));
    f.momentum.copy_(m.reshape({-1}));
    f.outer_steps = get("diloco/outer_steps/" + k).item<int64_t>();
  }
  im.local_step = get("diloco/local_step").item<int64_t>();
  im.next_fragment = get("diloco/next_fragment").item<int64_t>();
  DDPKIT_CHECK(im.next_fragment >= 0 && im.next_fragment < static_cast<int64_t>(im.fragments.size()),
               "DiLoCo::load_state: next fragment ", im.next_fragment, " of ", im.fragments.size());
}

TensorDict DiLoCo::site_state() const {
  const Impl& im = *impl_;
  TensorDict d;
  if (!im.options.error_feedback()) return d;
  for (size_t i = 0; i < im.fragments.size(); ++i) {
    d["diloco/sent_residual/" + std::to_string(i)] = im.fragments[i].sent_residual;
    d["diloco/mean_residual/" + std::to_string(i)] = im.fragments[i].mean_residual;
  }
  return d;
}

void DiLoCo::load_site_state(const TensorDict& state) {
  Impl& im = *impl_;
  if (!im.options.error_feedback()) return;
  if (state.empty()) {  // none kept (a checkpoint of another site size): the residuals start at zero
    for (DiLoCoFragment& f : im.fragments) f.sent_residual.zero_(), f.mean_residual.zero_();
    return;
  }
  for (size_t i = 0; i < im.fragments.size(); ++i) {
    DiLoCoFragment& f = im.fragments[i];
    for (auto [name, dst] : {std::pair<const char*, at::Tensor*>{"sent_residual", &f.sent_residual},
                             std::pair<const char*, at::Tensor*>{"mean_residual", &f.mean_residual}}) {
      const std::string key = std::string("diloco/") + name + "/" + std::to_string(i);
      auto it = state.find(key);
      DDPKIT_CHECK(it != state.end(), "DiLoCo::load_site_state: no '", key,
                   "' (a state saved without error_feedback, or of another fragment count?)");
      DDPKIT_CHECK(it->second.numel() == f.shard_size, "DiLoCo::load_site_state: this rank carries ", f.shard_size,
                   " values of fragment ", i, ", ", it->second.numel(), " in '", key,
                   "' (saved with another site size or parameters_sharded?)");
      dst->copy_(it->second.reshape({-1}));
    }
  }
}

at::Tensor DiLoCo::global_parameters(size_t fragment) const {
  DDPKIT_CHECK(fragment < impl_->fragments.size(), "DiLoCo: no fragment ", fragment);
  return impl_->fragments[fragment].global;
}
size_t DiLoCo::fragments() const { return impl_->fragments.size(); }
int64_t DiLoCo::outer_steps() const { return impl_->fragments[0].outer_steps; }
const DiLoCoStats& DiLoCo::stats() const { return impl_->stats; }

}  // namespace diloco
}  // namespace ddpkit
