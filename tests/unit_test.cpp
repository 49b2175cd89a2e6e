// Bucket assignment, codecs and process-group collectives.
#include "harness.h"

#include "host_key_override.h"

#include <ddpkit/comm/host_topology.h>
#include <ddpkit/optim/adam.h>
#include <ddpkit/optim/sgd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/serialize/archive.h>
#include <ddpkit/training/divergence_guard.h>

#include <cmath>
#include <future>

namespace ddpkit {
namespace {

using testing::error_of, testing::spawn_ranks_with, testing::spawn_ranks;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::vector<at::Tensor> tensors_of(std::vector<std::pair<int64_t, at::ScalarType>> spec) {
  std::vector<at::Tensor> out;
  for (auto& s : spec) out.push_back(at::empty({s.first}, s.second));
  return out;
}

// The four cases of PyTorch's test_c10d_common.py ComputeBucketAssignmentTest.
TEST(BucketAssignment, SingleLimitSingleDtype) {
  auto t = tensors_of({{100, at::kFloat}, {200, at::kFloat}, {100, at::kFloat}, {50, at::kFloat}});
  auto a = compute_bucket_assignment_by_size(t, {400});
  EXPECT_EQ(a.buckets, (std::vector<std::vector<size_t>>{{0}, {1}, {2}, {3}}));
  for (auto l : a.size_limits) EXPECT_EQ(l, 400u);
}

TEST(BucketAssignment, SingleLimitMultiDtype) {
  auto t = tensors_of({{50, at::kFloat}, {25, at::kDouble}, {50, at::kFloat}, {25, at::kDouble}, {50, at::kFloat},
                       {25, at::kDouble}});
  auto a = compute_bucket_assignment_by_size(t, {400});
  EXPECT_EQ(a.buckets, (std::vector<std::vector<size_t>>{{0, 2}, {1, 3}, {4}, {5}}));
}

TEST(BucketAssignment, MultiLimitSingleDtype) {
  auto t = tensors_of({{10, at::kFloat}, {10, at::kFloat}, {10, at::kFloat}, {10, at::kFloat}});
  auto a = compute_bucket_assignment_by_size(t, {40, 80});
  EXPECT_EQ(a.buckets, (std::vector<std::vector<size_t>>{{0}, {1, 2}, {3}}));
  EXPECT_EQ(a.size_limits, (std::vector<size_t>{40, 80, 80}));
}

TEST(BucketAssignment, MultiLimitMultiDtype) {
  auto t = tensors_of({{50, at::kFloat}, {25, at::kDouble}, {50, at::kFloat}, {25, at::kDouble}, {50, at::kFloat},
                       {25, at::kDouble}});
  auto a = compute_bucket_assignment_by_size(t, {200, 400});
  EXPECT_EQ(a.buckets, (std::vector<std::vector<size_t>>{{0}, {1}, {2, 4}, {3, 5}}));
  EXPECT_EQ(a.size_limits, (std::vector<size_t>{200, 200, 400, 400}));
}

TEST(BucketAssignment, SparseGetsOwnBucketAndOrderIsKept) {
  auto t = tensors_of({{10, at::kFloat}, {10, at::kFloat}, {10, at::kFloat}});
  auto a = compute_bucket_assignment_by_size(t, {1000}, {false, true, false}, {2, 1, 0});
  EXPECT_EQ(a.buckets, (std::vector<std::vector<size_t>>{{1}, {2, 0}}));
}

TEST(BucketAssignment, BadInputIsNamed) {
  auto t = tensors_of({{10, at::kFloat}});
  EXPECT_THAT(testing::error_of([&] { compute_bucket_assignment_by_size(t, {}); }),
              ::testing::HasSubstr("at least one size limit"));
  EXPECT_THAT(testing::error_of([&] { compute_bucket_assignment_by_size(t, {10}, {true, false}); }),
              ::testing::HasSubstr("expect_sparse has 2 entries for 1 tensors"));
}

// Every SIMD level must give exactly the bits of c10::Half / c10::BFloat16 rounding.
class CodecLevels : public ::testing::TestWithParam<codecs::SimdLevel> {};

at::Tensor codec_input(int64_t n) {
  at::Tensor x = at::randn({n}) * 100;
  // Specials: zero, -zero, inf, nan, subnormal-range values, fp16 overflow.
  auto* p = x.data_ptr<float>();
  p[0] = 0.f;
  p[1] = -0.f;
  p[2] = std::numeric_limits<float>::infinity();
  p[3] = std::numeric_limits<float>::quiet_NaN();
  p[4] = 1e-6f;
  p[5] = 70000.f;
  p[6] = 1.00390625f;  // exactly halfway between two bf16 values: rounds to even
  return x;
}

// Bit equality, except that any NaN matches any NaN (ATen's vector bf16 cast writes 0xffff where
// c10::BFloat16 writes 0x7fc0).
bool same_bits_or_nan(const at::Tensor& got, const at::Tensor& want) {
  at::Tensor nan = want.to(at::kFloat).isnan();
  return at::equal(got.to(at::kFloat).isnan(), nan) &&
         at::equal(got.view(at::kShort).masked_fill(nan, 0), want.view(at::kShort).masked_fill(nan, 0));
}

TEST_P(CodecLevels, MatchesC10Rounding) {
  if (!codecs::cpu_supports(GetParam())) GTEST_SKIP() << "CPU lacks this level";
  const auto saved = codecs::simd_level();
  codecs::set_simd_level(GetParam());
  const int64_t n = 1000 + 13;  // a vector tail too
  at::Tensor x = codec_input(n);
  for (auto dt : {at::kHalf, at::kBFloat16}) {
    for (double scale : {1.0, 0.5, 1.0 / 3}) {
      at::Tensor got = codecs::cast_scaled(x, dt, scale);
      at::Tensor want = (x * static_cast<float>(scale)).to(dt);
      EXPECT_TRUE(same_bits_or_nan(got, want)) << dt << " scale " << scale;
      at::Tensor back = at::empty({n}, at::kFloat);
      codecs::cast_scaled_into(got, back, 1.0);
      EXPECT_TRUE(at::allclose(back, want.to(at::kFloat), 0, 0, /*equal_nan=*/true)) << dt;
    }
    // Sum in fp32, one rounding.
    std::vector<at::Tensor> parts;
    for (int k = 0; k < 3; ++k) parts.push_back((at::randn({n}) * 10).to(dt));
    at::Tensor out = at::empty({n}, dt);
    codecs::sum_low_precision_into(parts, out);
    at::Tensor want = (parts[0].to(at::kFloat) + parts[1].to(at::kFloat) + parts[2].to(at::kFloat)).to(dt);
    EXPECT_TRUE(same_bits_or_nan(out, want)) << dt;
  }
  codecs::set_simd_level(saved);
}

INSTANTIATE_TEST_SUITE_P(AllLevels, CodecLevels,
                         ::testing::Values(codecs::SimdLevel::Scalar, codecs::SimdLevel::Avx2, codecs::SimdLevel::Avx512));

TEST(Codecs, BadArgumentsAreNamed) {
  EXPECT_THAT(testing::error_of([] { codecs::cast_scaled_into(at::zeros({4}), at::zeros({5}, at::kHalf)); }),
              ::testing::HasSubstr("src has 4 elements but dst has 5"));
  EXPECT_THAT(testing::error_of([] { codecs::sum_low_precision_into({at::zeros({4}, at::kHalf)}, at::zeros({4})); }),
              ::testing::HasSubstr("takes float16 or bfloat16"));
}

// The coalesced form by definition: for each row in ascending order, its entries summed in their
// order of appearance, rounding to the dtype after each addition.
at::Tensor coalesced_values_in_order(const at::Tensor& sparse) {
  at::Tensor rows = sparse._indices()[0];
  at::Tensor values = sparse._values();
  at::Tensor unique = std::get<0>(at::_unique(rows, /*sorted=*/true));
  std::vector<at::Tensor> out;
  for (int64_t u = 0; u < unique.numel(); ++u) {
    at::Tensor acc;
    for (int64_t i = 0; i < rows.numel(); ++i) {
      if (rows[i].item<int64_t>() != unique[u].item<int64_t>()) continue;
      acc = acc.defined() ? (acc.to(at::kDouble) + values[i].to(at::kDouble)).to(values.scalar_type())
                          : values[i].clone();
    }
    out.push_back(acc);
  }
  return at::stack(out);
}

TEST(Codecs, CoalesceSumsDuplicatesInOrderOfAppearance) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    // An embedding's gradient: many duplicate rows, an odd row width (a vector tail).
    at::Tensor rows = at::randint(0, 50, {1, 400}, gen, at::kLong);
    at::Tensor values = at::randn({400, 7}, gen).to(dtype);
    at::Tensor grad = at::_sparse_coo_tensor_unsafe(rows, values, {60, 7});
    at::Tensor got = codecs::coalesce(grad);
    at::Tensor reference = grad.coalesce();
    ASSERT_TRUE(got.is_coalesced()) << dtype;
    EXPECT_TRUE(at::equal(got._indices(), reference._indices())) << dtype;
    EXPECT_TRUE(at::equal(got._values(), coalesced_values_in_order(grad))) << dtype;
    // ATen sums duplicates in its sort's order: the same up to rounding (bfloat16 keeps 8 bits).
    const double tolerance = dtype == at::kBFloat16 ? 1e-1 : 1e-2;
    EXPECT_TRUE(at::allclose(got._values().to(at::kFloat), reference._values().to(at::kFloat), tolerance, tolerance))
        << dtype;
  }
  // Order matters in float: (1e8 + 1) - 1e8 is 0, 1e8 - 1e8 + 1 is 1. A lone -0 stays -0.
  at::Tensor order = at::_sparse_coo_tensor_unsafe(at::tensor({3, 3, 3, 1}, at::kLong).view({1, 4}),
                                                   at::tensor({1e8f, 1.f, -1e8f, -0.f}).view({4, 1}), {5, 1});
  at::Tensor summed = codecs::coalesce(order)._values();
  EXPECT_EQ(summed[1].item<float>(), 0.f);
  EXPECT_TRUE(std::signbit(summed[0].item<float>()));
  // Rows wide enough to be split between threads: the same bits with one thread and with two.
  at::Tensor wide = at::_sparse_coo_tensor_unsafe(at::randint(0, 300, {1, 1200}, gen, at::kLong),
                                                  at::randn({1200, 1024}, gen), {300, 1024});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  at::Tensor one = codecs::coalesce(wide)._values();
  at::set_num_threads(2);
  at::Tensor two = codecs::coalesce(wide)._values();
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(one, two));
  EXPECT_TRUE(at::allclose(one, wide.coalesce()._values(), 1e-5, 1e-5));
  // Coalesced input comes back as is; two sparse dimensions go to at::coalesce.
  at::Tensor done = wide.coalesce();
  EXPECT_TRUE(codecs::coalesce(done).is_same(done));
  at::Tensor matrix = at::_sparse_coo_tensor_unsafe(at::tensor({0, 0, 1, 0, 2, 0}, at::kLong).view({2, 3}),
                                                    at::tensor({1.f, 2.f, 3.f}), {3, 3});
  EXPECT_TRUE(at::equal(codecs::coalesce(matrix).to_dense(), matrix.to_dense()));
  // A row outside the tensor is named, not written out of bounds.
  at::Tensor bad = at::_sparse_coo_tensor_unsafe(at::tensor({0, 60}, at::kLong).view({1, 2}), at::ones({2, 7}), {60, 7});
  EXPECT_THAT(error_of([&] { codecs::coalesce(bad); }), HasSubstr("entry 1 has row 60, outside [0, 60)"));
}

