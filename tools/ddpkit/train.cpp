// `ddpkit train`: data-parallel training of an MLP or CNN on Fashion-MNIST or synthetic data.
#include "cli.h"
#include "training.h"

#include <torch/torch.h>
#include <ddpkit/ddpkit.h>
#include <ddpkit/runtime/memory_sampler.h>
#include <ddpkit/training/divergence_guard.h>

#include <ATen/CPUGeneratorImpl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace ddpkit {
namespace cli {
namespace {

// This process's minor page faults so far (each step's count goes in the JSON summary).
int64_t minor_page_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_minflt);
}

}  // namespace

const char* kTrainUsage = R"(usage: ddpkit train [flags]

Trains data-parallel across --nproc local processes (or joins a torchrun-style environment:
MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE). Rank 0 prints progress, per-epoch loss and test
accuracy, and a last line that is one JSON object.

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
  --checkpoint-every N    every N steps, and after the last (default 100)
  --resume                continue from the newest complete checkpoint in DIR (none: start afresh);
                          the training flags must match the ones it was written with
  --max-restarts K        when a rank dies or fails, stop every rank and start a new set that
                          resumes from the newest checkpoint, up to K times (torchrun's meaning)
)";

int run_train(const std::vector<std::string>& args, const std::vector<std::string>& argv) {
  Flags f(args,
          with_model_flag_defaults(
              {{"nproc", "2"}, {"fsdp", "off"}, {"fsdp-param-dtype", "fp32"}, {"fsdp-reduce-dtype", ""},
               {"hook", "none"}, {"bucket-cap-mb", ""}, {"epochs", "3"}, {"steps", "0"}, {"lr", ""}, {"seed", "1"},
               {"backend", "gloo"}, {"timeout-s", "300"}, {"gloo-threads", "2"}, {"two-phase-min-mb", "0"},
               {"gloo-connections", "1"}, {"piece-kb", "1024"}, {"powersgd-rank", ""},
               {"powersgd-start-iter", "10"}, {"powersgd-min-compression-rate", "2"}, {"powersgd-epsilon", "0"},
               {"powersgd-seed", "0"}, {"int8-block", "512"}, {"perchannel-bucket-size", "512"},
               {"local-sgd-start-iter", "100"}, {"local-sgd-period", "4"}, {"local-sgd-group-size", "0"},
               {"zero", "off"}, {"zero-overlap", "none"}, {"zero-precision", "fp32"}, {"checkpoint-dir", ""},
               {"checkpoint-every", "100"}, {"max-restarts", "0"}, {"report-resources", "0"}}),
          {"gradient-as-bucket-view", "find-unused-parameters", "no-ddp", "no-eval", "quiet", "no-malloc-tuning",
           "powersgd-batch-same-shape", "no-error-feedback", "no-warm-start", "int8-error-feedback",
           "optimizer-in-hook", "zero-shard-buckets", "zero-bucket-view", "no-divergence-guard", "resume"});
  const std::string model_name = f.str("model"), hook_name = f.str("hook");
  const std::string dataset = checked_dataset(f, model_name);
  const std::string fsdp_name = f.str("fsdp");
  const bool use_fsdp = fsdp_name != "off";
  ShardingStrategy fsdp_strategy = ShardingStrategy::kFullShard;
  if (use_fsdp) {
    try {
      fsdp_strategy = parse_sharding_strategy(fsdp_name);
    } catch (const c10::Error&) {
      throw UsageError("--fsdp must be off, full_shard, shard_grad_op, no_shard or hybrid_shard, got '" + fsdp_name + "'");
    }
    if (hook_name != "none" && hook_name != "fp16" && hook_name != "bf16")
      throw UsageError("--fsdp takes --hook none, fp16 or bf16 (its FSDP hooks), got '" + hook_name + "'");
    for (const char* flag : {"zero-shard-buckets", "zero-bucket-view", "optimizer-in-hook", "gradient-as-bucket-view",
                             "find-unused-parameters", "no-ddp"})
      if (f.on(flag)) throw UsageError(std::string("--") + flag + " does not apply to --fsdp");
    if (f.str("zero") != "off") throw UsageError("--fsdp shards the optimizer state itself: drop --zero");
  }
  auto fsdp_dtype = [&](const std::string& flag) -> c10::optional<at::ScalarType> {
    const std::string v = f.str(flag);
    if (v.empty()) return c10::nullopt;
    if (v == "fp32") return at::kFloat;
    if (v == "bf16") return at::kBFloat16;
    throw UsageError("--" + flag + " must be fp32 or bf16, got '" + v + "'");
  };
  if (hook_name != "none" && hook_name != "post_local_sgd") {
    const auto names = hooks::hook_names();
    if (std::find(names.begin(), names.end(), hook_name) == names.end()) {
      std::string known = "none";
      for (const auto& n : names) known += ", " + n;
      throw UsageError("--hook '" + hook_name + "' is unknown (" + known + ", post_local_sgd)");
    }
  }
  const std::string optimizer_name = f.str("optimizer");
  if (optimizer_name != "sgd" && optimizer_name != "adam" && optimizer_name != "adamw")
    throw UsageError("--optimizer must be sgd, adam or adamw, got '" + optimizer_name + "'");
  const int nproc = f.integer("nproc"), epochs = f.integer("epochs"), max_steps = f.integer("steps");
  const int batch = f.integer("batch-size"), threads = f.integer("threads");
  const double lr = !f.str("lr").empty() ? f.real("lr") : optimizer_name == "sgd" ? 0.05 : 1e-3;
  // auto: start from the default, then trial others during the first steps (online_tuning.h).
  const bool tune_caps = f.str("bucket-cap-mb") == "auto", tune_pieces = f.str("piece-kb") == "auto";
  const double cap = f.str("bucket-cap-mb").empty() || tune_caps ? hooks::default_bucket_cap_mb(hook_name)
                                                                  : f.real("bucket-cap-mb");
  const int piece_kb = tune_pieces ? 1024 : f.integer("piece-kb");
  if ((tune_caps || tune_pieces) && (f.str("zero") == "2" || f.str("zero-overlap") != "none" || f.str("fsdp") != "off" ||
                                     f.on("no-ddp")))
    throw UsageError("--bucket-cap-mb/--piece-kb auto tune DDP's buckets: not with --fsdp, --no-ddp, --zero 2 or "
                     "--zero-overlap (which lay their buckets out once); give numbers");
  if (tune_pieces && !hooks::moves_pieces(hook_name) && f.real("two-phase-min-mb") <= 0)
    throw UsageError("--piece-kb auto: --hook " + hook_name +
                     " moves no two-phase pieces (fp16, bf16, int8 and quantize hooks do, or --two-phase-min-mb)");
  if (nproc < 1) throw UsageError("--nproc must be >= 1");
  if (epochs < 1) throw UsageError("--epochs must be >= 1");
  if (max_steps < 0) throw UsageError("--steps must be >= 0");
  if (batch < 1) throw UsageError("--batch-size must be >= 1");
  if (threads < 1) throw UsageError("--threads must be >= 1");
  if (!(lr > 0)) throw UsageError("--lr must be positive");
  if (!(cap > 0)) throw UsageError("--bucket-cap-mb must be positive");
  const int64_t powersgd_rank =
      f.str("powersgd-rank").empty() ? hooks::default_powersgd_rank(hook_name) : f.integer("powersgd-rank");
  if (powersgd_rank < 1) throw UsageError("--powersgd-rank must be >= 1");
  if (f.integer("powersgd-start-iter") < 0) throw UsageError("--powersgd-start-iter must be >= 0");
  if (f.integer("int8-block") < 16 || f.integer("int8-block") % 16) throw UsageError("--int8-block must be a positive multiple of 16");
  if (f.integer("perchannel-bucket-size") < 1) throw UsageError("--perchannel-bucket-size must be >= 1");
  if (f.integer("local-sgd-start-iter") < 0) throw UsageError("--local-sgd-start-iter must be >= 0");
  if (f.integer("local-sgd-period") < 1) throw UsageError("--local-sgd-period must be >= 1");
  if (f.integer("local-sgd-group-size") < 0) throw UsageError("--local-sgd-group-size must be >= 0");
  const bool use_ddp = !f.on("no-ddp");

  const std::string checkpoint_dir = f.str("checkpoint-dir");
  const int checkpoint_every = f.integer("checkpoint-every"), max_restarts = f.integer("max-restarts");
  if (checkpoint_every < 1) throw UsageError("--checkpoint-every must be >= 1");
  if (max_restarts < 0) throw UsageError("--max-restarts must be >= 0");
  if (checkpoint_dir.empty() && f.on("resume")) throw UsageError("--resume needs --checkpoint-dir");
  if (!checkpoint_dir.empty() && f.on("optimizer-in-hook"))
    throw UsageError("--checkpoint-dir does not save the per-parameter optimizer state of --optimizer-in-hook");
  if (!checkpoint_dir.empty() && !f.on("resume") && (!in_distributed_env() || std::getenv("RANK") == std::string("0"))) {
    const auto existing = list_checkpoints(checkpoint_dir);
    if (!existing.empty())
      throw UsageError("--checkpoint-dir " + checkpoint_dir + " already holds checkpoints (newest " + existing.front() +
                       "): add --resume to continue that run, or name another directory");
  }
  if (max_restarts > 0 && checkpoint_dir.empty())
    std::cerr << "ddpkit: --max-restarts without --checkpoint-dir restarts training from step 0\n";
  // Restarted ranks resume from the newest checkpoint (--resume starts afresh when there is none).
  if (use_ddp && !in_distributed_env())
    return launch_local(nproc, argv, "/proc/self/exe", max_restarts,
                        checkpoint_dir.empty() ? std::vector<std::string>{} : std::vector<std::string>{"--resume"});

  PeakMemorySampler memory;  // this rank's peak with shared pages counted in proportion (PSS)
  set_compute_threads(threads);
  std::shared_ptr<ProcessGroup> pg;
  if (use_ddp) {
    if (f.integer("gloo-threads") < 1) throw UsageError("--gloo-threads must be >= 1");
    if (f.integer("gloo-connections") < 1) throw UsageError("--gloo-connections must be >= 1");
    if (f.real("two-phase-min-mb") < 0) throw UsageError("--two-phase-min-mb must be >= 0");
    if (piece_kb < 1) throw UsageError("--piece-kb must be >= 1");
    pg = init_process_group(InitOptions()
                                .backend(f.str("backend"))
                                .timeout(std::chrono::seconds(f.integer("timeout-s")))
                                .gloo_threads(f.integer("gloo-threads"))
                                .gloo_connections(f.integer("gloo-connections"))
                                .two_phase_min_bytes(static_cast<int64_t>(f.real("two-phase-min-mb") * 1024 * 1024))
                                .piece_bytes(int64_t{piece_kb} * 1024));
  }
  const int rank = pg ? pg->rank() : 0, world = pg ? pg->size() : 1;
  const bool lead = rank == 0;
  torch::manual_seed(f.integer("seed"));

  RunData run_data = load_run_data(f, model_name, dataset);
  Split& data = run_data.data;
  Model model = build_model(f, model_name, run_data.dims, data.train.num_classes);
  // FSDP: each listed submodule of at least --fsdp-min-unit-params parameters is a unit.
  std::unique_ptr<FullyShardedDataParallelBase> sharded_model;
  if (use_fsdp) {
    const int64_t min_unit = f.integer("fsdp-min-unit-params");
    if (min_unit < 1) throw UsageError("--fsdp-min-unit-params must be >= 1");
    std::vector<std::shared_ptr<torch::nn::Module>> units;
    for (const auto& u : model.units) {
      int64_t n = 0;
      for (const auto& p : u->parameters()) n += p.numel();
      if (n >= min_unit) units.push_back(u);
    }
    MixedPrecision mp;
    mp.param_dtype(fsdp_dtype("fsdp-param-dtype")).reduce_dtype(fsdp_dtype("fsdp-reduce-dtype"));
    sharded_model = std::make_unique<FullyShardedDataParallelBase>(
        model.module, pg,
        FullyShardedDataParallelOptions().sharding_strategy(fsdp_strategy).mixed_precision(mp).auto_wrap_policy(nullptr).unit_modules(units));
    if (hook_name == "fp16" || hook_name == "bf16") {
      auto state = std::make_shared<fsdp::LowPrecisionState>(sharded_model->shard_group(), mp.reduce_dtype().value_or(mp.param_dtype().value_or(at::kFloat)));
      // The low-precision hooks reduce-scatter under sharded strategies and allreduce under kNoShard.
      auto fn = hook_name == "fp16" ? fsdp::fp16_compress_hook : fsdp::bf16_compress_hook;
      if (fsdp_strategy == ShardingStrategy::kNoShard)
        sharded_model->register_comm_hook(FsdpAllreduceHook{[state, fn](const at::Tensor& g) { return fn(*state, g, at::Tensor()); }},
                                          hook_name);
      else
        sharded_model->register_comm_hook(
            FsdpReduceScatterHook{[state, fn](const at::Tensor& g, const at::Tensor& out) { return fn(*state, g, out); }}, hook_name);
    }
  }

  // One options object per optimizer feeds the plain optimizer, ZeRO's factory and the
  // per-parameter twin for --optimizer-in-hook.
  const OptimizerChoice optimizer_choice = choose_optimizer(optimizer_name, lr);
  const OptimizerFactory& factory = optimizer_choice.factory;
  const std::shared_ptr<hooks::FunctionalOptimizer>& functional = optimizer_choice.functional;
  // What the optimizer steps: the parameters, or FSDP's shards of them.
  const auto params = sharded_model ? sharded_model->parameters() : model.module->parameters();
  std::unique_ptr<torch::optim::Optimizer> optimizer = factory.create({torch::optim::OptimizerParamGroup(params)});

  std::unique_ptr<DistributedDataParallelBase> ddp;
  std::unique_ptr<hooks::PeriodicModelAverager> averager;
  TrainingState training_state;
  const bool optimizer_in_hook = f.on("optimizer-in-hook");
  if (optimizer_in_hook && !use_ddp) throw UsageError("--optimizer-in-hook needs DDP (drop --no-ddp)");
  const std::string zero_level = f.str("zero");
  if (zero_level != "off" && zero_level != "1" && zero_level != "2")
    throw UsageError("--zero must be off, 1 or 2, got '" + zero_level + "'");
  const ZeroOverlap zero_overlap = [&] {
    try {
      return parse_zero_overlap(f.str("zero-overlap"));
    } catch (const c10::Error&) {
      throw UsageError("--zero-overlap must be none, step or interleaved, got '" + f.str("zero-overlap") + "'");
    }
  }();
  std::shared_ptr<ZeroRedundancyOptimizer> zero;
  if (zero_level != "off") {
    if (!use_ddp) throw UsageError("--zero needs DDP (drop --no-ddp)");
    if (optimizer_in_hook) throw UsageError("--zero and --optimizer-in-hook both step inside the hook: pick one");
    if (hook_name == "post_local_sgd") throw UsageError("--zero does not combine with --hook post_local_sgd");
    if (zero_level == "2" && hook_name != "none")
      throw UsageError("--zero 2 communicates by reduce-scatter: drop --hook (use --zero-precision fp16|bf16)");
    zero = std::make_shared<ZeroRedundancyOptimizer>(
        params, factory, pg,
        ZeroOptions()
            .overlap_with_ddp(zero_overlap != ZeroOverlap::kNone)
            .parameters_as_bucket_view(f.on("zero-bucket-view")));
    optimizer.reset();
  } else if (zero_overlap != ZeroOverlap::kNone || f.on("zero-shard-buckets") || f.on("zero-bucket-view")) {
    throw UsageError("--zero-overlap, --zero-shard-buckets and --zero-bucket-view need --zero 1 or 2");
  }
  std::function<at::Tensor(const at::Tensor&)> train_forward = model.forward;
  if (sharded_model) {
    training_state.fsdp(sharded_model.get());
    train_forward = [d = sharded_model.get(), fwd = model.forward](const at::Tensor& x) {
      return d->forward_with([&] { return fwd(d->cast_input(x)); });
    };
  } else if (use_ddp) {
    ddp = std::make_unique<DistributedDataParallelBase>(
        model.module, pg,
        DistributedDataParallelOptions()
            .bucket_cap_mb(cap)
            .online_tuning(default_online_tuning(tune_caps, tune_pieces))
            .gradient_as_bucket_view(f.on("gradient-as-bucket-view"))
            .find_unused_parameters(f.on("find-unused-parameters")));
    CommHook hook;
    std::string registered = hook_name;
    std::shared_ptr<hooks::HookState> hook_state;
    if (hook_name == "post_local_sgd") {
      const int group = f.integer("local-sgd-group-size");
      if (group > 0 && world % group != 0)
        throw UsageError("--local-sgd-group-size " + std::to_string(group) + " does not divide the world size " + std::to_string(world));
      auto state = std::make_shared<hooks::PostLocalSGDState>(pg, group > 0 ? new_subgroups(*pg, group) : nullptr,
                                                              f.integer("local-sgd-start-iter"));
      hook = hooks::post_localSGD_hook(state);
      hook_state = state;
      averager = std::make_unique<hooks::PeriodicModelAverager>(f.integer("local-sgd-period"), f.integer("local-sgd-start-iter"), pg);
    } else if (hook_name != "none") {
      hooks::HookOptions ho;
      ho.powersgd(hooks::PowerSGDOptions()
                      .matrix_approximation_rank(powersgd_rank)
                      .start_powerSGD_iter(f.integer("powersgd-start-iter"))
                      .min_compression_rate(f.real("powersgd-min-compression-rate"))
                      .orthogonalization_epsilon(f.real("powersgd-epsilon"))
                      .random_seed(static_cast<uint64_t>(f.integer("powersgd-seed")))
                      .batch_tensors_with_same_shape(f.on("powersgd-batch-same-shape"))
                      .use_error_feedback(!f.on("no-error-feedback"))
                      .warm_start(!f.on("no-warm-start")));
      ho.int8(hooks::Int8Options().block(f.integer("int8-block")).error_feedback(f.on("int8-error-feedback")));
      ho.perchannel_bucket_size(f.integer("perchannel-bucket-size"));
      auto built = hooks::build_hook(hook_name, pg, ho);
      hook = built.hook;
      hook_state = built.state;
    }
    if (zero && zero_level == "2") {
      hook = zero2_hook(*ddp, zero, fsdp_sharded_reduce(pg, f.str("zero-precision")), zero_overlap);
      registered = "zero2_" + f.str("zero-precision");
    } else if (zero && zero_overlap != ZeroOverlap::kNone) {
      if (!hook) {
        hook = hooks::allreduce_hook(pg);
        registered = "allreduce";
      }
      hook = zero_overlap == ZeroOverlap::kStep ? hook_with_zero_step(hook, *ddp, zero, f.on("zero-shard-buckets"))
                                                 : hook_with_zero_step_interleaved(hook, *ddp, zero, f.on("zero-shard-buckets"));
      registered += "+zero_" + f.str("zero-overlap");
    }
    if (optimizer_in_hook) {
      if (!hook) {
        hook = hooks::allreduce_hook(pg);
        registered = "allreduce";
      }
      hook = hooks::optimizer_after_hook(hook, functional);
      registered += "+" + optimizer_name;
    }
    if (hook) ddp->register_comm_hook(hook, registered);
    training_state.ddp(ddp.get()).hook_state(hook_state).replicas_differ(hook_name == "post_local_sgd");
    train_forward = [d = ddp.get(), fwd = model.forward](const at::Tensor& x) {
      return d->forward_with([&] { return fwd(x); });
    };
  }

  const int64_t n_train = data.train.inputs.size(0);
  const int64_t per_rank = n_train / world;
  const int64_t steps_per_epoch = per_rank / batch;
  if (steps_per_epoch < 1) throw UsageError("--batch-size is larger than this rank's share of the data");
  const int64_t total_steps = max_steps > 0 ? std::min<int64_t>(max_steps, steps_per_epoch * epochs) : steps_per_epoch * epochs;
  const int run_epochs = static_cast<int>((total_steps + steps_per_epoch - 1) / steps_per_epoch);

  // The flags that decide the arithmetic: a checkpoint resumes only under the same ones.
  const auto settings = f.settings({"nproc", "epochs", "steps", "quiet", "no-eval", "timeout-s", "threads",
                                    "gloo-threads", "gloo-connections", "piece-kb", "data-dir", "no-malloc-tuning",
                                    "no-divergence-guard", "checkpoint-dir", "checkpoint-every", "resume",
                                    "max-restarts", "backend", "report-resources"});
  std::string settings_text;
  for (const auto& line : settings) settings_text += line + "\n";
  if (!sharded_model) training_state.module(model.module);
  training_state.optimizer(optimizer.get()).zero(zero);
  int64_t step = 0, start_epoch = 0, start_in_epoch = 0, resumed_from = -1;
  if (f.on("resume")) {
    if (auto ck = training_state.restore(pg.get(), checkpoint_dir)) {
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
      if (averager) averager->set_step(int_of(ck->local, "extra/averager_step", what));
      start_epoch = int_of(ck->common, "extra/epoch", what);
      const int64_t samples = int_of(ck->common, "extra/samples_in_epoch", what);
      // Same world size: the same step. Another: the global sample position, rounded down.
      start_in_epoch = samples / (static_cast<int64_t>(batch) * world);
      if (start_in_epoch >= steps_per_epoch) {
        ++start_epoch;
        start_in_epoch = 0;
      }
      step = start_epoch * steps_per_epoch + start_in_epoch;
      resumed_from = ck->step;
      if (lead)
        std::cerr << "resumed from " << ck->path << " (step " << ck->step << " of " << ck->world_size
                  << " ranks): epoch " << start_epoch + 1 << ", step " << step << "\n";
    }
  }
  const int report_every = f.integer("report-resources");
  if (report_every < 0) throw UsageError("--report-resources must be >= 0");
  auto report_resources = [&] {
    const ProcessResources mine = process_resources();
    at::Tensor all = at::zeros({world, 2}, at::kDouble);
    all[rank][0] = static_cast<double>(mine.rss_bytes);
    all[rank][1] = static_cast<double>(mine.open_fds);
    if (pg) ProcessGroup::wait(pg->allreduce(all));
    if (!lead) return;
    std::ostringstream os;
    os << "resources {\"step\": " << step << ", \"rss_mb\": [";
    for (int r = 0; r < world; ++r) os << (r ? ", " : "") << std::fixed << std::setprecision(1) << all[r][0].item<double>() / (1 << 20);
    os << "], \"open_fds\": [";
    for (int r = 0; r < world; ++r) os << (r ? ", " : "") << static_cast<int64_t>(all[r][1].item<double>());
    os << "]}\n";
    std::cerr << os.str();
  };
  int checkpoints_written = 0;
  auto write_checkpoint = [&](int64_t epoch, int64_t in_epoch) {
    TensorDict extra{{"settings", bytes_entry(settings_text)},
                     {"epoch", int_entry(epoch)},
                     {"samples_in_epoch", int_entry(in_epoch * batch * world)}};
    TensorDict extra_local;
    if (averager) extra_local["averager_step"] = int_entry(averager->step());
    training_state.save(pg.get(), checkpoint_dir, step, extra, extra_local);
    ++checkpoints_written;
  };

  auto loss_of = [&](const at::Tensor& out, const at::Tensor& y) { return model_loss(model, out, y); };
  Progress progress(lead && !f.on("quiet"));
  // Every rank checks the loss every 20 steps, together: a diverged run stops with advice.
  std::unique_ptr<DivergenceGuard> guard;
  if (!f.on("no-divergence-guard")) guard = std::make_unique<DivergenceGuard>(pg);
  std::vector<double> step_ms, forward_ms, backward_ms, optimizer_ms, minor_faults;
  int64_t tuned_from = -1;  // first step after online tuning (-1: none, or not finished)
  double accuracy = -1, test_loss = -1, last_loss = 0;
  const int64_t first_step = step;
  double train_seconds = 0;
  if (ddp) ddp->reducer().reset_traffic();
  std::vector<ReducerTimes> reducer_steps;  // each step's Reducer time: the report takes medians
  ReducerTimes reducer_so_far;
  for (int epoch = static_cast<int>(start_epoch); epoch < run_epochs && step < total_steps; ++epoch) {
    // DistributedSampler: one permutation for all ranks (same seed), rank r takes r, r+W, ...
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(f.integer("seed")) * 1000 + epoch);
    at::Tensor perm = at::randperm(n_train, gen, at::kLong).slice(0, rank, world * per_rank, world);
    double epoch_loss = 0;
    int64_t epoch_steps = 0;
    const auto epoch_start = std::chrono::steady_clock::now();
    for (int64_t i = epoch == start_epoch ? start_in_epoch : 0; i < steps_per_epoch && step < total_steps;) {
      at::Tensor idx = perm.slice(0, i * batch, (i + 1) * batch);
      // Text is held as bytes (a tenth of int64's memory per rank) and widened per batch.
      at::Tensor x = data.train.inputs.index_select(0, idx), y = data.train.labels.index_select(0, idx);
      if (model.language_model) x = x.to(at::kLong), y = y.to(at::kLong);
      using clock = std::chrono::steady_clock;
      auto ms_between = [](clock::time_point a, clock::time_point b) {
        return std::chrono::duration<double, std::milli>(b - a).count();
      };
      const int64_t faults_before = minor_page_faults();
      const auto t0 = clock::now();
      // Set-to-none (PyTorch 2.x's default): autograd then hands over each new gradient instead of
      // zeroing and accumulating into the old one, saving two passes over all gradients.
      for (auto& p : params) p.mutable_grad().reset();
      at::Tensor loss = loss_of(train_forward(x), y);
      const auto t1 = clock::now();
      loss.backward();  // returns once gradients are averaged across ranks
      const auto t2 = clock::now();
      if (zero) {
        zero->step();  // a no-op when overlapped: the hooks stepped during backward
      } else if (!optimizer_in_hook) {
        optimizer->step();  // else done per bucket during backward
      }
      if (averager) averager->average_parameters(model.module->parameters());
      const auto t3 = clock::now();
      forward_ms.push_back(ms_between(t0, t1));
      backward_ms.push_back(ms_between(t1, t2));
      optimizer_ms.push_back(ms_between(t2, t3));
      minor_faults.push_back(static_cast<double>(minor_page_faults() - faults_before));
      if (ddp) {
        const ReducerTimes now = ddp->reducer().times();
        reducer_steps.push_back({now.iterations - reducer_so_far.iterations, now.copy_in_ms - reducer_so_far.copy_in_ms,
                                 now.launch_ms - reducer_so_far.launch_ms, now.wait_ms - reducer_so_far.wait_ms,
                                 now.copy_out_ms - reducer_so_far.copy_out_ms});
        reducer_so_far = now;
      }
      const double ms = ms_between(t0, t3);
      step_ms.push_back(ms);
      // This step ran with the choice online tuning made at its forward: steady state from here.
      if (tuned_from < 0 && ddp && ddp->online_tuning().done && ddp->online_tuning().steps > 0)
        tuned_from = static_cast<int64_t>(step_ms.size()) - 1;
      last_loss = loss.item<double>();
      if (guard) {
        if (auto d = guard->observe(last_loss)) throw std::runtime_error(divergence_message(f, *d, powersgd_rank, lr));
      }
      epoch_loss += last_loss;
      ++epoch_steps;
      ++i;
      ++step;
      if (!checkpoint_dir.empty() && (step % checkpoint_every == 0 || step == total_steps)) write_checkpoint(epoch, i);
      if (report_every > 0 && step % report_every == 0) report_resources();
      progress.update("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(run_epochs), i,
                      std::min<int64_t>(steps_per_epoch, total_steps - (step - i)), last_loss, median(step_ms));
    }
    train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start).count();
    progress.finish();
    if (!f.on("no-eval")) {
      const TestScore score = evaluate(model, data.test, sharded_model.get(), pg.get());
      accuracy = score.accuracy;
      test_loss = score.loss;
    }
    if (lead) {
      std::cerr << "epoch " << epoch + 1 << ": mean loss " << std::fixed << std::setprecision(4)
                << epoch_loss / std::max<int64_t>(epoch_steps, 1);
      if (accuracy >= 0) std::cerr << "  test accuracy " << std::setprecision(4) << accuracy;
      if (model.language_model && test_loss >= 0)
        std::cerr << "  test loss " << test_loss << "  perplexity " << std::exp(test_loss);
      std::cerr << "\n";
    }
  }
  const int64_t steps_run = step - first_step;
  const CommStats traffic = pg ? pg->stats() : CommStats{};
  // Optimizer state held by each rank (the largest over ranks), in bytes.
  int64_t state_bytes = 0;
  if (zero) {
    state_bytes = zero->local_state_bytes();
  } else {
    if (optimizer)
      for (const auto& kv : optimizer->state())
        for (const auto& t : factory.state_tensors(*kv.second))
          if (t.defined()) state_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  // The largest rank's optimizer state, resident-memory high-water mark and PSS peak.
  memory.stop();
  int64_t peak_rss = memory.peak_rss_bytes(), peak_pss = memory.peak_pss_bytes();
  int64_t pss_sum = peak_pss;
  if (pg) {
    at::Tensor sum = at::tensor({static_cast<double>(peak_pss)}, at::kDouble);
    ProcessGroup::wait(pg->allreduce(sum));
    pss_sum = static_cast<int64_t>(sum[0].item<double>());
    at::Tensor b = at::tensor({static_cast<double>(state_bytes), static_cast<double>(peak_rss), static_cast<double>(peak_pss)},
                              at::kDouble);
    ProcessGroup::wait(pg->allreduce(b, c10d::ReduceOp::MAX));
    state_bytes = static_cast<int64_t>(b[0].item<double>());
    peak_rss = static_cast<int64_t>(b[1].item<double>());
    peak_pss = static_cast<int64_t>(b[2].item<double>());
  }
  if (lead) {
    TrainReport r;
    r.hook = use_ddp ? hook_name : std::string("local");
    if (optimizer_in_hook) r.hook += "+" + optimizer_name + "_in_hook";
    r.zero = zero_level == "off" ? "off" : zero_level + (zero_overlap == ZeroOverlap::kNone ? "" : "+" + f.str("zero-overlap"));
    r.optimizer = optimizer_name;
    r.model = model_name;
    r.fsdp = fsdp_name;
    r.world = world;
    r.batch = batch;
    r.steps = step;
    r.steps_run = steps_run;
    r.train_seconds = train_seconds;
    r.step_ms = step_ms;
    r.forward_ms = forward_ms;
    r.backward_ms = backward_ms;
    r.optimizer_ms = optimizer_ms;
    r.minor_faults = minor_faults;
    r.tuned_from = tuned_from;
    r.traffic = traffic;
    r.shared_memory = pg && pg->uses_shared_memory() ? (pg->hierarchical() ? "hierarchical" : "host") : "";
    r.piece_kb = pg ? pg->piece_bytes() / 1024 : 0;
    if (ddp) {
      const std::string table = bucket_traffic_table(*ddp, steps_run, &r.compression_ratio);
      if (!f.on("quiet")) std::cerr << table;
      if (!ddp->online_tuning().trials.empty()) std::cerr << tuning_table(ddp->online_tuning());
      r.bucket_cap_mb = static_cast<double>(ddp->reducer().bucket_cap()) / (1 << 20);
      r.tuning = &ddp->online_tuning();
      r.reducer = reducer_steps;
    }
    r.accuracy = accuracy;
    if (model.language_model && test_loss >= 0) r.test_perplexity = std::exp(test_loss);
    r.final_loss = last_loss;
    r.optimizer_state_bytes = state_bytes;
    r.peak_rss_bytes = peak_rss;
    r.peak_pss_bytes = peak_pss;
    r.mean_peak_pss_bytes = pss_sum / world;
    r.resumed_from = resumed_from;
    r.checkpoints_written = checkpoints_written;
    std::cout << report_json(r) << std::endl;
  }
  if (pg) ProcessGroup::wait(pg->barrier());
  return 0;
}

}  // namespace cli
}  // namespace ddpkit
