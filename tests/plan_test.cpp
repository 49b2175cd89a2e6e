// The cost model's arithmetic on a profile and constants given here (no measurement): the
// schedule, the topology, memory accounting and the file format. How well it predicts this
// machine is bench/plan_validation.py's (ctest -L plan).
#include <ddpkit/plan/cost_model.h>

#include <c10/util/Exception.h>
#include <cmath>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

using namespace ddpkit::plan;
using ::testing::HasSubstr;

namespace {

// Four 1024x1024 layers (4 MiB each), gradients ready evenly through a 40 ms backward.
ModelProfile four_layers() {
  ModelProfile m;
  m.forward_ms = 20;
  m.backward_ms = 40;
  m.optimizer_ms = 8;
  m.activation_bytes = 1 << 20;
  m.data_bytes = 10 << 20;
  m.batch = 32;
  for (int l = 0; l < 4; ++l) {
    ParamProfile p;
    p.numel = 1024 * 1024;
    p.shape = {1024, 1024};
    p.unit = l;
    p.grad_ready_ms = 10.0 * (4 - l);  // the last layer's gradient first
    m.params.push_back(p);
    m.unit_numel.push_back(p.numel);
  }
  return m;
}

MachineConstants machine(int cores) {
  MachineConstants c;
  c.cores = cores;
  for (PathCost* p : {&c.shm_allreduce_in_place, &c.shm_allreduce, &c.shm_allreduce_16bit, &c.shm_reduce_scatter,
                      &c.shm_allgather, &c.shm_broadcast, &c.shm_alltoall})
    *p = PathCost{0, 1.0};  // 1 GB/s: 1 ms per MB of bus bytes
  c.copy_gbyte_per_s = 1e6;  // copies and codecs free, to read the transfers alone
  c.cast_gbyte_per_s = 1e6;
  c.fp16_div_gbyte_per_s = 1e6;
  c.int8_gbyte_per_s = 1e6;
  c.uint8_encode_gbyte_per_s = 1e6;
  c.uint8_decode_gbyte_per_s = 1e6;
  c.matmul_gflop_per_s = 1e6;
  c.matmul_rank32_gflop_per_s = 1e6;
  c.gemm_gflop_per_s = 1e6;
  c.tcp_latency_us = 0;
  c.tcp_efficiency = 1;
  c.tcp_gbyte_per_s = 1e6;  // sockets free too
  c.process_bytes = 100 << 20;
  return c;
}

// A candidate by the CLI's names; cap 0: the hook's default, kChooseBucketCap: chosen as tuning would.
constexpr double kChooseBucketCap = -1;
Candidate with(const std::string& strategy, const std::string& hook, double cap_mb = 0) {
  Candidate c;
  c.strategy = parse_strategy(strategy);
  c.hook = parse_hook(hook);
  if (cap_mb != 0 && cap_mb != kChooseBucketCap) c.bucket_cap_mb = cap_mb;
  c.choose_bucket_cap = cap_mb == kChooseBucketCap;
  return c;
}

}  // namespace

TEST(Plan, Fp16WrapperPaysAtenFloat16Division) {
  JobSpec job;
  job.world_size = 2;
  MachineConstants slow = machine(2);
  slow.fp16_div_gbyte_per_s = 1;  // 1 ms per MB of fp32 gradients
  const double P = 16.0 * (1 << 20);
  for (const char* hook : {"fp16_wrapper", "bf16_wrapper"}) {
    const double fast_ms = predict(four_layers(), job, machine(2), with("ddp", hook)).step_ms;
    const double slow_ms = predict(four_layers(), job, slow, with("ddp", hook)).step_ms;
    // Two ranks on two cores: the division comes out of the rank's compute, whole.
    EXPECT_NEAR(slow_ms - fast_ms, std::string(hook) == "fp16_wrapper" ? P / 1e6 : 0, 1e-3) << hook;
  }
}

// PowerSGD's thin products: per element, as calibrated at ranks 4 and 32, along the line through
// them elsewhere, and never faster than a layer's products.
TEST(Plan, PowerSgdsProductsCostWhatTheRankCalibratedThem) {
  JobSpec job;
  job.world_size = 2;
  MachineConstants slow = machine(2);
  slow.matmul_gflop_per_s = 8;          // rank 4: 8 flops an element, 1 ns
  slow.matmul_rank32_gflop_per_s = 32;  // rank 32: 64 flops an element, 2 ns
  slow.gemm_gflop_per_s = 40;           // a layer's: 2r/40 ns an element, above the line at rank 64
  const double elements = 4.0 * 1024 * 1024;  // four 1024 x 1024 matrices, all compressed
  for (const auto& [rank, ns] : std::vector<std::pair<int, double>>{{4, 1}, {32, 2}, {18, 1.5}, {64, 3.2}}) {
    Candidate c = with("ddp", "powersgd");
    c.powersgd_rank = rank;
    const double fast_ms = predict(four_layers(), job, machine(2), c).step_ms;
    const double slow_ms = predict(four_layers(), job, slow, c).step_ms;
    // Two ranks on two cores: the three products, and P's orthogonalization (2 n r^2 flops a
    // matrix at the rank-4 rate), come out of the rank's compute whole.
    const double orthogonalization_ms = 4 * 2.0 * 1024 * rank * rank / (8 * 1e6);
    // (The free machine's own products: under 2 us.)
    EXPECT_NEAR(slow_ms - fast_ms, 3 * elements * ns / 1e6 + orthogonalization_ms, 0.01) << "rank " << rank;
  }
}