// ---- process group ----------------------------------------------------------------------------
TEST(ProcessGroup, CollectivesAcrossThreeRanks) {
  spawn_ranks(3, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    at::Tensor t = at::full({5}, static_cast<float>(rank + 1));
    ProcessGroup::wait(pg->allreduce(t));
    EXPECT_TRUE(at::allclose(t, at::full({5}, 6.f)));
    at::Tensor b = at::full({3}, static_cast<float>(rank));
    ProcessGroup::wait(pg->broadcast(b, 2));
    EXPECT_TRUE(at::allclose(b, at::full({3}, 2.f)));
    auto all = testing::allgather(*pg, at::full({2}, static_cast<float>(rank)));
    for (int r = 0; r < 3; ++r) EXPECT_TRUE(at::allclose(all[r], at::full({2}, static_cast<float>(r))));
    at::Tensor in = at::arange(6, at::kFloat) + 10 * rank, out = at::empty({6});
    ProcessGroup::wait(pg->alltoall(out, in));
    // Chunk r of out comes from rank r's chunk `rank`.
    for (int r = 0; r < 3; ++r)
      EXPECT_TRUE(at::allclose(out.narrow(0, 2 * r, 2), at::arange(2 * rank, 2 * rank + 2, at::kFloat) + 10 * r));
    ProcessGroup::wait(pg->barrier());
    EXPECT_GT(pg->uses_shared_memory() ? pg->stats().shm_bytes_sent : pg->stats().bytes_sent, 0u);
  });
}

