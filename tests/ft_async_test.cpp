// The async quorum (ft::QuorumMode::kAsync), ranks as threads: with nothing failing it trains
// exactly what the synchronous protocol trains; a group joining late is served a snapshot of its
// source's step boundary while the source's forward scribbles over its live parameters (as an
// FSDP reshard swaps them), adds zeros while it heals, and the others' average is divided by the
// groups that contribute: the source trains exactly what it trains alone.
#include "harness.h"

#include <ddpkit/ft/lighthouse.h>
#include <ddpkit/ft/manager.h>
#include <ddpkit/training/checkpoint.h>

#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <thread>

namespace ddpkit {
namespace {

using namespace std::chrono_literals;

ft::ManagerOptions options_for(const ft::Lighthouse& lh, const std::string& id, ft::QuorumMode mode) {
  return ft::ManagerOptions().lighthouse(lh.address()).group_id(id).quorum_timeout(30s).cross_group_timeout(30s).quorum_mode(mode);
}

at::Tensor batch(int64_t step) { return testing::seeded_randn({16, 8}, 700 + static_cast<uint64_t>(step)); }

// One group's model, seeded by `seed`, and its optimizer.
struct Replica {
  torch::nn::Linear lin{8, 4};
  torch::optim::SGD opt{lin->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)};
  TrainingState state;
  explicit Replica(uint64_t seed) {
    at::NoGradGuard no_grad;
    for (auto& p : lin->parameters()) p.copy_(testing::seeded_randn(p.sizes().vec(), seed));
    state.module(lin.ptr()).optimizer(&opt);
  }
  std::vector<at::Tensor> grads() {
    std::vector<at::Tensor> g;
    for (auto& p : lin->parameters()) g.push_back(p.grad());
    return g;
  }
  std::vector<at::Tensor> params() {
    std::vector<at::Tensor> out;
    for (auto& p : lin->parameters()) out.push_back(p.detach().clone());
    return out;
  }
};

// Three groups seeded apart (the first quorum copies a's model to b and c), 8 steps, under `mode`.
std::vector<std::vector<at::Tensor>> train_three(ft::QuorumMode mode) {
  ft::Lighthouse lighthouse(ft::LighthouseOptions().expected_groups(3));
  lighthouse.start();
  std::vector<std::vector<at::Tensor>> ends(3);
  std::vector<std::thread> groups;
  for (int g = 0; g < 3; ++g)
    groups.emplace_back([&, g] {
      testing::spawn_ranks(1, [&](int, std::shared_ptr<ProcessGroup> pg) {
        Replica r(20 + static_cast<uint64_t>(g));
        ft::Manager m(pg, r.state, options_for(lighthouse, std::string(1, static_cast<char>('a' + g)), mode));
        for (;;) {
          m.start_step();
          if (m.step() >= 8) break;
          r.lin(batch(m.step()) * (g + 1)).pow(2).mean().backward();  // each group its own data
          m.allreduce(r.grads());
          if (m.should_commit()) r.opt.step();
          r.opt.zero_grad();
        }
        EXPECT_EQ(m.stats().steps_not_committed + m.stats().steps_healing, 0) << "group " << g;
        m.close();
        ends[g] = r.params();
      });
    });
  for (auto& t : groups) t.join();
  lighthouse.shutdown();
  return ends;
}

TEST(ManagerAsync, WithNothingFailingTrainsWhatTheSyncProtocolTrains) {
  const auto sync = train_three(ft::QuorumMode::kSync), async = train_three(ft::QuorumMode::kAsync);
  for (int g = 0; g < 3; ++g)
    for (size_t i = 0; i < sync[g].size(); ++i) {
      EXPECT_TRUE(at::equal(async[g][i], sync[g][i])) << "group " << g << " parameter " << i;
      EXPECT_TRUE(at::equal(async[g][i], async[0][i])) << "group " << g << " parameter " << i;
    }
}

TEST(ManagerAsync, AJoiningGroupIsServedTheSourcesStepBoundaryAndAddsZerosWhileItHeals) {
  ft::Lighthouse lighthouse(ft::LighthouseOptions().expected_groups(1));
  lighthouse.start();
  constexpr int64_t kSteps = 14;
  std::atomic<int64_t> a_step{0};
  std::atomic<bool> b_made{false};
  std::vector<at::Tensor> a_end, b_end;
  ft::ManagerStats a_stats, b_stats;
  std::thread group_a([&] {
    testing::spawn_ranks(1, [&](int, std::shared_ptr<ProcessGroup> pg) {
      Replica r(31);
      ft::Manager m(pg, r.state, options_for(lighthouse, "a", ft::QuorumMode::kAsync));
      for (;;) {
        if (m.step() == 3)
          while (!b_made) std::this_thread::sleep_for(5ms);  // b is live: the next quorum waits for it
        m.start_step();
        if (m.step() >= kSteps) break;
        {
          // "Forward" swaps the parameters' storage for a while, as an FSDP reshard does: a heal
          // read from the live tensors now would copy NaNs.
          at::NoGradGuard no_grad;
          const auto saved = r.params();
          for (auto& p : r.lin->parameters()) p.fill_(std::numeric_limits<float>::quiet_NaN());
          std::this_thread::sleep_for(30ms);
          for (size_t i = 0; i < saved.size(); ++i) r.lin->parameters()[i].copy_(saved[i]);
        }
        r.lin(batch(m.step())).pow(2).mean().backward();
        m.allreduce(r.grads());
        if (m.should_commit()) r.opt.step();
        r.opt.zero_grad();
        a_step = m.step();
      }
      m.close();
      a_end = r.params();
      a_stats = m.stats();
    });
  });
  std::thread group_b([&] {
    testing::spawn_ranks(1, [&](int, std::shared_ptr<ProcessGroup> pg) {
      while (a_step < 3) std::this_thread::sleep_for(5ms);
      Replica r(99);  // another model: its first quorum copies a's
      ft::Manager m(pg, r.state, options_for(lighthouse, "b", ft::QuorumMode::kAsync));
      b_made = true;
      for (;;) {
        m.start_step();
        if (m.step() >= kSteps) break;
        r.lin(batch(m.step())).pow(2).mean().backward();  // the same data as a: once healed, equal gradients
        m.allreduce(r.grads());
        if (m.should_commit()) r.opt.step();
        r.opt.zero_grad();
      }
      m.close();
      b_end = r.params();
      b_stats = m.stats();
    });
  });
  group_a.join();
  group_b.join();
  lighthouse.shutdown();
  // a's model trained alone on the same batches: what a's must be if every step divided by the
  // groups that added their own gradients (b's zeros while it healed are not a group's half).
  Replica ref(31);
  for (int64_t step = 0; step < kSteps; ++step) {
    ref.lin(batch(step)).pow(2).mean().backward();
    ref.opt.step();
    ref.opt.zero_grad();
  }
  const auto want = ref.params();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(at::equal(b_end[i], a_end[i])) << "parameter " << i << ": b did not end with a's model";
    EXPECT_TRUE(at::equal(a_end[i], want[i])) << "parameter " << i << ": a's average was not its own gradient";
  }
  EXPECT_EQ(b_stats.heals + b_stats.init_syncs, 1);
  EXPECT_GE(b_stats.steps_healing, 1) << "b loaded its copy before its forward: nothing to overlap";
  EXPECT_EQ(a_stats.steps_not_committed + a_stats.steps_healing, 0) << a_stats.last_error;
  EXPECT_GT(a_stats.snapshot_seconds, 0.0) << "a did not serve a snapshot";
  EXPECT_EQ(a_stats.steps_committed, kSteps);
}

}  // namespace
}  // namespace ddpkit

