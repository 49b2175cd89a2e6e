// The step as a program, and what collectives cost in a job's topology (internal to the cost
// model, src/plan/cost_model.cpp; the reasoning is in docs/plan.md).
#pragma once

#include <ddpkit/plan/cost_model.h>

#include <algorithm>
#include <vector>

namespace ddpkit {
namespace plan {
namespace detail {

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

// ---- DDP buckets (src/plan/bucket_costs.cpp) -------------------------------------------------

struct Bucket {
  std::vector<size_t> params;
  int64_t numel = 0;
  double ready_ms = 0;  // the last of its gradients, from the start of backward
};

// The Reducer's own assignment (compute_bucket_assignment_by_size over shape-only tensors, in
// reverse registration order, DDP's first-bucket cap then the cap), ordered by readiness.
std::vector<Bucket> ddp_buckets(const ModelProfile& model, double cap_mb, double time_scale);
// One bucket's communication under candidate c's hook: its codec's CPU and its collectives, on
// `net` (the whole job) or `subgroup` (post_local_sgd's group).
Comm ddp_bucket(const ModelProfile& model, const JobSpec& job, const Candidate& c, const Bucket& b, const Network& net,
                const Network& subgroup);

}  // namespace detail
}  // namespace plan
}  // namespace ddpkit
