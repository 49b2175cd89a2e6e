// ft::Manager::register_state: what heals and checkpoints carry of the loop's own state, by scope
// (shared, shared per rank, local), with replica groups as threads over an in-process lighthouse.
#include "harness.h"

#include <ddpkit/ft/lighthouse.h>
#include <ddpkit/ft/manager.h>
#include <ddpkit/training/checkpoint.h>

#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>

namespace ddpkit {
namespace {

using namespace std::chrono_literals;

// A loop's own counters, one per scope, each counting the steps its group committed; and how many
// times a heal or a checkpoint loaded each.
struct Counters {
  int64_t shared = 0, per_rank = 0, local = 0;
  int loads_shared = 0, loads_per_rank = 0, loads_local = 0;

  void register_with(ft::Manager& m, int rank) {
    m.register_state("shared", [this] { return TensorDict{{"n", int_entry(shared)}}; },
                     [this](const TensorDict& d) { shared = int_of(d, "n", "shared"), ++loads_shared; });
    // Per rank: each rank's value differs (rank * 1000 + count), as a shard would.
    m.register_state("per_rank", [this, rank] { return TensorDict{{"n", int_entry(rank * 1000 + per_rank)}}; },
                     [this, rank](const TensorDict& d) { per_rank = int_of(d, "n", "per_rank") - rank * 1000, ++loads_per_rank; },
                     ft::StateScope::kSharedPerRank);
    m.register_state("local", [this] { return TensorDict{{"n", int_entry(local)}}; },
                     [this](const TensorDict& d) {
                       local = d.empty() ? 0 : int_of(d, "n", "local");
                       ++loads_local;
                     },
                     ft::StateScope::kLocal);
  }
  void commit() { ++shared, ++per_rank, ++local; }
};

ft::ManagerOptions options_for(const ft::Lighthouse& lh, const std::string& id) {
  return ft::ManagerOptions().lighthouse(lh.address()).group_id(id).quorum_timeout(30s).cross_group_timeout(30s);
}

// Group b starts after group a has committed 3 steps: its first quorum heals it from a. The shared
// and per-rank state come across rank to rank; the local state stays b's own (never loaded).
TEST(ManagerState, HealsCarryTheSharedScopesAndLeaveTheLocalOne) {
  ft::Lighthouse lighthouse(ft::LighthouseOptions().expected_groups(1));
  lighthouse.start();
  constexpr int kRanks = 2, kSteps = 8;
  std::atomic<int> b_made{0};
  std::vector<Counters> a(kRanks), b(kRanks);
  std::vector<int64_t> b_heals(kRanks), a_shared_when_b_joined(kRanks, -1);
  std::thread group_a([&] {
    testing::spawn_ranks(kRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      ft::Manager m(pg, options_for(lighthouse, "a"));
      a[rank].register_with(m, rank);
      for (;;) {
        if (m.step() == 3)
          while (b_made.load() < kRanks) std::this_thread::sleep_for(5ms);  // b is live: the next quorum waits for it
        m.start_step();
        if (m.step() >= kSteps) break;
        if (m.should_commit()) a[rank].commit();
      }
    });
  });
  std::thread group_b([&] {
    testing::spawn_ranks(kRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      while (a[rank].shared < 3) std::this_thread::sleep_for(5ms);
      ft::Manager m(pg, options_for(lighthouse, "b"));
      b[rank].register_with(m, rank);
      ++b_made;
      for (;;) {
        m.start_step();
        if (m.step() >= kSteps) break;
        if (m.should_commit()) b[rank].commit();
      }
      b_heals[rank] = m.stats().heals;
    });
  });
  group_a.join();
  group_b.join();
  lighthouse.shutdown();
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(b_heals[r], 1);
    EXPECT_EQ(b[r].loads_shared, 1);
    EXPECT_EQ(b[r].loads_per_rank, 1);
    EXPECT_EQ(b[r].loads_local, 0) << "a heal loaded the local scope";
    // After the heal the groups commit the same steps: equal shared counts, rank by rank.
    EXPECT_EQ(b[r].shared, a[r].shared);
    EXPECT_EQ(b[r].per_rank, a[r].per_rank) << "the per-rank state crossed to another rank";
    EXPECT_EQ(a[r].shared, kSteps);
    EXPECT_LT(b[r].local, kSteps);  // only the steps b committed itself
    EXPECT_EQ(a[r].loads_shared + a[r].loads_per_rank + a[r].loads_local, 0);
  }
}

// save_checkpoint / restore_checkpoint: every scope back, and the step; a group of another size
// is refused per-rank state it cannot have, before anything is loaded (its local state would start
// afresh).
TEST(ManagerState, CheckpointsKeepEveryScopeAndTheStep) {
  ft::Lighthouse lighthouse(ft::LighthouseOptions().expected_groups(1));
  lighthouse.start();
  char dir_template[] = "/tmp/ddpkit-manager-state.XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  testing::spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Counters c;
    ft::Manager m(pg, options_for(lighthouse, "writer"));
    c.register_with(m, rank);
    for (int i = 0; i < 5; ++i) {
      m.start_step();
      if (m.should_commit()) c.commit();
    }
    m.save_checkpoint(dir);
  });
  testing::spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Counters c;
    ft::Manager m(pg, options_for(lighthouse, "reader"));
    c.register_with(m, rank);
    EXPECT_EQ(m.restore_checkpoint(dir), 5);
    EXPECT_EQ(m.step(), 5);
    EXPECT_EQ(c.shared, 5);
    EXPECT_EQ(c.per_rank, 5);
    EXPECT_EQ(c.local, 5);
  });
  testing::spawn_ranks(1, [&](int, std::shared_ptr<ProcessGroup> pg) {
    Counters c;
    ft::Manager m(pg, options_for(lighthouse, "smaller"));
    c.register_with(m, 0);
    EXPECT_THAT(testing::error_of([&] { m.restore_checkpoint(dir); }),
                ::testing::HasSubstr("no per-rank state 'per_rank': it was written by a group of another size"));
    EXPECT_EQ(c.loads_shared + c.loads_per_rank + c.loads_local, 0);  // checked before any is loaded
  });
  lighthouse.shutdown();
  std::filesystem::remove_all(dir);
}