namespace ddpkit {
namespace {

// Groups whose cross-group collectives do not match (here: another model) fail every step the same
// way; no new quorum mends that, so should_commit stops the loop with the error, naming it, rather
// than failing forever.
TEST(ManagerAsync, AFailureThatRepeatsStepAfterStepStopsTheLoopNamingIt) {
  ft::Lighthouse lighthouse(ft::LighthouseOptions().expected_groups(2));
  lighthouse.start();
  std::vector<std::string> errors(2);
  std::vector<int64_t> failed(2);
  std::vector<std::thread> groups;
  for (int g = 0; g < 2; ++g)
    groups.emplace_back([&, g] {
      testing::spawn_ranks(1, [&](int, std::shared_ptr<ProcessGroup> pg) {
        torch::nn::Linear lin(8, 4 + g);  // b's model is not a's
        ft::Manager m(pg, options_for(lighthouse, std::string(1, static_cast<char>('a' + g)), ft::QuorumMode::kAsync)
                              .init_sync(false));
        errors[g] = testing::error_of([&] {
          for (int step = 0; step < 100; ++step) {
            m.start_step();
            lin(batch(step)).pow(2).mean().backward();
            std::vector<at::Tensor> grads;
            for (auto& p : lin->parameters()) grads.push_back(p.grad());
            m.allreduce(grads);
            m.should_commit();
            lin->zero_grad();
          }
        });
        failed[g] = m.stats().steps_not_committed;
        m.close(/*leave=*/false);
      });
    });
  for (auto& t : groups) t.join();
  lighthouse.shutdown();
  for (int g = 0; g < 2; ++g) {
    EXPECT_THAT(errors[g], ::testing::HasSubstr("20 steps in a row failed the same way")) << "group " << g;
    EXPECT_EQ(failed[g], 20) << "group " << g;
  }
}

}  // namespace
}  // namespace ddpkit