// Without shared memory, allgather and alltoall go over Gloo as one message per peer each way
// (src/comm/gloo_exchange.cpp): every dtype as bytes, odd sizes, a strided output; a peer that
// never sends is named within the group's timeout.
// libtorch after 2.6 records every Gloo collective in one process-wide flight recorder that adds
// each group to its table without a lock; ddpkit's calls into Gloo go one at a time, so groups
// whose first collectives start together do not corrupt it (on libtorch 2.11 this crashed 5 runs
// of the FSDP suite in 145 before they did; docs/threading.md, "Calls into Gloo").
TEST(ProcessGroup, GroupsStartingTogetherCallGlooOneAtATime) {
  constexpr int kWorld = 4, kGroups = 6;
  auto store = c10::make_intrusive<c10d::HashStore>();
  spawn_ranks(kWorld, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    std::vector<std::shared_ptr<ProcessGroup>> groups;
    for (int g = 0; g < kGroups; ++g)
      groups.push_back(std::make_shared<ProcessGroup>(
          c10::make_intrusive<c10d::PrefixStore>("g" + std::to_string(g), store), rank, kWorld,
          ProcessGroupOptions().gloo_hostname("127.0.0.1").shared_memory(false)));
    ProcessGroup::wait(pg->barrier());
    std::vector<at::Tensor> values;
    std::vector<FuturePtr> sums;
    for (int g = 0; g < kGroups; ++g) {
      values.push_back(at::full({3}, static_cast<float>(rank + g)));
      sums.push_back(groups[g]->allreduce(values.back()));
    }
    for (int g = 0; g < kGroups; ++g) {
      ProcessGroup::wait(sums[g]);
      EXPECT_TRUE(at::equal(values[g], at::full({3}, static_cast<float>(kWorld * g + kWorld * (kWorld - 1) / 2))))
          << "group " << g;
    }
  });
}