TEST(Plan, RanksThatFillTheCoresPayForTheirSumsInTheStep) {
  JobSpec job;
  job.world_size = 2;
  // Two ranks on two cores: every shared-memory sum comes out of compute.
  const Prediction p = predict(four_layers(), job, machine(2), with("ddp", "none", 4));
  // 16 MiB allreduced at 2(n-1)/n = 1: 16.8 ms at 1 GB/s, on top of 68 ms of compute.
  const double sums = 16.0 * (1 << 20) / 1e6;
  EXPECT_NEAR(p.step_ms, 68 + sums, 1e-6);
  EXPECT_NEAR(p.exposed_comm_ms, sums, 1e-6);
}

TEST(Plan, ASpareCoreHidesSumsBehindBackward) {
  JobSpec job;
  job.world_size = 2;
  // Four cores: each bucket's 4.2 ms sum runs beside the next 10 ms of backward; only the last
  // bucket's (the first layer's, ready at the end) is exposed.
  const Prediction p = predict(four_layers(), job, machine(4), with("ddp", "none", 4));
  const double bucket = 4.0 * (1 << 20) / 1e6;
  EXPECT_NEAR(p.step_ms, 68 + bucket, 1e-6);
}

// Two hosts of one rank each, joined by a 1 Gbit/s link.
static JobSpec two_hosts_at_1gbit() {
  JobSpec job;
  job.world_size = 2;
  job.hosts = 2;
  job.link_gbit = 1;
  return job;
}

TEST(Plan, ALinkCarriesWhatEachHookSends) {
  JobSpec job = two_hosts_at_1gbit();
  const auto m = machine(4);
  const Prediction fp32 = predict(four_layers(), job, m, with("ddp", "allreduce"));
  const Prediction fp16 = predict(four_layers(), job, m, with("ddp", "fp16"));
  const Prediction int8 = predict(four_layers(), job, m, with("ddp", "int8"));
  // One rank per host: a 2-rank ring sends the whole buffer once.
  EXPECT_NEAR(fp32.wire_bytes_per_step, 16.0 * (1 << 20), 1);
  EXPECT_NEAR(fp16.wire_bytes_per_step, 8.0 * (1 << 20), 1);
  EXPECT_NEAR(int8.wire_bytes_per_step, 2 * 0.5 * 4.0 * (1 << 20) * (1 + 4.0 / 512), 1);  // two alltoalls
  // 16 MiB at 1 Gbit/s is 134 ms: the step is bound by the link.
  EXPECT_GT(fp32.step_ms, 134);
  EXPECT_LT(fp16.step_ms, fp32.step_ms);
  job.link_gbit = 100;
  EXPECT_LT(predict(four_layers(), job, m, with("ddp", "allreduce")).step_ms, fp32.step_ms / 2);
}

// Gloo's time per message between hosts: the job's figure where it gives one, else the
// machine's loopback one. Each allreduce between two hosts is 2(h-1) = 2 messages.
TEST(Plan, ALinksLatencyIsTheJobsWhereItGivesOne) {
  JobSpec job = two_hosts_at_1gbit();
  job.link_gbit = 1e6;  // the wire's bytes (and the sockets' CPU) next to free: latency alone
  const Candidate c = with("ddp", "none", 4);
  const double free_ms = predict(four_layers(), job, machine(4), c).step_ms;
  job.link_latency_us = 5000;
  // Four 4 MiB buckets, ready 10 ms apart: each one's 10 ms of messages ends as the next is ready,
  // so only the last bucket's (ready as backward ends) is exposed.
  EXPECT_NEAR(predict(four_layers(), job, machine(4), c).step_ms - free_ms, 10, 1e-3);
  MachineConstants loopback = machine(4);
  loopback.tcp_latency_us = 2000;
  EXPECT_NEAR(predict(four_layers(), job, loopback, c).step_ms - free_ms, 10, 1e-3);  // the job's wins
  job.link_latency_us = 1000;
  EXPECT_NEAR(predict(four_layers(), job, loopback, c).step_ms - free_ms, 2, 1e-3);
  job.link_latency_us = 0;
  EXPECT_NEAR(predict(four_layers(), job, loopback, c).step_ms - free_ms, 4, 1e-3);  // the machine's
}

