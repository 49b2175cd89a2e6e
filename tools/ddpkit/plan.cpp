// `ddpkit plan`: ranks strategies and hooks for a job by the cost model (include/ddpkit/plan/).
#include "cli.h"
#include "plan_cli.h"
#include "training.h"

#include <ddpkit/hooks/default_hooks.h>
#include <ddpkit/plan/profile.h>
#include <ddpkit/runtime/runtime.h>

#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <csignal>
#include <cstring>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

extern char** environ;

namespace ddpkit {
namespace cli {

const char* kPlanUsage = R"(usage: ddpkit plan [flags]

Predicts, for each strategy and hook, the step time and peak memory per rank of a training job,
and ranks them: those that fit --memory-limit-gb first, then the fastest. The model is the one
`ddpkit train` would build from the same flags; it is profiled here (a few steps alone, with as
many replicas at once as the job puts on a host's cores, then 10 steps of one rank in a process of
its own for its memory), and the machine's constants come from --calibrate. docs/plan.md has the
model, its inputs and how well it predicts.

  --world-size N          ranks in all (default 2)
  --hosts H               hosts they are spread over, evenly (default 1)
  --link-gbit X           bandwidth between hosts (default 10)
  --link-latency-us X     Gloo's time per message between hosts: half the mean of many back-to-back
                          small allreduces between two of them (default 0: this machine's loopback
                          figure from --calibrate, which projections to other networks rest on)
  --cores-per-host N      cores per host (default: this machine's)
  --hosts-on-this-machine the hosts are network namespaces or containers of this machine (a
                          rehearsal of a multi-host job): the profile computes the ranks of every
                          host at once, up to this machine's cores, as they will contend for its
                          caches and memory bandwidth
  --memory-limit-gb X     per rank (default 0: no limit)
  --strategy S            only this one: ddp, zero1, zero2, full_shard, shard_grad_op, no_shard,
                          hybrid_shard (default: all)
  --hook H                only this hook (default: all each strategy takes); DDP's hooks beyond
                          the default rows (fp16_wrapper, bf16_wrapper, quantize_per_tensor,
                          quantize_per_channel, batched_powersgd, post_local_sgd, noop) are
                          predicted when --hook names one
  --bucket-cap-mb X|auto  DDP and ZeRO-1 bucket cap (default: ddpkit train's for the hook); auto:
                          of the caps ddpkit train --bucket-cap-mb auto tries (1-64 MiB), the one
                          predicted fastest, kept only when 3 % faster than the default
  --powersgd-rank N       (default: ddpkit train's, 4; batched_powersgd 32)
  --local-sgd-period N    post_local_sgd: steps between parameter averages (default 4); its
                          step is predicted as the mean over a period
  --local-sgd-group-size N
                          post_local_sgd: gradients allreduced within groups of N consecutive
                          ranks (default 0: kept local)
  --optimizer-in-hook     DDP's rows with the optimizer stepping each bucket in the hook, as
                          ddpkit train --optimizer-in-hook (hook none becomes allreduce)
  --fsdp-param-dtype fp32|bf16, --fsdp-reduce-dtype fp32|bf16
                          FSDP's rows under mixed precision, as ddpkit train takes them (hook
                          none); bf16 profiles the model's compute in bf16 too
  --json                  one JSON array, best first: strategy, hook, predicted_step_ms,
                          memory_per_rank_bytes, fits, and the breakdowns
  --calibrate             measure this machine's constants (about 8 minutes), store them, print them
  --constants FILE        where they are kept (default $XDG_CACHE_HOME/ddpkit/plan-constants.json,
                          or ~/.cache/...); measured on first use when missing
  --profile-steps N       timed steps of the profile (default 8; more where steps are short, so
                          that they span a second)
  --describe FILE         plan for the model this JSON describes (layers' parameter shapes, FSDP
                          units, forward time or GFLOP) instead of profiling one: a model too big
                          for this machine, say (docs/plan.md, "Describing a model")
  --save-profile FILE     write the model's profile as such a description (to edit, or to plan
                          for it elsewhere)

The model and data flags of `ddpkit train` (--model, --dataset, --mlp-dims, --layers, --d-model,
--heads, --seq-len, --batch-size, --optimizer, --threads, --fsdp-min-unit-params,
--synthetic-size, --data-dir, --text-dir) mean what they mean there.
)";

namespace {

std::string default_constants_path() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  std::string dir = xdg && *xdg ? std::string(xdg) : std::string(home && *home ? home : "/tmp") + "/.cache";
  return dir + "/ddpkit/plan-constants.json";
}

void make_parent_dirs(const std::string& path) {
  for (size_t at = path.find('/', 1); at != std::string::npos; at = path.find('/', at + 1))
    ::mkdir(path.substr(0, at).c_str(), 0755);
}

// The whole file; none when it cannot be opened.
std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A number as a user writes it (25, 0.1): link speeds, bucket caps.
std::string plain(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

}  // namespace

std::string cap_column(const plan::Candidate& c) {
  if (c.is_fsdp()) return "-";
  return c.bucket_cap_mb ? plain(*c.bucket_cap_mb) : "default";
}

int hook_width(const std::vector<plan::Prediction>& rows) {
  size_t w = 20;
  for (const auto& r : rows) w = std::max(w, r.candidate.label().size());
  return static_cast<int>(w + 1);
}

std::string mb(int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(0) << static_cast<double>(bytes) / (1 << 20);
  return os.str();
}

namespace {

// The plan's own flags, beyond train's model and data flags: with a value (and its default), and
// switches. train_args leaves both out of the train command it prints.
const std::map<std::string, std::string> kPlanFlagDefaults = {
    {"world-size", "2"}, {"hosts", "1"}, {"link-gbit", "10"}, {"link-latency-us", "0"}, {"cores-per-host", "0"},
    {"memory-limit-gb", "0"}, {"strategy", ""}, {"hook", ""}, {"bucket-cap-mb", ""}, {"powersgd-rank", "0"},
    {"local-sgd-period", "4"}, {"local-sgd-group-size", "0"}, {"fsdp-param-dtype", "fp32"}, {"fsdp-reduce-dtype", ""},
    {"busy-dtype", "fp32"}, {"busy-barrier", ""}, {"constants", ""}, {"profile-steps", "8"}, {"describe", ""},
    {"save-profile", ""}};
const std::vector<std::string> kPlanSwitches = {"json", "calibrate", "busy-replica", "optimizer-in-hook",
                                                "hosts-on-this-machine"};

}  // namespace

Flags plan_flags(const std::vector<std::string>& args) {
  return Flags(args, with_model_flag_defaults(kPlanFlagDefaults), kPlanSwitches);
}

namespace {

// The `ddpkit train` flags that run a candidate.
std::vector<std::string> train_flags(const plan::Candidate& c) {
  std::vector<std::string> out;
  const std::string strategy = plan::to_string(c.strategy), hook = plan::to_string(c.hook);
  if (c.strategy == plan::Strategy::kZero1 || c.strategy == plan::Strategy::kZero2) out = {"--zero", strategy.substr(4)};
  else if (c.strategy != plan::Strategy::kDdp) out = {"--fsdp", strategy};
  if (c.hook != plan::Hook::kNone) out.insert(out.end(), {"--hook", hook});
  if (c.has_bucket_cap() && c.bucket_cap_mb && *c.bucket_cap_mb != hooks::default_bucket_cap_mb(hook))
    out.insert(out.end(), {"--bucket-cap-mb", plain(*c.bucket_cap_mb)});
  if ((c.hook == plan::Hook::kPowerSgd || c.hook == plan::Hook::kBatchedPowerSgd) && c.powersgd_rank > 0)
    out.insert(out.end(), {"--powersgd-rank", std::to_string(c.powersgd_rank)});
  if (c.hook == plan::Hook::kPostLocalSgd && c.local_sgd_period != 4)
    out.insert(out.end(), {"--local-sgd-period", std::to_string(c.local_sgd_period)});
  if (c.hook == plan::Hook::kPostLocalSgd && c.local_sgd_group_size > 0)
    out.insert(out.end(), {"--local-sgd-group-size", std::to_string(c.local_sgd_group_size)});
  if (c.optimizer_in_hook) out.push_back("--optimizer-in-hook");
  if (c.mixed_precision()) out.insert(out.end(), {"--fsdp-param-dtype", c.param_dtype});
  if (c.mixed_precision() && c.reduced_in() != c.param_dtype)
    out.insert(out.end(), {"--fsdp-reduce-dtype", c.reduced_in()});
  return out;
}

std::string self_path() {
  char self[4096] = {0};
  DDPKIT_CHECK(::readlink("/proc/self/exe", self, sizeof self - 1) > 0, "plan: cannot find this program");
  return self;
}

}  // namespace

TrainResult train_result(const std::vector<std::string>& flags, const std::string& env) {
  std::string cmd = env + " '" + self_path() + "' train --quiet --no-eval";
  for (const auto& a : flags) cmd += " '" + a + "'";
  cmd += " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  DDPKIT_CHECK(pipe, "plan: cannot start ", cmd);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  const int rc = ::pclose(pipe);
  auto field = [&](const std::string& name) {
    const std::string key = "\"" + name + "\": ";
    const auto at = out.rfind(key);
    DDPKIT_CHECK(rc == 0 && at != std::string::npos, "plan: ", cmd, " failed: ", out);
    return std::stod(out.substr(at + key.size()));
  };
  TrainResult r;
  r.median_step_ms = field("median_step_ms");
  r.peak_rss_bytes = static_cast<int64_t>(field("peak_rss_bytes"));
  return r;
}

namespace {

std::atomic<bool> g_stop_busy{false};
void stop_busy(int) { g_stop_busy = true; }

// Replicas that keep the other cores of a host as busy as the job's other ranks will, each a
// process of its own (`ddpkit plan ... --busy-replica`) as ranks are, stepping in lockstep with
// the timed one through `barrier` (plan::StepBarrier) as ranks do.
class BusyReplicas {
 public:
  BusyReplicas(int n, const std::vector<std::string>& args, const plan::StepBarrier& barrier) {
    const std::string self = self_path();
    // Built before fork: the child may only exec (this process has threads).
    std::vector<std::string> all{self, "plan"};
    all.insert(all.end(), args.begin(), args.end());
    all.insert(all.end(), {"--busy-replica", "--busy-barrier", barrier.address()});
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    std::string launched = "DDPKIT_LAUNCHED=1";  // main's once-per-job messages are this job's
    std::vector<char*> envp{launched.data()};
    for (char** e = environ; *e; ++e)
      if (std::strncmp(*e, "DDPKIT_LAUNCHED=", 16) != 0) envp.push_back(*e);
    envp.push_back(nullptr);
    for (int i = 0; i < n; ++i) {
      int fds[2];
      DDPKIT_CHECK(::pipe(fds) == 0, "plan: pipe failed");
      const pid_t pid = ::fork();
      DDPKIT_CHECK(pid >= 0, "plan: fork failed");
      if (pid == 0) {
        ::dup2(fds[1], STDOUT_FILENO);
        ::close(fds[0]);
        ::execve(self.c_str(), argv.data(), envp.data());
        ::_exit(127);
      }
      ::close(fds[1]);
      pids_.push_back(pid);
      char c = 0;
      const bool ready = ::read(fds[0], &c, 1) == 1;
      ::close(fds[0]);
      if (!ready) {
        stop();
        throw std::runtime_error("plan: a busy replica (ddpkit plan --busy-replica) failed to start");
      }
    }
  }
  ~BusyReplicas() { stop(); }
  void stop() {
    for (pid_t p : pids_) ::kill(p, SIGTERM);
    for (pid_t p : pids_) ::waitpid(p, nullptr, 0);
    pids_.clear();
  }

