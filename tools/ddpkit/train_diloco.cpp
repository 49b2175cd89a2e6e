// `ddpkit train --fault-tolerant --diloco H`: one rank of one site (replica group) of a DiLoCo job.
//
// The site trains alone (DDP / ZeRO / FSDP inside its group, --optimizer as the inner one) and
// every H / P inner steps syncs one fragment with the other sites (diloco::DiLoCo over the
// ft::Manager's quorum). Data: site g's rank r reads share g*W + r of R*W of every epoch, at the
// job's inner step (a healed site takes its source's, so it reads on from there).
#include "train_build.h"
#include "train_ft_common.h"

#include <ddpkit/diloco/diloco.h>
#include <ddpkit/ft/manager.h>
#include <ddpkit/runtime/memory_sampler.h>

#include <nlohmann/json.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <fstream>
#include <map>
#include <numeric>

namespace ddpkit {
namespace cli {
namespace {

// The model's parameters as layers, in order: each FSDP unit's (a transformer block) is one
// layer; the parameters between units (embeddings, final norm, head) form a layer per run.
std::vector<std::vector<at::Tensor>> layers_of(const Training& run) {
  std::map<const void*, size_t> unit_of;
  for (size_t u = 0; u < run.model.units.size(); ++u)
    for (const auto& p : run.model.units[u]->parameters()) unit_of[p.unsafeGetTensorImpl()] = u;
  std::vector<std::vector<at::Tensor>> layers;
  long last = -2;  // the unit of the last parameter (-1: none)
  for (const auto& p : run.model.module->parameters()) {
    auto it = unit_of.find(p.unsafeGetTensorImpl());
    const long u = it == unit_of.end() ? -1 : static_cast<long>(it->second);
    if (u != last || layers.empty()) layers.emplace_back();
    layers.back().push_back(p);
    last = u;
  }
  return layers;
}

TensorDict without_prefix(const TensorDict& d, const std::string& prefix) {
  TensorDict out;
  for (const auto& [k, v] : d)
    if (k.compare(0, prefix.size(), prefix) == 0) out[k.substr(prefix.size())] = v;
  return out;
}

// The model the sites agree on: every fragment's global parameters into the model (trailing inner
// steps since the last sync, when the steps are not a multiple of H / P, are not in it).
void load_global_parameters(const std::vector<std::vector<at::Tensor>>& fragments, const diloco::DiLoCo& dl) {
  at::NoGradGuard no_grad;
  for (size_t fr = 0; fr < fragments.size(); ++fr) {
    const at::Tensor g = dl.global_parameters(fr);
    int64_t offset = 0;
    for (const auto& p : fragments[fr]) {
      p.detach().copy_(g.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
  }
}

// What a site's rank 0 prints at the end, besides the run's own figures in `run_figures`.
nlohmann::json diloco_report(const TrainFlags& t, const std::vector<std::vector<at::Tensor>>& fragments,
                             const diloco::DiLoCo& dl, const ft::Manager& manager, int64_t steps_run,
                             uint64_t site_cross_bytes, nlohmann::json run_figures) {
  nlohmann::json j = std::move(run_figures);
  const auto& s = manager.stats();
  const auto& d = dl.stats();
  j["replica_group"] = t.replica_group;
  j["group_id"] = manager.group_id();
  j["replica_groups"] = t.replica_groups;
  j["diloco"] = t.diloco;
  j["fragments"] = t.fragments;
  j["fragment_delay"] = t.fragment_delay;
  j["round_seconds"] = t.round_seconds;
  j["outer_codec"] = t.outer_codec;
  j["outer_error_feedback"] = t.outer_error_feedback;
  j["outer_steps"] = dl.outer_steps();
  std::vector<int64_t> per_fragment;
  for (const auto& fr : fragments) {
    int64_t n = 0;
    for (const auto& p : fr) n += p.numel();
    per_fragment.push_back(n);
  }
  j["fragment_parameters"] = per_fragment;  // this rank's (FSDP: its shards)
  j["parameters"] = std::accumulate(per_fragment.begin(), per_fragment.end(), int64_t{0});
  j["outer_syncs"] = d.syncs;
  j["sync_retries"] = d.sync_retries;
  j["heals"] = d.heals;
  j["checksum_mismatches"] = d.checksum_mismatches;
  j["last_sites"] = d.last_sites;
  j["last_sites_weighted"] = d.last_sites_weighted;
  j["sync_blocked_seconds"] = d.blocked_seconds;
  j["longest_sync_blocked_seconds"] = d.longest_blocked_seconds;
  j["longest_later_sync_blocked_seconds"] = d.longest_later_blocked_seconds;
  j["sync_transfer_seconds"] = d.transfer_seconds;
  j["sync_wait_seconds"] = d.wait_seconds;
  j["site_gather_seconds"] = d.site_gather_seconds;
  j["last_error"] = d.last_error;
  j["quorums"] = s.quorums;
  j["reconfigurations"] = s.reconfigurations;
  j["reconfiguration_seconds"] = s.reconfiguration_seconds;
  j["longest_reconfiguration_seconds"] = s.longest_reconfiguration_seconds;
  j["heal_bytes"] = s.heal_bytes;
  j["heal_seconds"] = s.heal_seconds;
  j["cross_transport"] = s.cross_transport;
  j["cross_bytes_sent"] = s.cross_bytes_sent;
  j["cross_bytes_per_step"] = steps_run > 0 ? static_cast<double>(s.cross_bytes_sent) / static_cast<double>(steps_run) : 0.0;
  // What the whole site put on the links between sites per sync (its ranks together: each carries
  // 1/W of a replicated model's pseudo-gradient, or its own FSDP shards), beside this rank's.
  j["cross_bytes_sent_by_site"] = site_cross_bytes;
  j["cross_bytes_per_rank_per_sync"] = d.syncs > 0 ? static_cast<double>(s.cross_bytes_sent) / static_cast<double>(d.syncs) : 0.0;
  j["cross_bytes_per_site_per_sync"] = d.syncs > 0 ? static_cast<double>(site_cross_bytes) / static_cast<double>(d.syncs) : 0.0;
  return j;
}

}  // namespace

int run_diloco_rank(const Flags& f, const TrainFlags& t) {
  PeakMemorySampler memory;
  set_compute_threads(t.threads);
  std::shared_ptr<ProcessGroup> pg = join_group(f, t);
  const int rank = pg->rank(), world = pg->size();
  const auto timeout = std::chrono::milliseconds(int64_t{f.integer("timeout-s")} * 1000);
  const FaultPoints fault(t.replica_group, rank);
  Training run;
  std::unique_ptr<diloco::DiLoCo> dl;
  int64_t inner_step = 0;  // the job's inner steps so far: the data position
  // A heal carries the outer state and the data position along with TrainingState's.
  auto extra = [&] {
    TensorDict d = dl->state();
    d["inner_step"] = int_entry(inner_step);
    return d;
  };
  auto load_extra = [&](const TensorDict& d) {
    dl->load_state(d);
    inner_step = int_of(d, "inner_step", "the healed state");
  };
  // 4 outer all-reduce pieces in flight across sites (DiLoCoOptions::piece_bytes).
  ft::Manager manager(pg, run.state, group_manager_options(t, fault, timeout).cross_gloo_threads(4), extra, load_extra);
  RunData run_data = build_rank(f, t, pg, run);
  Split& data = run_data.data;
  const auto fragments =
      t.fragments == 1 ? std::vector<std::vector<at::Tensor>>{run.params} : diloco::fragments_of(layers_of(run), t.fragments, t.fragment_layout);
  dl = std::make_unique<diloco::DiLoCo>(manager, fragments,
                                        diloco::DiLoCoOptions()
                                            .sync_every(t.diloco)
                                            .outer_lr(t.outer_lr)
                                            .outer_momentum(t.outer_momentum)
                                            .codec(t.outer_codec)
                                            .error_feedback(t.outer_error_feedback)
                                            .fragment_delay(t.fragment_delay)
                                            .fragment_alpha(t.fragment_alpha)
                                            .round_seconds(t.round_seconds)
                                            .parameters_sharded(t.use_fsdp)
                                            .on_phase(fault.hook()));

  const int data_world = t.replica_groups * world, data_rank = t.replica_group * world + rank;
  const int64_t n_train = data.train.inputs.size(0);
  const Schedule schedule = schedule_for(n_train, data_world, t);
  const auto settings = checkpoint_settings(f);
  // Sites differ between syncs (their local parameters, inner optimizer, generator): each writes
  // its own checkpoints, DIR/<group id>/, after the same syncs, and resumes from its own.
  TrainFlags site = t;
  if (!t.checkpoint_dir.empty()) site.checkpoint_dir = t.checkpoint_dir + "/" + manager.group_id();
  const StartPoint start = resume_point(f, site, run, pg.get(), settings, schedule.steps_per_epoch, data_world);
  if (start.resumed_from >= 0) {
    dl->load_state(without_prefix(t.use_fsdp ? start.local : start.common, "extra/"));
    dl->load_site_state(without_prefix(start.local, "extra/"));
    inner_step = start.step;
    manager.resume_at(int_of(start.common, "extra/manager_step", "checkpoint"));
  }
  int64_t checkpoints_written = 0;
  const bool lead = rank == 0;
  Progress progress(lead && t.replica_group == 0 && !f.on("quiet"));
  std::vector<double> step_ms;
  double last_loss = 0;
  at::Tensor perm;
  int64_t perm_epoch = -1, steps_run = 0;

  // Time-budgeted rounds end the job after --steps / H of them (sites run different step counts).
  const int64_t rounds = schedule.total_steps / t.diloco;
  auto done = [&] { return t.round_seconds > 0 ? dl->outer_steps() >= rounds : inner_step >= schedule.total_steps; };
  // train_seconds spans the first quorum and cross-group rendezvous too (start()), to the last
  // fragment applied (finish()): the span a torchft DiLoCo run's loop covers.
  const auto train_start = std::chrono::steady_clock::now();
  dl->start();  // a site that starts late heals here, at the others' next sync
  const double first_sync_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - train_start).count();
  for (;;) {
    if (done()) break;
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t epoch = inner_step / schedule.steps_per_epoch, i = inner_step % schedule.steps_per_epoch;
    if (epoch != perm_epoch) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(f.integer("seed")) * 1000 + epoch);
      perm = at::randperm(n_train, gen, at::kLong).slice(0, data_rank, data_world * schedule.per_rank, data_world);
      perm_epoch = epoch;
    }
    at::Tensor idx = perm.slice(0, i * t.batch, (i + 1) * t.batch);
    at::Tensor x = data.train.inputs.index_select(0, idx), y = data.train.labels.index_select(0, idx);
    if (run.model.language_model) x = x.to(at::kLong), y = y.to(at::kLong);
    for (auto& p : run.params) p.mutable_grad().reset();
    fault.at("forward", manager.step());
    at::Tensor loss = model_loss(run.model, run.forward(x), y);
    fault.at("backward", manager.step());
    loss.backward();
    if (run.zero)
      run.zero->step();
    else
      run.optimizer->step();
    last_loss = loss.item<double>();
    ++inner_step;
    ++steps_run;
    const bool outer = dl->after_inner_step();
    // After the same syncs on every site (the Manager's step counts the job's).
    if (outer && !site.checkpoint_dir.empty() && (manager.step() % t.checkpoint_every == 0 || done())) {
      TensorDict extras = checkpoint_extra(settings, inner_step / schedule.steps_per_epoch,
                                           (inner_step % schedule.steps_per_epoch) * t.batch * data_world);
      // The outer state is the site's (its ranks alike), but under FSDP each rank's covers its
      // own shards; the error-feedback residuals are each rank's too.
      TensorDict own;
      for (const auto& [k, v] : dl->state()) (t.use_fsdp ? own : extras)[k] = v;
      for (const auto& [k, v] : dl->site_state()) own[k] = v;
      extras["manager_step"] = int_entry(manager.step());
      run.state.save(pg.get(), site.checkpoint_dir, inner_step, extras, own);
      ++checkpoints_written;
    }
    step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (t.round_seconds > 0)
      progress.update("round", dl->outer_steps(), rounds, last_loss, median(step_ms));
    else
      progress.update("step", inner_step, schedule.total_steps, last_loss, median(step_ms));
  }
  dl->finish();
  const double train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - train_start).count();
  progress.finish();
  load_global_parameters(fragments, *dl);
  const TestScore score = f.on("no-eval") ? TestScore{-1, -1} : evaluate(run.model, data.test, run.sharded_model.get(), pg.get());
  memory.stop();
  at::Tensor site_bytes = at::full({1}, static_cast<double>(manager.stats().cross_bytes_sent), at::kDouble);
  ProcessGroup::wait(pg->allreduce(site_bytes));
  if (lead) {
    nlohmann::json j;
    j["world_size"] = world;
    j["steps"] = inner_step;
    j["steps_run"] = steps_run;
    j["median_step_ms"] = step_ms.empty() ? 0.0 : median(step_ms);
    j["train_seconds"] = train_seconds;
    j["first_sync_seconds"] = first_sync_seconds;  // the first quorum, rendezvous and any heal
    j["inner_step_seconds"] = std::accumulate(step_ms.begin(), step_ms.end(), 0.0) / 1000;  // the loop's steps alone
    j["final_loss"] = last_loss;
    j["test_accuracy"] = score.accuracy;
    j["test_loss"] = score.loss;
    j["resumed_from"] = start.resumed_from;
    j["checkpoints_written"] = checkpoints_written;
    j["parameter_checksum"] = parameter_checksum(run.params);
    j["peak_rss_bytes"] = memory.peak_rss_bytes();
    std::cout << diloco_report(t, fragments, *dl, manager, steps_run, static_cast<uint64_t>(site_bytes.item<double>()),
                               std::move(j))
                     .dump()
              << std::endl;
  }
  ProcessGroup::wait(pg->barrier());
  return 0;
}

}  // namespace cli
}  // namespace ddpkit
