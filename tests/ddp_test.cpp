// DistributedDataParallel, Reducer and default hooks, ranks as threads.
#include "harness.h"

#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <set>

namespace ddpkit {
namespace {

using testing::allgather;
using testing::make_mlp;
using testing::seed_grads;
using testing::SeedTask;
using testing::error_of;
using testing::spawn_ranks;
using testing::spawn_ranks_with;
using ::testing::HasSubstr;

// Tiny caps: many buckets, so ordering and rebuilding are exercised.
DistributedDataParallelOptions tiny_buckets() {
  return DistributedDataParallelOptions().bucket_cap_mb(0.00001).first_bucket_cap_mb(0.00001);
}

at::Tensor batch_for(int64_t step, int64_t rows, int64_t features = 8) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return at::randn({rows, features}, gen);
}

// ---- equivalence with single-process training --------------------------------------------------
class Equivalence : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(Equivalence, TinyBucketsMatchConcatenatedBatch) {
  const int world = std::get<0>(GetParam());
  const bool as_view = std::get<1>(GetParam());
  const int64_t per_rank = 4, steps = 5;
  // Reference: one process, the concatenated batch, plain SGD.
  auto ref = make_mlp(3);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int64_t s = 0; s < steps; ++s) {
    at::Tensor x = batch_for(s, per_rank * world);
    ref_opt.zero_grad();
    ref->forward(x).pow(2).mean().backward();
    ref_opt.step();
  }
  spawn_ranks(world, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto model = make_mlp(100 + rank);  // different init: DDP must broadcast rank 0's... of seed 3
    if (rank == 0) {
      auto fresh = make_mlp(3);
      torch::NoGradGuard g;
      for (size_t i = 0; i < model->parameters().size(); ++i) model->parameters()[i].copy_(fresh->parameters()[i]);
    }
    DistributedDataParallel<torch::nn::Sequential> ddp(model, pg, tiny_buckets().gradient_as_bucket_view(as_view));
    EXPECT_EQ(ddp.reducer().bucket_indices().size(), model->parameters().size());  // one tensor each
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int64_t s = 0; s < steps; ++s) {
      at::Tensor x = batch_for(s, per_rank * world).narrow(0, rank * per_rank, per_rank);
      opt.zero_grad();
      ddp.forward(x).pow(2).mean().backward();
      opt.step();
    }
    EXPECT_TRUE(ddp.reducer().buckets_rebuilt());
    for (size_t i = 0; i < model->parameters().size(); ++i) {
      EXPECT_TRUE(at::allclose(model->parameters()[i], ref->parameters()[i], 1e-5, 1e-6))
          << "rank " << rank << " parameter " << i;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Equivalence,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(false, true)));

// ---- hooks vs no hook (seed 002's model: p * x^(1+rank), mean) -----------------------------------
TEST(Hooks, AllreduceMatchesNoHook) {
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto ref = seed_grads(rank, pg, "");
    auto got = seed_grads(rank, pg, "allreduce");
    EXPECT_TRUE(at::allclose(got, ref, 1e-5, 0));
  });
}

TEST(Hooks, Fp16MatchesNoHook) {
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto ref = seed_grads(rank, pg, "");
    for (const char* h : {"fp16", "fp16_wrapper"}) EXPECT_TRUE(at::allclose(seed_grads(rank, pg, h), ref, 1e-5, 1e-4)) << h;
  });
}

// bf16 keeps 8 significant bits. Each rank's g_r/n is rounded once (error <= 2^-9 |g_r/n|), the
// fp32 sum once more (<= 2^-9 |sum|), so |hook - ref| <= 2^-8 |ref| + 2^-8 max_r |g_r|.
TEST(Hooks, Bf16WithinDocumentedBound) {
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto ref = seed_grads(rank, pg, "");
    at::Tensor local_max = at::zeros({1});
    {
      // max over ranks of |local gradient|: the gradient of rank r alone is n * (its share).
      auto model = std::make_shared<SeedTask>();
      auto gen = at::make_generator<at::CPUGeneratorImpl>(2020);
      at::Tensor input = at::randn({40, 20}, gen);
      model->forward(input, rank).mean().backward();
      local_max[0] = model->p.grad().abs().max().item<float>();
      ProcessGroup::wait(pg->allreduce(local_max, c10d::ReduceOp::MAX));
    }
    for (const char* h : {"bf16", "bf16_wrapper"}) {
      at::Tensor got = seed_grads(rank, pg, h);
      at::Tensor bound = ref.abs() * std::ldexp(1.0, -8) + local_max.item<float>() * std::ldexp(1.0, -8);
      EXPECT_TRUE((got - ref).abs().le(bound).all().item<bool>()) << h << " max error " << (got - ref).abs().max().item<float>();
      EXPECT_FALSE(at::equal(got, ref)) << h << " should be lossy";
    }
  });
}