TEST(ProcessGroup, GlooExchangesMoveEveryDtypeAndNameAMissingPeer) {
  for (int world : {2, 3}) {
    spawn_ranks_with(world, ProcessGroupOptions().shared_memory(false), [world](int rank, std::shared_ptr<ProcessGroup> pg) {
      ASSERT_FALSE(pg->uses_shared_memory());
      const int64_t n = 7;
      for (auto dt : {at::kFloat, at::kHalf, at::kBFloat16, at::kByte, at::kLong, at::kBool}) {
        auto values = [&](int64_t count, int64_t from, int who) {
          at::Tensor v = at::arange(from, from + count, at::kLong) + 3 * who;
          return dt == at::kBool ? (v % 2 == 0) : v.to(dt);
        };
        at::Tensor gathered = at::empty({world * n}, dt);
        ProcessGroup::wait(pg->allgather_into_tensor(gathered, values(n, 0, rank)));
        for (int r = 0; r < world; ++r)
          EXPECT_TRUE(at::equal(gathered.narrow(0, r * n, n), values(n, 0, r))) << dt << " allgather from " << r;
        // The list form receives into each output, a strided one through a copy.
        std::vector<at::Tensor> list;
        for (int r = 0; r < world; ++r) list.push_back(r == 1 ? at::empty({n, 2}, dt).select(1, 0) : at::empty({n}, dt));
        ProcessGroup::wait(pg->allgather(list, values(n, 0, rank)));
        for (int r = 0; r < world; ++r)
          EXPECT_TRUE(at::equal(list[r], values(n, 0, r))) << dt << " list allgather from " << r;
        at::Tensor out = at::empty({world * n}, dt);
        at::Tensor strided = at::empty({world * n, 2}, dt).select(1, 0);
        ASSERT_FALSE(strided.is_contiguous());
        ProcessGroup::wait(pg->alltoall(out, values(world * n, 0, rank)));
        ProcessGroup::wait(pg->alltoall(strided, values(world * n, 0, rank)));
        for (int r = 0; r < world; ++r) {
          EXPECT_TRUE(at::equal(out.narrow(0, r * n, n), values(n, rank * n, r))) << dt << " alltoall from " << r;
          EXPECT_TRUE(at::equal(strided.narrow(0, r * n, n), values(n, rank * n, r))) << dt << " strided from " << r;
        }
      }
    });
  }
  std::promise<void> rank0_done;
  spawn_ranks_with(2, ProcessGroupOptions().shared_memory(false).timeout(std::chrono::milliseconds(500)),
                   [&](int rank, std::shared_ptr<ProcessGroup> pg) {
                     if (rank == 1) return rank0_done.get_future().wait();  // alive, but not calling
                     const auto t0 = std::chrono::steady_clock::now();
                     EXPECT_THAT(error_of([&] {
                                   ProcessGroup::wait(pg->allgather_into_tensor(at::empty({20}), at::ones({10})));
                                 }),
                                 HasSubstr("allgather (40 B Float per rank) failed on rank 0 of 2: rank 1 sent "
                                           "nothing within 500 ms"));
                     EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
                     rank0_done.set_value();
                   });
}

// fp16/bf16 SUM goes through alltoall + fp32 accumulation + allgather; odd sizes are padded.
TEST(ProcessGroup, LowPrecisionAllreduceSumsInFloat32) {
  for (int world : {2, 3}) {
    spawn_ranks(world, [world](int rank, std::shared_ptr<ProcessGroup> pg) {
      for (auto dt : {at::kHalf, at::kBFloat16}) {
        const int64_t n = 1001;
        auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
        std::vector<at::Tensor> inputs;
        for (int r = 0; r < world; ++r) inputs.push_back(at::randn({n}, gen).to(dt));
        at::Tensor mine = inputs[rank].clone();
        ProcessGroup::wait(pg->allreduce(mine));
        at::Tensor want = at::zeros({n});
        for (auto& in : inputs) want += in.to(at::kFloat);
        EXPECT_TRUE(at::equal(mine.view(at::kShort), want.to(dt).view(at::kShort))) << dt << " world " << world;
      }
    });
  }
}

// Cut into many pieces (tiny piece_bytes; pieces do not divide the tensor), the pipelined
// two-phase path gives the same bits as one piece.
TEST(ProcessGroup, LowPrecisionAllreduceInPiecesEqualsOnePiece) {
  for (int world : {2, 3}) {
    // Gloo's path (on one host shared memory would take it).
    spawn_ranks_with(world, ProcessGroupOptions().piece_bytes(96).shared_memory(false), [world](int rank, std::shared_ptr<ProcessGroup> pg) {
          const int64_t n = 4099;
          EXPECT_GT(pg->pieces_for(n * 2), 20);
          for (auto dt : {at::kHalf, at::kBFloat16}) {
            auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
            at::Tensor want = at::zeros({n});
            at::Tensor mine;
            for (int r = 0; r < world; ++r) {
              at::Tensor in = at::randn({n}, gen).to(dt);
              want += in.to(at::kFloat);
              if (r == rank) mine = in;
            }
            pg->reset_stats();
            ProcessGroup::wait(pg->allreduce(mine));
            EXPECT_TRUE(at::equal(mine.view(at::kShort), want.to(dt).view(at::kShort))) << dt << " world " << world;
            // Two alltoalls per piece; bytes as one ring allreduce (plus padding of under a piece).
            const CommStats st = pg->stats();
            EXPECT_EQ(st.collectives % 2, 0u);
            EXPECT_GE(st.bytes_sent, 2u * (world - 1) * n * 2 / world);
            EXPECT_LE(st.bytes_sent, 2u * (world - 1) * (n + 96 * world) * 2 / world);
          }
        });
  }
}

// A job whose buffers do not split into pieces x ranks is refused with the caller's name for it.
TEST(ProcessGroup, TwoPhaseJobErrorsNameTheOperation) {
  spawn_ranks(2, [](int, std::shared_ptr<ProcessGroup> pg) {
    auto job = std::make_shared<TwoPhaseJob>();
    job->pieces = 3;
    job->send1 = job->recv1 = job->send2 = job->recv2 = at::zeros({10});
    job->reduce = [](int64_t) {};
    EXPECT_THAT(error_of([&] { ProcessGroup::wait(pg->two_phase(job, job->send1, "my codec")); }),
                AllOf(HasSubstr("my codec"), HasSubstr("3 x 2 equal chunks")));
    job->reduce = nullptr;
    EXPECT_THAT(error_of([&] { pg->two_phase(job, job->send1, "my codec"); }), HasSubstr("reduce step"));
  });
}

