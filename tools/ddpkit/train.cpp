// `ddpkit train`: data-parallel training of an MLP or CNN on Fashion-MNIST or synthetic data.
#include "cli.h"
#include "train_build.h"
#include "training.h"

#include <torch/torch.h>
#include <ddpkit/ddpkit.h>
#include <ddpkit/runtime/memory_sampler.h>
#include <ddpkit/training/divergence_guard.h>
#include <ddpkit/training/preemption.h>
#include <ddpkit/training/replica_group_sampler.h>

#include <ATen/CPUGeneratorImpl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace ddpkit {
namespace cli {
const char* kTrainUsage = R"(usage: ddpkit train [flags]

Trains data-parallel across --nproc local processes, or as one rank of a job another engine
started: torchrun, srun, mpirun, Kubeflow, Ray Train (their variables are read: docs/launching.md).
Rank 0 prints progress, per-epoch loss and test accuracy, and a last line that is one JSON object.

  --nproc N               local processes to launch (default 2)
  --model mlp|cnn|transformer         (default mlp)
  --dataset fashion-mnist|synthetic|text   (default fashion-mnist; text for transformer)
  --data-dir DIR          Fashion-MNIST IDX files (default /usr/share/datasets/fashion-mnist)
  --text-dir DIR          text: every file without a '.' in DIR, as bytes (default
                          /usr/share/games/fortunes, Debian's fortunes package); 5% held out
  --layers N  --d-model N  --heads N  --seq-len N
                          transformer: a GPT-style decoder over bytes (default 4, 256, 4, 64);
                          rank 0 reports test loss and perplexity per byte
  --mlp-dims A,B,...      MLP layer sizes (default 784,512,256,10; synthetic: 1024,4096,4096,1024)
  --hook NAME             none (DDP's built-in allreduce), allreduce, fp16, bf16, noop,
                          fp16_wrapper, bf16_wrapper, int8, quantize_per_tensor,
                          quantize_per_channel, powersgd, batched_powersgd, post_local_sgd
                          (default none)
  --powersgd-rank N       PowerSGD approximation rank (default 4; batched_powersgd 32: at rank 1
                          they fall 7 points and diverge on the default job)
  --powersgd-start-iter N plain allreduce before this iteration (default 10)
  --powersgd-min-compression-rate X   (default 2)
  --powersgd-epsilon X    orthogonalization epsilon (default 0)
  --powersgd-seed N       (default 0)
  --powersgd-batch-same-shape         batch same-shaped matrices
  --no-error-feedback     PowerSGD without error feedback
  --no-warm-start         PowerSGD with a fresh random Q every step
  --int8-block N          int8 hook: elements per scale (default 512)
  --int8-error-feedback   int8 hook: carry quantization errors to the next step
  --perchannel-bucket-size N          quantize_per_channel: elements per channel (default 512)
  --local-sgd-start-iter N            post_local_sgd: global allreduce before it (default 100)
  --local-sgd-period N    post_local_sgd: average parameters every N steps after (default 4)
  --local-sgd-group-size N            post_local_sgd: allreduce gradients within groups of N
                          ranks after the start (default 0: not at all)
  --optimizer sgd|adam|adamw          (default sgd, momentum 0.9)
  --optimizer-in-hook     step the optimizer per bucket as its communication completes,
                          overlapping it with backward (wraps --hook, or allreduce)
  --zero off|1|2          ZeroRedundancyOptimizer: 1 shards optimizer state, 2 also reduce-scatters
                          gradients so each rank keeps only its shard (default off)
  --zero-overlap none|step|interleaved
                          step the ZeRO shards inside DDP's hooks, after the last bucket (step)
                          or bucket by bucket (interleaved) (default none: after backward)
  --zero-shard-buckets    --zero 1 with overlap: split buckets among ranks by size
  --zero-bucket-view      --zero 1: each rank's shard in one flat buffer (parameters as bucket views)
  --zero-precision fp32|fp16|bf16     --zero 2: precision of the reduce-scatter (default fp32)
  --fsdp off|full_shard|shard_grad_op|no_shard|hybrid_shard
                          FullyShardedDataParallel instead of DDP (docs/fsdp.md): each layer (MLP,
                          CNN) or block (transformer) of at least --fsdp-min-unit-params parameters
                          is a unit; --hook none|fp16|bf16 picks its FSDP hook (default off)
  --fsdp-min-unit-params N            (default 100000)
  --fsdp-param-dtype fp32|bf16        FSDP mixed precision: compute dtype (default fp32)
  --fsdp-reduce-dtype fp32|bf16       gradient reduction dtype (default: the compute dtype)
  --bucket-cap-mb X|auto  bucket cap in MiB (default: 6 for fp16/bf16/int8/quantize hooks, else 25);
                          auto: trial caps of 1-64 MiB in the first steps, keep the fastest
  --epochs N              (default 3)
  --steps N               stop after N steps (default 0: run all epochs)
  --batch-size N          per rank (default 64)
  --lr X                  learning rate (default 0.05 for sgd, 0.001 for adam/adamw)
  --seed N                (default 1)
  --threads N             intra-op threads per rank (default 1)
  --backend gloo|nccl     (default gloo)
  --timeout-s N           collective timeout (default 300)
  --synthetic-size N      synthetic training samples (default 8192)
  --gloo-threads N        Gloo worker threads per rank (default 2)
  --gloo-connections N    TCP connections per peer pair; large allreduces are split over them
  --two-phase-min-mb X    fp32 allreduces of at least X MiB use two alltoalls instead of Gloo's
                          ring (default 0: off; fp16/bf16 always do)
  --piece-kb N|auto       two-phase collectives (fp16/bf16, int8) move N KiB per peer per
                          message, pipelined (default 1024); auto: trial 256, 1024 and 4096
  --gradient-as-bucket-view
  --find-unused-parameters
  --no-ddp                train locally in one process, without DistributedDataParallel
  --no-eval               skip test-set evaluation
  --quiet                 no progress bar
  --no-divergence-guard   keep training when the loss turns NaN/Inf or explodes (by default
                          the run stops, naming the hook and the setting to change)
  --no-malloc-tuning      keep glibc's default mmap/trim thresholds (ddpkit::tune_allocator_for_training)
  --report-resources N    every N steps rank 0 prints each rank's resident memory and open file
                          descriptors (a line "resources {...}" on stderr), for leak hunting

Checkpoints and restarts (docs/fault_tolerance.md):
  --checkpoint-dir DIR    rank 0 writes DIR/checkpoint-<step>.ddpk atomically: model, optimizer
                          (ZeRO: consolidated), hook state, DDP buckets, RNG and data position
  --checkpoint-every N    every N steps, and after the last (default 100); and on SIGTERM or
                          SIGUSR1 (preemption): every rank checkpoints the same step, exit 143
  --resume                continue from the newest complete checkpoint in DIR (none: start afresh);
                          the training flags must match the ones it was written with
  --max-restarts K        when a rank dies or fails, stop every rank and start a new set that
                          resumes from the newest checkpoint, up to K times (torchrun's meaning);
                          with --fault-tolerant: per replica group (default there 10)

Fault tolerance across replica groups (docs/fault_tolerance.md):
  --fault-tolerant        train as replica groups that go on when groups die: a per-step quorum,
                          gradients averaged across the live groups, a restarted group healed from
                          a live one (no checkpoint read); DDP (any hook but post_local_sgd),
                          ZeRO-1 or FSDP inside each group
  --replica-groups R      groups of --nproc ranks each (default 1), launched and each restarted here
  --min-replicas M        fewest groups a step may run with (default 1); below it the job stops
  --lighthouse HOST:PORT  the quorum service (ddpkit lighthouse); default: started here
  --replica-group G       run only group G of R (a job over several hosts: one command per group,
                          all with the same --lighthouse)
  --heal-connections N    connections a heal streams a peer's state over where it cannot read
                          the peer's memory (between hosts; default 1: one TCP stream fills a
                          link unless the network caps each flow below it)
  --cross-lazy-connections
                          groups (sites) connect to each other when a collective first needs it,
                          rings and trees, instead of all pairs at each quorum change: for tens
                          of groups or sites (docs/scale.md)
  --quorum-mode MODE      async (default): the quorum, a new membership's process group and a
                          heal run beside forward and backward, and a healing group adds zeros
                          for a step; sync: each step waits for its quorum and its heals. Every
                          group of a job takes the same (DiLoCo's syncs are always sync)
  --step-log PATH         each group's rank 0 appends a line per step to PATH.<group id>: the
                          step, its end (Unix ms), its length (ms) and whether it committed
  With --checkpoint-dir, the quorum's first group writes the checkpoints (the replicas are equal;
  give every group's rank 0 the same directory); --resume loads one under any --replica-groups.

DiLoCo across replica groups, for sites joined by slow links (docs/diloco.md; needs --fault-tolerant):
  --diloco H              each group trains alone for H inner steps (--optimizer, DDP/ZeRO/FSDP inside),
                          then the groups average their pseudo-gradients and take an outer step
  --outer-lr LR           the outer SGD's learning rate (default 0.7)
  --outer-momentum M      its Nesterov momentum (default 0.9; 0: none)
  --outer-codec C         the pseudo-gradients' wire format: fp32, fp16, bf16, int8, int4, int2 (default fp32)
  --outer-error-feedback  carry what each encoding rounds away into the next sync (off)
  --fragments P           Streaming DiLoCo: P fragments of the model's layers, one synced every H/P
                          steps (default 1)
  --fragment-layout L     strided (layer i in fragment i % P; default) or sequential
  --fragment-delay T      a fragment's average runs behind the next T inner steps (0..H/P-1; default 0)
  --fragment-alpha A      on applying, a fragment becomes lerp(global, local, A) (default 0: global)
  --round-seconds S       stragglers: each round lasts S seconds (or H steps), each group running the
                          steps it can, weighted by them; the job runs --steps / H rounds
)";

namespace {

// This process's minor page faults so far (each step's count goes in the JSON summary).
int64_t minor_page_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_minflt);
}


}  // namespace

std::shared_ptr<ProcessGroup> join_group(const Flags& f, const TrainFlags& t) {
  return init_process_group(InitOptions()
                                .backend(f.str("backend"))
                                .timeout(std::chrono::seconds(f.integer("timeout-s")))
                                .gloo_threads(f.integer("gloo-threads"))
                                .gloo_connections(f.integer("gloo-connections"))
                                .two_phase_min_bytes(static_cast<int64_t>(f.real("two-phase-min-mb") * 1024 * 1024))
                                .piece_bytes(int64_t{t.piece_kb} * 1024));
}

// FSDP over the model: each listed submodule of at least --fsdp-min-unit-params parameters is a
// unit; --hook fp16|bf16 registers the matching FSDP hook.
std::unique_ptr<FullyShardedDataParallelBase> build_fsdp(const Flags& f, const TrainFlags& t, const Model& model,
                                                         const std::shared_ptr<ProcessGroup>& pg) {
  const int64_t min_unit = f.integer("fsdp-min-unit-params");
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (const auto& u : model.units) {
    int64_t n = 0;
    for (const auto& p : u->parameters()) n += p.numel();
    if (n >= min_unit) units.push_back(u);
  }
  MixedPrecision mp;
  mp.param_dtype(t.fsdp_param_dtype).reduce_dtype(t.fsdp_reduce_dtype);
  auto sharded = std::make_unique<FullyShardedDataParallelBase>(
      model.module, pg,
      FullyShardedDataParallelOptions()
          .sharding_strategy(t.fsdp_strategy)
          .mixed_precision(mp)
          .auto_wrap_policy(nullptr)
          .unit_modules(units));
  if (t.hook != "fp16" && t.hook != "bf16") return sharded;
  auto state = std::make_shared<fsdp::LowPrecisionState>(
      sharded->shard_group(), mp.reduce_dtype().value_or(mp.param_dtype().value_or(at::kFloat)));
  // The low-precision hooks reduce-scatter under sharded strategies and allreduce under kNoShard.
  auto fn = t.hook == "fp16" ? fsdp::fp16_compress_hook : fsdp::bf16_compress_hook;
  if (t.fsdp_strategy == ShardingStrategy::kNoShard)
    sharded->register_comm_hook(
        FsdpAllreduceHook{[state, fn](const at::Tensor& g) { return fn(*state, g, at::Tensor()); }}, t.hook);
  else
    sharded->register_comm_hook(
        FsdpReduceScatterHook{[state, fn](const at::Tensor& g, const at::Tensor& out) { return fn(*state, g, out); }},
        t.hook);
  return sharded;
}

// --hook's DDP hook (none: DDP's built-in allreduce, an empty hook) and its state.
struct BuiltHook {
  CommHook hook;
  std::string registered;
  std::shared_ptr<hooks::HookState> state;
  std::unique_ptr<hooks::PeriodicModelAverager> averager;  // post_local_sgd
};

BuiltHook build_ddp_hook(const Flags& f, const TrainFlags& t, const std::shared_ptr<ProcessGroup>& pg) {
  BuiltHook b;
  b.registered = t.hook;
  if (t.hook == "post_local_sgd") {
    const int group = f.integer("local-sgd-group-size");
    if (group > 0 && pg->size() % group != 0)
      throw UsageError("--local-sgd-group-size " + std::to_string(group) + " does not divide the world size " +
                       std::to_string(pg->size()));
    auto state = std::make_shared<hooks::PostLocalSGDState>(pg, group > 0 ? new_subgroups(*pg, group) : nullptr,
                                                            f.integer("local-sgd-start-iter"));
    b.hook = hooks::post_localSGD_hook(state);
    b.state = state;
    b.averager = std::make_unique<hooks::PeriodicModelAverager>(f.integer("local-sgd-period"),
                                                                 f.integer("local-sgd-start-iter"), pg);
  } else if (t.hook != "none") {
    hooks::HookOptions ho;
    ho.powersgd(hooks::PowerSGDOptions()
                    .matrix_approximation_rank(t.powersgd_rank)
                    .start_powerSGD_iter(f.integer("powersgd-start-iter"))
                    .min_compression_rate(f.real("powersgd-min-compression-rate"))
                    .orthogonalization_epsilon(f.real("powersgd-epsilon"))
                    .random_seed(static_cast<uint64_t>(f.integer("powersgd-seed")))
                    .batch_tensors_with_same_shape(f.on("powersgd-batch-same-shape"))
                    .use_error_feedback(!f.on("no-error-feedback"))
                    .warm_start(!f.on("no-warm-start")));
    ho.int8(hooks::Int8Options().block(f.integer("int8-block")).error_feedback(f.on("int8-error-feedback")));
    ho.perchannel_bucket_size(f.integer("perchannel-bucket-size"));
    auto built = hooks::build_hook(t.hook, pg, ho);
    b.hook = built.hook;
    b.state = built.state;
  }
  return b;
}

// Wraps the hook for ZeRO (zero2's reduce-scatter, or a step inside the hook) and for
// --optimizer-in-hook, naming what was registered.
void wrap_ddp_hook(const Flags& f, const TrainFlags& t, DistributedDataParallelBase& ddp,
                   const std::shared_ptr<ZeroRedundancyOptimizer>& zero,
                   const std::shared_ptr<hooks::FunctionalOptimizer>& functional,
                   const std::shared_ptr<ProcessGroup>& pg, BuiltHook& b) {
  auto or_allreduce = [&] {
    if (b.hook) return;
    b.hook = hooks::allreduce_hook(pg);
    b.registered = "allreduce";
  };
  if (zero && t.zero_level == "2") {
    b.hook = zero2_hook(ddp, zero, fsdp_sharded_reduce(pg, f.str("zero-precision")), t.zero_overlap);
    b.registered = "zero2_" + f.str("zero-precision");
  } else if (zero && t.zero_overlap != ZeroOverlap::kNone) {
    or_allreduce();
    const bool shard_buckets = f.on("zero-shard-buckets");
    b.hook = t.zero_overlap == ZeroOverlap::kStep ? hook_with_zero_step(b.hook, ddp, zero, shard_buckets)
                                                  : hook_with_zero_step_interleaved(b.hook, ddp, zero, shard_buckets);
    b.registered += "+zero_" + f.str("zero-overlap");
  }
  if (t.optimizer_in_hook) {
    or_allreduce();
    b.hook = hooks::optimizer_after_hook(b.hook, functional);
    b.registered += "+" + t.optimizer;
  }
}

void build_training(const Flags& f, const TrainFlags& t, const std::shared_ptr<ProcessGroup>& pg, Training& run) {
  if (t.use_fsdp) run.sharded_model = build_fsdp(f, t, run.model, pg);
  // One options object per optimizer feeds the plain optimizer, ZeRO's factory and the
  // per-parameter twin for --optimizer-in-hook.
  run.optimizer_choice = choose_optimizer(t.optimizer, t.lr);
  const OptimizerFactory& factory = run.optimizer_choice.factory;
  run.params = run.sharded_model ? run.sharded_model->parameters() : run.model.module->parameters();
  run.optimizer = factory.create({torch::optim::OptimizerParamGroup(run.params)});
  if (t.zero_level != "off") {
    run.zero = std::make_shared<ZeroRedundancyOptimizer>(
        run.params, factory, pg,
        ZeroOptions()
            .overlap_with_ddp(t.zero_overlap != ZeroOverlap::kNone)
            .parameters_as_bucket_view(f.on("zero-bucket-view")));
    run.optimizer.reset();
  }
  run.forward = run.model.forward;
  if (run.sharded_model) {
    run.state.fsdp(run.sharded_model.get());
    run.forward = [d = run.sharded_model.get(), fwd = run.model.forward](const at::Tensor& x) {
      return d->forward_with([&] { return fwd(d->cast_input(x)); });
    };
  } else if (t.use_ddp) {
    run.ddp = std::make_unique<DistributedDataParallelBase>(
        run.model.module, pg,
        DistributedDataParallelOptions()
            .bucket_cap_mb(t.cap)
            .online_tuning(default_online_tuning(t.tune_caps, t.tune_pieces))
            .gradient_as_bucket_view(f.on("gradient-as-bucket-view"))
            .find_unused_parameters(f.on("find-unused-parameters")));
    BuiltHook hook = build_ddp_hook(f, t, pg);
    wrap_ddp_hook(f, t, *run.ddp, run.zero, run.optimizer_choice.functional, pg, hook);
    if (hook.hook) run.ddp->register_comm_hook(hook.hook, hook.registered);
    run.averager = std::move(hook.averager);
    run.state.ddp(run.ddp.get()).hook_state(hook.state).replicas_differ(t.hook == "post_local_sgd");
    run.forward = [d = run.ddp.get(), fwd = run.model.forward](const at::Tensor& x) {
      return d->forward_with([&] { return fwd(x); });
    };
  }
  if (!run.sharded_model) run.state.module(run.model.module);
  run.state.optimizer(run.optimizer.get()).zero(run.zero);
}

// Where a run starts: step 0, or a checkpoint's position (--resume).
RunData build_rank(const Flags& f, const TrainFlags& t, const std::shared_ptr<ProcessGroup>& pg, Training& run) {
  torch::manual_seed(f.integer("seed"));
  RunData run_data = load_run_data(f, t.model, t.dataset);
  run.model = build_model(f, t.model, run_data.dims, run_data.data.train.num_classes);
  build_training(f, t, pg, run);
  return run_data;
}

Schedule schedule_for(int64_t n_train, int data_world, const TrainFlags& t) {
  Schedule s;
  s.per_rank = n_train / data_world;
  s.steps_per_epoch = s.per_rank / t.batch;
  if (s.steps_per_epoch < 1) throw UsageError("--batch-size is larger than this rank's share of the data");
  s.total_steps = t.max_steps > 0 ? std::min<int64_t>(t.max_steps, s.steps_per_epoch * t.epochs)
                                  : s.steps_per_epoch * t.epochs;
  return s;
}

std::vector<std::string> checkpoint_settings(const Flags& f) {
  // How the job is run and spread: a checkpoint resumes under other values of these (another
  // world size, another replica count, with or without fault tolerance).
  return f.settings({"nproc", "epochs", "steps", "quiet", "no-eval", "timeout-s", "threads", "gloo-threads",
                     "gloo-connections", "piece-kb", "data-dir", "no-malloc-tuning", "no-divergence-guard",
                     "checkpoint-dir", "checkpoint-every", "resume", "max-restarts", "backend", "report-resources",
                     "fault-tolerant", "replica-groups", "replica-group", "min-replicas", "lighthouse", "step-log", "heal-connections",
                     "cross-lazy-connections", "quorum-mode"});
}

TensorDict checkpoint_extra(const std::vector<std::string>& settings, int64_t epoch, int64_t samples_in_epoch) {
  std::string text;
  for (const auto& line : settings) text += line + "\n";
  return {{"settings", bytes_entry(text)}, {"epoch", int_entry(epoch)}, {"samples_in_epoch", int_entry(samples_in_epoch)}};
}

at::Tensor guard_history_entry(const DivergenceGuard::History& h) {
  return at::tensor({static_cast<double>(h.steps), h.first_window_mean, h.best_window_mean,
                     static_cast<double>(h.best_window_end), h.window_sum, h.window_count, h.window_nonfinite},
                    at::kDouble);
}

DivergenceGuard::History guard_history_of(const at::Tensor& entry) {
  DDPKIT_CHECK(entry.scalar_type() == at::kDouble && entry.numel() == 7,
               "checkpoint: extra/divergence_guard must hold 7 doubles, got ", entry.numel(), " of ", entry.scalar_type());
  const at::Tensor e = entry.contiguous();
  const double* v = e.data_ptr<double>();
  return DivergenceGuard::History{static_cast<int64_t>(v[0]), v[1], v[2], static_cast<int64_t>(v[3]), v[4], v[5], v[6]};
}

StartPoint resume_point(const Flags& f, const TrainFlags& t, Training& run, ProcessGroup* pg,
                        const std::vector<std::string>& settings, int64_t steps_per_epoch, int data_world) {
  std::string settings_text;
  for (const auto& line : settings) settings_text += line + "\n";
  StartPoint start;
  if (!f.on("resume")) return start;
  auto ck = run.state.restore(pg, t.checkpoint_dir);
  if (!ck) return start;
  const std::string what = "checkpoint " + ck->path;
  const std::string saved = bytes_of(ck->common, "extra/settings", what);
  if (saved != settings_text) {
    std::string diff;
    std::istringstream a(saved);
    for (std::string line; std::getline(a, line);)
      if (std::find(settings.begin(), settings.end(), line) == settings.end()) diff += " --" + line;
    throw std::runtime_error(what + " was written with different training flags (" + diff.substr(1) +
                             "): resume with those, or name another --checkpoint-dir");
  }
  if (run.averager) run.averager->set_step(int_of(ck->local, "extra/averager_step", what));
  start.epoch = int_of(ck->common, "extra/epoch", what);
  const int64_t samples = int_of(ck->common, "extra/samples_in_epoch", what);
  // Same world size: the same step. Another: the global sample position, rounded down.
  start.in_epoch = samples / (static_cast<int64_t>(t.batch) * data_world);
  if (start.in_epoch >= steps_per_epoch) {
    ++start.epoch;
    start.in_epoch = 0;
  }
  start.step = start.epoch * steps_per_epoch + start.in_epoch;
  start.resumed_from = ck->step;
  start.common = ck->common;
  start.local = ck->local;
  if (auto it = ck->local.find("extra/divergence_guard"); it != ck->local.end()) start.divergence_guard = it->second;
  if (!pg || pg->rank() == 0)
    std::cerr << "resumed from " << ck->path << " (step " << ck->step << " of " << ck->world_size << " ranks): epoch "
              << start.epoch + 1 << ", step " << start.step << "\n";
  return start;
}

namespace {

// Every rank's resident memory and open descriptors, printed by rank 0 (--report-resources).
void report_resources(ProcessGroup* pg, int64_t step) {
  const int rank = pg ? pg->rank() : 0, world = pg ? pg->size() : 1;
  const ProcessResources mine = process_resources();
  at::Tensor all = at::zeros({world, 2}, at::kDouble);
  all[rank][0] = static_cast<double>(mine.rss_bytes);
  all[rank][1] = static_cast<double>(mine.open_fds);
  if (pg) ProcessGroup::wait(pg->allreduce(all));
  if (rank != 0) return;
  std::ostringstream os;
  os << "resources {\"step\": " << step << ", \"rss_mb\": [";
  for (int r = 0; r < world; ++r)
    os << (r ? ", " : "") << std::fixed << std::setprecision(1) << all[r][0].item<double>() / (1 << 20);
  os << "], \"open_fds\": [";
  for (int r = 0; r < world; ++r) os << (r ? ", " : "") << static_cast<int64_t>(all[r][1].item<double>());
  os << "]}\n";
  std::cerr << os.str();
}

// What the steps measured, per step.
struct StepLog {
  std::vector<double> step_ms, forward_ms, backward_ms, optimizer_ms, minor_faults;
  std::vector<ReducerTimes> reducer;  // each step's Reducer time: the report takes medians
  ReducerTimes reducer_so_far;
  int64_t tuned_from = -1;  // first step after online tuning (-1: none, or not finished)
};

// One step on batch (x, y): forward, backward (gradients averaged across ranks on return), the
// optimizer, timed by phase. Returns the loss.
double train_step(Training& run, bool optimizer_in_hook, const at::Tensor& x, const at::Tensor& y, StepLog& log) {
  using clock = std::chrono::steady_clock;
  auto ms_between = [](clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  const int64_t faults_before = minor_page_faults();
  const auto t0 = clock::now();
  // Set-to-none (PyTorch 2.x's default): autograd then hands over each new gradient instead of
  // zeroing and accumulating into the old one, saving two passes over all gradients.
  for (auto& p : run.params) p.mutable_grad().reset();
  at::Tensor loss = model_loss(run.model, run.forward(x), y);
  const auto t1 = clock::now();
  loss.backward();
  const auto t2 = clock::now();
  if (run.zero) {
    run.zero->step();  // a no-op when overlapped: the hooks stepped during backward
  } else if (!optimizer_in_hook) {
    run.optimizer->step();  // else done per bucket during backward
  }
  if (run.averager) run.averager->average_parameters(run.model.module->parameters());
  const auto t3 = clock::now();
  log.forward_ms.push_back(ms_between(t0, t1));
  log.backward_ms.push_back(ms_between(t1, t2));
  log.optimizer_ms.push_back(ms_between(t2, t3));
  log.minor_faults.push_back(static_cast<double>(minor_page_faults() - faults_before));
  if (run.ddp) {
    const ReducerTimes now = run.ddp->reducer().times();
    const ReducerTimes& was = log.reducer_so_far;
    log.reducer.push_back({now.iterations - was.iterations, now.copy_in_ms - was.copy_in_ms,
                           now.launch_ms - was.launch_ms, now.wait_ms - was.wait_ms, now.copy_out_ms - was.copy_out_ms});
    log.reducer_so_far = now;
  }
  log.step_ms.push_back(ms_between(t0, t3));
  // This step ran with the choice online tuning made at its forward: steady state from here.
  if (log.tuned_from < 0 && run.ddp && run.ddp->online_tuning().done && run.ddp->online_tuning().steps > 0)
    log.tuned_from = static_cast<int64_t>(log.step_ms.size()) - 1;
  return loss.item<double>();
}

// The largest rank's optimizer state, resident-memory high-water mark and PSS peak, and the
// mean PSS peak, into the report.
void gather_memory(Training& run, ProcessGroup* pg, PeakMemorySampler& memory, TrainReport& r) {
  int64_t state_bytes = 0;
  if (run.zero) {
    state_bytes = run.zero->local_state_bytes();
  } else if (run.optimizer) {
    for (const auto& kv : run.optimizer->state())
      for (const auto& t : run.optimizer_choice.factory.state_tensors(*kv.second))
        if (t.defined()) state_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  memory.stop();
  int64_t peak_rss = memory.peak_rss_bytes(), peak_pss = memory.peak_pss_bytes();
  int64_t pss_sum = peak_pss;
  if (pg) {
    at::Tensor sum = at::tensor({static_cast<double>(peak_pss)}, at::kDouble);
    ProcessGroup::wait(pg->allreduce(sum));
    pss_sum = static_cast<int64_t>(sum[0].item<double>());
    at::Tensor b = at::tensor(
        {static_cast<double>(state_bytes), static_cast<double>(peak_rss), static_cast<double>(peak_pss)}, at::kDouble);
    ProcessGroup::wait(pg->allreduce(b, c10d::ReduceOp::MAX));
    state_bytes = static_cast<int64_t>(b[0].item<double>());
    peak_rss = static_cast<int64_t>(b[1].item<double>());
    peak_pss = static_cast<int64_t>(b[2].item<double>());
  }
  r.optimizer_state_bytes = state_bytes;
  r.peak_rss_bytes = peak_rss;
  r.peak_pss_bytes = peak_pss;
  r.mean_peak_pss_bytes = pss_sum / (pg ? pg->size() : 1);
}

// Rank 0's last line: the run as one JSON object (and DDP's bucket and tuning tables).
void print_report(const Flags& f, const TrainFlags& t, Training& run, ProcessGroup* pg, StepLog& log, TrainReport& r) {
  r.hook = t.use_ddp ? t.hook : std::string("local");
  if (t.optimizer_in_hook) r.hook += "+" + t.optimizer + "_in_hook";
  r.zero = t.zero_level == "off" ? "off"
                                 : t.zero_level + (t.zero_overlap == ZeroOverlap::kNone ? "" : "+" + f.str("zero-overlap"));
  r.optimizer = t.optimizer;
  r.model = t.model;
  r.fsdp = t.fsdp_name;
  r.world = pg ? pg->size() : 1;
  r.batch = t.batch;
  r.step_ms = log.step_ms;
  r.forward_ms = log.forward_ms;
  r.backward_ms = log.backward_ms;
  r.optimizer_ms = log.optimizer_ms;
  r.minor_faults = log.minor_faults;
  r.tuned_from = log.tuned_from;
  r.traffic = pg ? pg->stats() : CommStats{};
  r.shared_memory = pg && pg->uses_shared_memory() ? (pg->hierarchical() ? "hierarchical" : "host") : "";
  r.piece_kb = pg ? pg->piece_bytes() / 1024 : 0;
  if (run.ddp) {
    const std::string table = bucket_traffic_table(*run.ddp, r.steps_run, &r.compression_ratio);
    if (!f.on("quiet")) std::cerr << table;
    if (!run.ddp->online_tuning().trials.empty()) std::cerr << tuning_table(run.ddp->online_tuning());
    r.bucket_cap_mb = static_cast<double>(run.ddp->reducer().bucket_cap()) / (1 << 20);
    r.tuning = &run.ddp->online_tuning();
    r.reducer = log.reducer;
  }
  std::cout << report_json(r) << std::endl;
}

// Rank 0's line after each epoch: mean loss, and the test set's accuracy (or perplexity).
void print_epoch(int epoch, double mean_loss, const TestScore& score, bool language_model) {
  std::cerr << "epoch " << epoch + 1 << ": mean loss " << std::fixed << std::setprecision(4) << mean_loss;
  if (score.accuracy >= 0) std::cerr << "  test accuracy " << std::setprecision(4) << score.accuracy;
  if (language_model && score.loss >= 0) std::cerr << "  test loss " << score.loss << "  perplexity " << std::exp(score.loss);
  std::cerr << "\n";
}

}  // namespace

int run_train(const std::vector<std::string>& args, const std::vector<std::string>& argv) {
  const Flags f = parse_train_flags(args);
  const TrainFlags t = check_train_flags(f);
  if (t.fault_tolerant) {
#if DDPKIT_WITH_PS
    return run_fault_tolerant(f, t, argv);
#else
    throw UsageError("--fault-tolerant needs a ddpkit built with gRPC (its lighthouse): scripts/install-deps.sh");
#endif
  }
  // Restarted ranks resume from the newest checkpoint (--resume starts afresh when there is none).
  if (t.use_ddp && !in_distributed_env())
    return launch_local(t.nproc, argv, "/proc/self/exe", t.max_restarts,
                        t.checkpoint_dir.empty() ? std::vector<std::string>{} : std::vector<std::string>{"--resume"});

  // With checkpoints, SIGTERM/SIGUSR1 mean "checkpoint now and exit for a requeue": caught from
  // before the rendezvous, so a signal during start-up is not the default's sudden death.
  std::unique_ptr<PreemptionWatch> preemption;
  if (!t.checkpoint_dir.empty()) preemption = std::make_unique<PreemptionWatch>();
  PeakMemorySampler memory;  // this rank's peak with shared pages counted in proportion (PSS)
  set_compute_threads(t.threads);
  std::shared_ptr<ProcessGroup> pg = t.use_ddp ? join_group(f, t) : nullptr;
  const int rank = pg ? pg->rank() : 0, world = pg ? pg->size() : 1;
  const bool lead = rank == 0;
  Training run;
  RunData run_data = build_rank(f, t, pg, run);
  Split& data = run_data.data;

  const int64_t n_train = data.train.inputs.size(0);
  const Schedule schedule = schedule_for(n_train, world, t);
  // DistributedSampler: one permutation per epoch for all ranks (same seed), rank r takes r, r+W, ...
  ReplicaGroupSampler sampler(n_train, ReplicaGroupSamplerOptions()
                                           .batch_size(t.batch)
                                           .group_size(world)
                                           .group_rank(rank)
                                           .seed(static_cast<uint64_t>(f.integer("seed"))));
  const int64_t steps_per_epoch = schedule.steps_per_epoch,
                total_steps = schedule.total_steps;
  const int run_epochs = static_cast<int>((total_steps + steps_per_epoch - 1) / steps_per_epoch);

  // The flags that decide the arithmetic: a checkpoint resumes only under the same ones.
  const auto settings = checkpoint_settings(f);
  const StartPoint start = resume_point(f, t, run, pg.get(), settings, steps_per_epoch, world);
  int64_t step = start.step;
  TrainReport report;
  // Every rank checks the loss every 20 steps, together: a diverged run stops with advice. A
  // resumed run's guard carries on from the checkpoint's (where training started, the best so far).
  std::unique_ptr<DivergenceGuard> guard;
  if (!f.on("no-divergence-guard")) guard = std::make_unique<DivergenceGuard>(pg);
  if (guard && start.divergence_guard.defined()) guard->restore(guard_history_of(start.divergence_guard));
  auto write_checkpoint = [&](int64_t epoch, int64_t in_epoch) {
    TensorDict extra_local;
    if (run.averager) extra_local["averager_step"] = int_entry(run.averager->step());
    if (guard) extra_local["divergence_guard"] = guard_history_entry(guard->history());
    run.state.save(pg.get(), t.checkpoint_dir, step, checkpoint_extra(settings, epoch, in_epoch * t.batch * world),
                   extra_local);
    ++report.checkpoints_written;
  };

  Progress progress(lead && !f.on("quiet"));
  StepLog log;
  TestScore score{-1, -1};  // -1: not measured
  double last_loss = 0, train_seconds = 0;
  if (run.ddp) run.ddp->reducer().reset_traffic();
  for (int epoch = static_cast<int>(start.epoch); epoch < run_epochs && step < total_steps; ++epoch) {
    double epoch_loss = 0;
    int64_t epoch_steps = 0;
    const auto epoch_start = std::chrono::steady_clock::now();
    for (int64_t i = epoch == start.epoch ? start.in_epoch : 0; i < steps_per_epoch && step < total_steps;) {
      at::Tensor idx = sampler.batch(epoch * steps_per_epoch + i);
      // Text is held as bytes (a tenth of int64's memory per rank) and widened per batch.
      at::Tensor x = data.train.inputs.index_select(0, idx), y = data.train.labels.index_select(0, idx);
      if (run.model.language_model) x = x.to(at::kLong), y = y.to(at::kLong);
      last_loss = train_step(run, t.optimizer_in_hook, x, y, log);
      if (guard) {
        if (auto d = guard->observe(last_loss)) throw std::runtime_error(divergence_message(f, *d, t.powersgd_rank, t.lr));
      }
      epoch_loss += last_loss;
      ++epoch_steps;
      ++i;
      ++step;
      const bool scheduled = step % t.checkpoint_every == 0 || step == total_steps;
      if (!t.checkpoint_dir.empty() && scheduled) write_checkpoint(epoch, i);
      if (preemption && preemption->stop_now(pg.get())) {
        if (!scheduled) write_checkpoint(epoch, i);
        progress.finish();
        if (lead)
          std::cerr << "ddpkit: preempted (" << (preemption->received() ? strsignal(preemption->received()) : "a signal")
                    << (preemption->received() ? "" : " on another rank") << "): checkpoint of step " << step
                    << " written to " << t.checkpoint_dir << "; exiting with status " << kPreemptedExitCode
                    << " for the engine to run the job again (--resume continues from it)\n";
        if (pg) ProcessGroup::wait(pg->barrier());
        return kPreemptedExitCode;
      }
      if (t.report_every > 0 && step % t.report_every == 0) report_resources(pg.get(), step);
      progress.update("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(run_epochs), i,
                      std::min<int64_t>(steps_per_epoch, total_steps - (step - i)), last_loss, median(log.step_ms));
    }
    train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start).count();
    progress.finish();
    if (!f.on("no-eval")) score = evaluate(run.model, data.test, run.sharded_model.get(), pg.get());
    if (lead) print_epoch(epoch, epoch_loss / std::max<int64_t>(epoch_steps, 1), score, run.model.language_model);
  }
  report.steps = step;
  report.steps_run = step - start.step;
  report.train_seconds = train_seconds;
  report.accuracy = score.accuracy;
  if (run.model.language_model && score.loss >= 0) report.test_perplexity = std::exp(score.loss);
  report.final_loss = last_loss;
  report.resumed_from = start.resumed_from;
  gather_memory(run, pg.get(), memory, report);
  if (lead) print_report(f, t, run, pg.get(), log, report);
  if (pg) ProcessGroup::wait(pg->barrier());
  return 0;
}

}  // namespace cli
}  // namespace ddpkit
