// The cost model behind `ddpkit plan` (docs/plan.md): per-rank peak memory and step time of a
// data-parallel job under DDP (any hook), ZeRO-1/2 and each FSDP strategy, from a measured profile
// of the model (compute, gradient-ready times, activations) and measured constants of the machine
// (collectives through shared memory, codecs, a training process's own memory). Network links are
// not measured here: they are the job's inputs (hosts, Gbit/s), see MachineConstants.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ddpkit {
namespace plan {

// What one rank's model looks like and costs, run alone (ProfileOptions, plan/profile.h).
struct ParamProfile {
  int64_t numel = 0;
  std::vector<int64_t> shape;
  int unit = -1;              // FSDP unit (index into ModelProfile::unit_numel), -1: the root's
  double grad_ready_ms = 0;   // when backward produced its gradient, from the start of backward
};
// The model's compute in another dtype (FSDP's mixed precision: parameters gathered and computed in
// bf16), timed as ModelProfile's: grad_ready_ms per parameter in ModelProfile::params' order.
struct ComputeProfile {
  double forward_ms = 0, backward_ms = 0;
  std::vector<double> grad_ready_ms;
  int64_t activation_bytes = 0;
};
struct ModelProfile {
  std::string name;
  std::vector<ParamProfile> params;  // in the module's parameters() order (DDP buckets them reversed)
  std::vector<int64_t> unit_numel;   // FSDP units, in forward order
  double forward_ms = 0, backward_ms = 0;
  double optimizer_ms = 0;           // the optimizer's step over every parameter
  int64_t activation_bytes = 0;      // heap the forward leaves alive for backward
  int64_t data_bytes = 0;            // the data set every rank holds (heap in use)
  int64_t data_load_bytes = 0;       // resident memory loading it added (its transient peak)
  int batch = 0, threads = 1;
  int concurrent = 1;                // copies that ran at once while compute was timed (contention)
  std::optional<ComputeProfile> bf16;  // when profiled: the same steps computed in bf16
  int64_t param_bytes() const;
};

// time = latency + bus bytes / bandwidth; bus bytes as nccl-tests counts them (2(n-1)/n of the
// buffer for allreduce, (n-1)/n for the others), so one constant serves every world size.
struct PathCost {
  double latency_us = 0;
  double gbyte_per_s = 1;
  double ms(double bus_bytes) const { return latency_us * 1e-3 + bus_bytes / (gbyte_per_s * 1e6); }
};

// Measured by `ddpkit plan --calibrate` (plan::calibrate), stored as JSON.
struct MachineConstants {
  int cores = 1;
  // Shared memory between the ranks of one host, one core per rank. allreduce_in_place: DDP's
  // buckets summed where they lie (its default); allreduce: through the shared slots (hooks).
  PathCost shm_allreduce_in_place, shm_allreduce, shm_allreduce_16bit, shm_reduce_scatter, shm_allgather,
      shm_broadcast, shm_alltoall;
  // Gloo over TCP: its per-hop latency on loopback, the mean over back-to-back collectives (with
  // the waits for a descheduled thread a step pays); a link's bandwidth is the job's input
  // (JobSpec::link_gbit), of which TCP carries tcp_efficiency as payload.
  double tcp_latency_us = 100;
  double tcp_efficiency = 0.94;
  // What Gloo's TCP costs the cores: bus bytes per second of a large allreduce between two ranks
  // over loopback, where no wire limits it (sends, receives and sums, each rank on a core). A
  // link's bytes take that CPU at each end, beside the compute on the same cores; the transfer
  // lasts the longer of it and the wire.
  double tcp_gbyte_per_s = 2;
  double copy_gbyte_per_s = 5;      // memcpy of large buffers
  double cast_gbyte_per_s = 5;      // fp32 -> fp16/bf16 and back, per fp32 byte
  double int8_gbyte_per_s = 2;      // int8 block quantize + dequantize-and-sum, per fp32 byte
  // ATen's division of a float16 tensor, per fp32 byte: allreduce_hook's div_ of the bucket that
  // fp16_compress_wrapper hands it (libtorch 1.13 divides float16 an element at a time on the CPU,
  // unlike bfloat16, so it has a rate of its own).
  double fp16_div_gbyte_per_s = 5;
  // PyTorch's quantization hooks' uint8 codec (ATen operations), per fp32 byte: the parameters and
  // codes of one bucket, and one rank's part decoded into the sum (a bucket decodes world parts).
  double uint8_encode_gbyte_per_s = 1, uint8_decode_gbyte_per_s = 1;
  // PowerSGD's products (a matrix against r columns and back) at rank 4 and at rank 32: thin
  // products, far below a layer's rate, and faster per flop as r grows.
  double matmul_gflop_per_s = 10, matmul_rank32_gflop_per_s = 30;
  double gemm_gflop_per_s = 50;     // a layer's products, every rank at once: a described model's GFLOP
  double optimizer_gbyte_per_s = 5; // unused when the profile times the optimizer itself
  int64_t process_bytes = 0;        // a training process before its model, data and activations
  // What each strategy/hook ("zero1/none", "ddp/fp16") holds beyond the model's own accounting
  // (staging copies, flat views, allocator slack), per byte of parameters: measured by
  // --calibrate as a 2-rank job's peak less the prediction without it.
  std::map<std::string, double> extra_bytes_per_param_byte;
  // The same, measured with DDPKIT_SHM=0 (ranks over Gloo, as between hosts: no shared-memory
  // buffers, Gloo's own), for jobs of more than one host or of one rank. Empty: those use the
  // ones above.
  std::map<std::string, double> extra_bytes_per_param_byte_gloo;
  // The memory accounting the extras were measured against (kMemoryModel when current): an
  // extra is a residual, so one measured against another accounting is refused, not misused.
  int memory_model = 0;
  static constexpr int kMemoryModel = 8;
  std::string measured_on;          // host and date, for the record
};

// The job, beyond the model.
struct JobSpec {
  int world_size = 2;
  int hosts = 1;
  double link_gbit = 10;           // between hosts
  // Gloo's time per message between hosts, in microseconds (half a small allreduce between two
  // of them); 0: this machine's loopback figure, MachineConstants::tcp_latency_us.
  double link_latency_us = 0;
  int threads = 1;                 // intra-op threads per rank
  int cores_per_host = 0;          // 0: this machine's (network namespaces on one machine share it)
  std::string optimizer = "sgd";   // sgd (momentum), adam, adamw
  int64_t memory_limit_bytes = 0;  // per rank; 0: no limit
  // The hosts are network namespaces (or containers) of this one machine, as in a rehearsal of a
  // multi-host job: their ranks compute at once on its cores and share its caches and memory
  // bandwidth, which the profile then includes (`ddpkit plan --hosts-on-this-machine`).
  bool hosts_on_this_machine = false;
  int ranks_per_host() const { return (world_size + hosts - 1) / hosts; }
};

// How a job is run: DDP, ZeRO-1/2 over DDP, or one of FSDP's sharding strategies. to_string gives
// the names `ddpkit plan --strategy` and the JSON use; parse_strategy reads them.
enum class Strategy { kDdp, kZero1, kZero2, kFullShard, kShardGradOp, kNoShard, kHybridShard };
// The communication hook: kNone is DDP's built-in allreduce (FSDP's and ZeRO's own reduction);
// DDP takes any, FSDP none, fp16 or bf16, ZeRO none. Named as `ddpkit train --hook` names them.
enum class Hook {
  kNone, kAllreduce, kFp16, kBf16, kFp16Wrapper, kBf16Wrapper, kInt8, kQuantizePerTensor, kQuantizePerChannel,
  kPowerSgd, kBatchedPowerSgd, kPostLocalSgd, kNoop
};
const char* to_string(Strategy s);
const char* to_string(Hook h);
// The strategy or hook a name means; an error listing the names otherwise.
Strategy parse_strategy(const std::string& name);
Hook parse_hook(const std::string& name);
bool is_fsdp(Strategy s);

// One way to run it. candidates() lists DDP with hooks none, allreduce, fp16, bf16, int8 and
// powersgd, ZeRO-1/2, and each FSDP strategy with none and bf16; other_hook_candidates() DDP's
// other hooks, predicted when asked for. label() names it in a row: the hook, with "+optimizer"
// when the optimizer runs in it and "+mp_bf16" (and "_reduce_fp32") under mixed precision.
struct Candidate {
  Strategy strategy = Strategy::kDdp;
  Hook hook = Hook::kNone;
  // In MiB; unset: the hook's default (hooks::default_bucket_cap_mb). The prediction carries the
  // cap used.
  std::optional<double> bucket_cap_mb;
  // DDP and ZeRO-1, whose buckets `ddpkit train --bucket-cap-mb auto` tunes: of the caps that
  // tuning tries, the one predicted fastest, kept over the default only when faster by the
  // tuner's min_gain, as the tuner decides (ddp/online_tuning.h).
  bool choose_bucket_cap = false;
  int powersgd_rank = 0;        // 0: ddpkit train's default for the hook (4; batched_powersgd 32)
  int local_sgd_period = 4;     // post_local_sgd: parameters averaged every this many steps
  // post_local_sgd: gradients allreduced within groups of this many consecutive ranks (0: kept
  // local), as `ddpkit train --local-sgd-group-size`.
  int local_sgd_group_size = 0;
  // DDP: the optimizer steps each bucket's parameters as its communication completes, on the
  // thread that completes it (`ddpkit train --optimizer-in-hook`); with hook none the hook is
  // allreduce, as train registers it.
  bool optimizer_in_hook = false;
  // FSDP's mixed precision (`ddpkit train --fsdp-param-dtype/--fsdp-reduce-dtype`): the dtype units
  // are gathered and computed in, fp32 or bf16 (which needs the profile's bf16 compute), and the
  // one gradients are reduced in ("": the param dtype). Hook none only.
  std::string param_dtype = "fp32", reduce_dtype;
  bool mixed_precision() const { return param_dtype != "fp32"; }
  const std::string& reduced_in() const { return reduce_dtype.empty() ? param_dtype : reduce_dtype; }
  // DDP and ZeRO-1 reduce in buckets whose cap is chosen and given to `ddpkit train`.
  bool has_bucket_cap() const { return strategy == Strategy::kDdp || strategy == Strategy::kZero1; }
  bool is_fsdp() const { return plan::is_fsdp(strategy); }
  std::string label() const {
    std::string l = std::string(to_string(hook)) + (optimizer_in_hook ? "+optimizer" : "");
    if (mixed_precision()) l += "+mp_" + param_dtype;
    if (mixed_precision() && reduced_in() != param_dtype) l += "_reduce_" + reduced_in();
    return l;
  }
};

struct MemoryBreakdown {
  // host_shared: shared memory of this host's ranks that a rank touches beyond its own buffers:
  // every local rank's collective slots, and the peers' FSDP shards, which a unit's compute reads
  // where they lie. It counts in a rank's resident peak and grows with the ranks on a host, which
  // the 2-rank calibration of measured_extra cannot see.
  int64_t process = 0, data = 0, parameters = 0, gradients = 0, optimizer_state = 0, communication = 0,
          activations = 0, host_shared = 0, measured_extra = 0;
  int64_t loading = 0;  // the process while it loads the data (what loading frees, training reuses)
  int64_t total() const {
    const int64_t training =
        process + data + parameters + gradients + optimizer_state + communication + activations + host_shared +
        measured_extra;
    return training > loading ? training : loading;
  }
};

struct Prediction {
  Candidate candidate;
  double step_ms = 0;
  double compute_ms = 0;            // forward + backward + optimizer under this job's core sharing
  double exposed_comm_ms = 0;       // what communication adds to the step
  double wire_bytes_per_step = 0;   // bytes each rank sends between hosts
  MemoryBreakdown memory;
  bool fits = true;
  std::string note;                 // why it does not apply, when it does not
};

// The key of MachineConstants' extras a candidate's memory takes: "strategy/hook", and "+mp_bf16"
// under mixed precision (the optimizer in the hook holds what its hook does).
std::string measured_extra_key(const Candidate& c);

// Strategies and the hooks each takes, as the CLI names them: the rows `ddpkit plan` ranks.
std::vector<Candidate> candidates(const JobSpec& job);
// DDP's other hooks, predicted when asked for by name (`ddpkit plan --hook`).
std::vector<Candidate> other_hook_candidates();
Prediction predict(const ModelProfile& model, const JobSpec& job, const MachineConstants& machine,
                   const Candidate& candidate);
// Every candidate, best first: those that fit before those that do not, then by step time.
std::vector<Prediction> rank_candidates(const ModelProfile& model, const JobSpec& job, const MachineConstants& machine,
                                        const std::vector<Candidate>& list);

// The activation_bytes at which the accounting of one rank training alone (no collectives) comes to
// `peak`, the resident peak measured of such a run: what a real process holds beyond the process,
// the data, the parameters, their gradients and the optimizer's state and step temporaries (the
// step's transients and what the heap keeps of them, as well as what forward saves). Not below 0.
// `ddpkit plan` measures the peak with `ddpkit train --nproc 1 --no-ddp`.
int64_t activations_from_peak(const ModelProfile& model, const MachineConstants& machine, const std::string& optimizer,
                              int64_t peak);

// JSON, for --calibrate's file and for --json.
std::string to_json(const MachineConstants& m);
MachineConstants machine_constants_from_json(const std::string& text);
// The first rate this ddpkit reads (tcp_gbyte_per_s, say) that a constants file written by an
// older one lacks, the file otherwise one ddpkit wrote; empty when none is missing or `text` is no
// such file. `ddpkit plan` measures such a file again rather than refusing it.
std::string rate_missing_from(const std::string& text);
std::string to_json(const std::vector<Prediction>& rows);

// A model as JSON: what `ddpkit plan --save-profile` writes, and what a user writes for a model
// this machine cannot profile (docs/plan.md, "Describing a model"): its layers' parameter shapes,
// which are FSDP units, and its compute. Left out, backward is twice the forward, a forward given
// in GFLOP runs at the calibrated matmul rate, the optimizer's step moves its bytes per parameter
// at the copy rate, and gradients become ready in reverse layer order, in proportion to size.
std::string to_json(const ModelProfile& model);
ModelProfile model_profile_from_json(const std::string& text, const MachineConstants& machine,
                                     const std::string& optimizer);

}  // namespace plan
}  // namespace ddpkit
