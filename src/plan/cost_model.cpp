// The cost model (include/ddpkit/plan/cost_model.h; the reasoning is in docs/plan.md).
//
// Time: a rank runs its step as a program of compute segments and collectives. Collectives go one
// at a time, in issue order, as ddpkit's sequencer runs them; each has a CPU part (copies, codecs,
// sums through shared memory) and a wire part (bytes over a link between hosts). When the ranks of
// a host use every core, a collective's CPU part is taken from the rank's compute; with a core to
// spare it runs beside it. Compute (forward, backward, the optimizer) is the profile's, stretched
// when a host has more busy threads than cores.
//
// Memory: what the job holds by design (parameters, gradients, optimizer state, shards and units,
// activations, the data set) plus each strategy's communication buffers, from the same reasoning.
#include <ddpkit/plan/cost_model.h>

#include <ddpkit/comm/process_group.h>
#include <ddpkit/ddp/distributed_data_parallel.h>
#include <ddpkit/ddp/online_tuning.h>
#include <ddpkit/error.h>
#include <ddpkit/hooks/default_hooks.h>
#include <ddpkit/optim/adam.h>
#include <ddpkit/reducer/bucket_assignment.h>

#include "step_program.h"

#include <algorithm>
#include <cmath>
#include <functional>

namespace ddpkit {
namespace plan {

using namespace detail;  // the step program: Comm, Timeline, Op, Network

int64_t ModelProfile::param_bytes() const {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel * 4;
  return n;
}

namespace {

JobSpec subgroup_job(const JobSpec& job, int size) {
  JobSpec g = job;
  g.world_size = std::max(1, size);
  g.hosts = std::max(1, g.world_size / job.ranks_per_host());
  if (g.world_size % g.hosts) g.hosts = 1;
  return g;
}

// ---- FSDP units ----------------------------------------------------------------------------

struct Unit {
  int64_t numel = 0;
  double forward_ms = 0, backward_ms = 0;
};

// The profile's units plus, when parameters are left outside them, the root's; compute split in
// proportion to each unit's share of backward (measured from its gradients' ready times).
std::vector<Unit> fsdp_units(const ModelProfile& model, double forward_ms, double backward_ms) {
  std::vector<Unit> units(model.unit_numel.size());
  for (size_t u = 0; u < units.size(); ++u) units[u].numel = model.unit_numel[u];
  Unit root;
  std::vector<double> done(units.size(), 0);
  for (const auto& p : model.params) {
    if (p.unit < 0) root.numel += p.numel;
    else done[p.unit] = std::max(done[p.unit], p.grad_ready_ms);
  }
  // Backward runs the units last to first: unit u's share is its ready time minus the one after's.
  const double total = std::max(model.backward_ms, 1e-9);
  double previous = 0;
  for (size_t u = units.size(); u-- > 0;) {
    const double share = std::max(0.0, done[u] - previous) / total;
    units[u].backward_ms = share * backward_ms;
    units[u].forward_ms = share * forward_ms;
    previous = std::max(previous, done[u]);
  }
  double assigned_f = 0, assigned_b = 0;
  for (const auto& u : units) assigned_f += u.forward_ms, assigned_b += u.backward_ms;
  root.forward_ms = std::max(0.0, forward_ms - assigned_f);
  root.backward_ms = std::max(0.0, backward_ms - assigned_b);
  if (root.numel > 0 || units.empty()) units.insert(units.begin(), root);
  else units.front().forward_ms += root.forward_ms, units.front().backward_ms += root.backward_ms;
  return units;
}

// ZeRO-1 partitions whole parameters, sorted-greedy (the largest first, each to the rank with the
// fewest elements so far, as ZeroRedundancyOptimizer does): the largest rank's share of the
// elements, which sets the job's peak and its optimizer step. ZeRO-2 shards flat buckets evenly.
double largest_greedy_share(const ModelProfile& model, int world) {
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (const auto& p : model.params) {
    sizes.push_back(p.numel);
    total += p.numel;
  }
  std::stable_sort(sizes.begin(), sizes.end(), std::greater<int64_t>());
  std::vector<int64_t> ranks(static_cast<size_t>(world), 0);
  for (int64_t n : sizes) *std::min_element(ranks.begin(), ranks.end()) += n;
  return total > 0 ? static_cast<double>(*std::max_element(ranks.begin(), ranks.end())) / static_cast<double>(total)
                   : 1.0 / world;
}

double state_per_param(const std::string& optimizer) {
  if (optimizer == "sgd") return 1;  // momentum
  if (optimizer == "adam" || optimizer == "adamw") return 2;
  DDPKIT_CHECK(false, "the cost model knows optimizers sgd, adam and adamw, got '", optimizer, "'");
  return 0;
}

// Candidate::choose_bucket_cap: each cap online tuning would try, predicted. The fastest that fits
// (where the default fits) replaces the default only by the tuner's margin: a predicted gain
// smaller than that would not survive the run's own trials either.
Prediction predict_choosing_bucket_cap(const ModelProfile& model, const JobSpec& job, const MachineConstants& machine,
                                       Candidate c) {
  c.choose_bucket_cap = false;
  c.bucket_cap_mb.reset();
  const Prediction by_default = predict(model, job, machine, c);
  if (!c.has_bucket_cap()) return by_default;
  const OnlineTuningOptions tuning = default_online_tuning(/*bucket_caps=*/true, /*pieces=*/false);
  Prediction fastest = by_default;
  for (const double cap : tuning.bucket_caps_mb()) {
    c.bucket_cap_mb = cap;
    Prediction p = predict(model, job, machine, c);
    if ((p.fits || !by_default.fits) && p.step_ms < fastest.step_ms) fastest = std::move(p);
  }
  return fastest.step_ms < by_default.step_ms * (1 - tuning.min_gain()) ? fastest : by_default;
}

// ddpkit's Adam/AdamW build their denominator a slice at a time (include/ddpkit/optim/adam.h):
// two 64K-element scratch slices, not libtorch's two tensors the size of the largest parameter.
double step_temporaries(const ModelProfile& model, const std::string& optimizer) {
  int64_t largest_param = 0;
  for (const auto& p : model.params) largest_param = std::max(largest_param, 4 * p.numel);
  const int64_t slice = 4 * optim::kAdamSliceElements;
  return optimizer == "sgd" ? 0 : 2.0 * static_cast<double>(std::min(largest_param, slice));
}

}  // namespace

int64_t activations_from_peak(const ModelProfile& model, const MachineConstants& machine, const std::string& optimizer,
                              int64_t peak) {
  const double P = static_cast<double>(model.param_bytes());
  const double held = static_cast<double>(machine.process_bytes + model.data_bytes) + 2 * P +
                      state_per_param(optimizer) * P + step_temporaries(model, optimizer);
  return std::max<int64_t>(0, peak - static_cast<int64_t>(held));
}

namespace {

// The candidate with its defaults filled in, after the checks that name what is wrong with it.
Candidate checked_candidate(const ModelProfile& model, const JobSpec& job, Candidate c) {
  DDPKIT_CHECK(!c.bucket_cap_mb || *c.bucket_cap_mb > 0, "plan: a bucket cap must be positive, got ",
               c.bucket_cap_mb.value_or(0), " MiB");
  DDPKIT_CHECK(job.world_size >= 1 && job.hosts >= 1 && job.hosts <= job.world_size,
               "plan: need 1 <= hosts (", job.hosts, ") <= world size (", job.world_size, ")");
  DDPKIT_CHECK(job.world_size % job.hosts == 0, "plan: the world size (", job.world_size,
               ") must be a multiple of the host count (", job.hosts, ")");
  DDPKIT_CHECK(!model.params.empty(), "plan: the model profile has no parameters");
  if (!c.bucket_cap_mb) c.bucket_cap_mb = hooks::default_bucket_cap_mb(to_string(c.hook));
  const Strategy s = c.strategy;
  const bool fsdp = c.is_fsdp();
  DDPKIT_CHECK(!fsdp || c.hook == Hook::kNone || c.hook == Hook::kFp16 || c.hook == Hook::kBf16,
               "plan: FSDP takes hook none, fp16 or bf16, got '", to_string(c.hook), "'");
  DDPKIT_CHECK(s == Strategy::kDdp || fsdp || c.hook == Hook::kNone, "plan: ", to_string(s), " takes no hook, got '",
               to_string(c.hook), "'");
  DDPKIT_CHECK(!c.optimizer_in_hook || s == Strategy::kDdp, "plan: the optimizer runs in DDP's hook only, not with ",
               to_string(s));
  const std::string& reduce_dtype = c.reduced_in();
  DDPKIT_CHECK((c.param_dtype == "fp32" || c.param_dtype == "bf16") && (reduce_dtype == "fp32" || reduce_dtype == "bf16"),
               "plan: mixed precision's dtypes are fp32 or bf16, got param '", c.param_dtype, "' reduce '",
               c.reduce_dtype, "'");
  DDPKIT_CHECK(c.mixed_precision() || reduce_dtype == "fp32", "plan: with fp32 parameters, reduce in bf16 with ",
               "hook bf16 (the reduce dtype alone is not modelled)");
  DDPKIT_CHECK(!c.mixed_precision() || (fsdp && c.hook == Hook::kNone),
               "plan: mixed precision is FSDP's, with hook none (", to_string(s), " / ", to_string(c.hook), ")");
  DDPKIT_CHECK(!c.mixed_precision() || model.bf16, "plan: the profile has no bf16 compute for mixed precision ",
               "(ddpkit plan --fsdp-param-dtype bf16 profiles it; a description gives it as \"bf16\")");
  if (c.optimizer_in_hook && c.hook == Hook::kNone) c.hook = Hook::kAllreduce;  // what train registers
  if (c.hook == Hook::kPostLocalSgd) {
    const int g = c.local_sgd_group_size;
    DDPKIT_CHECK(g >= 0 && (g == 0 || job.world_size % g == 0), "plan: the local SGD group size (", g,
                 ") must divide the world size (", job.world_size, ")");
    DDPKIT_CHECK(g <= job.ranks_per_host() || g % job.ranks_per_host() == 0, "plan: a local SGD group of ", g,
                 " ranks must be whole hosts of ", job.ranks_per_host(), " when it spans hosts");
  }
  return c;
}

// The profile as this candidate computes: under mixed precision forward and backward are the
// bf16 profile's (the fp32 shards' step is not).
ModelProfile computed_profile(const ModelProfile& model, const Candidate& c) {
  ModelProfile in_bf16 = model;
  if (!c.mixed_precision()) return in_bf16;
  in_bf16.forward_ms = model.bf16->forward_ms;
  in_bf16.backward_ms = model.bf16->backward_ms;
  in_bf16.activation_bytes = model.bf16->activation_bytes;
  for (size_t k = 0; k < in_bf16.params.size() && k < model.bf16->grad_ready_ms.size(); ++k)
    in_bf16.params[k].grad_ready_ms = model.bf16->grad_ready_ms[k];
  return in_bf16;
}

// What every strategy's step is built from: the job on this machine's cores, its networks, the
// compute phases scaled by contention, and the sizes of the parameters and optimizer state.
struct StepModel {
  StepModel(const ModelProfile& model_, const JobSpec& job_, const MachineConstants& machine_, const Candidate& c_)
      : model(model_),
        job(job_),
        machine(machine_),
        c(c_),
        computed(computed_profile(model_, c_)),
        world(job_.world_size),
        rph(job_.ranks_per_host()),
        cores(std::max(1, job_.cores_per_host > 0 ? job_.cores_per_host : machine_.cores)),
        busy(static_cast<double>(rph) * job_.threads),
        // The profile timed `concurrent` replicas on this machine's cores: contention up to
        // there is in its figures, time-sharing beyond it is not.
        scale(std::max(1.0, busy / cores) /
              std::max(1.0, static_cast<double>(model_.concurrent) * model_.threads / std::max(1, machine_.cores))),
        steals(busy >= cores),
        cpu_scale(std::max(1.0, busy / cores)),
        net(job_, machine_, cpu_scale),
        local_sgd_group(subgroup_job(job_, c_.local_sgd_group_size)),
        subgroup(local_sgd_group, machine_, cpu_scale),
        F(computed.forward_ms * scale),
        B(computed.backward_ms * scale),
        O(model_.optimizer_ms * scale),
        P(static_cast<double>(model_.param_bytes())),
        state(state_per_param(job_.optimizer) * P),
        temporaries(step_temporaries(model_, job_.optimizer)) {}