// Hosts are numbered by their lowest rank; local ranks ascend within a host.
TEST(HostTopology, GroupsRanksByHostKey) {
  const std::vector<std::string> keys{"a", "b", "a", "c", "b"};
  const HostTopology t = topology_from_keys(keys, 4);
  EXPECT_EQ(t.hosts(), 3);
  EXPECT_EQ(t.host_of_rank, (std::vector<int>{0, 1, 0, 2, 1}));
  EXPECT_EQ(t.ranks_of_host, (std::vector<std::vector<int>>{{0, 2}, {1, 4}, {3}}));
  EXPECT_EQ(t.host(), 1);
  EXPECT_EQ(t.local_rank(), 1);
  EXPECT_EQ(t.local_size(), 2);
  EXPECT_FALSE(t.single_host());
  EXPECT_EQ(topology_from_keys(keys, 3).local_size(), 1);
  EXPECT_THAT(error_of([&] { topology_from_keys(keys, 5); }), HasSubstr("rank 5 outside 0..4"));
}

// Ranks as threads of one process are one host, whatever LOCAL_WORLD_SIZE says.
TEST(HostTopology, RanksAsThreadsShareOneHost) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<HostTopology> got(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] { got[r] = discover_host_topology(*store, "g", r, 3, std::chrono::seconds(10)); });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(got[r].single_host());
    EXPECT_EQ(got[r].local_rank(), r);
    EXPECT_EQ(got[r].local_size(), 3);
  }
  const std::string key = this_host_key();
  EXPECT_EQ(std::count(key.begin(), key.end(), '/'), 3) << key;  // machine / boot / netns / pidns
}

// Every group knows its topology; a subgroup's is its own (two groups of 2 out of 4 ranks).
TEST(HostTopology, EachGroupFindsItsOwn) {
  spawn_ranks(4, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    EXPECT_TRUE(pg->topology().single_host());
    EXPECT_EQ(pg->topology().local_size(), 4);
    auto sub = new_subgroups(*pg, 2);
    EXPECT_EQ(sub->topology().local_size(), 2);
    EXPECT_EQ(sub->topology().local_rank(), rank % 2);
  });
}

// Ranks each on a host of its own (a cross group) are known from two counters; any host with two
// ranks takes every rank's key. Hosts simulated by labels on one machine.
TEST(HostTopology, RanksOnHostsOfTheirOwnAndSharedHosts) {
  auto discover = [](const std::vector<std::string>& labels) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    const int world = static_cast<int>(labels.size());
    std::vector<HostTopology> got(labels.size());
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r)
      threads.emplace_back([&, r] {
        ScopedHostKey host(labels[r]);
        got[r] = discover_host_topology(*store, "g", r, world, std::chrono::seconds(10));
      });
    for (auto& t : threads) t.join();
    return got;
  };
  const auto alone = discover({"a", "b", "c", "d", "e"});
  for (int r = 0; r < 5; ++r) {
    EXPECT_EQ(alone[r].hosts(), 5);
    EXPECT_EQ(alone[r].host(), r);
    EXPECT_EQ(alone[r].local_size(), 1);
    EXPECT_EQ(alone[r].host_of_rank, (std::vector<int>{0, 1, 2, 3, 4}));
  }
  const auto shared = discover({"a", "b", "a", "c", "b"});
  for (int r = 0; r < 5; ++r) {
    EXPECT_EQ(shared[r].host_of_rank, (std::vector<int>{0, 1, 0, 2, 1})) << "rank " << r;
    EXPECT_EQ(shared[r].ranks_of_host, (std::vector<std::vector<int>>{{0, 2}, {1, 4}, {3}})) << "rank " << r;
  }
}

TEST(HostTopology, ARankThatNeverPublishesIsNamed) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::string error;
  std::string other_error;
  std::thread other([&] { other_error = error_of([&] { discover_host_topology(*store, "g", 2, 3, std::chrono::milliseconds(300)); }); });
  error = error_of([&] { discover_host_topology(*store, "g", 0, 3, std::chrono::milliseconds(300)); });
  other.join();
  EXPECT_THAT(error, AllOf(HasSubstr("rank(s) 1 did not publish their host within 300 ms"), HasSubstr("rank 0 of 3")));
  EXPECT_THAT(other_error, HasSubstr("rank(s) 1 did not publish"));
}

// The opt-in fp32 paths (two alltoalls; slices over several connections) sum like Gloo's ring.
TEST(ProcessGroup, Fp32AllreducePathsAgree) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> ts;
  std::atomic<int> ok{0};
  const int world = 3;
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      auto base = ProcessGroupOptions().gloo_hostname("127.0.0.1");
      ProcessGroup ring(store, r, world, ProcessGroupOptions(base).group_name("ring"));
      ProcessGroup two_phase(store, r, world, ProcessGroupOptions(base).group_name("two").two_phase_min_bytes(1));
      ProcessGroup sliced(store, r, world, ProcessGroupOptions(base).group_name("sliced").gloo_connections(3));
      const int64_t n = (5 << 20) / 4 + 7;  // > 4 MiB (slicing threshold), not divisible by 3
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + r);
      at::Tensor x = at::randn({n}, gen);
      at::Tensor a = x.clone(), b = x.clone(), c = x.clone();
      ProcessGroup::wait(ring.allreduce(a));
      ProcessGroup::wait(two_phase.allreduce(b));
      ProcessGroup::wait(sliced.allreduce(c));
      if (at::allclose(a, b, 1e-6, 1e-6) && at::allclose(a, c, 1e-6, 1e-6)) ++ok;
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(ok.load(), world);
}

