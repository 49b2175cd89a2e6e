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

#include <fstream>
#include <numeric>

namespace ddpkit {
namespace cli {
namespace {

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

// The flags as DiLoCoOptions (checked when the flags are read: check_diloco_flags validates them).
diloco::DiLoCoOptions diloco_options(const TrainFlags& t, const FaultPoints& fault) {
  return diloco::DiLoCoOptions()
      .sync_every(t.diloco)
      .outer_lr(t.outer_lr)
      .outer_momentum(t.outer_momentum)
      .codec(t.outer_codec)
      .error_feedback(t.outer_error_feedback)
      .fragment_delay(t.fragment_delay)
      .fragment_alpha(t.fragment_alpha)
      .round_seconds(t.round_seconds)
      .parameters_sharded(t.use_fsdp)
      .on_phase(fault.hook());
}

// A site's checkpoint: TrainingState's, the registered state (DiLoCo's, the data position), the
// Manager's step and the CLI's resume settings. Collective over the site.
void save_site_checkpoint(Training& run, const ft::Manager& manager, const std::string& dir, int64_t inner_step,
                          TensorDict extras) {
  TensorDict common, local;
  manager.checkpoint_state(&common, &local);
  for (auto& [k, v] : common) extras[k] = std::move(v);
  extras["manager_step"] = int_entry(manager.step());
  run.state.save(manager.group().get(), dir, inner_step, extras, local);
}

// The JSON line's run figures (diloco_report adds the sync's).
nlohmann::json run_figures(const ft::Manager& manager, const Training& run, int64_t inner_step, int64_t steps_run,
                           const std::vector<double>& step_ms, double train_seconds, double first_sync_seconds,
                           double last_loss, const TestScore& score, const StartPoint& start, int64_t checkpoints,
                           int64_t peak_rss_bytes) {
  nlohmann::json j;
  j["world_size"] = manager.group()->size();
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
  j["checkpoints_written"] = checkpoints;
  j["parameter_checksum"] = parameter_checksum(run.params);
  j["peak_rss_bytes"] = peak_rss_bytes;
  return j;
}

}  // namespace

// One rank of one site: the library's loop (docs/diloco.md), with the CLI's flags, output and
// fault points. Sites differ between syncs, so each checkpoints DIR/<group id>/ and resumes from it.
int run_diloco_rank(const Flags& f, const TrainFlags& t) {
  PeakMemorySampler memory;
  set_compute_threads(t.threads);
  std::shared_ptr<ProcessGroup> pg = join_group(f, t);
  const FaultPoints fault(t.replica_group, pg->rank());
  Training run;
  // 4 outer all-reduce pieces in flight across sites (DiLoCoOptions::piece_bytes).
  ft::Manager manager(pg, run.state, group_manager_options(t, fault, timeout_of(f)).cross_gloo_threads(4));
  int64_t inner_step = 0;  // the job's inner steps so far: the data position, which a heal carries
  manager.register_state("data", [&] { return TensorDict{{"inner_step", int_entry(inner_step)}}; },
                         [&](const TensorDict& d) { inner_step = int_of(d, "inner_step", "the data position"); });
  RunData run_data = build_rank(f, t, pg, run);
  const auto fragments = t.fragments == 1 ? std::vector<std::vector<at::Tensor>>{run.params}
                                          : diloco::fragments_of(diloco::layers_of(*run.model.module, run.model.units),
                                                                 t.fragments, t.fragment_layout);
  diloco::DiLoCo dl(manager, fragments, diloco_options(t, fault));
  ReplicaGroupSampler sampler = group_sampler(f, t, run_data.data, *pg);
  const Schedule schedule = schedule_for(sampler.dataset_size(), sampler.data_world(), t);
  const auto settings = checkpoint_settings(f);
  TrainFlags site = t;
  if (!t.checkpoint_dir.empty()) site.checkpoint_dir = t.checkpoint_dir + "/" + manager.group_id();
  const StartPoint start = resume_point(f, site, run, pg.get(), settings, schedule.steps_per_epoch, sampler.data_world());
  if (start.resumed_from >= 0) {
    manager.load_checkpoint_state(without_prefix(start.common, "extra/"), without_prefix(start.local, "extra/"));
    manager.resume_at(int_of(start.common, "extra/manager_step", "checkpoint"));
  }
  int64_t checkpoints = 0, steps_run = 0;
  Progress progress(pg->rank() == 0 && t.replica_group == 0 && !f.on("quiet"));
  std::vector<double> step_ms;
  double last_loss = 0;
  // Time-budgeted rounds end the job after --steps / H of them (sites run different step counts).
  const int64_t rounds = schedule.total_steps / t.diloco;
  auto done = [&] { return t.round_seconds > 0 ? dl.outer_steps() >= rounds : inner_step >= schedule.total_steps; };
  // train_seconds spans start() (the first quorum, rendezvous, a late site's heal) to finish():
  // the span a torchft DiLoCo run's loop covers.
  const auto train_start = std::chrono::steady_clock::now();
  dl.start();
  const double first_sync_seconds = ms_since(train_start) / 1000;
  while (!done()) {
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor loss = forward_backward(run, run_data.data.train, sampler.batch(inner_step), fault, manager.step());
    optimizer_step(run);
    last_loss = loss.item<double>();
    ++inner_step, ++steps_run;
    // After the same syncs on every site (the Manager's step counts the job's).
    if (dl.after_inner_step() && !site.checkpoint_dir.empty() && (manager.step() % t.checkpoint_every == 0 || done())) {
      save_site_checkpoint(run, manager, site.checkpoint_dir, inner_step,
                           checkpoint_extra(settings, inner_step / schedule.steps_per_epoch,
                                            (inner_step % schedule.steps_per_epoch) * t.batch * sampler.data_world()));
      ++checkpoints;
    }
    step_ms.push_back(ms_since(t0));
    const bool by_round = t.round_seconds > 0;
    progress.update(by_round ? "round" : "step", by_round ? dl.outer_steps() : inner_step,
                    by_round ? rounds : schedule.total_steps, last_loss, median(step_ms));
  }
  dl.finish();
  const double train_seconds = ms_since(train_start) / 1000;
  progress.finish();
  load_global_parameters(fragments, dl);
  const TestScore score = f.on("no-eval") ? TestScore{-1, -1} : evaluate(run.model, run_data.data.test, run.sharded_model.get(), pg.get());
  memory.stop();
  at::Tensor site_bytes = at::full({1}, static_cast<double>(manager.stats().cross_bytes_sent), at::kDouble);
  ProcessGroup::wait(pg->allreduce(site_bytes));
  if (pg->rank() == 0)
    std::cout << diloco_report(t, fragments, dl, manager, steps_run, static_cast<uint64_t>(site_bytes.item<double>()),
                               run_figures(manager, run, inner_step, steps_run, step_ms, train_seconds, first_sync_seconds,
                                           last_loss, score, start, checkpoints, memory.peak_rss_bytes()))
                     .dump()
              << std::endl;
  ProcessGroup::wait(pg->barrier());
  return 0;
}

}  // namespace cli
}  // namespace ddpkit