// Fault-tolerant DDP groups seeded differently (separate jobs that each seed their own model): the
// first quorum copies group a's model and optimizer to b and c (init sync: a is the first by id),
// so they train one model, a's, bit-identical. Group c's model is then corrupted and c asks to heal
// (request_heal): its next quorum copies the others' again. A group alone builds no cross group.
TEST(ManagerState, GroupsSeededDifferentlyTrainOneModel) {
  ft::Lighthouse lighthouse(ft::LighthouseOptions().expected_groups(3));
  lighthouse.start();
  constexpr int kSteps = 8;
  auto batch = [](int step) { return testing::seeded_randn({16, 8}, 500 + static_cast<uint64_t>(step)); };
  struct End {
    std::vector<at::Tensor> params;
    ft::ManagerStats stats;
  };
  std::vector<End> ends(3);
  std::vector<std::thread> groups;
  for (int g = 0; g < 3; ++g)
    groups.emplace_back([&, g] {
      testing::spawn_ranks(1, [&](int, std::shared_ptr<ProcessGroup> pg) {
        torch::nn::Linear lin(8, 4);
        {
          at::NoGradGuard no_grad;
          for (auto& p : lin->parameters()) p.copy_(testing::seeded_randn(p.sizes().vec(), 10 + static_cast<uint64_t>(g)));
        }
        torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        TrainingState state;
        state.module(lin.ptr()).optimizer(&opt);
        ft::Manager m(pg, state, options_for(lighthouse, std::string(1, static_cast<char>('a' + g))));
        while (m.step() < kSteps) {
          m.start_step();
          lin(batch(static_cast<int>(m.step()))).pow(2).mean().backward();
          std::vector<at::Tensor> grads;
          for (auto& p : lin->parameters()) grads.push_back(p.grad());
          m.allreduce(grads);
          if (m.should_commit()) opt.step();
          opt.zero_grad();
          if (g == 2 && m.step() == 4) {  // c's model found to differ (here: made to)
            at::NoGradGuard no_grad;
            lin->weight.add_(1.0);
            m.request_heal("test: c's weights were changed");
          }
        }
        m.close();
        for (auto& p : lin->parameters()) ends[g].params.push_back(p.detach().clone());
        ends[g].stats = m.stats();
      });
    });
  for (auto& t : groups) t.join();
  // a's model trained alone on the same batches: what every group's must be.
  torch::nn::Linear ref(8, 4);
  {
    at::NoGradGuard no_grad;
    for (auto& p : ref->parameters()) p.copy_(testing::seeded_randn(p.sizes().vec(), 10));
  }
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    ref(batch(step)).pow(2).mean().backward();
    ref_opt.step();
    ref_opt.zero_grad();
  }
  for (int g = 0; g < 3; ++g) {
    SCOPED_TRACE("group " + std::to_string(g));
    EXPECT_EQ(ends[g].stats.init_syncs, g == 0 ? 0 : 1);
    EXPECT_EQ(ends[g].stats.heals, g == 2 ? 1 : 0);
    EXPECT_EQ(ends[g].stats.reconfigurations, 1);  // one cross group, built at the first quorum
    for (size_t i = 0; i < ends[g].params.size(); ++i) {
      EXPECT_TRUE(at::equal(ends[g].params[i], ends[0].params[i]));
      EXPECT_LT((ends[g].params[i] - ref->parameters()[i].detach()).abs().max().item<double>(), 1e-6);
    }
  }
  // Alone: every quorum is the group itself, and no cross group is built.
  testing::spawn_ranks(1, [&](int, std::shared_ptr<ProcessGroup> pg) {
    ft::Manager m(pg, options_for(lighthouse, "solo"));
    for (int i = 0; i < 5; ++i) {
      m.start_step();
      m.should_commit();
    }
    EXPECT_EQ(m.stats().quorums, 5);
    EXPECT_EQ(m.stats().reconfigurations, 0);
  });
  lighthouse.shutdown();
}

TEST(ManagerState, BadRegistrationsAreNamed) {
  ft::Lighthouse lighthouse(ft::LighthouseOptions{});
  lighthouse.start();
  testing::spawn_ranks(1, [&](int, std::shared_ptr<ProcessGroup> pg) {
    ft::Manager m(pg, options_for(lighthouse, "g"));
    auto save = [] { return TensorDict{}; };
    auto load = [](const TensorDict&) {};
    m.register_state("data", save, load);
    EXPECT_THAT(testing::error_of([&] { m.register_state("data", save, load); }),
                ::testing::HasSubstr("'data' is registered already"));
    EXPECT_THAT(testing::error_of([&] { m.register_state("a/b", save, load); }), ::testing::HasSubstr("no '/'"));
    EXPECT_THAT(testing::error_of([&] { m.register_state("x", nullptr, load); }),
                ::testing::HasSubstr("give both a save and a load function"));
    m.unregister_state("data");
    m.register_state("data", save, load);  // free again
  });
  lighthouse.shutdown();
}

}  // namespace
}  // namespace ddpkit
