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

#include <algorithm>
#include <cmath>
#include <functional>

namespace ddpkit {
namespace plan {

int64_t ModelProfile::param_bytes() const {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel * 4;
  return n;
}

std::vector<Candidate> candidates(const JobSpec& job) {
  std::vector<Candidate> out;
  auto add = [&](const std::string& s, const std::string& h) {
    Candidate c;
    c.strategy = s;
    c.hook = h;
    out.push_back(c);
  };
  for (const char* h : {"none", "allreduce", "fp16", "bf16", "int8", "powersgd"}) add("ddp", h);
  add("zero1", "none");
  add("zero2", "none");
  for (const char* s : {"full_shard", "shard_grad_op", "no_shard"})
    for (const char* h : {"none", "bf16"}) add(s, h);
  if (job.hosts > 1)
    for (const char* h : {"none", "bf16"}) add("hybrid_shard", h);
  return out;
}

std::string measured_extra_key(const Candidate& c) {
  return c.strategy + "/" + c.hook + (c.mixed_precision() ? "+mp_" + c.param_dtype : "");
}

std::vector<Candidate> other_hook_candidates() {
  std::vector<Candidate> out;
  for (const char* h : {"fp16_wrapper", "bf16_wrapper", "quantize_per_tensor", "quantize_per_channel",
                        "batched_powersgd", "post_local_sgd", "noop"}) {
    Candidate c;
    c.hook = h;
    out.push_back(c);
  }
  return out;
}

namespace {

// ---- the step as a program ------------------------------------------------------------------

struct Comm {
  double cpu_ms = 0, wire_ms = 0, wire_bytes = 0;
  Comm& operator+=(const Comm& o) {
    cpu_ms += o.cpu_ms;
    wire_ms += o.wire_ms;
    wire_bytes += o.wire_bytes;
    return *this;
  }
};

// Runs compute segments and collectives on two clocks: the rank's compute, and the sequencer's.
class Timeline {
 public:
  explicit Timeline(bool cpu_steals) : steals_(cpu_steals) {}
  void compute(double ms) { compute_ += ms; }
  // Issues a collective now; returns when the sequencer finishes it.
  double issue(const Comm& c) {
    const double start = std::max(compute_, comm_);
    comm_ = start + c.cpu_ms + c.wire_ms;
    if (steals_) compute_ += c.cpu_ms;  // the rank's own core does the copies and sums
    wire_bytes_ += c.wire_bytes;
    return comm_;
  }
  void wait_until(double t) { compute_ = std::max(compute_, t); }
  void wait_all() { compute_ = std::max(compute_, comm_); }
  double now() const { return compute_; }
  double wire_bytes() const { return wire_bytes_; }

 private:
  bool steals_;
  double compute_ = 0, comm_ = 0, wire_bytes_ = 0;
};

// ---- collectives in this job's topology -------------------------------------------------------

enum class Op { kAllreduce, kAllreduceInPlace, kAllreduce16, kReduceScatter, kAllgather, kBroadcast, kAlltoall };

class Network {
 public:
  Network(const JobSpec& job, const MachineConstants& m, double cpu_scale)
      : job_(job), m_(m), scale_(cpu_scale), rph_(job.ranks_per_host()), hosts_(job.hosts) {}