// A strided (non-contiguous) tensor goes through the padded copy and comes back in place.
TEST(ProcessGroup, LowPrecisionAllreduceOfStridedTensor) {
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    at::Tensor base = at::full({6, 4}, static_cast<float>(rank + 1)).to(at::kHalf);
    at::Tensor strided = base.t();  // 4x6 view, not contiguous
    ASSERT_FALSE(strided.is_contiguous());
    ProcessGroup::wait(pg->allreduce(strided));
    EXPECT_TRUE(at::equal(base, at::full({6, 4}, 3.f).to(at::kHalf)));
  });
}

TEST(ProcessGroup, BadArgumentsAreNamed) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  EXPECT_THAT(testing::error_of([&] { ProcessGroup(store, 2, 2); }), ::testing::HasSubstr("rank must be in [0, 2), got 2"));
  EXPECT_THAT(testing::error_of([&] { ProcessGroup(store, 0, 1, ProcessGroupOptions().backend("mpi2")); }),
              ::testing::HasSubstr("unknown backend 'mpi2'"));
  EXPECT_THAT(testing::error_of([] { init_process_group(InitOptions().rank(0).world_size(1).init_method("foo://x")); }),
              ::testing::HasSubstr("unknown init_method 'foo://x'"));
}

TEST(ProcessGroup, FileStoreRendezvous) {
  const std::string path = "/tmp/ddpkit_filestore_" + std::to_string(getpid());
  std::remove(path.c_str());
  std::vector<std::thread> ts;
  std::atomic<int> ok{0};
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      auto pg = init_process_group(
          InitOptions().rank(r).world_size(2).init_method("file://" + path).gloo_hostname("127.0.0.1").timeout(std::chrono::seconds(30)));
      at::Tensor t = at::ones({4});
      ProcessGroup::wait(pg->allreduce(t));
      if (at::allclose(t, at::full({4}, 2.f))) ++ok;
    });
  for (auto& t : ts) t.join();
  std::remove(path.c_str());
  EXPECT_EQ(ok.load(), 2);
}

TEST(ProcessGroup, SubgroupsMadeAgainAreNewGroups) {
  // new_subgroups twice in one job: the second set are groups of their own (new names), not the
  // first set's Gloo addresses. Rank 0 comes late, so rank 1 would read what the first left.
  auto store = c10::make_intrusive<c10d::HashStore>();
  testing::spawn_groups(
      2, [&](const c10::intrusive_ptr<c10d::Store>&, int r) { return testing::make_group(store, r, 2, 2, std::chrono::seconds(10)); },
      [&](int rank, std::shared_ptr<ProcessGroup> pg) {
        std::string first_name;
        {
          auto pair = new_subgroups(*pg, 2);
          first_name = pair->options().group_name();
          at::Tensor t = at::full({5}, static_cast<float>(rank + 1));
          ProcessGroup::wait(pair->allreduce(t));
          EXPECT_TRUE(at::equal(t, at::full({5}, 3.f)));
        }
        if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
        auto again = new_subgroups(*pg, 2);
        EXPECT_NE(again->options().group_name(), first_name);
        EXPECT_EQ(again->options().group_name().rfind(pg->options().group_name() + "/subgroup2-0.", 0), 0u)
            << again->options().group_name();
        at::Tensor t = at::full({5}, static_cast<float>(rank + 1));
        ProcessGroup::wait(again->allreduce(t));
        EXPECT_TRUE(at::equal(t, at::full({5}, 3.f)));
        // Singletons: each rank its own group, both made in the same call.
        auto alone = new_subgroups(*pg, 1);
        EXPECT_EQ(alone->size(), 1);
        EXPECT_NE(alone->options().group_name(), again->options().group_name());
      });
  EXPECT_THAT(testing::error_of([&] { new_subgroups(*testing::make_group(c10::make_intrusive<c10d::HashStore>(), 0, 1), 2); }),
              ::testing::HasSubstr("must be positive and divide the world size 1"));
}

TEST(ProcessGroup, AGroupLeavesNoStoreKeysBehind) {
  // Construction's keys (Gloo's rendezvous, topology, the shared-memory choice and segment) and a
  // shared buffer's are deleted once every rank has read them, with shared memory on and off.
  for (bool shared_memory : {true, false}) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    testing::spawn_groups(
        3,
        [&](const c10::intrusive_ptr<c10d::Store>&, int r) {
          return std::make_shared<ProcessGroup>(
              store, r, 3, ProcessGroupOptions().gloo_hostname("127.0.0.1").shared_memory(shared_memory).group_name("keys"));
        },
        [&](int rank, std::shared_ptr<ProcessGroup> pg) {
          EXPECT_EQ(pg->uses_shared_memory(), shared_memory);
          at::Tensor buffer = pg->allreduce_buffer(1000, at::kFloat);
          buffer.fill_(static_cast<float>(rank));
          ProcessGroup::wait(pg->allreduce(buffer));
          EXPECT_TRUE(at::equal(buffer, at::full({1000}, 3.f)));
          ProcessGroup::wait(pg->barrier());
          EXPECT_EQ(store->getNumKeys(), 0) << "shared memory " << shared_memory;
        });
  }
}