 private:
  std::vector<pid_t> pids_;
};

plan::JobSpec job_of(const Flags& f) {
  plan::JobSpec job;
  job.world_size = f.integer("world-size");
  job.hosts = f.integer("hosts");
  job.link_gbit = f.real("link-gbit");
  job.link_latency_us = f.real("link-latency-us");
  job.cores_per_host = f.integer("cores-per-host");
  job.threads = f.integer("threads");
  job.optimizer = f.str("optimizer");
  job.memory_limit_bytes = static_cast<int64_t>(f.real("memory-limit-gb") * (1LL << 30));
  job.hosts_on_this_machine = f.on("hosts-on-this-machine");
  if (job.world_size < 1) throw UsageError("--world-size must be >= 1");
  if (job.hosts < 1 || job.world_size % job.hosts) throw UsageError("--hosts must be >= 1 and divide --world-size");
  if (!(job.link_gbit > 0)) throw UsageError("--link-gbit must be positive");
  if (!(job.link_latency_us >= 0)) throw UsageError("--link-latency-us must be >= 0");
  if (job.cores_per_host < 0) throw UsageError("--cores-per-host must be >= 0");
  if (job.threads < 1) throw UsageError("--threads must be >= 1");
  if (job.optimizer != "sgd" && job.optimizer != "adam" && job.optimizer != "adamw")
    throw UsageError("--optimizer must be sgd, adam or adamw, got '" + job.optimizer + "'");
  if (f.integer("batch-size") < 1) throw UsageError("--batch-size must be >= 1");
  if (f.integer("fsdp-min-unit-params") < 1) throw UsageError("--fsdp-min-unit-params must be >= 1");
  if (f.integer("profile-steps") < 1) throw UsageError("--profile-steps must be >= 1");
  return job;
}

// What a real training process of the model holds beyond the accounting's fixed parts: one rank
// alone (`ddpkit train --nproc 1 --no-ddp`), its resident peak, as activations. The in-process
// measure (plan::profile_model) sees a heap that loading and profiling have already grown: it
// missed 40-64 MB of what fresh processes kept of the MLPs' and the CNN's steps here, and counted
// 23 MB too many for the transformer. Null when that run fails (the in-process measure stays).
std::optional<int64_t> activations_of_a_real_run(const std::vector<std::string>& args, const plan::JobSpec& job,
                                                 const plan::ModelProfile& profile,
                                                 const plan::MachineConstants& machine) {
  plan::JobSpec one_rank = job;
  one_rank.world_size = one_rank.hosts = 1;
  std::vector<std::string> flags = train_args(args, one_rank, plan::Candidate());
  flags.insert(flags.end(), {"--no-ddp", "--steps", "10"});
  try {
    const TrainResult r = train_result(flags);
    return plan::activations_from_peak(profile, machine, job.optimizer, r.peak_rss_bytes);
  } catch (const std::exception& e) {
    std::cerr << "ddpkit plan: one rank's training run failed, so activations are the profile's own measure ("
              << e.what() << ")\n";
    return std::nullopt;
  }
}

// Profiles the model the flags name, with the job's other ranks on this host as busy replicas
// (`args` are the flags they get); with `busy` set, this process is such a replica (stepping in
// --busy-dtype). With `machine`, the activations are then measured in a real run
// (activations_of_a_real_run). With `bf16`, the same steps again with the model and its inputs in
// bf16, as FSDP's mixed precision computes them (ModelProfile::bf16; the optimizer steps the fp32
// shards, so it is not timed there).
plan::ModelProfile profile_job(const Flags& f, const std::vector<std::string>& args, const plan::JobSpec& job,
                               int machine_cores, bool busy, const plan::MachineConstants* machine = nullptr,
                               bool bf16 = false) {
  const int batch = f.integer("batch-size"), min_unit = f.integer("fsdp-min-unit-params");
  // The data every rank holds: the heap loading it leaves in use; and the resident memory loading
  // adds, whose transient part (a gunzipped file, say) training reuses but which may be the peak.
  const std::string model_name = f.str("model");
  const std::string dataset = checked_dataset(f, model_name);
  const int64_t heap_before = plan::heap_in_use(), rss_before = process_resources().rss_bytes;
  RunData run_data = load_run_data(f, model_name, dataset);
  const int64_t data_bytes = std::max<int64_t>(0, plan::heap_in_use() - heap_before);
  const int64_t data_load_bytes = std::max<int64_t>(0, process_resources().rss_bytes - rss_before);
  const Split& data = run_data.data;
  DDPKIT_CHECK(data.train.inputs.size(0) >= batch, "plan: --batch-size ", batch, " is larger than the data set");

  const std::string optimizer = job.optimizer;
  // A replica in `dtype` (bf16: FSDP's mixed precision, its optimizer not timed).
  auto make_in = [&](at::ScalarType dtype) {
    Model model = build_model(f, model_name, run_data.dims, data.train.num_classes);
    if (dtype != at::kFloat) model.module->to(dtype);
    plan::ProfileTarget t;
    t.module = model.module;
    for (const auto& u : model.units) {
      int64_t n = 0;
      for (const auto& p : u->parameters()) n += p.numel();
      if (n >= min_unit) t.units.push_back(u);
    }
    at::Tensor x = data.train.inputs.slice(0, 0, batch), y = data.train.labels.slice(0, 0, batch);
    if (model.language_model) x = x.to(at::kLong), y = y.to(at::kLong);
    else if (x.is_floating_point()) x = x.to(dtype);
    t.loss = [model, x, y] { return model_loss(model, model.forward(x), y); };
    if (dtype != at::kFloat) {
      t.optimizer_step = [] {};
      return t;
    }
    // The optimizer train steps (the rate does not change its time).
    std::shared_ptr<torch::optim::Optimizer> opt = choose_optimizer(optimizer, 1e-3).factory.create(
        {torch::optim::OptimizerParamGroup(model.module->parameters())});
    t.optimizer_step = [opt] { opt->step(); };
    return t;
  };
  if (busy) {
    std::signal(SIGTERM, stop_busy);
    const at::ScalarType dtype = f.str("busy-dtype") == "bf16" ? at::kBFloat16 : at::kFloat;
    if (f.str("busy-barrier").empty()) throw UsageError("--busy-replica needs --busy-barrier (ddpkit plan starts replicas)");
    plan::StepBarrier barrier(f.str("busy-barrier"));  // joined before it reports itself started
    plan::step_until(
        [&] { return make_in(dtype); }, job.threads, g_stop_busy,
        [] {
          const char c = 'r';
          if (::write(STDOUT_FILENO, &c, 1) != 1) std::_Exit(1);
        },
        [&] {
          if (!barrier.arrive_and_wait(&g_stop_busy)) std::exit(0);  // stopped: no step more
        });
    std::exit(0);
  }
  plan::ProfileOptions po;
  po.steps = f.integer("profile-steps");
  po.threads = job.threads;
  // As many replicas at once as the job puts on a host (up to 8): time-sharing more ranks than
  // cores costs more than their ratio (caches, switches), so it is measured rather than scaled.
  // A host with more cores than this machine: only as many as its cores are busy.
  // Hosts on this machine: every host's ranks compute here at once, as many as its cores hold
  // (time-sharing beyond them the cost model scales by --cores-per-host): replicas that share a
  // machine's caches and memory bandwidth step slower than one alone.
  const int cores = job.cores_per_host > 0 ? job.cores_per_host : machine_cores;
  const int fill = job.hosts_on_this_machine || cores > machine_cores ? std::max(1, machine_cores / job.threads)
                                                                        : job.ranks_per_host();
  const int here = job.hosts_on_this_machine ? job.world_size : job.ranks_per_host();
  po.busy_replicas = std::max(1, std::min({here, fill, 8}));
  // Timed in lockstep with the replicas, meeting them at the end of every backward as the job's
  // ranks meet at the gradients' last allreduce.
  auto in_lockstep = [&](const std::vector<std::string>& replica_args, at::ScalarType dtype) {
    plan::StepBarrier barrier(po.busy_replicas);
    BusyReplicas others(po.busy_replicas - 1, replica_args, barrier);
    plan::ProfileOptions o = po;
    if (po.busy_replicas > 1) o.after_backward = [&] { barrier.arrive_and_wait(); };
    return plan::profile_model([&] { return make_in(dtype); }, o);
  };
  plan::ModelProfile profile = in_lockstep(args, at::kFloat);
  const int64_t fp32_in_process = profile.activation_bytes;
  if (bf16) {
    std::vector<std::string> busy_args = args;
    busy_args.insert(busy_args.end(), {"--busy-dtype", "bf16"});
    const plan::ModelProfile low = in_lockstep(busy_args, at::kBFloat16);
    plan::ComputeProfile c;
    c.forward_ms = low.forward_ms;
    c.backward_ms = low.backward_ms;
    for (const auto& p : low.params) c.grad_ready_ms.push_back(p.grad_ready_ms);
    c.activation_bytes = low.activation_bytes;  // from the real run's, below, where there is one
    profile.bf16 = c;
  }
  profile.name = model_name;
  profile.batch = batch;
  profile.data_bytes = data_bytes;
  profile.data_load_bytes = data_load_bytes;
  if (machine)
    if (const auto activations = activations_of_a_real_run(args, job, profile, *machine)) {
      profile.activation_bytes = *activations;
      // In bf16 a real process holds neither the fp32 run's surplus (FSDP's mixed-precision peaks
      // came out -12 to +20 % against it, the transformer over) nor that scaled by what the bf16
      // steps held in this process against the fp32 ones (14-22 % short): much of it is heap the
      // steps leave, which does not shrink with the dtype. Between the two: an empirical rule,
      // chosen on those rows (docs/plan.md).
      if (profile.bf16 && fp32_in_process > 0) {
        const double ratio = static_cast<double>(profile.bf16->activation_bytes) / static_cast<double>(fp32_in_process);
        profile.bf16->activation_bytes = static_cast<int64_t>(static_cast<double>(*activations) * (1 + ratio) / 2);
      }
    }
  return profile;
}

// The calibration job: a 3-layer MLP of 12.6M parameters (none of validation's models), 2 ranks.
const std::vector<std::string> kCalibrationModel = {"--dataset", "synthetic", "--mlp-dims", "1024,3072,3072,1024",
                                                    "--synthetic-size", "2048", "--fsdp-min-unit-params", "1000"};

// The libtorch version constants were measured with ("libtorch X" in measured_on), or "".
std::string measured_libtorch(const plan::MachineConstants& m) {
  const size_t at = m.measured_on.find("libtorch ");
  if (at == std::string::npos) return "";
  const size_t from = at + std::strlen("libtorch ");
  return m.measured_on.substr(from, m.measured_on.find_first_of(";, ", from) - from);
}

plan::MachineConstants calibrate(const std::string& path) {
  std::cerr << "ddpkit plan: measuring collectives, copies and codecs\n";
  plan::MachineConstants m = plan::calibrate_machine(2);
  m.process_bytes = train_result({"--nproc", "2", "--dataset", "synthetic", "--mlp-dims", "16,16", "--synthetic-size",
                                  "256", "--batch-size", "16", "--steps", "3"})
                        .peak_rss_bytes;
  // What each strategy holds beyond the model's accounting, from a real 2-rank job's peak: with
  // shared memory, as ranks of one host; and over Gloo alone, as ranks of two hosts or a job of
  // one rank (a 2-rank job over Gloo holds 7-20 % more than over shared memory: its own buffers,
  // not the arena).
  const Flags f = plan_flags(kCalibrationModel);
  const plan::JobSpec job = job_of(f);
  plan::JobSpec two_hosts = job;
  two_hosts.hosts = 2;
  const plan::ModelProfile profile = profile_job(f, kCalibrationModel, job, m.cores, false, &m, /*bf16=*/true);
  const double P = static_cast<double>(profile.param_bytes());
  std::vector<plan::Candidate> measured = plan::candidates(job);
  for (auto c : plan::other_hook_candidates()) {
    // Averaging every step: the short job holds the averaging's flat buffer, as a long one does.
    if (c.hook == plan::Hook::kPostLocalSgd) c.local_sgd_period = 1;
    measured.push_back(c);
  }
  for (plan::Strategy s : {plan::Strategy::kFullShard, plan::Strategy::kShardGradOp,
                           plan::Strategy::kNoShard}) {  // FSDP's mixed precision
    plan::Candidate c;
    c.strategy = s;
    c.param_dtype = "bf16";
    measured.push_back(c);
  }
  for (const auto& c : measured) {
    const std::string key = plan::measured_extra_key(c);
    std::cerr << "ddpkit plan: measuring " << key << "\n";
    std::vector<std::string> flags = kCalibrationModel;
    flags.insert(flags.end(), {"--nproc", "2", "--steps", "5"});
    for (const auto& a : kHooksFromTheThirdStep) flags.push_back(a);
    for (const auto& a : train_flags(c)) flags.push_back(a);
    // One run each: with large blocks in the LargeBlockCache a job's peak repeats to 1-2 MB (in
    // glibc's heap it moved by whole blocks from run to run, and two runs were averaged).
    auto peak = [&](const std::string& env) { return static_cast<double>(train_result(flags, env).peak_rss_bytes); };
    m.extra_bytes_per_param_byte[key] =
        (peak("") - static_cast<double>(plan::predict(profile, job, m, c).memory.total())) / P;
    m.extra_bytes_per_param_byte_gloo[key] =
        (peak("DDPKIT_SHM=0") - static_cast<double>(plan::predict(profile, two_hosts, m, c).memory.total())) / P;
  }
  m.memory_model = plan::MachineConstants::kMemoryModel;
  make_parent_dirs(path);
  std::ofstream out(path);
  DDPKIT_CHECK(out, "plan: cannot write ", path);
  out << plan::to_json(m) << "\n";
  return m;
}

plan::MachineConstants load_or_calibrate(const std::string& path) {
  const std::optional<std::string> text = read_text(path);
  if (!text) {
    std::cerr << "ddpkit plan: no machine constants at " << path << "; measuring them (ddpkit plan --calibrate)\n";
    return calibrate(path);
  }
  // Constants from an older ddpkit are measured again rather than refused: extras measured against
  // another memory accounting would count memory twice or not at all, and a file from before a
  // rate was measured (a layer's products, the uint8 codec, TCP's CPU) lacks it.
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  std::string stale;
  if (j.is_object() && j.contains("extra_bytes_per_param_byte") &&
      j.value("memory_model", 1) != plan::MachineConstants::kMemoryModel)
    stale = "against an older memory model";
  else if (const std::string rate = plan::rate_missing_from(*text); !rate.empty())
    stale = "before its '" + rate + "' was";
  if (!stale.empty()) {
    std::cerr << "ddpkit plan: " << path << " was measured " << stale << "; measuring again\n";
    return calibrate(path);
  }
  plan::MachineConstants m;
  try {
    m = plan::machine_constants_from_json(*text);
  } catch (const c10::Error& e) {
    throw std::runtime_error(path + ": " + e.what_without_backtrace());
  }
  // The process floor is the libtorch's own (a rank of pip's CUDA torch 2.15 holds 389 MiB, of
  // Debian's 1.13 169 MiB): memory figures from constants of another libtorch are off by that much.
  const std::string then = measured_libtorch(m);
  if (!then.empty() && then != TORCH_VERSION)
    std::cerr << "ddpkit plan: " << path << " was measured with libtorch " << then << ", this is " << TORCH_VERSION
              << ": its per-rank floor (" << m.process_bytes / (1 << 20)
              << " MiB) may not be this libtorch's; ddpkit plan --calibrate measures them for this one\n";
  return m;
}

}  // namespace

std::vector<std::string> train_args(const std::vector<std::string>& args, const plan::JobSpec& job,
                                    const plan::Candidate& c) {
  std::vector<std::string> out = {"--nproc", std::to_string(job.ranks_per_host())};
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string name = args[i].rfind("--", 0) == 0 ? args[i].substr(2, args[i].find('=') - 2) : "";
    if (std::find(kPlanSwitches.begin(), kPlanSwitches.end(), name) != kPlanSwitches.end()) continue;
    if (kPlanFlagDefaults.count(name)) {
      if (args[i].find('=') == std::string::npos) ++i;  // its value
      continue;
    }
    out.push_back(args[i]);
  }
  for (const auto& a : train_flags(c)) out.push_back(a);
  return out;
}

std::string joined(const std::vector<std::string>& words) {
  std::string s;
  for (const auto& w : words) s += (s.empty() ? "" : " ") + w;
  return s;
}

namespace {

// --bucket-cap-mb, or `cap_by_default` when it is not given, into `c`: none (the hook's default),
// auto (choose as the tuner would) or MiB.
void set_bucket_cap(const Flags& f, const std::string& cap_by_default, plan::Candidate& c) {
  const std::string cap = f.str("bucket-cap-mb").empty() ? cap_by_default : f.str("bucket-cap-mb");
  if (cap.empty()) return;
  if (cap == "auto") {
    c.choose_bucket_cap = true;
    return;
  }
  const double mb = f.real("bucket-cap-mb");
  if (!(mb > 0)) throw UsageError("--bucket-cap-mb must be positive or auto, got '" + cap + "'");
  c.bucket_cap_mb = mb;
}

// --strategy or --hook by name; a UsageError listing the names otherwise.
template <typename Parse>
auto named(const Flags& f, const std::string& flag, Parse parse) -> std::optional<decltype(parse(""))> {
  if (f.str(flag).empty()) return std::nullopt;
  try {
    return parse(f.str(flag));
  } catch (const c10::Error& e) {
    std::string message = e.what_without_backtrace();
    if (message.rfind("ddpkit: ", 0) == 0) message = message.substr(8);
    throw UsageError("--" + flag + ": " + message);
  }
}

}  // namespace

Planned make_plan(const Flags& f, const std::vector<std::string>& args, const std::string& cap_by_default) {
  Planned out;
  out.constants_path = f.str("constants").empty() ? default_constants_path() : f.str("constants");
  out.job = job_of(f);
  if (f.on("busy-replica")) profile_job(f, args, out.job, 1, true);
  const std::string param_dtype = f.str("fsdp-param-dtype"), reduce_dtype = f.str("fsdp-reduce-dtype");
  if (param_dtype != "fp32" && param_dtype != "bf16")
    throw UsageError("--fsdp-param-dtype must be fp32 or bf16, got '" + param_dtype + "'");
  if (!reduce_dtype.empty() && reduce_dtype != "fp32" && reduce_dtype != "bf16")
    throw UsageError("--fsdp-reduce-dtype must be fp32 or bf16, got '" + reduce_dtype + "'");
  if (param_dtype == "fp32" && !reduce_dtype.empty() && reduce_dtype != "fp32")
    throw UsageError("--fsdp-reduce-dtype bf16 with fp32 parameters is FSDP's hook bf16 (--hook bf16)");
  const bool mixed = param_dtype != "fp32";
  if (f.integer("powersgd-rank") < 0) throw UsageError("--powersgd-rank must be >= 1");
  if (f.integer("local-sgd-period") < 1) throw UsageError("--local-sgd-period must be >= 1");
  const int group = f.integer("local-sgd-group-size");
  if (group < 0 || (group > 0 && out.job.world_size % group))
    throw UsageError("--local-sgd-group-size must be >= 0 and divide --world-size, got " + std::to_string(group));
  const bool in_hook = f.on("optimizer-in-hook");
  std::vector<plan::Candidate> all = plan::candidates(out.job);
  const auto strategy = named(f, "strategy", plan::parse_strategy);
  const auto hook = named(f, "hook", plan::parse_hook);
  if (hook)  // DDP's other hooks are predicted when asked for by name
    for (const auto& c : plan::other_hook_candidates()) all.push_back(c);
  std::vector<plan::Candidate> list;
  for (auto c : all) {
    if (strategy && c.strategy != *strategy) continue;
    if (hook && c.hook != *hook) continue;
    // The optimizer in the hook: DDP alone; hook none would repeat allreduce's row (train
    // registers allreduce for it) unless asked for by name.
    if (in_hook && (c.strategy != plan::Strategy::kDdp || (!hook && c.hook == plan::Hook::kNone))) continue;
    // Mixed precision: FSDP's rows, hook none (DDP's and ZeRO's rows stay, as they are).
    if (mixed && c.is_fsdp() && c.hook != plan::Hook::kNone) continue;
    if (mixed && c.is_fsdp()) {
      c.param_dtype = param_dtype;
      c.reduce_dtype = reduce_dtype;
    }
    set_bucket_cap(f, cap_by_default, c);
    c.powersgd_rank = f.integer("powersgd-rank");
    c.local_sgd_period = f.integer("local-sgd-period");
    c.local_sgd_group_size = group;
    c.optimizer_in_hook = in_hook;
    list.push_back(c);
  }
  if (list.empty())
    throw UsageError("no strategy and hook match --strategy '" + f.str("strategy") + "' --hook '" + f.str("hook") +
                     "'" + (in_hook ? " with --optimizer-in-hook (DDP's hooks only)" : "") +
                     " (ddpkit plan --help lists them)");
  const plan::MachineConstants machine = load_or_calibrate(out.constants_path);
  if (f.str("describe").empty()) {
    bool any_mixed = false;
    for (const auto& c : list) any_mixed = any_mixed || c.mixed_precision();
    out.profile = profile_job(f, args, out.job, machine.cores, false, &machine, any_mixed);
  } else {
    const std::optional<std::string> text = read_text(f.str("describe"));
    if (!text) throw UsageError("--describe: cannot read '" + f.str("describe") + "'");
    try {
      out.profile = plan::model_profile_from_json(*text, machine, out.job.optimizer);
    } catch (const c10::Error& e) {
      throw UsageError(f.str("describe") + ": " + e.what_without_backtrace());
    }
  }
  if (!f.str("save-profile").empty()) {
    std::ofstream saved(f.str("save-profile"));
    DDPKIT_CHECK(saved, "plan: cannot write ", f.str("save-profile"));
    saved << plan::to_json(out.profile) << "\n";
  }
  out.rows = plan::rank_candidates(out.profile, out.job, machine, list);
  return out;
}

int run_plan(const std::vector<std::string>& args) {
  const Flags f = plan_flags(args);
  if (f.on("calibrate")) {
    const std::string path = f.str("constants").empty() ? default_constants_path() : f.str("constants");
    const plan::MachineConstants m = calibrate(path);
    std::cout << plan::to_json(m) << "\n";
    std::cerr << "stored in " << path << "\n";
    return 0;
  }
  const Planned p = make_plan(f, args);
  const plan::JobSpec& job = p.job;
  const plan::ModelProfile& profile = p.profile;
  const auto& rows = p.rows;
  if (f.on("json")) {
    std::cout << plan::to_json(rows) << "\n";
    return 0;
  }
  const bool described = !f.str("describe").empty();
  std::cout << "# " << (described ? profile.name + " (" + f.str("describe") + ")" : f.str("model")) << ": "
            << profile.params.size() << " tensors, " << std::fixed << std::setprecision(1)
            << static_cast<double>(profile.param_bytes()) / 4e6 << "M parameters; " << job.world_size << " ranks on "
            << job.hosts << " host(s)" << (job.hosts > 1 ? " at " + plain(job.link_gbit) + " Gbit/s" : "")
            << (job.hosts > 1 && job.link_latency_us > 0 ? ", " + plain(job.link_latency_us) + " us a message" : "")
            << "; batch " << profile.batch << " per rank; " << job.optimizer << "\n";
  std::cout << (described ? "# described: forward " : "# measured alone: forward ") << std::setprecision(1) << profile.forward_ms << " ms, backward "
            << profile.backward_ms << " ms, optimizer " << profile.optimizer_ms << " ms (" << profile.concurrent
            << " replica(s) at once); constants: " << p.constants_path << "\n";
  const int hook_column = hook_width(rows);
  std::cout << std::left << std::setw(15) << "strategy" << std::setw(hook_column) << "hook" << std::right << std::setw(7)
            << "cap_MB" << std::setw(10) << "step_ms" << std::setw(10) << "comm_ms" << std::setw(12) << "memory_MB" << std::setw(12) << "wire_MB"
            << "  fits\n";
  for (const auto& r : rows) {
    std::cout << std::left << std::setw(15) << plan::to_string(r.candidate.strategy) << std::setw(hook_column) << r.candidate.label() << std::right
              << std::setw(7) << cap_column(r.candidate) << std::setw(10) << std::setprecision(1) << r.step_ms << std::setw(10) << r.exposed_comm_ms << std::setw(12)
              << mb(r.memory.total()) << std::setw(12) << std::setprecision(1) << r.wire_bytes_per_step / (1 << 20)
              << "  " << (r.fits ? "yes" : "no") << "\n";
  }
  if (rows.front().fits && described) {
    std::cout << "# run the first: your model's training with " << joined(train_flags(rows.front().candidate))
              << " (ddpkit train's flags)\n";
  } else if (rows.front().fits) {
    std::cout << "# run the first" << (job.hosts > 1 ? " (on each host, torchrun-style variables set)" : "")
              << ": ddpkit train " << joined(train_args(args, job, rows.front().candidate)) << "\n";
  } else {
    std::cout << "# nothing fits --memory-limit-gb " << f.str("memory-limit-gb") << "\n";
  }
  return 0;
}

}  // namespace cli
}  // namespace ddpkit
