// `ddpkit train --fault-tolerant`: R replica groups that keep training when groups die.
//
// Without --replica-group, this process is the job's launcher: it starts a lighthouse (unless
// --lighthouse names one) and one supervisor per group, each running the group's --nproc ranks
// and restarting the group when one of them dies (up to --max-restarts times). With
// --replica-group G it launches that one group (a job spread over hosts: one such command per
// group). Each rank then trains under an ft::Manager: the per-step quorum, the cross-group
// average and, for a group that starts behind, the heal.
#include "train_build.h"
#include "train_ft_common.h"

#include <ddpkit/ft/cross_group_gradients.h>
#include <ddpkit/ft/lighthouse.h>
#include <ddpkit/ft/manager.h>
#include <ddpkit/runtime/memory_sampler.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>

namespace ddpkit {
namespace cli {
namespace {

// The launcher: a lighthouse, and a supervisor per group. The job ends when a group has trained
// every step; the others (in the same quorum, done within moments) get 10 s, then are stopped.
int run_replica_groups(const Flags& f, const TrainFlags& t, const std::vector<std::string>& argv) {
  std::unique_ptr<ft::Lighthouse> lighthouse;
  std::string address = t.lighthouse;
  if (address.empty()) {
    // DiLoCo: the quorum waits for a site as long as the sites wait for it (for_diloco).
    const auto options = t.diloco > 0 ? ft::LighthouseOptions::for_diloco(timeout_of(f)) : ft::LighthouseOptions();
    lighthouse = std::make_unique<ft::Lighthouse>(ft::LighthouseOptions(options)
                                                      .address("127.0.0.1:0")
                                                      .min_replicas(t.min_replicas)
                                                      .expected_groups(t.replica_groups)
                                                      .token(read_token("", "DDPKIT_FT_TOKEN")));
    lighthouse->start();
    address = lighthouse->address();
    std::cerr << "ddpkit: lighthouse at " << address << " (min replicas " << t.min_replicas << ")\n";
  }
  std::atomic<bool> stop{false};
  std::vector<std::atomic<int>> codes(static_cast<size_t>(t.replica_groups));
  for (auto& c : codes) c = -1;
  std::vector<std::thread> supervisors;
  for (int g = 0; g < t.replica_groups; ++g) {
    std::vector<std::string> args = argv;
    args.insert(args.end(), {"--replica-group", std::to_string(g), "--lighthouse", address});
    supervisors.emplace_back([&, g, args] {
      // A restarted group loads the newest checkpoint, if any, then heals to the others' step.
      codes[static_cast<size_t>(g)] =
          launch_local(t.nproc, args, "/proc/self/exe", t.max_restarts,
                       t.checkpoint_dir.empty() ? std::vector<std::string>{} : std::vector<std::string>{"--resume"}, &stop,
                       t.nproc * t.replica_groups);
    });
  }
  auto finished_at = std::chrono::steady_clock::time_point::max();
  for (;;) {
    int running = 0;
    bool one_done = false;
    for (const auto& c : codes) {
      running += c.load() == -1;
      one_done = one_done || c.load() == 0;
    }
    if (running == 0) break;
    if (one_done && finished_at == std::chrono::steady_clock::time_point::max())
      finished_at = std::chrono::steady_clock::now();
    if (std::chrono::steady_clock::now() - finished_at > std::chrono::seconds(10)) stop = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (auto& s : supervisors) s.join();
  int first_failure = 0;
  for (int g = 0; g < t.replica_groups; ++g) {
    const int c = codes[static_cast<size_t>(g)];
    if (c == 0) return 0;
    if (first_failure == 0 && c != kStoppedByCaller) first_failure = c;
  }
  std::cerr << "ddpkit: no replica group finished\n";
  return first_failure != 0 ? first_failure : 1;
}

// The per-step times of one rank, and rank 0's --step-log (a line per step: step, wall time in ms,
// the step's ms, committed or not).
struct StepRecord {
  std::vector<double> step_ms, quorum_ms;
  std::vector<double> serving_ms;  // the steps at whose start this rank copied a state it served (a heal source)
  double first_commit_s = -1;      // from the rank's start to its first committed step
  std::unique_ptr<std::ofstream> log;
  StepRecord(const Flags& f, bool lead, const std::string& group_id) {
    if (!lead || f.str("step-log").empty()) return;
    const std::string path = f.str("step-log") + "." + group_id;
    log = std::make_unique<std::ofstream>(path, std::ios::app);
    if (!*log) throw UsageError("--step-log: cannot append to " + path);
  }
  void add(int64_t step, double ms, bool committed) {
    step_ms.push_back(ms);
    if (!log) return;
    const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::system_clock::now().time_since_epoch()).count();
    *log << step << ' ' << now << ' ' << ms << ' ' << (committed ? 1 : 0) << '\n' << std::flush;
  }
};

// What a group's rank 0 prints at the end: one JSON line.
std::string ft_report(const TrainFlags& t, const ft::Manager& manager, const Training& run, const StepRecord& rec,
                      double last_loss, const TestScore& score, const StartPoint& start, int64_t checkpoints_written,
                      int64_t peak_rss_bytes) {
  const auto& s = manager.stats();
  const std::vector<double>& ms = rec.step_ms;
  nlohmann::json j;
  j["replica_group"] = t.replica_group;
  j["group_id"] = manager.group_id();
  j["replica_groups"] = t.replica_groups;
  j["world_size"] = manager.group()->size();
  j["steps"] = manager.step();
  j["median_step_ms"] = ms.empty() ? 0.0 : median(ms);
  j["median_quorum_ms"] = median(rec.quorum_ms);
  j["serving_step_ms"] = rec.serving_ms.empty() ? 0.0 : *std::max_element(rec.serving_ms.begin(), rec.serving_ms.end());
  j["first_commit_s"] = rec.first_commit_s;
  j["longest_step_ms"] = ms.empty() ? 0.0 : *std::max_element(ms.begin(), ms.end());
  j["final_loss"] = last_loss;
  j["test_accuracy"] = score.accuracy;
  j["test_loss"] = score.loss;
  j["quorums"] = s.quorums;
  j["reconfigurations"] = s.reconfigurations;
  j["reconfiguration_seconds"] = s.reconfiguration_seconds;
  j["longest_reconfiguration_seconds"] = s.longest_reconfiguration_seconds;
  j["heals"] = s.heals;
  j["init_syncs"] = s.init_syncs;
  j["heal_bytes"] = s.heal_bytes;
  j["heal_seconds"] = s.heal_seconds;
  j["heal_fetch_seconds"] = s.heal_fetch_seconds;
  j["serve_seconds"] = s.serve_seconds;
  j["heals_single_copy"] = s.heals_single_copy;
  j["heal_route"] = s.heal_route;
  j["cross_transport"] = s.cross_transport;
  j["resumed_from"] = start.resumed_from;
  j["checkpoints_written"] = checkpoints_written;
  j["steps_committed"] = s.steps_committed;
  j["steps_not_committed"] = s.steps_not_committed;
  j["steps_healing"] = s.steps_healing;
  j["quorum_wait_seconds"] = s.quorum_wait_seconds;
  j["snapshot_seconds"] = s.snapshot_seconds;
  j["quorum_mode"] = t.quorum_mode;
  j["cross_bytes_per_step"] = ms.empty() ? 0.0 : static_cast<double>(s.cross_bytes_sent) / static_cast<double>(ms.size());
  j["parameter_checksum"] = parameter_checksum(run.params);
  j["peak_rss_bytes"] = peak_rss_bytes;
  return j.dump();
}

// One rank of replica group t.replica_group: the library's loop (docs/fault_tolerance.md), with
// the CLI's flags, output and fault points.
int run_ft_rank(const Flags& f, const TrainFlags& t) {
  const auto rank_start = std::chrono::steady_clock::now();
  PeakMemorySampler memory;
  set_compute_threads(t.threads);
  std::shared_ptr<ProcessGroup> pg = join_group(f, t);
  const FaultPoints fault(t.replica_group, pg->rank());
  Training run;  // run.state is filled by build_rank; the Manager reads it from the first quorum on
  ft::Manager manager(pg, run.state, group_manager_options(t, fault, timeout_of(f)));
  RunData run_data = build_rank(f, t, pg, run);
  ft::CrossGroupGradients crossing(manager, run.params, run.ddp.get(), run.zero.get());
  ReplicaGroupSampler sampler = group_sampler(f, t, run_data.data, *pg);
  const Schedule schedule = schedule_for(sampler.dataset_size(), sampler.data_world(), t);
  // --resume: the newest checkpoint's sample position over this job's R*W ranks (it may have been
  // written under another replica count, or without fault tolerance).
  const auto settings = checkpoint_settings(f);
  const StartPoint start = resume_point(f, t, run, pg.get(), settings, schedule.steps_per_epoch, sampler.data_world());
  if (start.resumed_from >= 0) manager.resume_at(start.step);
  int64_t checkpoints_written = 0;
  Progress progress(pg->rank() == 0 && t.replica_group == 0 && !f.on("quiet"));
  StepRecord rec(f, pg->rank() == 0, manager.group_id());
  double last_loss = 0;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    const double snapshots_before = manager.stats().snapshot_seconds;
    // Also once after the last step: a group that did not commit it (its cross-group average
    // failed where the others' did not) heals in that last quorum rather than finishing alone.
    manager.start_step();
    const bool serving = manager.stats().snapshot_seconds != snapshots_before;
    rec.quorum_ms.push_back(ms_since(t0));
    const int64_t step = manager.step();
    if (step >= schedule.total_steps) break;
    at::Tensor loss = forward_backward(run, run_data.data.train, sampler.batch(step), fault, step);
    crossing.after_backward();
    const bool committed = manager.should_commit();
    if (committed) {
      optimizer_step(run);
      last_loss = loss.item<double>();
      // The replicas are equal: the quorum's first group writes for all (collective within it).
      const int64_t done = manager.step();
      if (!t.checkpoint_dir.empty() && manager.replica_rank() == 0 &&
          (done % t.checkpoint_every == 0 || done == schedule.total_steps)) {
        run.state.save(pg.get(), t.checkpoint_dir, done,
                       checkpoint_extra(settings, done / schedule.steps_per_epoch,
                                        (done % schedule.steps_per_epoch) * t.batch * sampler.data_world()));
        ++checkpoints_written;
      }
    }
    rec.add(step, ms_since(t0), committed);
    if (serving) rec.serving_ms.push_back(rec.step_ms.back());
    if (committed && rec.first_commit_s < 0) rec.first_commit_s = ms_since(rank_start) / 1000;
    progress.update("step", manager.step(), schedule.total_steps, last_loss, median(rec.step_ms));
  }
  progress.finish();
  manager.close();  // the group leaves the job at once; its threads and cross groups are freed
  const TestScore score = f.on("no-eval") ? TestScore{-1, -1} : evaluate(run.model, run_data.data.test, run.sharded_model.get(), pg.get());
  memory.stop();
  if (pg->rank() == 0)
    std::cout << ft_report(t, manager, run, rec, last_loss, score, start, checkpoints_written, memory.peak_rss_bytes()) << std::endl;
  ProcessGroup::wait(pg->barrier());
  return 0;
}

}  // namespace

int run_fault_tolerant(const Flags& f, const TrainFlags& t, const std::vector<std::string>& argv) {
  if (in_distributed_env()) {
    if (t.replica_group < 0)
      throw UsageError("--fault-tolerant under a launcher that sets RANK/WORLD_SIZE: give --replica-group and --lighthouse");
    try {
      return t.diloco > 0 ? run_diloco_rank(f, t) : run_ft_rank(f, t);
    } catch (const ft::JobFinished& e) {
      // Started again after every group finished: its work is done (a launcher need not retry it).
      std::cerr << "ddpkit train: replica group " << t.replica_group << ": " << e.what() << std::endl;
      return 0;
    }
  }
  if (t.replica_group >= 0) return launch_local(t.nproc, argv, "/proc/self/exe", t.max_restarts);
  return run_replica_groups(f, t, argv);
}

}  // namespace cli
}  // namespace ddpkit