TEST(Hooks, NoopThenManualAverageMatchesNoHook) {
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto ref = seed_grads(rank, pg, "");
    auto got = seed_grads(rank, pg, "noop");
    EXPECT_FALSE(at::allclose(got, ref));
    got.div_(pg->size());
    ProcessGroup::wait(pg->allreduce(got));
    EXPECT_TRUE(at::allclose(got, ref, 1e-5, 0));
  });
}

// Every hook, several buckets, 1..4 Gloo threads: ranks end with identical parameters.
TEST(Hooks, RanksStayIdenticalWithEveryHookAndGlooThreadCount) {
  for (int threads : {1, 4}) {
    for (const auto& hook : hooks::hook_names()) {
      if (hook == "noop") continue;  // noop does not synchronize by design
      spawn_ranks(
          2,
          [&](int rank, std::shared_ptr<ProcessGroup> pg) {
            auto model = make_mlp(7, {8, 64, 64, 64, 4});
            DistributedDataParallel<torch::nn::Sequential> ddp(model, pg, tiny_buckets());
            ddp.register_comm_hook(hooks::make_hook(hook, pg), hook);
            torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
            for (int s = 0; s < 4; ++s) {
              opt.zero_grad();
              ddp.forward(batch_for(s * 10 + rank, 6)).pow(2).mean().backward();
              opt.step();
            }
            for (auto& p : model->parameters()) {
              auto all = allgather(*pg, p.detach());
              EXPECT_TRUE(at::equal(all[0], all[1])) << hook << " threads " << threads;
            }
          },
          threads);
    }
  }
}

// ---- GradBucket and registration -----------------------------------------------------------------
TEST(Hooks, IsLastOnlyOnLastBucket) {
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto model = make_mlp(1, {2, 400, 400, 400, 400});
    DistributedDataParallel<torch::nn::Sequential> ddp(model, pg, DistributedDataParallelOptions().bucket_cap_mb(0.5));
    std::vector<bool> flags;
    std::vector<size_t> indices;
    ddp.register_comm_hook(
        [&](GradBucket& b) {
          flags.push_back(b.is_last());
          indices.push_back(b.index());
          EXPECT_EQ(b.gradients().size(), b.parameters().size());
          for (size_t i = 0; i < b.parameters().size(); ++i) EXPECT_EQ(b.gradients()[i].sizes(), b.parameters()[i].sizes());
          return completed_future(b.buffer());
        },
        "flags");
    ddp.forward(at::randn({10, 2})).sum().backward();
    ASSERT_GT(flags.size(), 2u);
    EXPECT_TRUE(flags.back());
    for (size_t i = 0; i + 1 < flags.size(); ++i) EXPECT_FALSE(flags[i]);
    for (size_t i = 0; i < indices.size(); ++i) EXPECT_EQ(indices[i], i);  // launched in index order
  });
}

// On one host a CPU bucket lives in memory every local rank maps (ProcessGroup::allreduce_buffer),
// so its allreduce sums in place; with shared memory off it is plain memory. Same gradients.
TEST(DDP, BucketsLiveInSharedMemoryOnOneHost) {
  for (bool shm : {true, false}) {
    spawn_ranks_with(
        2, ProcessGroupOptions().shared_memory(shm),
        [&](int rank, std::shared_ptr<ProcessGroup> pg) {
          EXPECT_EQ(pg->uses_shared_memory(), shm);
          auto model = make_mlp(1, {2, 400, 400});
          DistributedDataParallel<torch::nn::Sequential> ddp(model, pg, tiny_buckets());
          int buckets = 0;
          ddp.register_comm_hook(
              [&](GradBucket& b) {
                EXPECT_EQ(testing::in_shared_memory(b.buffer()), shm) << "bucket " << b.index();
                ++buckets;
                return pg->allreduce(b.buffer(), c10d::ReduceOp::AVG);
              },
              "where");
          ddp.forward(at::randn({10, 2}) * (rank + 1)).pow(2).mean().backward();
          EXPECT_GT(buckets, 1);
          for (const auto& p : model->parameters()) {
            const auto all = allgather(*pg, p.grad());
            EXPECT_TRUE(at::equal(all[0], all[1]));
          }
        });
  }
}