// Gloo's sockets take CPU at each end (MachineConstants::tcp_gbyte_per_s): out of compute where a
// rank fills its host's core, and beside the wire, the transfer lasting the longer of the two.
TEST(Plan, TcpTakesTheCoresBesideTheWire) {
  JobSpec job = two_hosts_at_1gbit();
  job.cores_per_host = 1;
  MachineConstants m = machine(1);
  const double sockets = 16.0 * (1 << 20) / 1e6;  // each rank sends the 16 MiB once: 16.8 ms at 1 GB/s
  auto step = [&](double link_gbit, double tcp_gbyte_per_s) {
    job.link_gbit = link_gbit;
    m.tcp_gbyte_per_s = tcp_gbyte_per_s;
    return predict(four_layers(), job, m, with("ddp", "none", 4)).step_ms;
  };
  // A fast link: the sockets' CPU is the transfer, and every bucket's comes out of compute.
  EXPECT_NEAR(step(1000, 1), 68 + sockets, 0.2);
  EXPECT_NEAR(step(1000, 1e6), 68, 0.2);
  // A slow link: the wire is the transfer (134 ms for 16 MiB at 1 Gbit/s); the sockets' CPU runs
  // beside it, adding nothing to the step (added to the wire, it would add 16.8 ms).
  EXPECT_GT(step(1, 1), 134);
  EXPECT_NEAR(step(1, 1), step(1, 1e6), 0.5);
}

// The hooks outside the default rows, by what each sends between two hosts of one rank each.
TEST(Plan, DdpsOtherHooksSendWhatTheirFormatsHold) {
  JobSpec job = two_hosts_at_1gbit();
  const auto m = machine(4);
  const double P = 16.0 * (1 << 20);
  auto wire = [&](const Candidate& c) { return predict(four_layers(), job, m, c).wire_bytes_per_step; };
  EXPECT_NEAR(wire(with("ddp", "fp16_wrapper")), P / 2, 1);
  EXPECT_NEAR(wire(with("ddp", "bf16_wrapper")), P / 2, 1);
  // uint8 codes gathered from both ranks: each sends its quarter-size codes to the other host.
  EXPECT_NEAR(wire(with("ddp", "quantize_per_tensor")), P / 4, 1);
  EXPECT_NEAR(wire(with("ddp", "quantize_per_channel")), P / 4, 1);
  // batched PowerSGD at rank 32: each bucket a square of side ceil(sqrt(numel)), P and Q of
  // side x 32. Buckets: the last layer alone (DDP's 1 MiB first cap), then the other three.
  double batched = 0;
  for (double numel : {1024.0 * 1024, 3 * 1024.0 * 1024}) batched += 2 * 4 * std::ceil(std::sqrt(numel)) * 32;
  EXPECT_NEAR(wire(with("ddp", "batched_powersgd")), batched, 1);
  // Local SGD: every period's average sends the parameters once; a step carries 1/period of it.
  Candidate local = with("ddp", "post_local_sgd");
  EXPECT_NEAR(wire(local), P / 4, 1);
  local.local_sgd_period = 1;
  EXPECT_NEAR(wire(local), P, 1);
  // Memory: the codes of every rank and their sum beside the bucket copies.
  job.hosts = 1;
  EXPECT_GT(predict(four_layers(), job, m, with("ddp", "quantize_per_channel")).memory.communication,
            predict(four_layers(), job, m, with("ddp", "allreduce")).memory.communication);
  EXPECT_THROW(predict(four_layers(), job, m, with("ddp", "bogus")), c10::Error);
}

// --optimizer-in-hook: each bucket's share of the step follows its allreduce on the thread that
// completes it. With a spare core that share runs beside backward; on cores the ranks fill, it is
// taken from compute as the sums are, and the step is the step with the optimizer after backward.
TEST(Plan, TheOptimizerInTheHookOverlapsBackwardOnlyWithASpareCore) {
  JobSpec job;
  job.world_size = 2;
  Candidate in_hook = with("ddp", "none", 4);
  in_hook.optimizer_in_hook = true;
  const double bucket = 4.0 * (1 << 20) / 1e6;  // one layer's allreduce at 1 GB/s
  const Prediction spare = predict(four_layers(), job, machine(4), in_hook);
  EXPECT_EQ(spare.candidate.hook, Hook::kAllreduce);  // what train registers for hook none
  EXPECT_EQ(spare.candidate.label(), "allreduce+optimizer");
  // The first layer's bucket, ready as backward ends: its allreduce and its quarter of the 8 ms step.
  EXPECT_NEAR(spare.step_ms, 20 + 40 + bucket + 2, 1e-3);
  EXPECT_NEAR(predict(four_layers(), job, machine(4), with("ddp", "allreduce", 4)).step_ms, 20 + 40 + bucket + 8, 1e-3);
  const Prediction full = predict(four_layers(), job, machine(2), in_hook);
  EXPECT_NEAR(full.step_ms, predict(four_layers(), job, machine(2), with("ddp", "allreduce", 4)).step_ms, 1e-6);
  EXPECT_NEAR(full.step_ms, 20 + 40 + 4 * bucket + 8, 1e-3);
  // Memory: the wrapped hook's.
  EXPECT_EQ(full.memory.total(), predict(four_layers(), job, machine(2), with("ddp", "allreduce", 4)).memory.total());
  Candidate zero = with("zero1", "none");
  zero.optimizer_in_hook = true;
  EXPECT_THROW(predict(four_layers(), job, machine(2), zero), c10::Error);
}

