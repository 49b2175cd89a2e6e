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

#include <ddpkit/ft/lighthouse.h>
#include <ddpkit/ft/manager.h>
#include <ddpkit/runtime/memory_sampler.h>

#include <nlohmann/json.hpp>

#include <ATen/CPUGeneratorImpl.h>

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
    lighthouse = std::make_unique<ft::Lighthouse>(ft::LighthouseOptions()
                                                      .address("127.0.0.1:0")
                                                      .min_replicas(t.min_replicas)
                                                      .expected_groups(t.replica_groups)
                                                      // DiLoCo: a live site asks only every H/P inner
                                                      // steps; a quorum without it would let sites
                                                      // that committed different syncs go on apart.
                                                      .join_timeout(t.diloco > 0
                                                                        ? std::chrono::milliseconds(int64_t{f.integer("timeout-s")} * 1000)
                                                                        : std::chrono::milliseconds(10000))
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

// One rank of replica group t.replica_group.
int run_ft_rank(const Flags& f, const TrainFlags& t) {
  PeakMemorySampler memory;
  set_compute_threads(t.threads);
  std::shared_ptr<ProcessGroup> pg = join_group(f, t);
  const int rank = pg->rank(), world = pg->size();
  const auto timeout = std::chrono::milliseconds(int64_t{f.integer("timeout-s")} * 1000);
  const FaultPoints fault(t.replica_group, rank);
  Training run;  // run.state is filled by build_rank; the Manager reads it from the first quorum on
  ft::Manager manager(pg, run.state, group_manager_options(t, fault, timeout));
  // Every group starts from the same parameters; a group that starts late heals to the others'.
  // Under DDP the cross-group average runs bucket by bucket inside backward; FSDP's shards and
  // ZeRO-2's gradient shards (rank r of every group holds the same elements) cross after backward.
  RunData run_data = build_rank(f, t, pg, run);
  const bool zero2 = run.zero && run.zero->sharded_gradients();
  const bool crosses_in_backward = run.ddp != nullptr && !zero2;
  if (crosses_in_backward) run.ddp->reducer().set_cross_replica_reduction(manager.cross_group_reduction(run.params));
  Split& data = run_data.data;

  // Each group keeps its own share of every epoch (group g: ranks g*W .. g*W+W-1 of R*W); while a
  // group is out, its share is skipped (docs/fault_tolerance.md).
  const int data_world = t.replica_groups * world, data_rank = t.replica_group * world + rank;
  const int64_t n_train = data.train.inputs.size(0);
  const Schedule schedule = schedule_for(n_train, data_world, t);
  const int64_t per_rank = schedule.per_rank, steps_per_epoch = schedule.steps_per_epoch,
                total_steps = schedule.total_steps;
  // --resume: the newest checkpoint's sample position over this job's R*W ranks (it may have been
  // written under another replica count, or without fault tolerance).
  const auto settings = checkpoint_settings(f);
  const StartPoint start = resume_point(f, t, run, pg.get(), settings, steps_per_epoch, data_world);
  if (start.resumed_from >= 0) manager.resume_at(start.step);
  int64_t checkpoints_written = 0;

  const bool lead = rank == 0;
  Progress progress(lead && t.replica_group == 0 && !f.on("quiet"));
  std::vector<double> step_ms, quorum_ms;
  std::unique_ptr<std::ofstream> step_log;
  if (lead && !f.str("step-log").empty()) {
    const std::string path = f.str("step-log") + "." + manager.group_id();
    step_log = std::make_unique<std::ofstream>(path, std::ios::app);
    if (!*step_log) throw UsageError("--step-log: cannot append to " + path);
  }
  double last_loss = 0;
  at::Tensor perm;
  int64_t perm_epoch = -1;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    // Also once after the last step: a group that did not commit it (its cross-group average
    // failed where the others' did not) heals in that last quorum rather than finishing alone.
    manager.start_step();
    quorum_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    const int64_t step = manager.step();
    if (step >= total_steps) break;
    const int64_t epoch = step / steps_per_epoch, i = step % steps_per_epoch;
    if (epoch != perm_epoch) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(f.integer("seed")) * 1000 + epoch);
      perm = at::randperm(n_train, gen, at::kLong).slice(0, data_rank, data_world * per_rank, data_world);
      perm_epoch = epoch;
    }
    at::Tensor idx = perm.slice(0, i * t.batch, (i + 1) * t.batch);
    at::Tensor x = data.train.inputs.index_select(0, idx), y = data.train.labels.index_select(0, idx);
    if (run.model.language_model) x = x.to(at::kLong), y = y.to(at::kLong);
    for (auto& p : run.params) p.mutable_grad().reset();
    fault.at("forward", step);
    at::Tensor loss = model_loss(run.model, run.forward(x), y);
    fault.at("backward", step);
    loss.backward();
    if (zero2) {
      manager.allreduce(run.zero->gradient_shards());
    } else if (!crosses_in_backward) {
      std::vector<at::Tensor> grads;
      for (const auto& p : run.params)
        if (p.grad().defined()) grads.push_back(p.grad());
      manager.allreduce(grads);
    }
    const bool committed = manager.should_commit();
    if (committed) {
      if (run.zero)
        run.zero->step();
      else
        run.optimizer->step();
      last_loss = loss.item<double>();
      // The replicas are equal: the quorum's first group writes for all (collective within it).
      const int64_t done = manager.step();
      if (!t.checkpoint_dir.empty() && manager.replica_rank() == 0 &&
          (done % t.checkpoint_every == 0 || done == total_steps)) {
        run.state.save(pg.get(), t.checkpoint_dir, done,
                       checkpoint_extra(settings, done / steps_per_epoch,
                                        (done % steps_per_epoch) * t.batch * data_world));
        ++checkpoints_written;
      }
    }
    step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (step_log) {
      const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::system_clock::now().time_since_epoch()).count();
      *step_log << step << ' ' << now << ' ' << step_ms.back() << ' ' << (committed ? 1 : 0) << '\n' << std::flush;
    }
    progress.update("step", manager.step(), total_steps, last_loss, median(step_ms));
  }
  progress.finish();
  const TestScore score = f.on("no-eval") ? TestScore{-1, -1} : evaluate(run.model, data.test, run.sharded_model.get(), pg.get());
  memory.stop();
  if (lead) {
    const auto& s = manager.stats();
    std::ostringstream os;
    os << std::setprecision(6) << "{\"replica_group\": " << t.replica_group << ", \"group_id\": \"" << manager.group_id()
       << "\", \"replica_groups\": " << t.replica_groups << ", \"world_size\": " << world
       << ", \"steps\": " << manager.step() << ", \"median_step_ms\": " << (step_ms.empty() ? 0.0 : median(step_ms))
       << ", \"median_quorum_ms\": " << median(quorum_ms)
       << ", \"longest_step_ms\": " << (step_ms.empty() ? 0.0 : *std::max_element(step_ms.begin(), step_ms.end()))
       << ", \"final_loss\": " << last_loss << ", \"test_accuracy\": " << score.accuracy
       << ", \"test_loss\": " << score.loss
       << ", \"quorums\": " << s.quorums << ", \"reconfigurations\": " << s.reconfigurations
       << ", \"reconfiguration_seconds\": " << s.reconfiguration_seconds
       << ", \"longest_reconfiguration_seconds\": " << s.longest_reconfiguration_seconds << ", \"heals\": " << s.heals
       << ", \"heal_bytes\": " << s.heal_bytes << ", \"heal_seconds\": " << s.heal_seconds
       << ", \"heal_fetch_seconds\": " << s.heal_fetch_seconds << ", \"serve_seconds\": " << s.serve_seconds
       << ", \"heals_single_copy\": " << s.heals_single_copy << ", \"heal_route\": " << nlohmann::json(s.heal_route).dump()
       << ", \"cross_transport\": \"" << s.cross_transport << "\""
       << ", \"resumed_from\": " << start.resumed_from << ", \"checkpoints_written\": " << checkpoints_written
       << ", \"steps_committed\": " << s.steps_committed << ", \"steps_not_committed\": " << s.steps_not_committed
       << ", \"cross_bytes_per_step\": "
       << (step_ms.empty() ? 0.0 : static_cast<double>(s.cross_bytes_sent) / static_cast<double>(step_ms.size()))
       << ", \"parameter_checksum\": \"" << parameter_checksum(run.params) << "\""
       << ", \"peak_rss_bytes\": " << memory.peak_rss_bytes() << "}";
    std::cout << os.str() << std::endl;
  }
  ProcessGroup::wait(pg->barrier());
  return 0;
}

}  // namespace

int run_fault_tolerant(const Flags& f, const TrainFlags& t, const std::vector<std::string>& argv) {
  if (in_distributed_env()) {
    if (t.replica_group < 0)
      throw UsageError("--fault-tolerant under a launcher that sets RANK/WORLD_SIZE: give --replica-group and --lighthouse");
    return t.diloco > 0 ? run_diloco_rank(f, t) : run_ft_rank(f, t);
  }
  if (t.replica_group >= 0) return launch_local(t.nproc, argv, "/proc/self/exe", t.max_restarts);
  return run_replica_groups(f, t, argv);
}

}  // namespace cli
}  // namespace ddpkit
