// diloco::DiLoCo over real ft::Managers, sites and their ranks as threads of one process (an
// in-process lighthouse): the outer step against torch's own SGD(nesterov) applied to the same
// pseudo-gradients, with Streaming's fragments and alpha mixing; a site of W ranks carrying 1/W
// of the pseudo-gradient each (the bytes of a site of one rank, the same outer step); and each
// sync's transfer time.
#include "harness.h"

#include <ddpkit/diloco/diloco.h>
#include <ddpkit/ft/lighthouse.h>
#include <ddpkit/ft/manager.h>

#include <torch/optim/sgd.h>

#include <mutex>
#include <thread>

namespace ddpkit {
namespace {

using namespace std::chrono_literals;

// The model of every site, its parameters' shapes by fragment.
using Shapes = std::vector<std::vector<std::vector<int64_t>>>;
// Two fragments, fragment 0 of two tensors, fragment 1 of one: small enough to compare every value.
const Shapes kSmall = {{{3, 5}, {7}}, {{11}}};
// Large enough that padding and trailers are under 2 % of the bytes.
const Shapes kLarge = {{{512, 256}}, {{64, 1024}}};

std::vector<std::vector<at::Tensor>> initial_fragments(const Shapes& model) {
  std::vector<std::vector<at::Tensor>> out;
  uint64_t seed = 500;
  for (const auto& shapes : model) {
    out.emplace_back();
    for (const auto& s : shapes) out.back().push_back(testing::seeded_randn(s, seed++));
  }
  return out;
}

int64_t numel_of(const Shapes& model, size_t fragment) {
  int64_t n = 0;
  for (const auto& s : model[fragment]) n += c10::multiply_integers(s);
  return n;
}

// Site s's inner step t: what it subtracts from each fragment's flat parameters.
at::Tensor inner_step(int64_t numel, int site, int t, size_t fragment) {
  return testing::seeded_randn({numel}, 9000 + 100 * static_cast<uint64_t>(site) + 10 * static_cast<uint64_t>(t) + fragment) *
         0.1;
}

at::Tensor flat(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> parts;
  for (const auto& t : ts) parts.push_back(t.reshape({-1}));
  return at::cat(parts);
}

void subtract_flat(std::vector<at::Tensor>& ts, const at::Tensor& step) {
  int64_t offset = 0;
  for (auto& t : ts) {
    t.sub_(step.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

// What each site's rank r reports after its run.
struct RankEnd {
  std::vector<at::Tensor> globals, locals;  // per fragment, flat
  diloco::DiLoCoStats stats;
  ft::ManagerStats manager;
  uint64_t cross_bytes = 0;
  std::string cross_transport;  // what the last cross group ran on
  std::vector<double> transfer_per_sync;  // each committed sync's transfer time
};

// Runs `sites` sites of `ranks` thread-ranks each for `steps` inner steps (inner_step above), every
// rank with its own Manager over its site's group and a DiLoCo with `options`.
// What a test changes in a run: each site's starting parameters (default: the same everywhere),
// and something done to a site after its inner step t (before DiLoCo sees the step).
struct SiteHooks {
  std::function<std::vector<std::vector<at::Tensor>>(int site)> initial;
  std::function<void(int site, int t, diloco::DiLoCo&)> after_step;
};

std::vector<std::vector<RankEnd>> run_sites(const Shapes& model, int sites, int ranks, int steps,
                                           diloco::DiLoCoOptions options, bool lazy_connections = false,
                                           const SiteHooks& hooks = {}) {
  ft::Lighthouse lighthouse(ft::LighthouseOptions().expected_groups(sites).heartbeat_timeout(2s));
  lighthouse.start();
  std::vector<std::vector<RankEnd>> ends(static_cast<size_t>(sites), std::vector<RankEnd>(static_cast<size_t>(ranks)));
  std::vector<std::thread> threads;
  std::mutex mu;
  std::exception_ptr first;
  for (int s = 0; s < sites; ++s) {
    threads.emplace_back([&, s] {
      try {
        // Lazily connected cross groups are Gloo's: sites without shared memory, as on hosts of their own.
        testing::spawn_ranks_with(ranks, ProcessGroupOptions().shared_memory(!lazy_connections),
                                  [&](int rank, std::shared_ptr<ProcessGroup> pg) {
          TrainingState state;
          ft::Manager manager(pg, state,
                              ft::ManagerOptions()
                                  .lighthouse(lighthouse.address())
                                  .group_id("site" + std::to_string(s))
                                  .quorum_timeout(60s)
                                  .cross_group_timeout(60s)
                                  .cross_lazy_connections(lazy_connections));
          std::vector<std::vector<at::Tensor>> params = hooks.initial ? hooks.initial(s) : initial_fragments(model);
          diloco::DiLoCo dl(manager, params, options);
          RankEnd& end = ends[static_cast<size_t>(s)][static_cast<size_t>(rank)];
          dl.start();
          for (int t = 0; t < steps; ++t) {
            for (size_t f = 0; f < params.size(); ++f) subtract_flat(params[f], inner_step(numel_of(model, f), s, t, f));
            if (hooks.after_step) hooks.after_step(s, t, dl);
            const double transfer_before = dl.stats().transfer_seconds;
            const int64_t syncs_before = dl.stats().syncs;
            dl.after_inner_step();
            if (dl.stats().syncs > syncs_before)
              end.transfer_per_sync.push_back(dl.stats().transfer_seconds - transfer_before);
          }
          dl.finish();
          for (size_t f = 0; f < params.size(); ++f) {
            end.globals.push_back(dl.global_parameters(f).clone());
            end.locals.push_back(flat(params[f]).clone());
          }
          end.stats = dl.stats();
          end.manager = manager.stats();
          end.cross_bytes = manager.stats().cross_bytes_sent;
          end.cross_transport = manager.stats().cross_transport;
          ProcessGroup::wait(pg->barrier());
        });
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  lighthouse.shutdown();
  if (first) std::rethrow_exception(first);
  return ends;
}

// The outer rule written with torch's own optimizer: per fragment a torch::optim::SGD(lr,
// momentum, nesterov) whose parameter is the global copy and whose gradient is the sites' mean
// pseudo-gradient; after each step the synced fragment's local parameters become
// lerp(global, local, alpha). Fragments are synced in turn, one per H / P inner steps.
struct Reference {
  std::vector<at::Tensor> globals;                       // per fragment, flat
  std::vector<std::vector<at::Tensor>> locals;           // per site, per fragment
  std::vector<std::unique_ptr<torch::optim::SGD>> optimizers;

  // Every site starts from `init` (default: initial_fragments(kSmall)).
  Reference(int sites, int steps, int64_t sync_every, double lr, double momentum, double alpha,
            const std::vector<std::vector<at::Tensor>>& init = initial_fragments(kSmall)) {
    const size_t fragments = kSmall.size();
    for (size_t f = 0; f < fragments; ++f) {
      globals.push_back(flat(init[f]).clone().set_requires_grad(true));
      optimizers.push_back(std::make_unique<torch::optim::SGD>(
          std::vector<at::Tensor>{globals[f]}, torch::optim::SGDOptions(lr).momentum(momentum).nesterov(true)));
    }
    for (int s = 0; s < sites; ++s) {
      locals.emplace_back();
      for (size_t f = 0; f < fragments; ++f) locals.back().push_back(flat(init[f]).clone());
    }
    const int64_t period = sync_every / static_cast<int64_t>(fragments);
    size_t next = 0;
    for (int t = 0; t < steps; ++t) {
      for (int s = 0; s < sites; ++s)
        for (size_t f = 0; f < fragments; ++f) locals[s][f] -= inner_step(numel_of(kSmall, f), s, t, f);
      if ((t + 1) % period != 0) continue;
      at::NoGradGuard no_grad;
      at::Tensor mean = at::zeros_like(locals[0][next]);
      for (int s = 0; s < sites; ++s) mean += (globals[next].detach() - locals[s][next]);
      mean /= sites;
      globals[next].mutable_grad() = mean;
      optimizers[next]->step();
      for (int s = 0; s < sites; ++s) {
        const at::Tensor g = globals[next].detach();
        locals[s][next] = g + alpha * (locals[s][next] - g);
      }
      next = (next + 1) % fragments;
    }
  }
};

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Nesterov momentum 0.9, outer lr 0.7, two fragments synced in turn with alpha 0.5 mixing, over
// several rounds: every rank of every site ends where torch's SGD(nesterov=True) puts the same
// pseudo-gradients (fp32 codec: within 1e-6), with one rank a site and with two (each carrying
// half of the pseudo-gradient across sites).
// Runs `sites` sites of `ranks` ranks under that rule and compares every rank with the
// reference: fp32 codec, so within 1e-6.
void expect_torch_sgd_nesterov(int sites, int ranks, bool lazy_connections) {
  const int steps = 24;
  const int64_t sync_every = 4;
  const double lr = 0.7, momentum = 0.9, alpha = 0.5;
  const Reference ref(sites, steps, sync_every, lr, momentum, alpha);
  const auto ends = run_sites(
      kSmall, sites, ranks, steps,
      diloco::DiLoCoOptions().sync_every(sync_every).outer_lr(lr).outer_momentum(momentum).fragment_alpha(alpha),
      lazy_connections);
  for (int s = 0; s < sites; ++s)
    for (int r = 0; r < ranks; ++r) {
      const std::string where = std::to_string(sites) + " sites of " + std::to_string(ranks) + " rank(s), site " +
                                std::to_string(s) + " rank " + std::to_string(r);
      const RankEnd& e = ends[s][r];
      if (lazy_connections) EXPECT_THAT(e.cross_transport, ::testing::StartsWith("gloo (pairs connected on demand)"));
      EXPECT_EQ(e.stats.checksum_mismatches, 0) << where;
      EXPECT_EQ(e.stats.syncs, 1 + steps / (sync_every / 2)) << where;
      for (size_t f = 0; f < kSmall.size(); ++f) {
        EXPECT_LT(max_abs_diff(e.globals[f], ref.globals[f].detach()), 1e-6) << where << ", fragment " << f << ": global";
        EXPECT_LT(max_abs_diff(e.locals[f], ref.locals[s][f]), 1e-6) << where << ", fragment " << f << ": local";
      }
    }
}

TEST(DiLoCoSites, OuterStepIsTorchSgdNesterovWithAlphaMixing) {
  for (int ranks : {1, 2}) expect_torch_sgd_nesterov(2, ranks, /*lazy_connections=*/false);
}

// The same rule with cross groups that connect their pairs lazily, at 3 sites (recursive doubling
// folds one in) and 5, of 2 ranks and 1.
TEST(DiLoCoSites, OuterStepOverLazilyConnectedCrossGroups) {
  expect_torch_sgd_nesterov(3, 2, /*lazy_connections=*/true);
  expect_torch_sgd_nesterov(5, 1, /*lazy_connections=*/true);
}

// Sites seeded differently (each its own starting parameters, as separate jobs seeding themselves
// would) start from the first site's: its first quorum copies them to the others (init sync), so
// every site ends where torch's SGD(nesterov) puts sites that all started from site 0's.
TEST(DiLoCoSites, SitesSeededDifferentlyStartFromTheFirstSitesParameters) {
  const int sites = 3, steps = 24;
  auto seeded = [](int site) {
    auto params = initial_fragments(kSmall);
    for (auto& fragment : params)
      for (auto& p : fragment) p.add_(testing::seeded_randn(p.sizes().vec(), 77 + static_cast<uint64_t>(site)));
    return params;
  };
  const Reference ref(sites, steps, 4, 0.7, 0.9, 0.5, seeded(0));
  SiteHooks hooks;
  hooks.initial = seeded;
  for (int ranks : {1, 2}) {
    const auto ends = run_sites(kSmall, sites, ranks, steps,
                                diloco::DiLoCoOptions().sync_every(4).outer_lr(0.7).outer_momentum(0.9).fragment_alpha(0.5),
                                false, hooks);
    for (int s = 0; s < sites; ++s)
      for (int r = 0; r < ranks; ++r) {
        const std::string where = "site " + std::to_string(s) + " rank " + std::to_string(r) + " of " + std::to_string(ranks);
        const RankEnd& e = ends[s][r];
        EXPECT_EQ(e.manager.init_syncs, s == 0 ? 0 : 1) << where;
        EXPECT_EQ(e.manager.heals, 0) << where;
        EXPECT_EQ(e.stats.heals, 0) << where;
        EXPECT_EQ(e.stats.checksum_mismatches, 0) << where;
        for (size_t f = 0; f < kSmall.size(); ++f) {
          EXPECT_TRUE(at::equal(e.globals[f], ends[0][0].globals[f])) << where << ", fragment " << f;
          EXPECT_LT(max_abs_diff(e.globals[f], ref.globals[f].detach()), 1e-6) << where << ", fragment " << f << ": global";
          EXPECT_LT(max_abs_diff(e.locals[f], ref.locals[s][f]), 1e-6) << where << ", fragment " << f << ": local";
        }
      }
  }
}

// A site whose global parameters are corrupted mid-run (as a bit flip in memory would): the next
// sync's checksums name it on every site, its pseudo-gradient is left out of that mean, and it
// copies the others' state at once; every site ends bit-identical, and the count and the message
// say which site and when.
TEST(DiLoCoSites, ASiteWhoseGlobalParametersDifferIsLeftOutAndHealed) {
  const int sites = 3, steps = 24;
  for (int ranks : {1, 2}) {
    SiteHooks hooks;
    hooks.after_step = [](int site, int t, diloco::DiLoCo& dl) {
      if (site != 2 || t != 9) return;
      for (size_t f = 0; f < dl.fragments(); ++f) dl.global_parameters(f).add_(0.01);
    };
    const auto ends = run_sites(kSmall, sites, ranks, steps, diloco::DiLoCoOptions().sync_every(4), false, hooks);
    for (int s = 0; s < sites; ++s)
      for (int r = 0; r < ranks; ++r) {
        const std::string where = "site " + std::to_string(s) + " rank " + std::to_string(r) + " of " + std::to_string(ranks);
        const RankEnd& e = ends[s][r];
        EXPECT_EQ(e.stats.checksum_mismatches, 1) << where;
        EXPECT_THAT(e.stats.last_checksum_mismatch, ::testing::HasSubstr("the global parameters of [site2] differed"))
            << where;
        EXPECT_EQ(e.stats.heals, s == 2 ? 1 : 0) << where;
        EXPECT_EQ(e.stats.syncs, 1 + steps / 2) << where;  // no sync lost
        for (size_t f = 0; f < kSmall.size(); ++f)
          EXPECT_TRUE(at::equal(e.globals[f], ends[0][0].globals[f])) << where << ", fragment " << f << ": global";
      }
  }
}

// A site of W ranks sends what a site of one rank sends: each rank carries 1/W of the
// pseudo-gradient across sites, 2(n-1)/n of its encoding in all (within 2 %, the 16-byte trailers
// and block padding), and all-gathers the mean inside the site.
TEST(DiLoCoSites, ASiteSendsOneCopyOfThePseudoGradientWhateverItsRanks) {
  const int sites = 2, steps = 8;
  const auto codec = codecs::make_codec("int8");
  // Syncs alternate the two fragments, one per inner step (H = 2, P = 2): the first quorum's (of
  // weight 0, fragment 0), then steps / 2 of each. Each sends 2(n-1)/n of its fragment's encoding.
  const double share = 2.0 * (sites - 1) / sites;
  const double expected = share * static_cast<double>((1 + steps / 2) * codec->encoded_bytes(numel_of(kLarge, 0)) +
                                                      steps / 2 * codec->encoded_bytes(numel_of(kLarge, 1)));
  std::vector<double> measured;
  for (int ranks : {1, 2, 4}) {
    const auto ends = run_sites(kLarge, sites, ranks, steps, diloco::DiLoCoOptions().sync_every(2).codec("int8"));
    for (int s = 0; s < sites; ++s) {
      uint64_t bytes = 0;
      for (const RankEnd& e : ends[s]) bytes += e.cross_bytes;
      EXPECT_EQ(ends[s][0].stats.syncs, 1 + steps);
      measured.push_back(static_cast<double>(bytes));
      EXPECT_NEAR(static_cast<double>(bytes) / expected, 1.0, 0.02)
          << ranks << " rank(s) a site, site " << s << ": " << bytes << " B sent, the formula says " << expected;
    }
  }
  EXPECT_NEAR(measured.back() / measured.front(), 1.0, 0.02) << "a site of 4 ranks against a site of 1";
}

// Each committed sync reports its transfer time: the figure is stamped before the average's
// future completes (it was read after wait() while the future's callback had not yet run: 0).
TEST(DiLoCoSites, EverySyncReportsItsTransferTime) {
  const Shapes one_fragment = {{{3, 5}, {7}, {11}}};
  const auto ends = run_sites(one_fragment, 2, 1, 40, diloco::DiLoCoOptions().sync_every(1));
  for (const auto& site : ends)
    for (size_t i = 0; i < site[0].transfer_per_sync.size(); ++i)
      EXPECT_GT(site[0].transfer_per_sync[i], 0.0) << "sync " << i << " reported no transfer time";
}

// Ranks of one site that hold different parameters (FSDP's shards) cannot split the carrying:
// start() says so and names the option.
TEST(DiLoCoSites, RanksHoldingDifferentParametersAreNamed) {
  ft::Lighthouse lighthouse(ft::LighthouseOptions().expected_groups(1));
  lighthouse.start();
  std::vector<std::string> errors(2);
  testing::spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    TrainingState state;
    ft::Manager manager(pg, state, ft::ManagerOptions().lighthouse(lighthouse.address()).group_id("site0"));
    std::vector<std::vector<at::Tensor>> params = {{testing::seeded_randn({64}, 1 + static_cast<uint64_t>(rank))}};
    diloco::DiLoCo dl(manager, params, diloco::DiLoCoOptions().sync_every(2));
    errors[rank] = testing::error_of([&] { dl.start(); });
  });
  lighthouse.shutdown();
  for (const auto& e : errors) EXPECT_THAT(e, ::testing::HasSubstr("set parameters_sharded(true)"));
}

}  // namespace
}  // namespace ddpkit