  const ModelProfile& model;
  const JobSpec& job;
  const MachineConstants& machine;
  const Candidate& c;
  const ModelProfile computed;
  const int world, rph;
  const int cores;      // busy threads beyond them stretch everything that runs on the CPU
  const double busy;
  const double scale;
  const bool steals;
  const double cpu_scale;
  const Network net;
  const JobSpec local_sgd_group;
  const Network subgroup;
  const double F, B, O, P;  // forward, backward, optimizer ms; parameter bytes
  const double state, temporaries;
};

// DDP's memory for communication: buckets summed in place in shared memory (each rank writes its
// peers' shares there), else every bucket a copy of the gradients, plus what the hook encodes into.
double ddp_communication_bytes(const StepModel& m, const std::vector<Bucket>& buckets, double largest) {
  const Hook hook = m.c.hook;
  const double P = m.P;
  const bool in_place = hook == Hook::kNone && m.world > 1 && m.job.hosts == 1;
  double comm = in_place ? P * (m.world - 1) / m.world : P;
  if (hook == Hook::kFp16 || hook == Hook::kBf16) comm += largest / 2 * 2;
  if (hook == Hook::kFp16Wrapper || hook == Hook::kBf16Wrapper) comm += largest / 2;
  if (hook == Hook::kInt8) comm += largest / 4 * 2;
  // The codes from every rank (decoded straight into the bucket).
  if (hook == Hook::kQuantizePerTensor || hook == Hook::kQuantizePerChannel) comm += largest / 4 * (m.world + 1);
  if (hook == Hook::kPowerSgd) comm += P;  // error feedback
  // Per bucket, kept: its padded square, the error fed back and the input's copy.
  if (hook == Hook::kBatchedPowerSgd)
    for (const auto& b : buckets) comm += 3 * 4.0 * std::pow(std::ceil(std::sqrt(static_cast<double>(b.numel))), 2);
  if (hook == Hook::kPostLocalSgd) comm += P;  // the flat copy averaging makes
  if (hook == Hook::kNoop) comm = P;
  return comm;
}

// DDP, ZeRO-1 and ZeRO-2: backward with the buckets' communication, then the step (the whole
// model's, or the shard's and its broadcast or allgather). Returns the optimizer's ms.
double ddp_step(const StepModel& m, Timeline& t, MemoryBreakdown& mem) {
  const Candidate& c = m.c;
  const Strategy s = c.strategy;
  const double P = m.P, O = m.O;
  const auto buckets = ddp_buckets(m.model, *c.bucket_cap_mb, m.scale);
  double largest = 0;
  t.compute(m.F);
  double at = 0;
  for (const auto& b : buckets) {
    largest = std::max(largest, 4.0 * b.numel);
    t.compute(std::max(0.0, b.ready_ms - at));
    at = std::max(at, b.ready_ms);
    if (s == Strategy::kZero2) {
      // zero2_hook: gradients into the bucket, the bucket into its padded copy, the bucket
      // zeroed around the shard, and back into the gradients: four passes over it.
      Comm rs;
      rs.cpu_ms = m.net.copy_ms(4 * 4.0 * b.numel);
      rs += m.net.collective(Op::kReduceScatter, 4.0 * b.numel);
      t.issue(rs);
    } else {
      Comm comm = ddp_bucket(m.model, m.job, c, b, m.net, m.subgroup);
      // In the hook, the bucket's share of the optimizer's step follows its communication, on
      // the thread that completes it (holding the next bucket's collective back).
      if (c.optimizer_in_hook) comm.cpu_ms += O * 4.0 * b.numel / P;
      t.issue(comm);
    }
  }
  t.compute(std::max(0.0, m.B - at));
  t.wait_all();
  mem.gradients = static_cast<int64_t>(P);
  if (s == Strategy::kDdp) {
    if (!c.optimizer_in_hook) t.compute(O);
    if (c.hook == Hook::kPostLocalSgd && m.world > 1) {
      // Every local_sgd_period steps the parameters are averaged: one flat copy (cat, divide,
      // and back) and an allreduce of all of them. The step predicted is the mean step.
      Comm average;
      average.cpu_ms = m.net.copy_ms(3 * P);
      average += m.net.collective(Op::kAllreduce, P);
      const double period = std::max(1, c.local_sgd_period);
      average.cpu_ms /= period;
      average.wire_ms /= period;
      average.wire_bytes /= period;
      t.wait_until(t.issue(average));
    }
    mem.optimizer_state = static_cast<int64_t>(m.state + m.temporaries);
    mem.communication = static_cast<int64_t>(ddp_communication_bytes(m, buckets, largest));
    return O;
  }
  // The shard's step, then every rank's updated shard to the others.
  const double shard = 1.0 / m.world;
  const double owned = s == Strategy::kZero1 ? largest_greedy_share(m.model, m.world) : shard;
  const double optimizer_ms = O * owned;
  t.compute(optimizer_ms);
  Comm sync = m.net.collective(s == Strategy::kZero1 ? Op::kBroadcast : Op::kAllgather, P);
  sync.cpu_ms += m.net.copy_ms(P * shard);
  t.issue(sync);
  t.wait_all();
  mem.optimizer_state = static_cast<int64_t>(m.state * owned + m.temporaries);  // whole parameters per rank
  // zero1: the flat copies every broadcast fills; zero2: the padded gradient buckets and the
  // shards of the gradients, beside DDP's buckets.
  mem.communication = static_cast<int64_t>(s == Strategy::kZero1 ? P * (m.world - 1) / m.world + P : 2 * P + P * shard);
  return optimizer_ms;
}

// FSDP's shape on this job: who shards with whom, and in what the units travel.
struct FsdpLayout {
  explicit FsdpLayout(const StepModel& m)
      : reshard_after_forward(m.c.strategy == Strategy::kFullShard || m.c.strategy == Strategy::kHybridShard),
        sharded(m.c.strategy != Strategy::kNoShard),
        low(m.c.hook == Hook::kFp16 || m.c.hook == Hook::kBf16),
        unit_elt(m.c.mixed_precision() ? 2 : 4),
        reduce_elt(m.c.reduced_in() == "bf16" ? 2 : 4),
        shard_job(sharding_job(m)),
        shard_net(shard_job, m.machine, m.cpu_scale),
        across(across_hosts_job(m.job)),
        between(across, m.machine, m.cpu_scale),
        shard_world(shard_job.world_size),
        // Sharded over one host's ranks in fp32, every shard lies in memory they share and a
        // unit is gathered where it lies, after a barrier at forward: no copy (docs/fsdp.md,
        // "Gathers on one host"). Mixed precision gathers bf16 copies of the shards.
        in_place(sharded && shard_world > 1 && (m.job.hosts == 1 || m.c.strategy == Strategy::kHybridShard) &&
                 !m.c.mixed_precision()) {}