// post_local_sgd with --local-sgd-group-size: gradients allreduced within groups of consecutive
// ranks. Two hosts of two ranks: a group of two is a host (shared memory, nothing on the link
// but the period's average); a group of four spans the link every step.
TEST(Plan, LocalSgdGroupsReduceWithinTheirRanks) {
  JobSpec job;
  job.world_size = 4;
  job.hosts = 2;
  job.link_gbit = 1;
  const auto m = machine(4);
  const double P = 16.0 * (1 << 20);
  auto local = [&](int group) {
    Candidate c = with("ddp", "post_local_sgd");
    c.local_sgd_group_size = group;
    return predict(four_layers(), job, m, c);
  };
  // The average every 4 steps: a hierarchical allreduce, each local rank carrying half its host's
  // ring (the whole buffer between two hosts).
  const double average = P / 2 / 4;
  EXPECT_NEAR(local(0).wire_bytes_per_step, average, 1);
  EXPECT_NEAR(local(2).wire_bytes_per_step, average, 1);
  EXPECT_GT(local(2).step_ms, local(0).step_ms);  // the host's sums
  EXPECT_NEAR(local(4).wire_bytes_per_step, average + P / 2, 1);
  EXPECT_GT(local(2).memory.host_shared, local(0).memory.host_shared);  // the group's own slots
  EXPECT_THROW(local(3), c10::Error);
}

// Two ranks per host: DDP's allreduce is hierarchical, each local rank carrying half the host's
// between-host ring; ZeRO-2's reduce-scatter and allgather go flat, each rank sending half its
// buffer to the other host over the one link the host's ranks share.
TEST(Plan, OnlyAllreduceSharesTheLinkHierarchically) {
  JobSpec one_per_host, two_per_host;
  one_per_host.world_size = 2;
  two_per_host.world_size = 4;
  for (JobSpec* j : {&one_per_host, &two_per_host}) {
    j->hosts = 2;
    j->link_gbit = 1;
  }
  const auto m = machine(4);
  const Prediction ddp1 = predict(four_layers(), one_per_host, m, with("ddp", "allreduce"));
  const Prediction ddp2 = predict(four_layers(), two_per_host, m, with("ddp", "allreduce"));
  EXPECT_NEAR(ddp2.wire_bytes_per_step, ddp1.wire_bytes_per_step / 2, 1);
  EXPECT_NEAR(ddp2.step_ms, ddp1.step_ms, 0.1 * ddp1.step_ms);  // the host's link carries the same
  const Prediction zero1 = predict(four_layers(), one_per_host, m, with("zero2", "none"));
  const Prediction zero2 = predict(four_layers(), two_per_host, m, with("zero2", "none"));
  EXPECT_NEAR(zero2.wire_bytes_per_step, zero1.wire_bytes_per_step, 1);
  EXPECT_GT(zero2.step_ms, 1.6 * zero1.step_ms);  // twice the bytes on the link
}

// --bucket-cap-mb auto in the plan: where a link is about as slow as backward, small buckets send
// each layer as it is ready instead of most of the model after backward; where sums only take
// cores from compute, no cap gains the tuner's margin and the default stays.
TEST(Plan, AChosenBucketCapOverlapsALinkWithBackward) {
  JobSpec job;
  job.world_size = 2;
  job.hosts = 2;
  job.link_gbit = 4;  // 4 MiB in 8.4 ms; the model's 16 MiB in about backward's 40 ms
  const auto m = machine(4);
  const Prediction by_default = predict(four_layers(), job, m, with("ddp", "none"));
  const Prediction chosen = predict(four_layers(), job, m, with("ddp", "none", kChooseBucketCap));
  EXPECT_EQ(*by_default.candidate.bucket_cap_mb, 25);
  // 25 MiB: the first layer's bucket (1 MiB first cap) at 10 ms, the other three after backward:
  // 20 + 40 + 25.2 + 8. One layer a bucket: the last sent 8.4 ms after backward: 20 + 48.4 + 8.
  const double layer = 4.0 * (1 << 20) * 8 / 4e6;
  EXPECT_NEAR(by_default.step_ms, 20 + 40 + 3 * layer + 8, 1e-3);  // copies at 1e6 GB/s add 1e-5 ms
  EXPECT_LT(*chosen.candidate.bucket_cap_mb, 25);
  EXPECT_NEAR(chosen.step_ms, 20 + 40 + layer + 8, 1e-3);
  const Prediction at_that_cap = predict(four_layers(), job, m, with("ddp", "none", *chosen.candidate.bucket_cap_mb));
  EXPECT_DOUBLE_EQ(at_that_cap.step_ms, chosen.step_ms);

  JobSpec one_host;
  one_host.world_size = 2;
  const Prediction kept = predict(four_layers(), one_host, machine(2), with("ddp", "none", kChooseBucketCap));
  EXPECT_EQ(*kept.candidate.bucket_cap_mb, 25);
  EXPECT_DOUBLE_EQ(kept.step_ms, predict(four_layers(), one_host, machine(2), with("ddp", "none")).step_ms);
  // FSDP has no buckets to choose.
  const Prediction fsdp = predict(four_layers(), job, m, with("full_shard", "none", kChooseBucketCap));
  EXPECT_DOUBLE_EQ(fsdp.step_ms, predict(four_layers(), job, m, with("full_shard", "none")).step_ms);
  EXPECT_THROW(predict(four_layers(), job, m, with("ddp", "none", -3)), c10::Error);
}