// Without a hook (and with .grad not the bucket's view) the gradients themselves are reduced
// through the shared bucket (ProcessGroup::allreduce_parts). By default autograd's gradients of
// parameters of 64 KiB and more are born in memory the local ranks share (GradientArena), where
// peers read them and write their shares of the sum; with that off they keep private memory. A
// .grad that was there before backward stays the same tensor. Same values every way.
TEST(DDP, BuiltInAllreduceReducesGradientsWhereTheyLie) {
  struct Setting {
    bool shm, arena;
  };
  const std::vector<Setting> settings = {{false, false}, {true, true}, {true, false}};
  std::vector<std::vector<at::Tensor>> grads(settings.size());  // [setting][rank * params + i]
  for (size_t k = 0; k < settings.size(); ++k) {
    const Setting setting = settings[k];
    grads[k].resize(2 * 6);
    spawn_ranks_with(2, ProcessGroupOptions().shared_memory(setting.shm), [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      auto model = make_mlp(1, {8, 300, 200, 4});
      DistributedDataParallel<torch::nn::Sequential> ddp(
          model, pg, DistributedDataParallelOptions().gradients_in_shared_memory(setting.arena));
      const auto params = model->parameters();
      ASSERT_EQ(params.size(), 6u);
      for (int step = 0; step < 4; ++step) {
        // Steps 2 and 3 keep the gradients (zeroed in place, as zero_grad(set_to_none=false)).
        std::vector<void*> before;
        for (auto& p : params) {
          if (step < 2) {
            p.mutable_grad() = at::Tensor();
          } else {
            p.mutable_grad().zero_();
          }
          before.push_back(p.grad().defined() ? p.grad().data_ptr() : nullptr);
        }
        ddp.forward(batch_for(step, 4) * (rank + 1)).pow(2).mean().backward();
        for (size_t i = 0; i < params.size(); ++i) {
          const bool big = params[i].numel() * 4 >= (64 << 10);
          EXPECT_EQ(testing::in_shared_memory(params[i].grad()), setting.arena && big)
              << "parameter " << i << ", step " << step << ", shm " << setting.shm;
          if (step >= 2) EXPECT_EQ(params[i].grad().data_ptr(), before[i]) << "parameter " << i;
        }
      }
      for (size_t i = 0; i < params.size(); ++i) grads[k][rank * params.size() + i] = params[i].grad().clone();
    });
  }
  for (size_t k = 1; k < settings.size(); ++k)
    for (size_t i = 0; i < grads[0].size(); ++i)
      EXPECT_TRUE(at::allclose(grads[0][i], grads[k][i], 1e-6, 1e-7)) << "setting " << k << ", gradient " << i;
  for (size_t k = 0; k < settings.size(); ++k)
    for (size_t i = 0; i < 6; ++i) EXPECT_TRUE(at::equal(grads[k][i], grads[k][6 + i])) << "ranks differ, " << i;
}

TEST(DDP, OneRankLeavesGradientsWhereAutogradPutThem) {
  // At world size 1 the built-in allreduce is the identity: no copy into the buckets and back,
  // with or without gradient_as_bucket_view; a hook still sees whole buckets.
  for (const bool as_view : {false, true}) {
    spawn_ranks(1, [&](int, std::shared_ptr<ProcessGroup> pg) {
      auto model = make_mlp(1, {8, 300, 200, 4});
      auto ref = make_mlp(1, {8, 300, 200, 4});
      DistributedDataParallel<torch::nn::Sequential> ddp(model, pg,
                                                         DistributedDataParallelOptions().gradient_as_bucket_view(as_view));
      const auto params = model->parameters();
      std::vector<void*> born(params.size(), nullptr);
      for (size_t i = 0; i < params.size(); ++i)
        params[i].register_hook([&born, i](const at::Tensor& g) { born[i] = g.data_ptr(); });
      for (int step = 0; step < 3; ++step) {  // across the bucket rebuild
        for (auto& p : params) p.mutable_grad() = at::Tensor();
        for (auto& p : ref->parameters()) p.mutable_grad() = at::Tensor();
        ddp.forward(batch_for(step, 4)).pow(2).mean().backward();
        ref->forward(batch_for(step, 4)).pow(2).mean().backward();
        for (size_t i = 0; i < params.size(); ++i) {
          EXPECT_EQ(params[i].grad().data_ptr(), born[i]) << "parameter " << i << ", step " << step << ", view " << as_view;
          EXPECT_TRUE(at::equal(params[i].grad(), ref->parameters()[i].grad())) << "parameter " << i;
        }
      }
    });
  }
}