  // `bytes`: the buffer each rank contributes (allreduce, reduce-scatter input, alltoall input) or
  // receives in all (allgather output, broadcast), as nccl-tests sizes them.
  Comm collective(Op op, double bytes) const {
    Comm c;
    if (job_.world_size <= 1 || bytes <= 0) return c;
    const bool reduce = op == Op::kAllreduce || op == Op::kAllreduceInPlace || op == Op::kAllreduce16;
    // ddpkit's hierarchy (shared memory within a host, Gloo between hosts) serves allreduce only;
    // with several hosts every other collective goes flat over Gloo among all ranks.
    const bool flat = hosts_ > 1 && !reduce;
    if (rph_ > 1 && !flat) {
      // Within the host: one shared-memory collective (a hierarchical allreduce's local
      // reduce and broadcast cost about what a local allreduce does).
      const double n = rph_;
      const double factor = reduce ? 2 * (n - 1) / n : (n - 1) / n;
      const PathCost& p = shm(hosts_ > 1 && op == Op::kAllreduceInPlace ? Op::kAllreduce : op);
      c.cpu_ms += scale_ * p.ms(factor * bytes);
    }
    if (flat) {
      // Each rank sends (n-1)/n of the buffer: to the other hosts' ranks over the link, which the
      // host's ranks share, and to its own host's over loopback TCP.
      const double n = job_.world_size;
      const double remote = (n - rph_) / n * bytes, loopback = (rph_ - 1) / n * bytes;
      c.wire_bytes += remote;
      tcp(c, remote + loopback, latency_ms() * (hosts_ - 1) + remote * rph_ / link_bytes_per_ms());
    } else if (hosts_ > 1) {
      // Allreduce between hosts: a ring of 2(h-1)/h of the buffer per host, split among the host's
      // ranks (each carries the slice it reduced locally).
      const double h = hosts_;
      const double host_wire = 2 * (h - 1) / h * bytes;
      c.wire_bytes += host_wire / rph_;
      tcp(c, host_wire / rph_, latency_ms() * 2 * (h - 1) + host_wire / link_bytes_per_ms());
    }
    return c;
  }
  double copy_ms(double bytes) const { return scale_ * bytes / (m_.copy_gbyte_per_s * 1e6); }
  double cast_ms(double fp32_bytes) const { return scale_ * fp32_bytes / (m_.cast_gbyte_per_s * 1e6); }
  double int8_ms(double fp32_bytes) const { return scale_ * fp32_bytes / (m_.int8_gbyte_per_s * 1e6); }
  double fp16_div_ms(double fp32_bytes) const { return scale_ * fp32_bytes / (m_.fp16_div_gbyte_per_s * 1e6); }
  double uint8_encode_ms(double fp32_bytes) const {
    return scale_ * fp32_bytes / (m_.uint8_encode_gbyte_per_s * 1e6);
  }
  double uint8_decode_ms(double fp32_bytes) const {
    return scale_ * fp32_bytes / (m_.uint8_decode_gbyte_per_s * 1e6);
  }
  int world() const { return job_.world_size; }
  double flops_ms(double flops) const { return scale_ * flops / (m_.matmul_gflop_per_s * 1e6); }
  // PowerSGD's three products on an n x m matrix at rank r (P = M Q, Q = M^T P, M ~ P Q^T). These
  // thin products run far below a layer's rate and their time per element grows with r: calibrated
  // at rank 4 (powerSGD_hook's default) and at rank 32 (batched_powerSGD_hook's), in between and
  // beyond along the line through the two, never faster than a layer's rate.
  double powersgd_products_ms(double n, double m, double r) const {
    const double per_element_4 = 2.0 * 4 / m_.matmul_gflop_per_s, per_element_32 = 2.0 * 32 / m_.matmul_rank32_gflop_per_s;
    const double per_element = std::max(per_element_4 + (per_element_32 - per_element_4) * (r - 4) / 28,
                                        2.0 * r / m_.gemm_gflop_per_s);
    return scale_ * 3 * n * m * per_element / 1e6;
  }
  bool one_host() const { return hosts_ == 1; }