  // hybrid_shard shards within a host and allreduces the shard between hosts.
  static JobSpec sharding_job(const StepModel& m) {
    JobSpec j = m.job;
    if (m.c.strategy == Strategy::kHybridShard) {
      j.world_size = m.rph;
      j.hosts = 1;
    }
    return j;
  }
  static JobSpec across_hosts_job(const JobSpec& job) {
    JobSpec j = job;
    j.world_size = job.hosts;
    return j;
  }

  const bool reshard_after_forward, sharded, low;
  const double unit_elt, reduce_elt;  // element sizes of the gathered units and of the gradients reduced
  const JobSpec shard_job;
  const Network shard_net;
  const JobSpec across;  // hybrid_shard: the shard's allreduce among the hosts
  const Network between;
  const int shard_world;
  const bool in_place;
};

// FSDP's memory for communication and the peers' shards it reads where they lie.
void fsdp_memory(const StepModel& m, const FsdpLayout& f, const std::vector<Unit>& units, MemoryBreakdown& mem) {
  const double P = m.P;
  int64_t largest = 0;
  for (const auto& u : units) largest = std::max(largest, u.numel);
  const double L = 4.0 * largest, Lu = f.unit_elt * largest, Lg = f.reduce_elt * largest;
  const double held = f.sharded ? P / f.shard_world : P;
  mem.parameters = static_cast<int64_t>(held);
  mem.gradients = static_cast<int64_t>(held);
  mem.optimizer_state = static_cast<int64_t>(state_per_param(m.job.optimizer) * held +
                                             (f.sharded ? m.temporaries / f.shard_world : m.temporaries));
  // Gathered in place: only the flat gradients, the unit's whose backward runs and the one
  // being reduced. Gathered privately (across hosts, or in bf16): full_shard holds the unit
  // computing, the one prefetched and the flat gradient; shard_grad_op every gathered unit from
  // forward to the end of backward. no_shard: its flat gradients are the gradients (allreduced
  // in place and kept) unless reduced in bf16 (then beside them); fp16/bf16 hooks allreduce a
  // unit's copy; in bf16, the parameters' bf16 copy. Gradients computed in bf16 and reduced in
  // fp32 are born outside the flat gradient: a unit's worth of them beside it.
  const bool mixed = m.c.mixed_precision();
  const double born = mixed && f.reduce_elt == 4 ? Lu : 0;
  if (!f.sharded) {
    const double flats = f.reduce_elt == 4 ? 0 : P * f.reduce_elt / 4;
    mem.communication = static_cast<int64_t>(mixed ? P * f.unit_elt / 4 + flats + born : f.low ? L / 2 : 0);
  } else if (!mixed) {
    mem.communication = static_cast<int64_t>(f.in_place ? 2 * L : f.reshard_after_forward ? 3 * L : P + L);
  } else {
    mem.communication = static_cast<int64_t>((f.reshard_after_forward ? 2 * Lu : P * f.unit_elt / 4) + Lg + born);
  }
  if (f.in_place) mem.host_shared += static_cast<int64_t>(P * (f.shard_world - 1) / f.shard_world);
}

// FSDP: forward gathering each unit, backward gathering ahead and reducing behind, then the
// shard's step. Returns the optimizer's ms.
double fsdp_step(const StepModel& m, Timeline& t, MemoryBreakdown& mem) {
  const Candidate& c = m.c;
  const FsdpLayout f(m);
  const auto units = fsdp_units(m.computed, m.F, m.B);
  auto gather = [&](const Unit& u) {
    if (f.in_place) return Comm{};
    Comm g = f.shard_net.collective(Op::kAllgather, f.unit_elt * u.numel);
    if (c.mixed_precision()) g.cpu_ms += m.net.cast_ms(4.0 * u.numel / f.shard_world);  // the shard into bf16
    return g;
  };
  auto reduce = [&](const Unit& u) {
    const double bytes = 4.0 * u.numel;
    // Gradients are born in the flat gradient on the CPU (docs/fsdp.md): no copy, unless they
    // are computed in bf16 and reduced in fp32 (cast into it).
    Comm r;
    if (c.mixed_precision() && f.reduce_elt == 4) r.cpu_ms += m.net.cast_ms(bytes);
    if (!f.sharded) {
      r += m.net.collective(Op::kAllreduce, f.reduce_elt * u.numel);
      return r;
    }
    if (f.low) r.cpu_ms += m.net.cast_ms(bytes);
    r += f.shard_net.collective(Op::kReduceScatter, f.low ? bytes / 2 : f.reduce_elt * u.numel);
    if (f.reduce_elt == 2 && !f.low) r.cpu_ms += m.net.cast_ms(bytes / f.shard_world);  // the shard's into fp32
    if (c.strategy == Strategy::kHybridShard && m.job.hosts > 1)
      r += f.between.collective(Op::kAllreduce, f.reduce_elt * u.numel / f.shard_world);
    return r;
  };
  // Forward: each unit gathered as it starts (no forward prefetch); unsharded under mixed
  // precision, cast from the fp32 parameters.
  for (const auto& u : units) {
    if (f.sharded) t.wait_until(t.issue(gather(u)));
    else if (c.mixed_precision()) t.compute(m.net.cast_ms(4.0 * u.numel));
    t.compute(u.forward_ms);
  }
  // Backward, last unit first: the next unit's gather goes out before this one computes
  // (BACKWARD_PRE), its reduction once its gradients are in.
  double next_gathered = t.now();
  for (size_t k = units.size(); k-- > 0;) {
    if (f.reshard_after_forward && k + 1 == units.size()) next_gathered = t.issue(gather(units[k]));
    t.wait_until(next_gathered);
    if (f.reshard_after_forward && k > 0) next_gathered = t.issue(gather(units[k - 1]));
    t.compute(units[k].backward_ms);
    t.issue(reduce(units[k]));
  }
  t.wait_all();
  const double optimizer_ms = f.sharded ? m.O / f.shard_world : m.O;
  t.compute(optimizer_ms);
  fsdp_memory(m, f, units, mem);
  return optimizer_ms;
}

// What every strategy holds beside its own accounting: the host's shared-memory slots, and the
// measured extras of communicating ranks.
void add_shared_slots_and_extras(const StepModel& m, MemoryBreakdown& mem) {
  const double P = m.P;
  // Every local rank's two collective slots (the default size), touched as data pass through
  // them; a model smaller than a slot touches less of each.
  if (m.rph > 1) {
    const double slot = static_cast<double>(ProcessGroupOptions().shm_slot_bytes());
    mem.host_shared += static_cast<int64_t>(m.rph * 2 * std::min(slot, P));
    // post_local_sgd's group is a process group of its own, with its own slots.
    const int in_group = m.local_sgd_group.ranks_per_host();
    if (m.c.hook == Hook::kPostLocalSgd && in_group > 1)
      mem.host_shared += static_cast<int64_t>(in_group * 2 * std::min(slot, P));
  }
  // Ranks that share no memory with a peer (between hosts) hold Gloo's buffers. A job of one rank
  // communicates nothing (every collective is the identity): neither's extras, which are what two
  // communicating ranks hold beyond the accounting. With Gloo's, one-rank DDP came out 12-22 % over.
  const auto& extras = m.job.hosts > 1 && !m.machine.extra_bytes_per_param_byte_gloo.empty()
                           ? m.machine.extra_bytes_per_param_byte_gloo
                           : m.machine.extra_bytes_per_param_byte;
  const auto extra = extras.find(measured_extra_key(m.c));
  if (extra != extras.end() && m.world > 1) mem.measured_extra = static_cast<int64_t>(extra->second * P);
}

}  // namespace

Prediction predict(const ModelProfile& model, const JobSpec& job, const MachineConstants& machine,
                   const Candidate& candidate) {
  if (candidate.choose_bucket_cap)
    return predict_choosing_bucket_cap(model, job, machine, candidate);
  Prediction out;
  out.candidate = checked_candidate(model, job, candidate);
  const StepModel m(model, job, machine, out.candidate);
  MemoryBreakdown& mem = out.memory;
  mem.process = machine.process_bytes;
  mem.data = model.data_bytes;
  mem.loading = machine.process_bytes + model.data_load_bytes;
  mem.activations = m.computed.activation_bytes;
  mem.parameters = static_cast<int64_t>(m.P);
  Timeline t(m.steals);
  const double optimizer_ms = out.candidate.is_fsdp() ? fsdp_step(m, t, mem) : ddp_step(m, t, mem);
  add_shared_slots_and_extras(m, mem);
  out.step_ms = t.now();
  out.compute_ms = m.F + m.B + optimizer_ms;
  out.exposed_comm_ms = std::max(0.0, out.step_ms - out.compute_ms);
  out.wire_bytes_per_step = t.wire_bytes();
  out.fits = job.memory_limit_bytes <= 0 || mem.total() <= job.memory_limit_bytes;
  return out;
}

std::vector<Prediction> rank_candidates(const ModelProfile& model, const JobSpec& job, const MachineConstants& machine,
                                        const std::vector<Candidate>& list) {
  std::vector<Prediction> rows;
  for (const auto& c : list) rows.push_back(predict(model, job, machine, c));
  std::stable_sort(rows.begin(), rows.end(), [](const Prediction& a, const Prediction& b) {
    if (a.fits != b.fits) return a.fits;
    return a.step_ms < b.step_ms;
  });
  return rows;
}

}  // namespace plan
}  // namespace ddpkit