TEST(DDP, TheBucketCapDefaultsOnceForTheLibraryAndTheCli) {
  // One default: unset, the cap is PyTorch's 25 MiB, or the registered hook's own
  // (hooks::default_bucket_cap_mb, what `ddpkit train` uses); a cap given is kept.
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    constexpr size_t MiB = 1 << 20;
    auto mib = [](double mb) { return static_cast<size_t>(mb * MiB); };
    auto make = [&](DistributedDataParallelOptions o) {
      return std::make_unique<DistributedDataParallel<torch::nn::Sequential>>(make_mlp(1, {8, 300, 200, 4}), pg, o);
    };
    auto plain = make({});
    EXPECT_EQ(plain->reducer().bucket_cap(), mib(kDefaultBucketCapMb));
    auto fp16 = make({});
    fp16->register_comm_hook(hooks::fp16_compress_hook(pg), "fp16");
    EXPECT_EQ(fp16->reducer().bucket_cap(), mib(hooks::default_bucket_cap_mb("fp16")));
    EXPECT_EQ(hooks::default_bucket_cap_mb("fp16"), hooks::kCompressingHookBucketCapMb);
    auto given = make(DistributedDataParallelOptions().bucket_cap_mb(3));
    given->register_comm_hook(hooks::fp16_compress_hook(pg), "fp16");
    EXPECT_EQ(given->reducer().bucket_cap(), mib(3));
    auto user = make({});
    user->register_comm_hook(hooks::allreduce_hook(pg), "user hook");
    EXPECT_EQ(user->reducer().bucket_cap(), mib(kDefaultBucketCapMb));
    // The hook's cap holds through the first iteration's rebuild in gradient-ready order.
    for (int step = 0; step < 3; ++step) fp16->forward(batch_for(step + rank, 4)).sum().backward();
    EXPECT_TRUE(fp16->reducer().buckets_rebuilt());
    EXPECT_EQ(fp16->reducer().bucket_cap(), mib(hooks::kCompressingHookBucketCapMb));
  });
}

TEST(Reducer, TimesCountEachSynchronizedBackwardAndResetWithTraffic) {
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto model = make_mlp(1, {8, 300, 200, 4});
    DistributedDataParallel<torch::nn::Sequential> ddp(model, pg, DistributedDataParallelOptions());
    ddp.register_comm_hook(hooks::noop_hook(), "noop");
    for (int step = 0; step < 3; ++step) ddp.forward(batch_for(step + rank, 4)).sum().backward();
    {
      torch::NoGradGuard no_grad;  // not synchronized: not counted
      ddp.forward(batch_for(9, 4));
    }
    ReducerTimes t = ddp.reducer().times();
    EXPECT_EQ(t.iterations, 3);
    EXPECT_GT(t.copy_in_ms, 0);   // the noop hook takes whole buckets: every gradient is copied in
    EXPECT_GT(t.copy_out_ms, 0);  // and back
    EXPECT_GE(t.launch_ms, 0);
    EXPECT_GE(t.wait_ms, 0);
    ddp.reducer().reset_traffic();
    t = ddp.reducer().times();
    EXPECT_EQ(t.iterations, 0);
    EXPECT_EQ(t.copy_in_ms + t.launch_ms + t.wait_ms + t.copy_out_ms, 0);
  });
}

TEST(Hooks, SecondRegistrationIsAnError) {
  spawn_ranks(1, [](int, std::shared_ptr<ProcessGroup> pg) {
    auto model = make_mlp(1);
    DistributedDataParallel<torch::nn::Sequential> ddp(model, pg);
    ddp.register_comm_hook(hooks::allreduce_hook(pg), "allreduce");
    EXPECT_THAT(error_of([&] { ddp.register_comm_hook(hooks::noop_hook(), "noop"); }),
                HasSubstr("a comm hook ('allreduce') is already registered"));
  });
}

