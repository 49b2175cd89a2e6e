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
  j["last_checksum_mismatch"] = d.last_checksum_mismatch;
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
  j["init_syncs"] = s.init_syncs;
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

// What one site rank's loop counted, for its report.
struct SiteRun {
  int64_t inner_step = 0;  // the job's inner steps so far: the data position, which a heal carries
  int64_t steps_run = 0, checkpoints = 0;
  double last_loss = 0, train_seconds = 0, first_sync_seconds = 0;
  std::vector<double> step_ms;
  StartPoint start;
};

// --resume: the site's newest checkpoint into TrainingState, the registered state (DiLoCo's, the
// data position) and the Manager's step.
void resume_site(const Flags& f, const TrainFlags& site, Training& run, ft::Manager& manager,
                 const ReplicaGroupSampler& sampler, const Schedule& schedule, SiteRun& r) {
  r.start = resume_point(f, site, run, manager.group().get(), checkpoint_settings(f), schedule.steps_per_epoch,
                         sampler.data_world());
  if (r.start.resumed_from < 0) return;
  manager.load_checkpoint_state(entries_under(r.start.common, "extra/"), entries_under(r.start.local, "extra/"));
  manager.resume_at(int_of(r.start.common, "extra/manager_step", "checkpoint"));
}

// After the loop: the global parameters into the model, the test score, and rank 0's JSON line.
void report_site(const Flags& f, const TrainFlags& t, Training& run, const RunData& data, const ft::Manager& manager,
                 const diloco::DiLoCo& dl, const std::vector<std::vector<at::Tensor>>& fragments, const SiteRun& r,
                 PeakMemorySampler& memory) {
  ProcessGroup& pg = *manager.group();
  load_global_parameters(fragments, dl);
  const TestScore score = f.on("no-eval") ? TestScore{-1, -1} : evaluate(run.model, data.data.test, run.sharded_model.get(), &pg);
  memory.stop();
  at::Tensor site_bytes = at::full({1}, static_cast<double>(manager.stats().cross_bytes_sent), at::kDouble);
  ProcessGroup::wait(pg.allreduce(site_bytes));
  if (pg.rank() != 0) return;
  nlohmann::json j;
  j["world_size"] = pg.size();
  j["steps"] = r.inner_step;
  j["steps_run"] = r.steps_run;
  j["median_step_ms"] = r.step_ms.empty() ? 0.0 : median(r.step_ms);
  j["train_seconds"] = r.train_seconds;
  j["first_sync_seconds"] = r.first_sync_seconds;  // the first quorum, rendezvous and any heal
  j["inner_step_seconds"] = std::accumulate(r.step_ms.begin(), r.step_ms.end(), 0.0) / 1000;  // the loop's steps alone
  j["final_loss"] = r.last_loss;
  j["test_accuracy"] = score.accuracy;
  j["test_loss"] = score.loss;
  j["resumed_from"] = r.start.resumed_from;
  j["checkpoints_written"] = r.checkpoints;
  j["parameter_checksum"] = parameter_checksum(run.params);
  j["peak_rss_bytes"] = memory.peak_rss_bytes();
  std::cout << diloco_report(t, fragments, dl, manager, r.steps_run, static_cast<uint64_t>(site_bytes.item<double>()),
                             std::move(j))
                   .dump()
            << std::endl;
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
  SiteRun r;
  // 4 outer all-reduce pieces in flight across sites (DiLoCoOptions::piece_bytes).
  ft::Manager manager(pg, run.state, group_manager_options(t, fault, timeout_of(f)).cross_gloo_threads(4));
  manager.register_state("data", [&] { return TensorDict{{"inner_step", int_entry(r.inner_step)}}; },
                         [&](const TensorDict& d) { r.inner_step = int_of(d, "inner_step", "the data position"); });
  RunData run_data = build_rank(f, t, pg, run);
  const auto fragments = t.fragments == 1 ? std::vector<std::vector<at::Tensor>>{run.params}
                                          : diloco::fragments_of(diloco::layers_of(*run.model.module, run.model.units),
                                                                 t.fragments, t.fragment_layout);
  diloco::DiLoCo dl(manager, fragments, diloco_options(t, fault));
  ReplicaGroupSampler sampler = group_sampler(f, t, run_data.data, *pg);
  const Schedule schedule = schedule_for(sampler.dataset_size(), sampler.data_world(), t);
  TrainFlags site = t;
  if (!t.checkpoint_dir.empty()) site.checkpoint_dir = t.checkpoint_dir + "/" + manager.group_id();
  resume_site(f, site, run, manager, sampler, schedule, r);
  Progress progress(pg->rank() == 0 && t.replica_group == 0 && !f.on("quiet"));
  // Time-budgeted rounds end the job after --steps / H of them (sites run different step counts).
  const int64_t rounds = schedule.total_steps / t.diloco;
  const bool by_round = t.round_seconds > 0;
  auto done = [&] { return by_round ? dl.outer_steps() >= rounds : r.inner_step >= schedule.total_steps; };
  // train_seconds spans start() (the first quorum, rendezvous, a late site's heal) to finish():
  // the span a torchft DiLoCo run's loop covers.
  const auto train_start = std::chrono::steady_clock::now();
  dl.start();
  r.first_sync_seconds = ms_since(train_start) / 1000;
  while (!done()) {
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor loss = forward_backward(run, run_data.data.train, sampler.batch(r.inner_step), fault, manager.step());
    optimizer_step(run);
    r.last_loss = loss.item<double>();
    ++r.inner_step, ++r.steps_run;
    // After the same syncs on every site (the Manager's step counts the job's).
    if (dl.after_inner_step() && !site.checkpoint_dir.empty() && (manager.step() % t.checkpoint_every == 0 || done())) {
      save_site_checkpoint(run, manager, site.checkpoint_dir, r.inner_step,
                           checkpoint_extra(checkpoint_settings(f), r.inner_step / schedule.steps_per_epoch,
                                            (r.inner_step % schedule.steps_per_epoch) * t.batch * sampler.data_world()));
      ++r.checkpoints;
    }
    r.step_ms.push_back(ms_since(t0));
    progress.update(by_round ? "round" : "step", by_round ? dl.outer_steps() : r.inner_step,
                    by_round ? rounds : schedule.total_steps, r.last_loss, median(r.step_ms));
  }
  dl.finish();
  r.train_seconds = ms_since(train_start) / 1000;
  manager.close();  // the site leaves the job at once; its threads and cross groups are freed
  progress.finish();
  report_site(f, t, run, run_data, manager, dl, fragments, r, memory);
  ProcessGroup::wait(pg->barrier());
  return 0;
}

}  // namespace cli
}  // namespace ddpkit