// Issue 14: the divergence guard decides on every rank alike, at the same step.
TEST(DivergenceGuard, NonFiniteLossOnOneRankStopsEveryRankAtTheSameStep) {
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    DivergenceGuard guard(pg, DivergenceGuardOptions().window(10));
    std::optional<Divergence> d;
    int64_t step = 0;
    for (; step < 100 && !d; ++step) d = guard.observe(rank == 1 && step == 23 ? NAN : 2.0 - 0.01 * step);
    ASSERT_TRUE(d.has_value());
    EXPECT_EQ(d->step, 29);
    EXPECT_EQ(d->what, "the loss became NaN or Inf (steps 20-29)");
  });
}

// A resumed run's guard carries on from the checkpoint's history: a fitted run (loss ~0.005) whose
// noise moves it to 0.007 after the resume is not "above where training started" (2.3, the
// original first window), and the restored guard decides exactly as the uninterrupted one would.
TEST(DivergenceGuard, ARestoredGuardCarriesOnFromItsHistory) {
  auto loss = [](int64_t s) { return s < 100 ? 2.3 - 0.0229 * s : s < 615 ? 0.005 : 0.007; };
  DivergenceGuard whole(nullptr, DivergenceGuardOptions().window(20));
  DivergenceGuard before(nullptr, DivergenceGuardOptions().window(20));
  for (int64_t s = 0; s < 598; ++s) {
    EXPECT_FALSE(whole.observe(loss(s)));
    EXPECT_FALSE(before.observe(loss(s)));
  }
  DivergenceGuard after(nullptr, DivergenceGuardOptions().window(20));
  after.restore(before.history());
  for (int64_t s = 598; s < 700; ++s) {
    EXPECT_FALSE(after.observe(loss(s))) << "step " << s;
    EXPECT_FALSE(whole.observe(loss(s)));
  }
  const auto a = after.history(), w = whole.history();
  EXPECT_EQ(a.steps, w.steps);
  EXPECT_DOUBLE_EQ(a.first_window_mean, w.first_window_mean);
  EXPECT_DOUBLE_EQ(a.best_window_mean, w.best_window_mean);
  EXPECT_EQ(a.best_window_end, w.best_window_end);
  // Without the history, the same resume reads the noise as lost progress.
  DivergenceGuard fresh(nullptr, DivergenceGuardOptions().window(20));
  std::optional<Divergence> lost;
  for (int64_t s = 598; s < 700 && !lost; ++s) lost = fresh.observe(loss(s));
  ASSERT_TRUE(lost);
  EXPECT_NE(lost->what.find("above where training started"), std::string::npos) << lost->what;
}

TEST(DivergenceGuard, ExplosionAndLostProgressAreCaughtAndTrainingIsNot) {
  auto run = [](const std::function<double(int64_t)>& loss) -> std::optional<Divergence> {
    DivergenceGuard guard(nullptr, DivergenceGuardOptions().window(10));
    for (int64_t s = 0; s < 400; ++s)
      if (auto d = guard.observe(loss(s))) return d;
    return std::nullopt;
  };
  // Falling with noise: never stopped.
  EXPECT_FALSE(run([](int64_t s) { return 2.3 * std::exp(-0.01 * s) + 0.3 + 0.2 * ((s * 7919) % 13) / 13.0; }));
  // Flat (a model that cannot learn this data): not divergence either.
  EXPECT_FALSE(run([](int64_t s) { return 6.93 + 0.01 * (s % 3); }));
  // Fitted to near zero, then noise triples it (0.03 -> 0.1): far below where it started, not divergence.
  EXPECT_FALSE(run([](int64_t s) { return s < 100 ? 2.3 - 0.0227 * s : s < 300 ? 0.03 : 0.1; }));
  // Learns, then blows up: more than 3x the best window.
  auto up = run([](int64_t s) { return s < 200 ? 2.0 - 0.009 * s : 50.0; });
  ASSERT_TRUE(up);
  EXPECT_EQ(up->step, 209);
  EXPECT_NE(up->what.find("x the lowest window mean so far"), std::string::npos) << up->what;
  // Learns a little, then returns to chance (PowerSGD at too low a rank): above where it started.
  auto lost = run([](int64_t s) { return s < 20 ? 2.3 - 0.06 * s : 2.6; });
  ASSERT_TRUE(lost);
  EXPECT_EQ(lost->step, 29);
  EXPECT_NE(lost->what.find("above where training started"), std::string::npos) << lost->what;
  EXPECT_NE(testing::error_of([] { DivergenceGuard(nullptr, DivergenceGuardOptions().window(0)); }).find("window must be >= 1"),
            std::string::npos);
}