TEST(Hooks, WrongResultIsAnErrorNamingHookAndBucket) {
  spawn_ranks(1, [](int, std::shared_ptr<ProcessGroup> pg) {
    for (int variant = 0; variant < 2; ++variant) {
      auto model = make_mlp(1);
      DistributedDataParallel<torch::nn::Sequential> ddp(model, pg);
      ddp.register_comm_hook(
          [variant](GradBucket& b) {
            return completed_future(variant == 0 ? b.buffer().narrow(0, 0, b.buffer().numel() - 1)
                                                 : b.buffer().to(at::kDouble));
          },
          "shrinker");
      const std::string err = error_of([&] { ddp.forward(at::randn({3, 8})).sum().backward(); });
      EXPECT_THAT(err, HasSubstr("comm hook 'shrinker' returned"));
      EXPECT_THAT(err, HasSubstr("for bucket 0; expected"));
    }
  });
}

// The first bucket's hook runs while backward is still computing earlier layers' gradients.
TEST(Reducer, FirstBucketLaunchesBeforeFirstLayerGradient) {
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto model = make_mlp(1, {64, 256, 256, 256, 256, 4});
    DistributedDataParallel<torch::nn::Sequential> ddp(model, pg, DistributedDataParallelOptions().bucket_cap_mb(0.2).first_bucket_cap_mb(0.01));
    std::mutex mu;
    std::vector<std::string> events;
    auto hook = hooks::allreduce_hook(pg);
    ddp.register_comm_hook(
        [&](GradBucket& b) {
          std::lock_guard<std::mutex> l(mu);
          events.push_back("hook" + std::to_string(b.index()));
          return hook(b);
        },
        "logging allreduce");
    at::Tensor first_weight = model->named_parameters()["0.weight"];
    first_weight.register_hook([&](at::Tensor g) {
      std::lock_guard<std::mutex> l(mu);
      events.push_back("first-layer-grad");
      return g;
    });
    ddp.forward(at::randn({8, 64})).sum().backward();
    auto pos = [&](const std::string& e) { return std::find(events.begin(), events.end(), e) - events.begin(); };
    ASSERT_LT(pos("hook0"), static_cast<long>(events.size()));
    EXPECT_LT(pos("hook0"), pos("first-layer-grad"));
    EXPECT_GE(ddp.reducer().bucket_indices().size(), 3u);
  });
}

// ---- unused parameters ---------------------------------------------------------------------------
struct TwoHeads : torch::nn::Module {
  TwoHeads() {
    std::lock_guard<std::mutex> lock(testing::seed_mutex());
    torch::manual_seed(5);
    trunk = register_module("trunk", torch::nn::Linear(6, 6));
    used = register_module("used", torch::nn::Linear(6, 3));
    unused = register_module("unused", torch::nn::Linear(6, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return used->forward(torch::relu(trunk->forward(x))); }
  torch::nn::Linear trunk{nullptr}, used{nullptr}, unused{nullptr};
};

TEST(Reducer, UnusedParameterKeepsNoGrad) {
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto model = std::make_shared<TwoHeads>();
    DistributedDataParallel<std::shared_ptr<TwoHeads>> ddp(model, pg, DistributedDataParallelOptions().find_unused_parameters(true));
    for (int s = 0; s < 3; ++s) {  // also across the bucket rebuild
      ddp.forward(batch_for(s + rank, 4, 6)).sum().backward();
      EXPECT_FALSE(model->unused->weight.grad().defined());
      EXPECT_FALSE(model->unused->bias.grad().defined());
      ASSERT_TRUE(model->used->weight.grad().defined());
      auto all = allgather(*pg, model->used->weight.grad());
      EXPECT_TRUE(at::equal(all[0], all[1]));
    }
    EXPECT_EQ(ddp.reducer().unused_parameters().size(), 2u);
  });
}

TEST(Reducer, UnusedParameterWithoutFindUnusedIsANamedError) {
  spawn_ranks(1, [](int, std::shared_ptr<ProcessGroup> pg) {
    auto model = std::make_shared<TwoHeads>();
    DistributedDataParallel<std::shared_ptr<TwoHeads>> ddp(model, pg);
    const std::string err = error_of([&] { ddp.forward(at::randn({2, 6})).sum().backward(); });
    EXPECT_THAT(err, HasSubstr("unused.weight"));
    EXPECT_THAT(err, HasSubstr("find_unused_parameters(true)"));
  });
}

