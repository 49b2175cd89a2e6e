// `ddpkit train`'s flags: their defaults, and the checks that run before any rank starts.
#include "train_flags.h"

#include "training.h"

#include <ddpkit/codecs/codec.h>
#include <ddpkit/diloco/diloco.h>
#include <ddpkit/training/checkpoint.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>

namespace ddpkit {
namespace cli {
namespace {


const std::vector<std::string> kTrainSwitches = {
    "gradient-as-bucket-view", "find-unused-parameters", "no-ddp", "no-eval", "quiet", "no-malloc-tuning",
    "powersgd-batch-same-shape", "no-error-feedback", "no-warm-start", "int8-error-feedback", "optimizer-in-hook",
    "zero-shard-buckets", "zero-bucket-view", "no-divergence-guard", "resume", "fault-tolerant", "outer-error-feedback",
    "cross-lazy-connections"};

compat::optional<at::ScalarType> fsdp_dtype(const Flags& f, const std::string& flag) {
  const std::string v = f.str(flag);
  if (v.empty()) return compat::nullopt;
  if (v == "fp32") return at::kFloat;
  if (v == "bf16") return at::kBFloat16;
  throw UsageError("--" + flag + " must be fp32 or bf16, got '" + v + "'");
}

// --model, --hook, --fsdp, --zero, --optimizer and how they combine.
void check_strategy_flags(const Flags& f, TrainFlags& t) {
  t.model = f.str("model");
  t.hook = f.str("hook");
  t.dataset = checked_dataset(f, t.model);
  t.fsdp_name = f.str("fsdp");
  t.use_fsdp = t.fsdp_name != "off";
  t.use_ddp = !f.on("no-ddp");
  t.optimizer_in_hook = f.on("optimizer-in-hook");
  if (t.use_fsdp) {
    try {
      t.fsdp_strategy = parse_sharding_strategy(t.fsdp_name);
    } catch (const c10::Error&) {
      throw UsageError("--fsdp must be off, full_shard, shard_grad_op, no_shard or hybrid_shard, got '" + t.fsdp_name +
                       "'");
    }
    if (t.hook != "none" && t.hook != "fp16" && t.hook != "bf16")
      throw UsageError("--fsdp takes --hook none, fp16 or bf16 (its FSDP hooks), got '" + t.hook + "'");
    for (const char* flag : {"zero-shard-buckets", "zero-bucket-view", "optimizer-in-hook", "gradient-as-bucket-view",
                             "find-unused-parameters", "no-ddp"})
      if (f.on(flag)) throw UsageError(std::string("--") + flag + " does not apply to --fsdp");
    if (f.str("zero") != "off") throw UsageError("--fsdp shards the optimizer state itself: drop --zero");
    t.fsdp_param_dtype = fsdp_dtype(f, "fsdp-param-dtype");
    t.fsdp_reduce_dtype = fsdp_dtype(f, "fsdp-reduce-dtype");
    if (f.integer("fsdp-min-unit-params") < 1) throw UsageError("--fsdp-min-unit-params must be >= 1");
  }
  if (t.hook != "none" && t.hook != "post_local_sgd") {
    const auto names = hooks::hook_names();
    if (std::find(names.begin(), names.end(), t.hook) == names.end()) {
      std::string known = "none";
      for (const auto& n : names) known += ", " + n;
      throw UsageError("--hook '" + t.hook + "' is unknown (" + known + ", post_local_sgd)");
    }
  }
  t.optimizer = f.str("optimizer");
  if (t.optimizer != "sgd" && t.optimizer != "adam" && t.optimizer != "adamw")
    throw UsageError("--optimizer must be sgd, adam or adamw, got '" + t.optimizer + "'");
  if (t.optimizer_in_hook && !t.use_ddp) throw UsageError("--optimizer-in-hook needs DDP (drop --no-ddp)");
  t.zero_level = f.str("zero");
  if (t.zero_level != "off" && t.zero_level != "1" && t.zero_level != "2")
    throw UsageError("--zero must be off, 1 or 2, got '" + t.zero_level + "'");
  try {
    t.zero_overlap = parse_zero_overlap(f.str("zero-overlap"));
  } catch (const c10::Error&) {
    throw UsageError("--zero-overlap must be none, step or interleaved, got '" + f.str("zero-overlap") + "'");
  }
  if (t.zero_level != "off") {
    if (!t.use_ddp) throw UsageError("--zero needs DDP (drop --no-ddp)");
    if (t.optimizer_in_hook) throw UsageError("--zero and --optimizer-in-hook both step inside the hook: pick one");
    if (t.hook == "post_local_sgd") throw UsageError("--zero does not combine with --hook post_local_sgd");
    if (t.zero_level == "2" && t.hook != "none")
      throw UsageError("--zero 2 communicates by reduce-scatter: drop --hook (use --zero-precision fp16|bf16)");
  } else if (t.zero_overlap != ZeroOverlap::kNone || f.on("zero-shard-buckets") || f.on("zero-bucket-view")) {
    throw UsageError("--zero-overlap, --zero-shard-buckets and --zero-bucket-view need --zero 1 or 2");
  }
}

// Sizes, rates and the hooks' numbers.
void check_number_flags(const Flags& f, TrainFlags& t) {
  t.nproc = f.integer("nproc");
  t.epochs = f.integer("epochs");
  t.max_steps = f.integer("steps");
  t.batch = f.integer("batch-size");
  t.threads = f.integer("threads");
  t.lr = !f.str("lr").empty() ? f.real("lr") : t.optimizer == "sgd" ? 0.05 : 1e-3;
  // auto: start from the default, then trial others during the first steps (online_tuning.h).
  t.tune_caps = f.str("bucket-cap-mb") == "auto";
  t.tune_pieces = f.str("piece-kb") == "auto";
  t.cap = f.str("bucket-cap-mb").empty() || t.tune_caps ? hooks::default_bucket_cap_mb(t.hook) : f.real("bucket-cap-mb");
  t.piece_kb = t.tune_pieces ? 1024 : f.integer("piece-kb");
  if ((t.tune_caps || t.tune_pieces) &&
      (t.zero_level == "2" || t.zero_overlap != ZeroOverlap::kNone || t.use_fsdp || !t.use_ddp))
    throw UsageError("--bucket-cap-mb/--piece-kb auto tune DDP's buckets: not with --fsdp, --no-ddp, --zero 2 or "
                     "--zero-overlap (which lay their buckets out once); give numbers");
  if (t.tune_pieces && !hooks::moves_pieces(t.hook) && f.real("two-phase-min-mb") <= 0)
    throw UsageError("--piece-kb auto: --hook " + t.hook +
                     " moves no two-phase pieces (fp16, bf16, int8 and quantize hooks do, or --two-phase-min-mb)");
  if (t.nproc < 1) throw UsageError("--nproc must be >= 1");
  if (t.epochs < 1) throw UsageError("--epochs must be >= 1");
  if (t.max_steps < 0) throw UsageError("--steps must be >= 0");
  if (t.batch < 1) throw UsageError("--batch-size must be >= 1");
  if (t.threads < 1) throw UsageError("--threads must be >= 1");
  if (!(t.lr > 0)) throw UsageError("--lr must be positive");
  if (!(t.cap > 0)) throw UsageError("--bucket-cap-mb must be positive");
  t.powersgd_rank = f.str("powersgd-rank").empty() ? hooks::default_powersgd_rank(t.hook) : f.integer("powersgd-rank");
  if (t.powersgd_rank < 1) throw UsageError("--powersgd-rank must be >= 1");
  if (f.integer("powersgd-start-iter") < 0) throw UsageError("--powersgd-start-iter must be >= 0");
  if (f.integer("int8-block") < 16 || f.integer("int8-block") % 16)
    throw UsageError("--int8-block must be a positive multiple of 16");
  if (f.integer("perchannel-bucket-size") < 1) throw UsageError("--perchannel-bucket-size must be >= 1");
  if (f.integer("local-sgd-start-iter") < 0) throw UsageError("--local-sgd-start-iter must be >= 0");
  if (f.integer("local-sgd-period") < 1) throw UsageError("--local-sgd-period must be >= 1");
  if (f.integer("local-sgd-group-size") < 0) throw UsageError("--local-sgd-group-size must be >= 0");
  if (f.integer("gloo-threads") < 1) throw UsageError("--gloo-threads must be >= 1");
  if (f.integer("gloo-connections") < 1) throw UsageError("--gloo-connections must be >= 1");
  if (f.real("two-phase-min-mb") < 0) throw UsageError("--two-phase-min-mb must be >= 0");
  if (t.piece_kb < 1) throw UsageError("--piece-kb must be >= 1");
  t.report_every = f.integer("report-resources");
  if (t.report_every < 0) throw UsageError("--report-resources must be >= 0");
}

void check_checkpoint_flags(const Flags& f, TrainFlags& t) {
  t.checkpoint_dir = f.str("checkpoint-dir");
  t.checkpoint_every = f.integer("checkpoint-every");
  t.max_restarts = f.str("max-restarts").empty() ? (t.fault_tolerant ? 10 : 0) : f.integer("max-restarts");
  if (t.checkpoint_every < 1) throw UsageError("--checkpoint-every must be >= 1");
  if (t.max_restarts < 0) throw UsageError("--max-restarts must be >= 0");
  if (t.checkpoint_dir.empty() && f.on("resume")) throw UsageError("--resume needs --checkpoint-dir");
  if (!t.checkpoint_dir.empty() && t.optimizer_in_hook)
    throw UsageError("--checkpoint-dir does not save the per-parameter optimizer state of --optimizer-in-hook");
  if (!t.checkpoint_dir.empty() && !f.on("resume") &&
      is_lead_process()) {
    const auto existing = list_checkpoints(t.checkpoint_dir);
    if (!existing.empty())
      throw UsageError("--checkpoint-dir " + t.checkpoint_dir + " already holds checkpoints (newest " +
                       existing.front() + "): add --resume to continue that run, or name another directory");
  }
  if (t.max_restarts > 0 && t.checkpoint_dir.empty() && !t.fault_tolerant)
    std::cerr << "ddpkit: --max-restarts without --checkpoint-dir restarts training from step 0\n";
}

// The library's checks of the DiLoCo options the flags give (DiLoCoOptions::validate), its
// errors naming the flags the user typed rather than the options.
void validate_diloco_flags(const TrainFlags& t) {
  try {
    diloco::DiLoCoOptions()
        .sync_every(t.diloco)
        .outer_lr(t.outer_lr)
        .outer_momentum(t.outer_momentum)
        .codec(t.outer_codec)
        .fragment_delay(t.fragment_delay)
        .fragment_alpha(t.fragment_alpha)
        .round_seconds(t.round_seconds)
        .parameters_sharded(t.use_fsdp)
        .validate(t.fragments);
  } catch (const c10::Error& e) {
    static const std::pair<std::string, std::string> kFlags[] = {
        {"ddpkit: DiLoCo: ", ""}, {"sync_every", "--diloco"}, {"outer_lr", "--outer-lr"},
        {"outer_momentum", "--outer-momentum"}, {"fragment_delay", "--fragment-delay"},
        {"fragment_alpha", "--fragment-alpha"}, {"round_seconds", "--round-seconds"},
        {"parameters_sharded", "--fsdp"}, {" fragments", " --fragments"}};
    std::string msg = e.msg();
    for (const auto& [option, flag] : kFlags)
      for (size_t at = msg.find(option); at != std::string::npos; at = msg.find(option, at + flag.size()))
        msg.replace(at, option.size(), flag);
    throw UsageError(msg);
  }
}

// --diloco and its outer optimizer, codec and fragments (docs/diloco.md).
void check_diloco_flags(const Flags& f, TrainFlags& t) {
  const char* needs[] = {"outer-lr", "outer-momentum", "outer-codec", "fragments", "fragment-delay", "fragment-alpha",
                         "fragment-layout", "round-seconds"};
  if (f.str("diloco").empty()) {
    for (const char* flag : needs)
      if (!f.str(flag).empty()) throw UsageError(std::string("--") + flag + " needs --diloco H");
    if (f.on("outer-error-feedback")) throw UsageError("--outer-error-feedback needs --diloco H");
    return;
  }
  t.outer_error_feedback = f.on("outer-error-feedback");
  t.diloco = f.integer("diloco");
  if (t.diloco < 1) throw UsageError("--diloco must be >= 1 (inner steps between syncs), got " + f.str("diloco"));
  if (!f.str("outer-lr").empty()) t.outer_lr = f.real("outer-lr");
  if (!f.str("outer-momentum").empty()) t.outer_momentum = f.real("outer-momentum");
  if (!f.str("fragment-alpha").empty()) t.fragment_alpha = f.real("fragment-alpha");
  if (!f.str("fragments").empty()) t.fragments = f.integer("fragments");
  if (!f.str("fragment-delay").empty()) t.fragment_delay = f.integer("fragment-delay");
  if (!f.str("outer-codec").empty()) t.outer_codec = f.str("outer-codec");
  if (!f.str("fragment-layout").empty()) t.fragment_layout = f.str("fragment-layout");
  if (!f.str("round-seconds").empty()) t.round_seconds = f.real("round-seconds");
  if (!f.str("round-seconds").empty() && !(t.round_seconds > 0))
    throw UsageError("--round-seconds must be > 0, got " + f.str("round-seconds"));
  validate_diloco_flags(t);
  if (t.fragment_layout != "strided" && t.fragment_layout != "sequential")
    throw UsageError("--fragment-layout is strided or sequential, got '" + t.fragment_layout + "'");
}

// --fault-tolerant and its replica groups (docs/fault_tolerance.md).
void check_fault_tolerance_flags(const Flags& f, TrainFlags& t) {
  t.fault_tolerant = f.on("fault-tolerant");
  t.replica_groups = f.integer("replica-groups");
  t.min_replicas = f.integer("min-replicas");
  t.lighthouse = f.str("lighthouse");
  t.replica_group = f.str("replica-group").empty() ? -1 : f.integer("replica-group");
  t.heal_connections = f.str("heal-connections").empty() ? 1 : f.integer("heal-connections");
  t.cross_lazy_connections = f.on("cross-lazy-connections");
  if (!f.str("quorum-mode").empty()) t.quorum_mode = f.str("quorum-mode");
  if (!t.fault_tolerant) {
    if (t.cross_lazy_connections) throw UsageError("--cross-lazy-connections needs --fault-tolerant");
    for (const char* flag : {"replica-group", "lighthouse", "step-log", "heal-connections", "quorum-mode"})
      if (!f.str(flag).empty()) throw UsageError(std::string("--") + flag + " needs --fault-tolerant");
    if (t.replica_groups != 1) throw UsageError("--replica-groups needs --fault-tolerant");
    if (t.min_replicas != 1) throw UsageError("--min-replicas needs --fault-tolerant");
    if (!f.str("diloco").empty()) throw UsageError("--diloco needs --fault-tolerant (each replica group is a site)");
    return;
  }
  check_diloco_flags(f, t);
  if (t.replica_groups < 1) throw UsageError("--replica-groups must be >= 1, got " + std::to_string(t.replica_groups));
  if (t.min_replicas < 1 || t.min_replicas > t.replica_groups)
    throw UsageError("--min-replicas must be in 1..--replica-groups (" + std::to_string(t.replica_groups) + "), got " +
                     std::to_string(t.min_replicas));
  if (t.quorum_mode != "async" && t.quorum_mode != "sync")
    throw UsageError("--quorum-mode is async or sync, got '" + t.quorum_mode + "'");
  if (t.heal_connections < 1 || t.heal_connections > 64)
    throw UsageError("--heal-connections must be in 1..64, got " + std::to_string(t.heal_connections));
  if (t.replica_group != -1 && (t.replica_group < 0 || t.replica_group >= t.replica_groups))
    throw UsageError("--replica-group must be in 0.." + std::to_string(t.replica_groups - 1) + ", got " +
                     f.str("replica-group"));
  if (t.replica_group >= 0 && t.lighthouse.empty())
    throw UsageError("--replica-group runs one group of a job whose lighthouse runs elsewhere: give --lighthouse HOST:PORT");
  if (!t.lighthouse.empty() && t.lighthouse.rfind(':') == std::string::npos)
    throw UsageError("--lighthouse must be HOST:PORT, got '" + t.lighthouse + "'");
  // What a heal cannot copy yet, or what makes the replicas of a group differ.
  if (!t.use_ddp) throw UsageError("--fault-tolerant replicates across groups of DDP or FSDP: drop --no-ddp");
  if (t.optimizer_in_hook || t.zero_overlap != ZeroOverlap::kNone)
    throw UsageError("--fault-tolerant steps the optimizer after the cross-group average: not with --optimizer-in-hook "
                     "or --zero-overlap (they step inside the hook)");
  if (t.hook == "post_local_sgd") throw UsageError("--fault-tolerant does not combine with --hook post_local_sgd");
  if (t.tune_caps || t.tune_pieces)
    throw UsageError("--fault-tolerant: give --bucket-cap-mb and --piece-kb as numbers (auto tunes per group)");
}

}  // namespace

Flags parse_train_flags(const std::vector<std::string>& args) {
  return Flags(args,
               with_model_flag_defaults(
                   {{"nproc", "2"}, {"fsdp", "off"}, {"fsdp-param-dtype", "fp32"}, {"fsdp-reduce-dtype", ""},
                    {"hook", "none"}, {"bucket-cap-mb", ""}, {"epochs", "3"}, {"steps", "0"}, {"lr", ""},
                    {"seed", "1"}, {"backend", "gloo"}, {"timeout-s", "300"}, {"gloo-threads", "2"},
                    {"two-phase-min-mb", "0"}, {"gloo-connections", "1"}, {"piece-kb", "1024"},
                    {"powersgd-rank", ""}, {"powersgd-start-iter", "10"}, {"powersgd-min-compression-rate", "2"},
                    {"powersgd-epsilon", "0"}, {"powersgd-seed", "0"}, {"int8-block", "512"},
                    {"perchannel-bucket-size", "512"}, {"local-sgd-start-iter", "100"}, {"local-sgd-period", "4"},
                    {"local-sgd-group-size", "0"}, {"zero", "off"}, {"zero-overlap", "none"},
                    {"zero-precision", "fp32"}, {"checkpoint-dir", ""}, {"checkpoint-every", "100"},
                    {"max-restarts", ""}, {"report-resources", "0"}, {"replica-groups", "1"},
                    {"replica-group", ""}, {"min-replicas", "1"}, {"lighthouse", ""},
                    {"step-log", ""}, {"heal-connections", ""}, {"quorum-mode", ""}, {"diloco", ""}, {"outer-lr", ""},
                    {"outer-momentum", ""}, {"outer-codec", ""}, {"fragments", ""}, {"fragment-delay", ""},
                    {"fragment-alpha", ""}, {"fragment-layout", ""}, {"round-seconds", ""}}),
               kTrainSwitches);
}

TrainFlags check_train_flags(const Flags& f) {
  TrainFlags t;
  check_strategy_flags(f, t);
  check_number_flags(f, t);
  check_fault_tolerance_flags(f, t);
  check_checkpoint_flags(f, t);
  return t;
}

}  // namespace cli
}  // namespace ddpkit