// A real one-rank run's peak, less what the accounting holds for it, is the model's activations:
// planning that run again gives its peak back.
TEST(Plan, ActivationsFromAPeakGiveThatPeakBack) {
  ModelProfile m = four_layers();
  const MachineConstants c = machine(2);
  const int64_t P = m.param_bytes(), MiB = 1 << 20;
  // SGD: process, data, parameters, gradients, momentum, and 5 MiB more.
  EXPECT_EQ(activations_from_peak(m, c, "sgd", c.process_bytes + m.data_bytes + 3 * P + 5 * MiB), 5 * MiB);
  // Adam: two moments, and ddpkit's Adam's two scratch slices of 64K floats (256 KiB each).
  EXPECT_EQ(activations_from_peak(m, c, "adam", c.process_bytes + m.data_bytes + 4 * P + MiB / 2 + 5 * MiB), 5 * MiB);
  EXPECT_EQ(activations_from_peak(m, c, "sgd", 0), 0);  // never below nothing
  m.activation_bytes = 5 * MiB;
  JobSpec one;
  one.world_size = 1;
  const Prediction p = predict(m, one, c, with("ddp", "none"));
  EXPECT_EQ(p.memory.process + p.memory.data + p.memory.parameters + p.memory.gradients + p.memory.optimizer_state +
                p.memory.activations,
            c.process_bytes + m.data_bytes + 3 * P + 5 * MiB);
}

TEST(Plan, ShardingDividesWhatEachRankHolds) {
  JobSpec job;
  job.world_size = 4;
  job.cores_per_host = 4;
  const auto model = four_layers();
  const int64_t P = model.param_bytes();
  const Prediction ddp = predict(model, job, machine(4), with("ddp", "none"));
  const Prediction zero1 = predict(model, job, machine(4), with("zero1", "none"));
  const Prediction fsdp = predict(model, job, machine(4), with("full_shard", "none"));
  EXPECT_EQ(ddp.memory.parameters, P);
  EXPECT_EQ(ddp.memory.optimizer_state, P);  // SGD's momentum
  EXPECT_EQ(zero1.memory.optimizer_state, P / 4);
  EXPECT_EQ(fsdp.memory.parameters, P / 4);
  EXPECT_EQ(fsdp.memory.gradients, P / 4);
  EXPECT_LT(fsdp.memory.total(), ddp.memory.total());
  job.optimizer = "adam";
  // Two moments, and the step's two scratch slices (256 KiB each), not two of the largest
  // parameter (4 MiB) as libtorch's Adam makes.
  EXPECT_EQ(predict(model, job, machine(4), with("ddp", "none")).memory.optimizer_state, 2 * P + 2 * (256 << 10));
  // On one host a unit is gathered where its shards lie, at no cost: full_shard's second gather
  // (for backward) costs nothing either. Across hosts it is a collective, and full_shard gathers
  // each unit twice to shard_grad_op's once.
  auto step = [&](const char* strategy) { return predict(model, job, machine(4), with(strategy, "none")).step_ms; };
  EXPECT_DOUBLE_EQ(step("full_shard"), step("shard_grad_op"));
  job.hosts = 2;
  EXPECT_GT(step("full_shard"), step("shard_grad_op"));
}

TEST(Plan, WhatFitsRanksFirst) {
  JobSpec job;
  job.world_size = 4;
  const auto model = four_layers();
  const auto m = machine(4);
  const int64_t ddp_bytes = predict(model, job, m, with("ddp", "none")).memory.total();
  job.memory_limit_bytes = ddp_bytes - 1;
  const auto rows = rank_candidates(model, job, m, candidates(job));
  ASSERT_FALSE(rows.empty());
  EXPECT_TRUE(rows.front().fits);
  bool seen_unfit = false;
  for (const auto& r : rows) {
    if (!r.fits) seen_unfit = true;
    else EXPECT_FALSE(seen_unfit) << to_string(r.candidate.strategy) << "/" << to_string(r.candidate.hook) << " fits but ranks after one that does not";
    if (r.candidate.strategy == Strategy::kDdp && r.candidate.hook == Hook::kNone) EXPECT_FALSE(r.fits);
  }
}