TEST(Reducer, StaticGraphFindsUnusedOnce) {
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto model = std::make_shared<TwoHeads>();
    DistributedDataParallel<std::shared_ptr<TwoHeads>> ddp(model, pg, DistributedDataParallelOptions().static_graph(true));
    for (int s = 0; s < 3; ++s) {
      ddp.forward(batch_for(s + rank, 4, 6)).sum().backward();
      EXPECT_FALSE(model->unused->weight.grad().defined());
    }
    EXPECT_EQ(ddp.reducer().unused_parameters().size(), 2u);
  });
}

// ---- no_sync -------------------------------------------------------------------------------------
TEST(DDP, NoSyncAccumulatesLocallyThenSyncAgrees) {
  for (bool as_view : {false, true}) {
    spawn_ranks(2, [as_view](int rank, std::shared_ptr<ProcessGroup> pg) {
      auto model = make_mlp(1);
      auto local = make_mlp(1);  // same init; accumulates without DDP for the expected value
      DistributedDataParallel<torch::nn::Sequential> ddp(model, pg, tiny_buckets().gradient_as_bucket_view(as_view));
      {
        auto guard = ddp.no_sync();
        ddp.forward(batch_for(rank, 4)).sum().backward();
      }
      local->forward(batch_for(rank, 4)).sum().backward();
      auto g = model->parameters()[0].grad().clone();
      auto all = allgather(*pg, g);
      EXPECT_FALSE(at::allclose(all[0], all[1])) << "no_sync iteration must not communicate";
      EXPECT_TRUE(at::allclose(g, local->parameters()[0].grad()));
      ddp.forward(batch_for(10 + rank, 4)).sum().backward();
      local->forward(batch_for(10 + rank, 4)).sum().backward();
      for (size_t i = 0; i < model->parameters().size(); ++i) {
        at::Tensor want = local->parameters()[i].grad().clone();
        ProcessGroup::wait(pg->allreduce(want));
        want.div_(2);
        auto got = allgather(*pg, model->parameters()[i].grad());
        EXPECT_TRUE(at::equal(got[0], got[1]));
        EXPECT_TRUE(at::allclose(model->parameters()[i].grad(), want, 1e-5, 1e-6)) << "param " << i;
      }
    });
  }
}

// ---- sparse gradients ----------------------------------------------------------------------------
struct SparseNet : torch::nn::Module {
  SparseNet() {
    std::lock_guard<std::mutex> lock(testing::seed_mutex());
    torch::manual_seed(9);
    emb = register_module("emb", torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(50, 8).mode(torch::kSum).sparse(true)));
    fc = register_module("fc", torch::nn::Linear(8, 2));
  }
  at::Tensor forward(const at::Tensor& idx, const at::Tensor& offsets) {
    return fc->forward(emb->forward(idx, offsets));
  }
  torch::nn::EmbeddingBag emb{nullptr};
  torch::nn::Linear fc{nullptr};
};

TEST(DDP, SparseEmbeddingBagMatchesFullBatch) {
  const int world = 2;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  at::Tensor idx = at::randint(0, 50, {world * 12}, gen, at::kLong);
  auto ref = std::make_shared<SparseNet>();
  ref->forward(idx, at::arange(0, world * 12, 3, at::kLong)).sum().backward();
  spawn_ranks(world, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    for (bool with_hook : {false, true}) {
      auto model = std::make_shared<SparseNet>();
      DistributedDataParallel<std::shared_ptr<SparseNet>> ddp(model, pg);
      if (with_hook) ddp.register_comm_hook(hooks::allreduce_hook(pg), "allreduce");
      ddp.forward(idx.narrow(0, rank * 12, 12), at::arange(0, 12, 3, at::kLong)).sum().backward();
      ASSERT_TRUE(model->emb->weight.grad().is_sparse());
      // The reference summed over the full batch; DDP averages, so compare to ref / world.
      EXPECT_TRUE(at::allclose(model->emb->weight.grad().to_dense(), ref->emb->weight.grad().to_dense() / world, 1e-5, 1e-6));
      EXPECT_TRUE(at::allclose(model->fc->weight.grad(), ref->fc->weight.grad() / world, 1e-5, 1e-6));
    }
  });
}

