// DiLoCo's outer all-reduce (include/ddpkit/diloco/outer_allreduce.h), ranks as threads: the
// weighted mean, bit-identical everywhere, over shared memory and Gloo, its bytes against the
// formula, and its error against fp32 flat in the number of sites (two quantizations, not one
// per hop).
#include "harness.h"

#include <ddpkit/codecs/codec.h>
#include <ddpkit/diloco/diloco.h>
#include <ddpkit/diloco/outer_allreduce.h>

#include <gmock/gmock.h>

namespace ddpkit {
namespace {

using diloco::weighted_mean;

at::Tensor site_values(int rank, int64_t n) { return testing::seeded_randn({n}, 100 + static_cast<uint64_t>(rank)); }

// Every rank's result, the reference mean and what each rank learnt, for `world` ranks.
struct MeanRun {
  std::vector<at::Tensor> results;
  std::vector<diloco::WeightedMeanResult> info;
  std::vector<CommStats> traffic;
  std::vector<int64_t> pieces;  // what each rank's group cut the payload into
};

MeanRun run_mean(int world, int64_t n, const std::string& codec, const std::vector<float>& weights, bool shm,
                 const std::vector<uint64_t>& checksums = {}, int gloo_threads = 2) {
  MeanRun out;
  out.results.resize(world);
  out.info.resize(world);
  out.traffic.resize(world);
  out.pieces.resize(world);
  testing::spawn_ranks_with(world, ProcessGroupOptions().shared_memory(shm).piece_bytes(64 << 10).gloo_threads(gloo_threads),
                            [&](int rank, std::shared_ptr<ProcessGroup> pg) {
                              at::Tensor v = site_values(rank, n);
                              auto info = std::make_shared<diloco::WeightedMeanResult>();
                              pg->reset_stats();
                              const auto c = codecs::make_codec(codec);
                              out.pieces[rank] = pg->pieces_for(c->encoded_bytes(n) * (world - 1) / world);
                              ProcessGroup::wait(weighted_mean(pg.get(), v, weights[rank], c,
                                                               checksums.empty() ? 7 : checksums[rank], info));
                              out.results[rank] = v;
                              out.info[rank] = *info;
                              out.traffic[rank] = pg->stats();
                            });
  return out;
}

at::Tensor reference_mean(int world, int64_t n, const std::vector<float>& weights) {
  at::Tensor sum = at::zeros({n}, at::kDouble);
  double total = 0;
  for (int r = 0; r < world; ++r) {
    sum += site_values(r, n).to(at::kDouble) * weights[r];
    total += weights[r];
  }
  return (total > 0 ? sum / total : sum).to(at::kFloat);
}

// More Gloo threads put more pieces in their first phase at once (what DiLoCo's cross group does
// over a long round trip): the same bytes come out, in any order the pieces land.
TEST(OuterAllreduce, MorePiecesInFlightGiveTheSameBits) {
  const std::vector<float> weights = {1, 2, 3};
  const MeanRun two = run_mean(3, 1 << 20, "int8", weights, false);
  const MeanRun four = run_mean(3, 1 << 20, "int8", weights, false, {}, 4);
  ASSERT_GT(four.pieces[0], 4);  // more pieces than the 4 in flight
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(at::equal(four.results[r], two.results[r])) << "rank " << r;
}

TEST(OuterAllreduce, Fp32IsTheWeightedMeanBitIdenticalOnEveryRank) {
  for (bool shm : {true, false}) {
    const std::vector<float> w = {1, 3, 0, 2};
    const int64_t n = 100003;  // not a multiple of anything
    MeanRun run = run_mean(4, n, "fp32", w, shm);
    const at::Tensor ref = reference_mean(4, n, w);
    EXPECT_LT(testing::relative_error(run.results[0], ref), 1e-6) << (shm ? "shm" : "gloo");
    for (int r = 1; r < 4; ++r) EXPECT_TRUE(at::equal(run.results[r], run.results[0])) << "rank " << r;
    EXPECT_DOUBLE_EQ(run.info[0].total_weight, 6.0);
    EXPECT_EQ(run.info[0].ranks_weighted, 3);
    EXPECT_TRUE(run.info[0].checksums_agree);
  }
}

TEST(OuterAllreduce, BytesSentMatchTheFormula) {
  for (const std::string codec : {"fp32", "int8", "int4"}) {
    const int world = 3;
    const int64_t n = 1 << 18;
    MeanRun run = run_mean(world, n, codec, {1, 1, 1}, /*shm=*/false);
    const auto c = codecs::make_codec(codec);
    const auto layout = diloco::outer_allreduce_layout(n, world, *c, run.pieces[0]);
    const double ideal = 2.0 * (world - 1) / world * static_cast<double>(c->encoded_bytes(n));
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(run.traffic[r].bytes_sent, static_cast<uint64_t>(layout.bytes_sent_per_rank)) << codec;
      EXPECT_LT(std::abs(static_cast<double>(run.traffic[r].bytes_sent) / ideal - 1), 0.02) << codec;
    }
  }
}

TEST(OuterAllreduce, ZeroWeightsAddNothingAndAllZeroGivesZeros) {
  MeanRun one = run_mean(3, 1000, "int8", {0, 5, 0}, true);
  // Only rank 1's values, through the codec twice.
  EXPECT_LT(testing::relative_error(one.results[2], site_values(1, 1000)), 2.5 / 127);
  MeanRun none = run_mean(3, 1000, "fp32", {0, 0, 0}, true);
  for (const auto& r : none.results) EXPECT_TRUE(r.eq(0).all().item<bool>());
  EXPECT_EQ(none.info[0].total_weight, 0);
}

TEST(OuterAllreduce, WithoutAGroupASiteKeepsItsOwnValues) {
  at::Tensor v = site_values(0, 100), alone = v.clone();
  ProcessGroup::wait(weighted_mean(nullptr, alone, 2, codecs::make_codec("int8")));
  EXPECT_TRUE(at::equal(alone, v));
  ProcessGroup::wait(weighted_mean(nullptr, alone, 0, codecs::make_codec("int8")));
  EXPECT_TRUE(alone.eq(0).all().item<bool>());
}

// A site whose checksum differs from the others' is named on every rank and left out of the mean
// (its global parameters are not the others': its pseudo-gradient would pull every site off). On
// a tie the lowest rank's checksum is the reference.
TEST(OuterAllreduce, OwnersNoticeSitesWhoseChecksumsDifferAndLeaveThemOut) {
  MeanRun run = run_mean(3, 5000, "fp32", {1, 1, 1}, true, {1, 1, 2});
  const at::Tensor without_2 = reference_mean(3, 5000, {1, 1, 0});
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(run.info[r].checksums_agree);
    EXPECT_THAT(run.info[r].disagreeing, ::testing::ElementsAre(2)) << "rank " << r;
    EXPECT_DOUBLE_EQ(run.info[r].total_weight, 2.0);
    EXPECT_EQ(run.info[r].ranks_weighted, 2);
    EXPECT_LT(testing::relative_error(run.results[r], without_2), 1e-6) << "rank " << r;
  }
  MeanRun tie = run_mean(2, 5000, "fp32", {1, 1}, true, {7, 9});
  for (const auto& i : tie.info) EXPECT_THAT(i.disagreeing, ::testing::ElementsAre(1));
  MeanRun weightless = run_mean(3, 5000, "fp32", {1, 0, 1}, true, {1, 2, 1});  // a healer's is not compared
  for (const auto& i : weightless.info) {
    EXPECT_TRUE(i.checksums_agree);
    EXPECT_TRUE(i.disagreeing.empty());
  }
}