TEST(Plan, MeasuredExtrasAddPerParameterByte) {
  JobSpec job;
  auto m = machine(2);
  const auto model = four_layers();
  const int64_t before = predict(model, job, m, with("zero1", "none")).memory.total();
  m.extra_bytes_per_param_byte["zero1/none"] = 0.5;
  const Prediction p = predict(model, job, m, with("zero1", "none"));
  EXPECT_EQ(p.memory.measured_extra, model.param_bytes() / 2);
  EXPECT_EQ(p.memory.total(), before + model.param_bytes() / 2);
  // Between hosts the ranks talk over Gloo alone: the extras measured that way, where there are.
  job.hosts = 2;
  EXPECT_EQ(predict(model, job, m, with("zero1", "none")).memory.measured_extra, model.param_bytes() / 2);
  m.extra_bytes_per_param_byte_gloo["zero1/none"] = 1.0;
  EXPECT_EQ(predict(model, job, m, with("zero1", "none")).memory.measured_extra, model.param_bytes());
  // One rank communicates nothing: no extra at all.
  job.world_size = job.hosts = 1;
  EXPECT_EQ(predict(model, job, m, with("zero1", "none")).memory.measured_extra, 0);
}

TEST(Plan, ConstantsRoundTripAndNameWhatIsMissing) {
  auto m = machine(3);
  m.extra_bytes_per_param_byte["ddp/fp16"] = 1.25;
  m.extra_bytes_per_param_byte_gloo["ddp/fp16"] = 1.5;
  m.memory_model = MachineConstants::kMemoryModel;
  m.measured_on = "test";
  const MachineConstants back = machine_constants_from_json(to_json(m));
  EXPECT_EQ(back.cores, 3);
  EXPECT_EQ(back.process_bytes, m.process_bytes);
  EXPECT_DOUBLE_EQ(back.shm_allgather.gbyte_per_s, 1.0);
  EXPECT_DOUBLE_EQ(back.extra_bytes_per_param_byte.at("ddp/fp16"), 1.25);
  EXPECT_DOUBLE_EQ(back.extra_bytes_per_param_byte_gloo.at("ddp/fp16"), 1.5);
  try {
    machine_constants_from_json("{\"cores\": 2}");
    FAIL() << "constants without the paths were accepted";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("shm_allreduce_in_place"));
  }
  EXPECT_THROW(machine_constants_from_json("not json"), c10::Error);
  // Extras measured against another memory accounting would count some memory twice (or never).
  m.memory_model = MachineConstants::kMemoryModel - 1;
  try {
    machine_constants_from_json(to_json(m));
    FAIL() << "extras of an older memory model were accepted";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("rerun ddpkit plan --calibrate"));
  }
}

// A file an older ddpkit wrote lacks the rates measured since: named, so `ddpkit plan` measures
// again; a file that is no constants file at all is left to machine_constants_from_json's errors.
TEST(Plan, ConstantsFromBeforeARateNameIt) {
  const std::string current = to_json(machine(2));
  EXPECT_EQ(rate_missing_from(current), "");
  const std::string key = "\"tcp_gbyte_per_s\"";
  const size_t at = current.find(key);
  ASSERT_NE(at, std::string::npos);
  std::string older = current;
  older.replace(at, key.size(), "\"unknown_rate\"");
  EXPECT_EQ(rate_missing_from(older), "tcp_gbyte_per_s");
  EXPECT_EQ(rate_missing_from("{\"cores\": 2}"), "");
  EXPECT_EQ(rate_missing_from("not json"), "");
}

TEST(Plan, ZeroOneHoldsTheLargestGreedyShare) {
  // Four equal tensors over 3 ranks: ZeRO-1 gives one rank two of them, so that rank holds half
  // the momentum and steps half the parameters; ZeRO-2's flat shards are a third each.
  const auto model = four_layers();
  const double P = static_cast<double>(model.param_bytes());
  JobSpec job;
  job.world_size = 3;
  const Prediction one = predict(model, job, machine(2), with("zero1", "none"));
  const Prediction two = predict(model, job, machine(2), with("zero2", "none"));
  EXPECT_NEAR(one.memory.optimizer_state, P / 2, 1);
  EXPECT_NEAR(two.memory.optimizer_state, P / 3, 1);
}