 private:
  const PathCost& shm(Op op) const {
    switch (op) {
      case Op::kAllreduce: return m_.shm_allreduce;
      case Op::kAllreduceInPlace: return m_.shm_allreduce_in_place;
      case Op::kAllreduce16: return m_.shm_allreduce_16bit;
      case Op::kReduceScatter: return m_.shm_reduce_scatter;
      case Op::kAllgather: return m_.shm_allgather;
      case Op::kBroadcast: return m_.shm_broadcast;
      case Op::kAlltoall: return m_.shm_alltoall;
    }
    return m_.shm_allreduce;
  }
  // A rank's `bytes` through Gloo's TCP while the link takes `wire_ms`: the sockets' CPU (sends,
  // receives, sums) runs beside the wire, so the transfer lasts the longer of the two, and that
  // CPU comes out of the rank's core (Timeline::issue) when the ranks fill the cores.
  void tcp(Comm& c, double bytes, double wire_ms) const {
    const double cpu = scale_ * bytes / (m_.tcp_gbyte_per_s * 1e6);
    c.cpu_ms += cpu;
    c.wire_ms += std::max(0.0, wire_ms - cpu);
  }
  double link_bytes_per_ms() const { return job_.link_gbit * 1e9 / 8 * m_.tcp_efficiency / 1e3; }
  double latency_ms() const { return (job_.link_latency_us > 0 ? job_.link_latency_us : m_.tcp_latency_us) * 1e-3; }
  const JobSpec& job_;
  const MachineConstants& m_;
  double scale_;
  int rph_, hosts_;
};

// ---- DDP buckets ----------------------------------------------------------------------------

struct Bucket {
  std::vector<size_t> params;
  int64_t numel = 0;
  double ready_ms = 0;  // the last of its gradients, from the start of backward
};

// The Reducer's own assignment (compute_bucket_assignment_by_size over shape-only tensors, in
// reverse registration order, DDP's first-bucket cap then the cap), ordered by readiness.
std::vector<Bucket> ddp_buckets(const ModelProfile& model, double cap_mb, double time_scale) {
  std::vector<at::Tensor> shapes;
  std::vector<size_t> reversed;
  for (size_t k = 0; k < model.params.size(); ++k) {
    shapes.push_back(at::empty(model.params[k].shape, at::TensorOptions().dtype(at::kFloat).device(at::kMeta)));
    reversed.push_back(model.params.size() - 1 - k);
  }
  const auto mib = [](double mb) { return static_cast<size_t>(mb * 1024 * 1024); };
  const BucketAssignment assignment = compute_bucket_assignment_by_size(
      shapes, {mib(DistributedDataParallelOptions().first_bucket_cap_mb()), mib(cap_mb)}, {}, reversed);
  std::vector<Bucket> out;
  for (const auto& indices : assignment.buckets) {
    Bucket b;
    b.params = indices;
    for (size_t k : indices) {
      b.numel += model.params[k].numel;
      b.ready_ms = std::max(b.ready_ms, model.params[k].grad_ready_ms * time_scale);
    }
    out.push_back(b);
  }
  std::stable_sort(out.begin(), out.end(), [](const Bucket& a, const Bucket& b) { return a.ready_ms < b.ready_ms; });
  return out;
}

int powersgd_rank_of(const Candidate& c) { return c.powersgd_rank > 0 ? c.powersgd_rank : hooks::default_powersgd_rank(c.hook); }

// PowerSGD on one bucket: its matrices worth compressing travel as P (n x r) and Q (m x r); the
// rest (vectors, small matrices) as one plain allreduce.
Comm powersgd_bucket(const ModelProfile& model, const Bucket& b, int r, const Network& net) {
  Comm total;
  double plain = 0, p_bytes = 0, q_bytes = 0, flops = 0, compressed = 0, products_ms = 0;
  for (size_t k : b.params) {
    const auto& shape = model.params[k].shape;
    int64_t n = shape.empty() ? 1 : shape[0], m = 1;
    for (size_t d = 1; d < shape.size(); ++d) m *= shape[d];
    if (shape.size() >= 2 && static_cast<double>((n + m) * r) * 2 < static_cast<double>(n * m)) {
      p_bytes += 4.0 * n * r;
      q_bytes += 4.0 * m * r;
      products_ms += net.powersgd_products_ms(n, m, r);
      flops += 2.0 * n * r * r;  // P's orthogonalization
      compressed += 4.0 * n * m;
    } else {
      plain += 4.0 * model.params[k].numel;
    }
  }
  // The hook works a matrix in cache-sized blocks of rows: last step's error is added to a block
  // the first product then reads from cache, and the third product's block is written back to
  // the bucket and subtracted into the new error from cache. Beyond the products, one pass over
  // the compressed matrices (bench/powersgd_passes.py times the hook's passes alone).
  total.cpu_ms += products_ms + net.flops_ms(flops) + net.copy_ms(compressed);
  if (plain > 0) total += net.collective(Op::kAllreduce, plain);
  if (p_bytes > 0) total += net.collective(Op::kAllreduce, p_bytes);
  if (q_bytes > 0) total += net.collective(Op::kAllreduce, q_bytes);
  return total;
}

// batched_powerSGD_hook: the bucket as one zero-padded square matrix, compressed at rank r.
Comm batched_powersgd_bucket(const Bucket& b, int r, const Network& net) {
  const double side = std::ceil(std::sqrt(static_cast<double>(b.numel)));
  const double rank = std::min(side, static_cast<double>(r));
  const double padded = 4.0 * side * side, factor = 4.0 * side * rank;
  Comm total;
  // The padded copy with last step's error added, the new error, and the result back: as
  // powerSGD_hook's three passes; P = M Q, Q = M^T P, M ~ P Q^T and P's orthogonalization.
  total.cpu_ms += net.powersgd_products_ms(side, side, rank) + net.flops_ms(2.0 * side * rank * rank) +
                  net.copy_ms(3 * padded) + net.copy_ms(2 * 4.0 * b.numel);
  total += net.collective(Op::kAllreduce, factor);
  total += net.collective(Op::kAllreduce, factor);
  return total;
}

// `subgroup`: post_local_sgd's group of consecutive ranks (subgroup_job).
Comm ddp_bucket(const ModelProfile& model, const JobSpec& job, const Candidate& c, const Bucket& b,
                const Network& net, const Network& subgroup) {
  const double bytes = 4.0 * b.numel;
  Comm comm;
  const std::string& h = c.hook;
  if (h == "noop") return comm;
  if (h == "none") {
    if (job.world_size > 1 && net.one_host()) return net.collective(Op::kAllreduceInPlace, bytes);
    comm.cpu_ms += net.copy_ms(2 * bytes);  // gradients into the bucket and back
    comm += net.collective(Op::kAllreduce, bytes);
    return comm;
  }
  comm.cpu_ms += net.copy_ms(2 * bytes);
  if (h == "allreduce") {
    comm += net.collective(Op::kAllreduce, bytes);
  } else if (h == "fp16" || h == "bf16") {
    comm.cpu_ms += net.cast_ms(bytes);
    comm += net.collective(Op::kAllreduce16, bytes / 2);
  } else if (h == "int8") {
    comm.cpu_ms += net.int8_ms(bytes);
    // Two alltoalls of one byte per element plus a 4-byte scale per 512.
    const double payload = bytes / 4 * (1 + 4.0 / 512);
    comm += net.collective(Op::kAlltoall, payload);
    comm += net.collective(Op::kAlltoall, payload);
  } else if (h == "fp16_wrapper" || h == "bf16_wrapper") {
    // compress_wrapper around allreduce_hook: a 16-bit copy of the bucket, divided by ATen (a
    // pass at the copy rate in bf16, far slower in float16), allreduced through the slots (not
    // cast in pieces there, as fp16/bf16 are), cast back.
    comm.cpu_ms += net.cast_ms(bytes) + (h == "fp16_wrapper" ? net.fp16_div_ms(bytes) : net.copy_ms(bytes / 2));
    comm += net.collective(Op::kAllreduce, bytes / 2);
  } else if (h == "quantize_per_tensor" || h == "quantize_per_channel") {
    // PyTorch's hooks: uint8 codes of the bucket gathered from every rank, each rank's decoded
    // into their mean in the bucket (one pass).
    comm.cpu_ms += net.uint8_encode_ms(bytes) + net.world() * net.uint8_decode_ms(bytes);
    comm += net.collective(Op::kAllgather, net.world() * bytes / 4);
  } else if (h == "powersgd") {
    comm += powersgd_bucket(model, b, powersgd_rank_of(c), net);
  } else if (h == "batched_powersgd") {
    comm += batched_powersgd_bucket(b, powersgd_rank_of(c), net);
  } else if (h == "post_local_sgd") {
    // Past its start the hook allreduces the bucket within the rank's group (--local-sgd-group-size),
    // else leaves it local: the bucket's copies alone.
    if (c.local_sgd_group_size > 1) comm += subgroup.collective(Op::kAllreduce, bytes);
  } else {
    DDPKIT_CHECK(false, "the cost model has no hook '", h, "'");
  }
  return comm;
}

// post_local_sgd's subgroups: `size` consecutive ranks, within a host where they fit in one, else
// whole hosts of them.
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

// Candidate::kChooseBucketCap: each cap online tuning would try, predicted. The fastest that fits
// (where the default fits) replaces the default only by the tuner's margin: a predicted gain
// smaller than that would not survive the run's own trials either.
Prediction predict_choosing_bucket_cap(const ModelProfile& model, const JobSpec& job, const MachineConstants& machine,
                                       Candidate c) {
  c.bucket_cap_mb = 0;
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

Prediction predict(const ModelProfile& model, const JobSpec& job, const MachineConstants& machine,
                   const Candidate& candidate) {
  if (candidate.bucket_cap_mb == Candidate::kChooseBucketCap)
    return predict_choosing_bucket_cap(model, job, machine, candidate);
  DDPKIT_CHECK(candidate.bucket_cap_mb >= 0, "plan: a bucket cap must be positive (or 0 for the hook's default), got ",
               candidate.bucket_cap_mb, " MiB");
  DDPKIT_CHECK(job.world_size >= 1 && job.hosts >= 1 && job.hosts <= job.world_size,
               "plan: need 1 <= hosts (", job.hosts, ") <= world size (", job.world_size, ")");
  DDPKIT_CHECK(job.world_size % job.hosts == 0, "plan: the world size (", job.world_size,
               ") must be a multiple of the host count (", job.hosts, ")");
  DDPKIT_CHECK(!model.params.empty(), "plan: the model profile has no parameters");
  Prediction out;
  out.candidate = candidate;
  Candidate& c = out.candidate;
  if (c.bucket_cap_mb <= 0) c.bucket_cap_mb = hooks::default_bucket_cap_mb(c.hook);
  const std::string& s = c.strategy;
  const bool fsdp = c.is_fsdp();
  const bool ddp = s == "ddp" || s == "zero1" || s == "zero2";
  DDPKIT_CHECK(fsdp || ddp, "plan: unknown strategy '", s, "' (ddp, zero1, zero2, full_shard, shard_grad_op, ",
               "no_shard, hybrid_shard)");
  DDPKIT_CHECK(!fsdp || c.hook == "none" || c.hook == "fp16" || c.hook == "bf16",
               "plan: FSDP takes hook none, fp16 or bf16, got '", c.hook, "'");
  DDPKIT_CHECK(s == "ddp" || fsdp || c.hook == "none", "plan: ", s, " takes no hook, got '", c.hook, "'");
  DDPKIT_CHECK(!c.optimizer_in_hook || s == "ddp", "plan: the optimizer runs in DDP's hook only, not with ", s);
  const std::string& reduce_dtype = c.reduced_in();
  DDPKIT_CHECK((c.param_dtype == "fp32" || c.param_dtype == "bf16") && (reduce_dtype == "fp32" || reduce_dtype == "bf16"),
               "plan: mixed precision's dtypes are fp32 or bf16, got param '", c.param_dtype, "' reduce '",
               c.reduce_dtype, "'");
  DDPKIT_CHECK(c.mixed_precision() || reduce_dtype == "fp32", "plan: with fp32 parameters, reduce in bf16 with ",
               "hook bf16 (the reduce dtype alone is not modelled)");
  DDPKIT_CHECK(!c.mixed_precision() || (fsdp && c.hook == "none"), "plan: mixed precision is FSDP's, with hook none (",
               s, " / ", c.hook, ")");
  DDPKIT_CHECK(!c.mixed_precision() || model.bf16, "plan: the profile has no bf16 compute for mixed precision ",
               "(ddpkit plan --fsdp-param-dtype bf16 profiles it; a description gives it as \"bf16\")");
  if (c.optimizer_in_hook && c.hook == "none") c.hook = "allreduce";  // what train registers
  if (c.hook == "post_local_sgd") {
    const int g = c.local_sgd_group_size;
    DDPKIT_CHECK(g >= 0 && (g == 0 || job.world_size % g == 0), "plan: the local SGD group size (", g,
                 ") must divide the world size (", job.world_size, ")");
    DDPKIT_CHECK(g <= job.ranks_per_host() || g % job.ranks_per_host() == 0, "plan: a local SGD group of ", g,
                 " ranks must be whole hosts of ", job.ranks_per_host(), " when it spans hosts");
  }

  const int world = job.world_size, rph = job.ranks_per_host();
  // Cores: busy threads beyond them stretch everything that runs on the CPU.
  const int cores = std::max(1, job.cores_per_host > 0 ? job.cores_per_host : machine.cores);
  const double busy = static_cast<double>(rph) * job.threads;
  const double measured_busy = static_cast<double>(model.concurrent) * model.threads;
  // The profile timed `concurrent` replicas on this machine's cores: contention up to there is in
  // its figures, time-sharing beyond it is not.
  const double scale = std::max(1.0, busy / cores) / std::max(1.0, measured_busy / std::max(1, machine.cores));
  const bool steals = busy >= cores;
  const double cpu_scale = std::max(1.0, busy / cores);
  const Network net(job, machine, cpu_scale);
  const JobSpec local_sgd_group = subgroup_job(job, c.local_sgd_group_size);
  const Network subgroup(local_sgd_group, machine, cpu_scale);
  // Under mixed precision forward and backward are the bf16 profile's; the fp32 shards' step is not.
  ModelProfile in_bf16;
  if (c.mixed_precision()) {
    in_bf16 = model;
    in_bf16.forward_ms = model.bf16->forward_ms;
    in_bf16.backward_ms = model.bf16->backward_ms;
    in_bf16.activation_bytes = model.bf16->activation_bytes;
    for (size_t k = 0; k < in_bf16.params.size() && k < model.bf16->grad_ready_ms.size(); ++k)
      in_bf16.params[k].grad_ready_ms = model.bf16->grad_ready_ms[k];
  }
  const ModelProfile& computed = c.mixed_precision() ? in_bf16 : model;
  const double F = computed.forward_ms * scale, B = computed.backward_ms * scale, O = model.optimizer_ms * scale;
  const double P = static_cast<double>(model.param_bytes());
  const double shard = 1.0 / world;
  double optimizer_ms = O;  // the step over what this rank updates

  Timeline t(steals);
  MemoryBreakdown& mem = out.memory;
  mem.process = machine.process_bytes;
  mem.data = model.data_bytes;
  mem.loading = machine.process_bytes + model.data_load_bytes;
  mem.activations = computed.activation_bytes;
  mem.parameters = static_cast<int64_t>(P);
  const double state = state_per_param(job.optimizer) * P;
  const double temporaries = step_temporaries(model, job.optimizer);

  if (ddp) {
    const auto buckets = ddp_buckets(model, c.bucket_cap_mb, scale);
    double largest = 0;
    t.compute(F);
    double at = 0;
    for (const auto& b : buckets) {
      largest = std::max(largest, 4.0 * b.numel);
      t.compute(std::max(0.0, b.ready_ms - at));
      at = std::max(at, b.ready_ms);
      if (s == "zero2") {
        // zero2_hook: gradients into the bucket, the bucket into its padded copy, the bucket
        // zeroed around the shard, and back into the gradients: four passes over it.
        Comm rs;
        rs.cpu_ms = net.copy_ms(4 * 4.0 * b.numel);
        rs += net.collective(Op::kReduceScatter, 4.0 * b.numel);
        t.issue(rs);
      } else {
        Comm comm = ddp_bucket(model, job, c, b, net, subgroup);
        // In the hook, the bucket's share of the optimizer's step follows its communication, on
        // the thread that completes it (holding the next bucket's collective back).
        if (c.optimizer_in_hook) comm.cpu_ms += O * 4.0 * b.numel / P;
        t.issue(comm);
      }
    }
    t.compute(std::max(0.0, B - at));
    t.wait_all();
    mem.gradients = static_cast<int64_t>(P);
    if (s == "ddp") {
      if (!c.optimizer_in_hook) t.compute(optimizer_ms);
      if (c.hook == "post_local_sgd" && world > 1) {
        // Every local_sgd_period steps the parameters are averaged: one flat copy (cat, divide,
        // and back) and an allreduce of all of them. The step predicted is the mean step.
        Comm average;
        average.cpu_ms = net.copy_ms(3 * P);
        average += net.collective(Op::kAllreduce, P);
        const double period = std::max(1, c.local_sgd_period);
        average.cpu_ms /= period;
        average.wire_ms /= period;
        average.wire_bytes /= period;
        t.wait_until(t.issue(average));
      }
      mem.optimizer_state = static_cast<int64_t>(state + temporaries);
      // Buckets: summed in place in shared memory, each rank writes its peers' shares there;
      // else every bucket is a copy of the gradients, plus what the hook encodes into.
      const bool in_place = c.hook == "none" && world > 1 && job.hosts == 1;
      double comm = in_place ? P * (world - 1) / world : P;
      if (c.hook == "fp16" || c.hook == "bf16") comm += largest / 2 * 2;
      if (c.hook == "fp16_wrapper" || c.hook == "bf16_wrapper") comm += largest / 2;
      if (c.hook == "int8") comm += largest / 4 * 2;
      // The codes from every rank (decoded straight into the bucket).
      if (c.hook == "quantize_per_tensor" || c.hook == "quantize_per_channel") comm += largest / 4 * (world + 1);
      if (c.hook == "powersgd") comm += P;  // error feedback
      // Per bucket, kept: its padded square, the error fed back and the input's copy.
      if (c.hook == "batched_powersgd")
        for (const auto& b : buckets) comm += 3 * 4.0 * std::pow(std::ceil(std::sqrt(static_cast<double>(b.numel))), 2);
      if (c.hook == "post_local_sgd") comm += P;  // the flat copy averaging makes
      if (c.hook == "noop") comm = P;
      mem.communication = static_cast<int64_t>(comm);
    } else {
      // The shard's step, then every rank's updated shard to the others.
      const double owned = s == "zero1" ? largest_greedy_share(model, world) : shard;
      optimizer_ms = O * owned;
      t.compute(optimizer_ms);
      Comm sync = net.collective(s == "zero1" ? Op::kBroadcast : Op::kAllgather, P);
      sync.cpu_ms += net.copy_ms(P * shard);
      t.issue(sync);
      t.wait_all();
      mem.optimizer_state = static_cast<int64_t>(state * owned + temporaries);  // whole parameters per rank
      // zero1: the flat copies every broadcast fills; zero2: the padded gradient buckets and
      // the shards of the gradients, beside DDP's buckets.
      mem.communication = static_cast<int64_t>(s == "zero1" ? P * (world - 1) / world + P : 2 * P + P * shard);
    }
  } else {
    const auto units = fsdp_units(computed, F, B);
    const bool reshard_after_forward = s == "full_shard" || s == "hybrid_shard";
    const bool sharded = s != "no_shard";
    const bool low = c.hook == "fp16" || c.hook == "bf16";
    // Element sizes of the gathered units and of the gradients reduced.
    const double unit_elt = c.mixed_precision() ? 2 : 4, reduce_elt = reduce_dtype == "bf16" ? 2 : 4;
    // hybrid_shard shards within a host and allreduces the shard between hosts.
    JobSpec shard_job = job;
    if (s == "hybrid_shard") {
      shard_job.world_size = rph;
      shard_job.hosts = 1;
    }
    const Network shard_net(shard_job, machine, cpu_scale);
    JobSpec across = job;  // hybrid_shard: the shard's allreduce among the hosts
    across.world_size = job.hosts;
    const Network between(across, machine, cpu_scale);
    const int shard_world = shard_job.world_size;
    // Sharded over one host's ranks in fp32, every shard lies in memory they share and a unit is
    // gathered where it lies, after a barrier at forward: no copy (docs/fsdp.md, "Gathers on one
    // host"). Mixed precision gathers bf16 copies of the shards.
    const bool in_place = sharded && shard_world > 1 && (job.hosts == 1 || s == "hybrid_shard") && !c.mixed_precision();
    auto gather = [&](const Unit& u) {
      if (in_place) return Comm{};
      Comm g = shard_net.collective(Op::kAllgather, unit_elt * u.numel);
      if (c.mixed_precision()) g.cpu_ms += net.cast_ms(4.0 * u.numel / shard_world);  // the shard into bf16
      return g;
    };
    auto reduce = [&](const Unit& u) {
      const double bytes = 4.0 * u.numel;
      // Gradients are born in the flat gradient on the CPU (docs/fsdp.md): no copy, unless they
      // are computed in bf16 and reduced in fp32 (cast into it).
      Comm r;
      if (c.mixed_precision() && reduce_elt == 4) r.cpu_ms += net.cast_ms(bytes);
      if (!sharded) {
        r += net.collective(Op::kAllreduce, reduce_elt * u.numel);
        return r;
      }
      if (low) r.cpu_ms += net.cast_ms(bytes);
      r += shard_net.collective(Op::kReduceScatter, low ? bytes / 2 : reduce_elt * u.numel);
      if (reduce_elt == 2 && !low) r.cpu_ms += net.cast_ms(bytes / shard_world);  // the shard's into fp32
      if (s == "hybrid_shard" && job.hosts > 1) r += between.collective(Op::kAllreduce, reduce_elt * u.numel / shard_world);
      return r;
    };
    // Forward: each unit gathered as it starts (no forward prefetch); unsharded under mixed
    // precision, cast from the fp32 parameters.
    for (const auto& u : units) {
      if (sharded) t.wait_until(t.issue(gather(u)));
      else if (c.mixed_precision()) t.compute(net.cast_ms(4.0 * u.numel));
      t.compute(u.forward_ms);
    }
    // Backward, last unit first: the next unit's gather goes out before this one computes
    // (BACKWARD_PRE), its reduction once its gradients are in.
    double next_gathered = t.now();
    for (size_t k = units.size(); k-- > 0;) {
      if (reshard_after_forward && k + 1 == units.size()) next_gathered = t.issue(gather(units[k]));
      t.wait_until(next_gathered);
      if (reshard_after_forward && k > 0) next_gathered = t.issue(gather(units[k - 1]));
      t.compute(units[k].backward_ms);
      t.issue(reduce(units[k]));
    }
    t.wait_all();
    if (sharded) optimizer_ms = O / shard_world;
    t.compute(optimizer_ms);
    int64_t largest = 0;
    for (const auto& u : units) largest = std::max(largest, u.numel);
    const double L = 4.0 * largest, Lu = unit_elt * largest, Lg = reduce_elt * largest;
    const double held = sharded ? P / shard_world : P;
    mem.parameters = static_cast<int64_t>(held);
    mem.gradients = static_cast<int64_t>(held);
    mem.optimizer_state = static_cast<int64_t>(state_per_param(job.optimizer) * held +
                                               (sharded ? temporaries / shard_world : temporaries));
    // Gathered in place: only the flat gradients, the unit's whose backward runs and the one
    // being reduced. Gathered privately (across hosts, or in bf16): full_shard holds the unit
    // computing, the one prefetched and the flat gradient; shard_grad_op every gathered unit from
    // forward to the end of backward. no_shard: its flat gradients are the gradients (allreduced
    // in place and kept) unless reduced in bf16 (then beside them); fp16/bf16 hooks allreduce a
    // unit's copy; in bf16, the parameters' bf16 copy. Gradients computed in bf16 and reduced in
    // fp32 are born outside the flat gradient: a unit's worth of them beside it.
    const double born = c.mixed_precision() && reduce_elt == 4 ? Lu : 0;
    if (!sharded) {
      const double flats = reduce_elt == 4 ? 0 : P * reduce_elt / 4;
      mem.communication = static_cast<int64_t>(c.mixed_precision() ? P * unit_elt / 4 + flats + born : low ? L / 2 : 0);
    } else if (!c.mixed_precision()) {
      mem.communication = static_cast<int64_t>(in_place ? 2 * L : reshard_after_forward ? 3 * L : P + L);
    } else {
      mem.communication = static_cast<int64_t>((reshard_after_forward ? 2 * Lu : P * unit_elt / 4) + Lg + born);
    }
    // The peers' shards of every unit, read where they lie.
    if (in_place) mem.host_shared += static_cast<int64_t>(P * (shard_world - 1) / shard_world);
  }
  // Every local rank's two collective slots (the default size), touched as data pass through
  // them; a model smaller than a slot touches less of each.
  if (rph > 1) {
    const double slot = static_cast<double>(ProcessGroupOptions().shm_slot_bytes());
    mem.host_shared += static_cast<int64_t>(rph * 2 * std::min(slot, P));
    // post_local_sgd's group is a process group of its own, with its own slots.
    const int in_group = local_sgd_group.ranks_per_host();
    if (c.hook == "post_local_sgd" && in_group > 1) mem.host_shared += static_cast<int64_t>(in_group * 2 * std::min(slot, P));
  }
  // Ranks that share no memory with a peer (between hosts) hold Gloo's buffers. A job of one rank
  // communicates nothing (every collective is the identity): neither's extras, which are what two
  // communicating ranks hold beyond the accounting. With Gloo's, one-rank DDP came out 12-22 % over.
  const auto& extras = job.hosts > 1 && !machine.extra_bytes_per_param_byte_gloo.empty()
                           ? machine.extra_bytes_per_param_byte_gloo
                           : machine.extra_bytes_per_param_byte;
  const auto extra = extras.find(measured_extra_key(c));
  if (extra != extras.end() && world > 1) mem.measured_extra = static_cast<int64_t>(extra->second * P);
  out.step_ms = t.now();
  out.compute_ms = F + B + optimizer_ms;
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