// Two quantizations whatever the number of sites: the error against the fp32 mean stays flat
// from 2 to 8 sites (a ring re-quantizing at every hop grows instead: bench/codec_bench.cpp).
TEST(OuterAllreduce, QuantizedErrorIsFlatInTheNumberOfSites) {
  for (const std::string codec : {"int8", "int4"}) {
    std::vector<double> errors;
    for (int world : {2, 4, 8}) {
      const std::vector<float> w(static_cast<size_t>(world), 1.0f);
      const int64_t n = 1 << 15;
      MeanRun run = run_mean(world, n, codec, w, true);
      errors.push_back(testing::relative_error(run.results[0], reference_mean(world, n, w)));
      for (int r = 1; r < world; ++r) EXPECT_TRUE(at::equal(run.results[r], run.results[0]));
    }
    const double bound = codecs::make_codec(codec)->error_bound();
    for (double e : errors) EXPECT_LT(e, 2 * bound * 4) << codec;  // two roundings; the mean shrinks |x|
    EXPECT_LT(errors[2], errors[0] * 1.5) << codec << ": " << errors[0] << " at 2 sites, " << errors[2] << " at 8";
  }
}

// Round t's pseudo-gradient of site `rank`: a drift common to the sites plus its own part.
at::Tensor round_values(int world, int rank, int t, int64_t n) {
  return site_values(rank + world * t, n) * 0.5 + site_values(1000 + t, n);
}