TEST(Plan, HostSharedMemoryGrowsWithTheRanksOfAHost) {
  const auto model = four_layers();
  const double P = static_cast<double>(model.param_bytes());
  const auto m = machine(2);
  auto shared = [&](int world, int hosts, const char* strategy) {
    JobSpec job;
    job.world_size = world;
    job.hosts = hosts;
    return static_cast<double>(predict(model, job, m, with(strategy, "none")).memory.host_shared);
  };
  const double slots = 2 * std::min<double>(1 << 20, P);  // one rank's two slots
  EXPECT_EQ(shared(1, 1, "ddp"), 0);
  EXPECT_NEAR(shared(4, 1, "ddp"), 4 * slots, 1);
  EXPECT_NEAR(shared(8, 2, "ddp"), 4 * slots, 1);
  // FSDP's shards: the peers' (W-1)/W of the parameters, read where they lie on one host.
  EXPECT_NEAR(shared(4, 1, "full_shard"), 4 * slots + P * 3 / 4, 1);
  EXPECT_NEAR(shared(8, 2, "hybrid_shard"), 4 * slots + P * 3 / 4, 1);
  EXPECT_NEAR(shared(4, 2, "full_shard"), 2 * slots, 1);  // sharded across hosts: no shared shards
}

TEST(Plan, BadJobsAreNamed) {
  JobSpec job;
  job.world_size = 3;
  job.hosts = 2;
  try {
    predict(four_layers(), job, machine(2), with("ddp", "none"));
    FAIL() << "3 ranks on 2 hosts were accepted";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("multiple of the host count"));
  }
  job.hosts = 1;
  try {
    predict(four_layers(), job, machine(2), with("zero3", "none"));
    FAIL() << "an unknown strategy was accepted";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("unknown strategy 'zero3'"));
  }
  EXPECT_THROW(predict(four_layers(), job, machine(2), with("full_shard", "int8")), c10::Error);
}

TEST(Plan, AProfileRoundTripsAsADescription) {
  auto model = four_layers();
  model.name = "four";
  model.params[3].unit = -1;  // the last layer the root's: a run of its own
  model.unit_numel.pop_back();
  const ModelProfile back = model_profile_from_json(to_json(model), machine(2), "sgd");
  EXPECT_EQ(back.name, "four");
  ASSERT_EQ(back.params.size(), model.params.size());
  for (size_t i = 0; i < model.params.size(); ++i) {
    EXPECT_EQ(back.params[i].shape, model.params[i].shape);
    EXPECT_EQ(back.params[i].unit, model.params[i].unit);
    EXPECT_DOUBLE_EQ(back.params[i].grad_ready_ms, model.params[i].grad_ready_ms);
  }
  EXPECT_EQ(back.unit_numel, model.unit_numel);
  JobSpec job;
  job.world_size = 4;
  for (const auto& c : candidates(job)) {
    const Prediction a = predict(model, job, machine(2), c), b = predict(back, job, machine(2), c);
    EXPECT_DOUBLE_EQ(a.step_ms, b.step_ms) << to_string(c.strategy) << "/" << to_string(c.hook);
    EXPECT_EQ(a.memory.total(), b.memory.total()) << to_string(c.strategy) << "/" << to_string(c.hook);
  }
}

// FSDP's mixed precision: compute is the bf16 profile's; units travel in bf16 (gathered as
// collectives even on one host: only fp32 shards lie in shared memory), and gradients in the
// reduce dtype.
TEST(Plan, MixedPrecisionComputesInBf16AndHalvesWhatUnitsSend) {
  ModelProfile model = four_layers();
  Candidate mixed = with("full_shard", "none");
  mixed.param_dtype = "bf16";
  JobSpec job = two_hosts_at_1gbit();
  const auto m = machine(4);
  EXPECT_THROW(predict(model, job, m, mixed), c10::Error);  // no bf16 compute profiled
  ComputeProfile bf16;
  bf16.forward_ms = 60;
  bf16.backward_ms = 120;
  for (const auto& p : model.params) bf16.grad_ready_ms.push_back(3 * p.grad_ready_ms);
  bf16.activation_bytes = 3 << 20;
  model.bf16 = bf16;
  const Prediction fp32 = predict(model, job, m, with("full_shard", "none"));
  const Prediction low = predict(model, job, m, mixed);
  EXPECT_EQ(low.candidate.label(), "none+mp_bf16");
  EXPECT_EQ(measured_extra_key(low.candidate), "full_shard/none+mp_bf16");
  EXPECT_NEAR(low.compute_ms, 60 + 120 + 8 / 2, 1e-9);  // the fp32 shard's step: the optimizer's half
  EXPECT_EQ(low.memory.activations, 3 << 20);
  EXPECT_NEAR(low.wire_bytes_per_step, fp32.wire_bytes_per_step / 2, 1);
  // Between hosts both gather privately: the unit computing, the one prefetched, the flat gradient.
  EXPECT_EQ(low.memory.communication, fp32.memory.communication / 2);
  Candidate reduce32 = mixed;
  reduce32.reduce_dtype = "fp32";
  const Prediction r32 = predict(model, job, m, reduce32);
  EXPECT_GT(r32.wire_bytes_per_step, low.wire_bytes_per_step);
  EXPECT_LT(r32.wire_bytes_per_step, fp32.wire_bytes_per_step);
  EXPECT_EQ(r32.candidate.label(), "none+mp_bf16_reduce_fp32");
  // On one host fp32 units are gathered in place, bf16 ones by a collective.
  JobSpec one_host;
  one_host.world_size = 2;
  EXPECT_EQ(predict(model, one_host, m, with("full_shard", "none")).wire_bytes_per_step, 0);
  EXPECT_GT(predict(model, one_host, m, mixed).exposed_comm_ms, 0);
  Candidate ddp = with("ddp", "none");
  ddp.param_dtype = "bf16";
  EXPECT_THROW(predict(model, job, m, ddp), c10::Error);
  Candidate hooked = with("full_shard", "bf16");
  hooked.param_dtype = "bf16";
  EXPECT_THROW(predict(model, job, m, hooked), c10::Error);
  // A description carries it; left out, backward is twice the forward and activations the fp32 ones.
  const ModelProfile back = model_profile_from_json(to_json(model), m, "sgd");
  ASSERT_TRUE(back.bf16.has_value());
  EXPECT_DOUBLE_EQ(predict(back, job, m, mixed).step_ms, low.step_ms);
  const ModelProfile described = model_profile_from_json(
      R"({"forward_ms": 10, "activation_bytes": 1000, "layers": [{"params": [[64, 64]]}], "bf16": {"forward_ms": 30}})", m,
      "sgd");
  ASSERT_TRUE(described.bf16.has_value());
  EXPECT_DOUBLE_EQ(described.bf16->backward_ms, 60);
  EXPECT_EQ(described.bf16->activation_bytes, 1000);
  EXPECT_DOUBLE_EQ(described.bf16->grad_ready_ms.at(0), 60);
  EXPECT_THROW(model_profile_from_json(R"({"forward_ms": 10, "layers": [{"params": [[4]]}], "bf16": {"backward_ms": 3}})",
                                       m, "sgd"),
               c10::Error);
}