// Steps `fused` and `reference` (over equal copies `ours` and `theirs`) four times with the same
// gradients: parameter 1 has none (skipped by both), and at step 2 parameter `transposed` (64 x 33)
// gets a non-contiguous one (libtorch's operations). Every parameter must stay bit-identical.
void expect_same_steps(std::vector<at::Tensor>& ours, std::vector<at::Tensor>& theirs, torch::optim::Optimizer& fused,
                       torch::optim::Optimizer& reference, size_t transposed, const std::string& label) {
  for (int step = 0; step < 4; ++step) {
    for (size_t i = 0; i < ours.size(); ++i) {
      at::Tensor g = at::randn(ours[i].sizes(), ours[i].options().requires_grad(false));
      if (step == 2 && i == transposed) g = at::randn({33, 64}).t();
      ours[i].mutable_grad() = g.clone();
      theirs[i].mutable_grad() = g.clone();
    }
    ours[1].mutable_grad().reset();
    theirs[1].mutable_grad().reset();
    fused.step();
    reference.step();
    for (size_t i = 0; i < ours.size(); ++i)
      ASSERT_TRUE(at::equal(ours[i], theirs[i])) << label << ", step " << step << ", parameter " << i
                                                << ": max difference " << (ours[i] - theirs[i]).abs().max().item<double>();
  }
}

// ---- ddpkit::optim::SGD ----------------------------------------------------------------------------
// One pass per parameter must give torch::optim::SGD's bits: every option, sizes with and without
// a vector tail, sizes split across threads, and the cases that take libtorch's operations.
TEST(FusedSGD, MatchesTorchSGDBitForBit) {
  struct Case {
    const char* name;
    torch::optim::SGDOptions options;
  };
  const std::vector<Case> cases = {
      {"plain", torch::optim::SGDOptions(0.1)},
      {"momentum", torch::optim::SGDOptions(0.05).momentum(0.9)},
      {"dampening_wd", torch::optim::SGDOptions(0.05).momentum(0.8).dampening(0.3).weight_decay(1e-2)},
      {"nesterov_wd", torch::optim::SGDOptions(0.01).momentum(0.9).nesterov(true).weight_decay(1e-3)},
  };
  const std::vector<std::vector<int64_t>> shapes = {{1}, {2}, {7}, {64, 33}, {3, 100003}};
  for (const auto& c : cases) {
    for (int threads : {1, 3}) {
      at::set_num_threads(threads);
      std::vector<at::Tensor> ours, theirs;
      for (size_t i = 0; i < shapes.size(); ++i) {
        ours.push_back(at::randn(shapes[i]).requires_grad_(true));
        theirs.push_back(ours.back().detach().clone().requires_grad_(true));
      }
      ours.push_back(at::randn({5, 6}, at::kDouble).requires_grad_(true));  // not float: libtorch's ops
      theirs.push_back(ours.back().detach().clone().requires_grad_(true));
      optim::SGD fused(ours, c.options);
      torch::optim::SGD reference(theirs, c.options);
      expect_same_steps(ours, theirs, fused, reference, 3, std::string(c.name) + ", " + std::to_string(threads) + " threads");
      // The state is torch::optim::SGD's: it saves from one and loads into the other.
      std::stringstream saved;
      torch::serialize::OutputArchive out;
      fused.save(out);
      out.save_to(saved);
      torch::optim::SGD loaded(theirs, c.options);
      torch::serialize::InputArchive in;
      in.load_from(saved);
      loaded.load(in);
      EXPECT_EQ(loaded.state().size(), c.options.momentum() != 0 ? ours.size() - 1 : 0u) << c.name;
    }
  }
  at::set_num_threads(1);
}

// ---- ddpkit::optim::Adam / AdamW ------------------------------------------------------------------
// Sliced, libtorch's operations must still give libtorch's bits: every option, tensors smaller
// and larger than a slice (with a vector tail), split across threads, a non-contiguous gradient
// (libtorch's whole-tensor path), and state that loads into libtorch's optimizer.
template <typename Ours, typename Theirs, typename Options>
void expect_adam_matches(const char* name, const Options& options) {
  const std::vector<std::vector<int64_t>> shapes = {{1}, {7}, {64, 33}, {3, 100003}, {200000}};
  for (int threads : {1, 3}) {
    at::set_num_threads(threads);
    std::vector<at::Tensor> ours, theirs;
    for (const auto& shape : shapes) {
      ours.push_back(at::randn(shape).requires_grad_(true));
      theirs.push_back(ours.back().detach().clone().requires_grad_(true));
    }
    Ours fused(ours, options);
    Theirs reference(theirs, options);
    expect_same_steps(ours, theirs, fused, reference, 2, std::string(name) + ", " + std::to_string(threads) + " threads");
    std::stringstream saved;
    torch::serialize::OutputArchive out;
    fused.save(out);
    out.save_to(saved);
    Theirs loaded(theirs, options);
    torch::serialize::InputArchive in;
    in.load_from(saved);
    loaded.load(in);
    EXPECT_EQ(loaded.state().size(), ours.size() - 1) << name;
  }
  at::set_num_threads(1);
}

TEST(SlicedAdam, MatchesLibtorchBitForBit) {
  expect_adam_matches<optim::Adam, torch::optim::Adam>("adam", torch::optim::AdamOptions(1e-2));
  expect_adam_matches<optim::Adam, torch::optim::Adam>("adam_wd", torch::optim::AdamOptions(1e-2).weight_decay(1e-2));
  expect_adam_matches<optim::Adam, torch::optim::Adam>("adam_amsgrad", torch::optim::AdamOptions(1e-3).amsgrad(true));
  expect_adam_matches<optim::AdamW, torch::optim::AdamW>("adamw", torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  expect_adam_matches<optim::AdamW, torch::optim::AdamW>("adamw_amsgrad",
                                                         torch::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true));
}

}  // namespace
}  // namespace ddpkit