// ---- join ----------------------------------------------------------------------------------------
TEST(DDP, JoinFinishesWithUnevenInputs) {
  for (bool find_unused : {false, true}) {
    spawn_ranks(3, [find_unused](int rank, std::shared_ptr<ProcessGroup> pg) {
      auto model = make_mlp(2);
      DistributedDataParallel<torch::nn::Sequential> ddp(model, pg, tiny_buckets().find_unused_parameters(find_unused));
      ddp.register_comm_hook(hooks::fp16_compress_hook(pg), "fp16");
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
      const int my_batches = 1 + 3 * rank;  // 1, 4, 7: rank 0 joins before the bucket rebuild
      int done = 0;
      ddp.join([&] {
        for (int s = 0; s < my_batches; ++s, ++done) {
          opt.zero_grad();
          ddp.forward(batch_for(s * 3 + rank, 4)).pow(2).mean().backward();
          opt.step();
        }
      });
      EXPECT_EQ(done, my_batches);
      for (auto& p : model->parameters()) {
        auto all = allgather(*pg, p.detach());
        EXPECT_TRUE(at::equal(all[0], all[2]) && at::equal(all[1], all[2]));
      }
    });
  }
}

// ---- construction checks -------------------------------------------------------------------------
TEST(DDP, ParameterShapeMismatchNamesFirstDifference) {
  EXPECT_THAT(error_of([] {
                spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
                  auto model = make_mlp(1, {8, rank == 0 ? 16 : 17, 4});
                  DistributedDataParallel<torch::nn::Sequential> ddp(model, pg);
                });
              }),
              HasSubstr("parameter 0 ('0.weight') differs across ranks: rank 0 has [16, 8] Float, rank 1 has [17, 8] Float"));
}

TEST(DDP, BroadcastsRankZeroStateAtConstruction) {
  spawn_ranks(3, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto model = make_mlp(50 + rank);
    DistributedDataParallel<torch::nn::Sequential> ddp(model, pg);
    auto want = make_mlp(50);
    for (size_t i = 0; i < model->parameters().size(); ++i) EXPECT_TRUE(at::equal(model->parameters()[i], want->parameters()[i]));
  });
}

struct WithBuffer : torch::nn::Module {
  WithBuffer() {
    fc = register_module("fc", torch::nn::Linear(4, 2));
    stat = register_buffer("stat", at::zeros({3}));
  }
  at::Tensor forward(const at::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
  at::Tensor stat;
};

TEST(DDP, BuffersFollowRankZeroEveryForward) {
  for (bool broadcast : {true, false}) {
    spawn_ranks(2, [broadcast](int rank, std::shared_ptr<ProcessGroup> pg) {
      std::shared_ptr<WithBuffer> model;
      {
        std::lock_guard<std::mutex> lock(testing::seed_mutex());
        model = std::make_shared<WithBuffer>();
      }
      DistributedDataParallel<std::shared_ptr<WithBuffer>> ddp(model, pg,
                                                               DistributedDataParallelOptions().broadcast_buffers(broadcast));
      model->stat.fill_(static_cast<float>(10 + rank));  // e.g. running statistics drifting apart
      ddp.forward(at::randn({2, 4})).sum().backward();
      EXPECT_TRUE(at::equal(model->stat, at::full({3}, broadcast ? 10.f : static_cast<float>(10 + rank))))
          << "rank " << rank << " broadcast_buffers " << broadcast;
    });
  }
}

TEST(DDP, MixedDtypesGetSeparateBuckets) {
  spawn_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto model = make_mlp(1, {4, 4, 2});
    model[2]->to(at::kDouble);
    auto net = std::make_shared<torch::nn::Module>();
    net->register_module("f", model[0]);
    net->register_module("d", model[2]);
    DistributedDataParallelBase ddp(net, pg);
    for (const auto& bucket : ddp.reducer().bucket_indices()) {
      std::set<at::ScalarType> dtypes;
      for (size_t v : bucket) dtypes.insert(ddp.reducer().parameters()[v].scalar_type());
      EXPECT_EQ(dtypes.size(), 1u);
    }
    at::Tensor x = batch_for(rank, 3, 4);
    ddp.forward_with([&] {
         auto h = model[0]->as<torch::nn::Linear>()->forward(x);
         return model[2]->as<torch::nn::Linear>()->forward(h.to(at::kDouble));
       })
        .sum()
        .backward();
    for (auto& p : net->parameters()) {
      auto all = allgather(*pg, p.grad());
      EXPECT_TRUE(at::equal(all[0], all[1]));
    }
  });
}

}  // namespace
}  // namespace ddpkit