// Error feedback at both quantizations: over rounds of int2 means, the applied sum stays within
// one rounding of the true sum (flat in the rounds); without it the roundings add up (as the
// square root of the rounds). Every rank decodes the same bytes each round, feedback or not.
TEST(OuterAllreduce, ErrorFeedbackKeepsTheSumOfMeansOnTrack) {
  const int world = 4, rounds = 32;
  const int64_t n = 3000;
  auto sum_error = [&](bool feedback) {
    std::vector<std::vector<double>> errors(world);
    std::vector<at::Tensor> applied(world);
    testing::spawn_ranks_with(world, ProcessGroupOptions().shared_memory(true).piece_bytes(1 << 10),
                              [&](int rank, std::shared_ptr<ProcessGroup> pg) {
                                const auto codec = codecs::make_codec("int2");
                                at::Tensor sent = at::zeros({n}), sum = at::zeros({n}), truth = at::zeros({n});
                                auto fb = std::make_shared<diloco::MeanErrorFeedback>();
                                fb->mean = at::zeros({n});
                                for (int t = 0; t < rounds; ++t) {
                                  at::Tensor mine = round_values(world, rank, t, n);
                                  for (int r = 0; r < world; ++r) truth += round_values(world, r, t, n) / world;
                                  at::Tensor v = feedback ? mine + sent : mine.clone();
                                  fb->sent = at::empty({n});
                                  ProcessGroup::wait(weighted_mean(pg.get(), v, 1.0f, codec, 0, nullptr,
                                                                   feedback ? fb : nullptr));
                                  if (feedback) sent = fb->sent;
                                  sum += v;
                                  errors[rank].push_back((sum - truth).norm().item<double>());
                                }
                                applied[rank] = sum;
                              });
    for (int r = 1; r < world; ++r) EXPECT_TRUE(at::equal(applied[r], applied[0])) << "rank " << r;
    return errors[0];
  };
  const std::vector<double> with = sum_error(true), without = sum_error(false);
  EXPECT_LT(with.back(), 0.4 * without.back()) << "after " << rounds << " rounds: " << with.back() << " with feedback, "
                                                << without.back() << " without";
  EXPECT_LT(with.back(), with[3] * 1.5) << "with feedback the error grew from " << with[3] << " to " << with.back();
}

TEST(OuterAllreduce, BadInputIsNamed) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto pg = testing::make_group(store, 0, 1);
  EXPECT_THAT(testing::error_of([&] { weighted_mean(pg.get(), at::zeros({4}, at::kDouble), 1, codecs::make_codec("fp32")); }),
              ::testing::HasSubstr("values must be contiguous float32"));
  EXPECT_THAT(testing::error_of([&] { weighted_mean(pg.get(), at::zeros({4}), -1, codecs::make_codec("fp32")); }),
              ::testing::HasSubstr("weight must be finite and >= 0"));
}

TEST(DiLoCoFragments, StridedAndSequentialOverLayers) {
  std::vector<std::vector<at::Tensor>> layers;
  for (int i = 0; i < 6; ++i) layers.push_back({at::full({1}, i)});
  auto strided = diloco::fragments_of(layers, 3, "strided");
  auto sequential = diloco::fragments_of(layers, 3, "sequential");
  ASSERT_EQ(strided.size(), 3u);
  EXPECT_EQ(strided[0][1].item<float>(), 3);  // layers 0, 3
  EXPECT_EQ(sequential[0][1].item<float>(), 1);  // layers 0, 1
  EXPECT_THAT(testing::error_of([&] { diloco::fragments_of(layers, 7, "strided"); }), ::testing::HasSubstr("at most one fragment per layer"));
  EXPECT_THAT(testing::error_of([&] { diloco::fragments_of(layers, 2, "random"); }), ::testing::HasSubstr("strided or sequential"));
}

}  // namespace
}  // namespace ddpkit