TEST(Plan, ADescribedModelFillsInWhatItLeavesOut) {
  auto m = machine(2);
  m.gemm_gflop_per_s = 50;
  m.matmul_gflop_per_s = 7;  // PowerSGD's: not a layer's
  m.copy_gbyte_per_s = 2;
  const ModelProfile model = model_profile_from_json(R"({
    "forward_gflop": 5,
    "layers": [{"unit": false, "params": [[100, 10]]},
               {"repeat": 3, "params": [[10, 10], [10]]},
               {"unit": false, "params": [[10]]}]})", m, "adam");
  ASSERT_EQ(model.params.size(), 8u);
  EXPECT_EQ(model.unit_numel, (std::vector<int64_t>{110, 110, 110}));
  EXPECT_EQ(model.params[0].unit, -1);
  EXPECT_EQ(model.params[5].unit, 2);
  EXPECT_EQ(model.params[7].unit, -1);
  EXPECT_DOUBLE_EQ(model.forward_ms, 100);   // 5 GFLOP at 50 GFLOP/s
  EXPECT_DOUBLE_EQ(model.backward_ms, 200);  // twice the forward
  EXPECT_DOUBLE_EQ(model.optimizer_ms, 1340 * 28 / 4e6);  // Adam's 28 bytes a parameter moved, 2 GB/s copied
  // Backward runs the layers in reverse: the last parameter first, the first at its very end.
  EXPECT_DOUBLE_EQ(model.params.back().grad_ready_ms, 200.0 * 10 / 1340);
  EXPECT_DOUBLE_EQ(model.params.front().grad_ready_ms, 200);
  for (size_t i = 1; i < model.params.size(); ++i)
    EXPECT_GT(model.params[i - 1].grad_ready_ms, model.params[i].grad_ready_ms);
  // What a description gets wrong is named.
  auto error = [&](const std::string& text) {
    try {
      model_profile_from_json(text, m, "sgd");
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_THAT(error(R"({"layers": [{"params": [[4]]}]})"), HasSubstr("one of forward_ms"));
  EXPECT_THAT(error(R"({"forward_ms": 1, "layers": [{"params": [[4, 0]]}]})"), HasSubstr("positive integer sizes"));
  EXPECT_THAT(error(R"({"forward_ms": 1, "layers": [{"params": [[4]], "units": 2}]})"), HasSubstr("unknown key 'units'"));
  EXPECT_THAT(error(R"({"forwards_ms": 1, "layers": []})"), HasSubstr("unknown key 'forwards_ms'"));
  EXPECT_THAT(error(R"({"forward_ms": 1, "layers": []})"), HasSubstr("'layers' must be a non-empty array"));
  EXPECT_THAT(error(R"({"forward_ms": 1, "layers": [{"params": [[4]]}, {"unit": 0, "params": [[4]]}]})"),
              HasSubstr("as true/false or as indices"));
  EXPECT_THAT(error("{"), HasSubstr("not JSON"));
}
