// FullyShardedDataParallel (issue 31), ranks as threads: every strategy equals single-process
// training on the concatenated batch; mixed precision, hooks, no_sync, clipping, state dicts and
// the named errors.
#include "harness.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

namespace ddpkit {
namespace {

using testing::error_of;
using testing::relative_error;
using testing::seed_mutex;
using testing::seeded_randn;
using testing::spawn_groups;
using testing::make_group;
using testing::spawn_ranks;
using testing::spawn_ranks_with;
using ::testing::HasSubstr;

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d) {
    fc = register_module("fc", torch::nn::Linear(d, d));
    gain = register_parameter("gain", torch::ones({d}) + 0.1 * torch::randn({d}));
  }
  at::Tensor forward(at::Tensor x) { return torch::tanh(fc(x)) * gain + x; }
  torch::nn::Linear fc{nullptr};
  at::Tensor gain;
};
TORCH_MODULE(Block);

// Units (policy 40): body's two Linears (Sequential children: wrapped by FSDP), the three blocks
// (ModuleList children: forward_unit). The root keeps offset, head and `unused` (never used), and
// the buffer `scale`. The last block is skipped on odd steps. No size divides 2, 3 and 4.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    body = register_module("body", torch::nn::Sequential(torch::nn::Linear(7, 13), torch::nn::Functional(torch::relu),
                                                         torch::nn::Linear(13, 11)));
    blocks = register_module("blocks", torch::nn::ModuleList(Block(11), Block(11), Block(11)));
    head = register_module("head", torch::nn::Linear(11, 4));
    unused = register_module("unused", torch::nn::Linear(11, 2));
    offset = register_parameter("offset", 0.1 * torch::randn({7}));
    scale = register_buffer("scale", torch::linspace(0.5, 1.5, 11));
  }
  at::Tensor forward(at::Tensor x, bool skip_last) {
    x = body->forward(x + offset) * scale;
    for (size_t i = 0; i < blocks->size(); ++i) {
      if (skip_last && i + 1 == blocks->size()) continue;
      x = fsdp::forward_unit(blocks[i]->as<BlockImpl>(), x);
    }
    return head(x);
  }
  torch::nn::Sequential body{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr}, unused{nullptr};
  at::Tensor offset, scale;
};
TORCH_MODULE(Net);

Net make_net() {
  std::lock_guard<std::mutex> lock(seed_mutex());
  torch::manual_seed(7);
  return Net();
}

constexpr int64_t kBatch = 3;
at::Tensor input_of(int step, int rank) { return seeded_randn({kBatch, 7}, 1000 + step * 10 + rank); }
at::Tensor target_of(int step, int rank) { return seeded_randn({kBatch, 4}, 5000 + step * 10 + rank); }

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name, std::vector<at::Tensor> params) {
  if (name == "adam") return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

// Single-process training on every rank's batch concatenated: what FSDP must equal.
std::map<std::string, at::Tensor> reference(int world, const std::string& optimizer, int steps) {
  Net net = make_net();
  auto opt = make_optimizer(optimizer, net->parameters());
  for (int step = 0; step < steps; ++step) {
    opt->zero_grad();
    std::vector<at::Tensor> xs, ys;
    for (int r = 0; r < world; ++r) {
      xs.push_back(input_of(step, r));
      ys.push_back(target_of(step, r));
    }
    torch::mse_loss(net->forward(at::cat(xs), step % 2 == 1), at::cat(ys)).backward();
    opt->step();
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().clone();
  for (const auto& b : net->named_buffers()) out[b.key()] = b.value().detach().clone();
  return out;
}

struct FsdpRun {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  std::string optimizer = "sgd";
  MixedPrecision mixed_precision;
  std::string hook;  // "", allreduce, reduce_scatter, fp16, bf16
  bool forward_prefetch = false;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  bool accumulate = false;  // no_sync on the first of two micro-batches
};

FullyShardedDataParallelOptions options_for(const FsdpRun& run, int rank, const std::shared_ptr<ProcessGroup>& pg) {
  auto o = FullyShardedDataParallelOptions()
               .sharding_strategy(run.strategy)
               .mixed_precision(run.mixed_precision)
               .auto_wrap_policy(size_based_auto_wrap_policy(40))
               .forward_prefetch(run.forward_prefetch)
               .backward_prefetch(run.backward_prefetch);
  if (run.strategy == ShardingStrategy::kHybridShard && pg->size() > 1) {
    // Shards over pairs of ranks (or alone, at an odd world), replicated across them.
    const int shard = pg->size() % 2 == 0 && pg->size() > 2 ? 2 : 1;
    o.shard_group(new_subgroups(*pg, shard));
    ProcessGroupOptions across = pg->options();
    across.group_name("replicate-" + std::to_string(rank % shard));
    o.replicate_group(std::make_shared<ProcessGroup>(pg->store(), rank / shard, pg->size() / shard, across));
  }
  return o;
}

void register_hook(FullyShardedDataParallelBase& fsdp, const std::string& hook) {
  auto pg = fsdp.shard_group();
  if (hook == "allreduce") fsdp.register_comm_hook(std::make_shared<fsdp::DefaultState>(pg), fsdp::allreduce_hook);
  if (hook == "reduce_scatter")
    fsdp.register_comm_hook(std::make_shared<fsdp::DefaultState>(pg), fsdp::reduce_scatter_hook);
  if (hook == "fp16" || hook == "bf16") {
    auto state = std::make_shared<fsdp::LowPrecisionState>(pg);
    if (fsdp.options().sharding_strategy() == ShardingStrategy::kNoShard) {
      auto fn = hook == "fp16" ? fsdp::fp16_compress_hook : fsdp::bf16_compress_hook;
      fsdp.register_comm_hook(FsdpAllreduceHook{[state, fn](const at::Tensor& grad) { return fn(*state, grad, at::Tensor()); }},
                              hook);
    } else {
      fsdp.register_comm_hook(state, hook == "fp16" ? fsdp::fp16_compress_hook : fsdp::bf16_compress_hook);
    }
  }
}

// Trains `steps` steps with FSDP on this rank; returns the full state dict (on every rank).
std::map<std::string, at::Tensor> train_fsdp(const FsdpRun& run, int rank, std::shared_ptr<ProcessGroup> pg, int steps) {
  Net net = make_net();
  FullyShardedDataParallel<Net> fsdp(net, pg, options_for(run, rank, pg));
  register_hook(fsdp, run.hook);
  auto opt = make_optimizer(run.optimizer, fsdp.parameters());
  for (int step = 0; step < steps; ++step) {
    opt->zero_grad();
    const at::Tensor x = input_of(step, rank), y = target_of(step, rank);
    if (run.accumulate) {
      {
        auto guard = fsdp.no_sync();
        torch::mse_loss(fsdp.forward(x.narrow(0, 0, 2), step % 2 == 1).to(at::kFloat), y.narrow(0, 0, 2))
            .mul(2.0 / 3)  // each micro-batch's mean, weighted as in the reference's concatenation
            .backward();
      }
      torch::mse_loss(fsdp.forward(x.narrow(0, 2, 1), step % 2 == 1).to(at::kFloat), y.narrow(0, 2, 1))
          .mul(1.0 / 3)
          .backward();
    } else {
      torch::mse_loss(fsdp.forward(x, step % 2 == 1).to(at::kFloat), y).backward();
    }
    opt->step();
  }
  std::map<std::string, at::Tensor> out;
  const auto dict = fsdp.full_state_dict(/*rank0_only=*/false);
  for (const auto& kv : dict.items()) out[kv.key()] = kv.value();
  return out;
}

void expect_close(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want,
                  double tolerance, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& kv : want) {
    auto it = got.find(kv.first);
    ASSERT_NE(it, got.end()) << what << ": no " << kv.first;
    ASSERT_EQ(it->second.sizes(), kv.second.sizes()) << what << ": " << kv.first;
    EXPECT_LE(relative_error(it->second, kv.second), tolerance) << what << ": " << kv.first;
  }
}

// Every rank's dict equals rank 0's, bit for bit.
void expect_ranks_identical(ProcessGroup& pg, const std::map<std::string, at::Tensor>& dict) {
  std::vector<at::Tensor> flat;
  for (const auto& kv : dict) flat.push_back(kv.second.reshape({-1}).to(at::kFloat));
  at::Tensor mine = at::cat(flat);
  for (const auto& other : testing::allgather(pg, mine)) EXPECT_TRUE(other.equal(mine)) << "rank " << pg.rank();
}

void check_run(const FsdpRun& run, int world, int steps, double tolerance, const std::string& what) {
  const auto want = reference(world, run.optimizer, steps);
  spawn_ranks(world, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto got = train_fsdp(run, rank, pg, steps);
    expect_close(got, want, tolerance, what + " rank " + std::to_string(rank));
    expect_ranks_identical(*pg, got);
  });
}

const std::vector<ShardingStrategy> kStrategies = {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                                   ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard};

TEST(FSDP, EveryStrategyEqualsSingleProcessTrainingAtWorldOneToFour) {
  for (auto strategy : kStrategies)
    for (const std::string optimizer : {"sgd", "adam"})
      for (int world = 1; world <= 4; ++world) {
        FsdpRun run;
        run.strategy = strategy;
        run.optimizer = optimizer;
        check_run(run, world, 4, 1e-6, to_string(strategy) + "/" + optimizer + "/W=" + std::to_string(world));
      }
}

TEST(FSDP, SharedMemoryOffGivesTheSameTraining) {
  const auto want = reference(2, "adam", 3);
  for (auto strategy : kStrategies) {
    spawn_ranks_with(2, ProcessGroupOptions().shared_memory(false), [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      ASSERT_FALSE(pg->uses_shared_memory());
      FsdpRun run;
      run.strategy = strategy;
      run.optimizer = "adam";
      expect_close(train_fsdp(run, rank, pg, 3), want, 1e-6, "no shm " + to_string(strategy));
    });
  }
}

// On one host in fp32, every rank's shard lies in one memory the host's ranks share: a step's
// collectives are one barrier and one reduce-scatter per unit with gradients, and no gather; with
// shared memory off, each unit is gathered for forward and again for backward.
TEST(FSDP, GathersOnOneHostReadTheSharedShardsWithoutCopying) {
  auto square = [] { return testing::make_mlp(5, {4, 4, 4, 4, 4}); };  // four 4x4 Linears
  for (bool shm : {true, false}) {
    spawn_ranks_with(2, ProcessGroupOptions().shared_memory(shm), [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      auto model = square();
      FullyShardedDataParallel<torch::nn::Sequential> fsdp(
          model, pg, FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(20)));
      ASSERT_EQ(fsdp.units().size(), 5u);  // the root (no parameters) and each Linear
      torch::optim::SGD opt(fsdp.parameters(), torch::optim::SGDOptions(0.1));
      for (int step = 0; step < 3; ++step) {
        if (step == 2) pg->reset_stats();
        opt.zero_grad();
        fsdp.forward(seeded_randn({4, 4}, 7 + rank)).pow(2).mean().backward();
        opt.step();
      }
      const uint64_t collectives = pg->stats().collectives;
      if (shm)
        EXPECT_EQ(collectives, 1u + 4u) << "a barrier and 4 reduce-scatters";
      else
        EXPECT_EQ(collectives, 4u + 4u + 4u) << "4 gathers for forward, 4 for backward, 4 reduce-scatters";
    });
  }
}

TEST(FSDP, PrefetchSettingsGiveTheSameTrainingAndBoundTheUnitsGathered) {
  const auto want = reference(3, "sgd", 4);
  for (bool forward : {false, true})
    for (auto backward : {BackwardPrefetch::kNone, BackwardPrefetch::kBackwardPre, BackwardPrefetch::kBackwardPost}) {
      spawn_ranks(3, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
        FsdpRun run;
        run.forward_prefetch = forward;
        run.backward_prefetch = backward;
        expect_close(train_fsdp(run, rank, pg, 4), want, 1e-6, "prefetch");
      });
    }
  spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Net net = make_net();
    FullyShardedDataParallel<Net> fsdp(
        net, pg, FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(40)).forward_prefetch(true));
    for (int step = 0; step < 3; ++step) fsdp.forward(input_of(step, rank), false).sum().backward();
    EXPECT_LE(fsdp.max_units_gathered(), 2);
    EXPECT_GE(fsdp.max_units_gathered(), 1);
  });
}

// Gradients are born in their unit's flat gradient: none of the units' is copied. Where autograd
// makes temporaries of a parameter's size (batch 4 through 4x4 Linears: every activation gradient
// is 16 floats, as each weight), they may take a weight's place: training is still exact.
TEST(FSDP, GradientsAreBornInPlaceAndTemporariesOfTheirSizeChangeNothing) {
  spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Net net = make_net();
    FullyShardedDataParallel<Net> fsdp(net, pg, FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(40)));
    for (int step = 0; step < 2; ++step) {
      fsdp.forward(input_of(step, rank), false).sum().backward();
      // The root's own parameters (offset, head, unused) may be copied: its backward is not one run.
      EXPECT_LE(fsdp.gradients_copied(), 3) << "step " << step;
    }
  });
  auto square = [] { return testing::make_mlp(5, {4, 4, 4, 4, 4}); };  // four 4x4 Linears, ReLU between
  auto batch = [](int step, int rank) { return seeded_randn({4, 4}, 90 + 10 * step + rank); };
  std::map<std::string, at::Tensor> want;
  {
    auto model = square();
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      model->forward(at::cat({batch(step, 0), batch(step, 1)})).pow(2).mean().backward();
      opt.step();
    }
    for (const auto& p : model->named_parameters()) want[p.key()] = p.value().detach().clone();
  }
  spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto model = square();
    FullyShardedDataParallel<torch::nn::Sequential> fsdp(
        model, pg, FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(20)));
    ASSERT_EQ(fsdp.units().size(), 5u);  // the root and each Linear
    torch::optim::SGD opt(fsdp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      fsdp.forward(batch(step, rank)).pow(2).mean().backward();
      // Temporaries took places (else this checks nothing the test above does not): their units'
      // gradients went into a fresh block instead.
      EXPECT_GT(fsdp.gradients_copied(), 0) << "step " << step;
      opt.step();
    }
    std::map<std::string, at::Tensor> got;
    const auto dict = fsdp.full_state_dict(/*rank0_only=*/false);
    for (const auto& kv : dict.items()) got[kv.key()] = kv.value();
    expect_close(got, want, 1e-6, "4x4 units, batch 4");
  });
}

TEST(FSDP, NoShardKeepsTheFlatGradientItReducedInPlace) {
  spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto model = testing::make_mlp(5, {4, 4, 4, 4, 4});
    FullyShardedDataParallel<torch::nn::Sequential> fsdp(
        model, pg,
        FullyShardedDataParallelOptions().sharding_strategy(ShardingStrategy::kNoShard).auto_wrap_policy(
            size_based_auto_wrap_policy(20)));
    std::vector<const void*> reduced;  // each unit's flat gradient, as the hook got it
    const fsdp::DefaultState state(pg);
    fsdp.register_comm_hook(FsdpAllreduceHook{[&](const at::Tensor& grad) {
      reduced.push_back(grad.data_ptr());
      return fsdp::allreduce_hook(state, grad);
    }});
    torch::optim::SGD opt(fsdp.parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      reduced.clear();
      for (auto& shard : fsdp.parameters()) shard.mutable_grad().reset();  // as ddpkit train (set to none)
      fsdp.forward(seeded_randn({4, 4}, 90 + 10 * step + rank)).pow(2).mean().backward();
      // Every unit's gradient is the flat gradient its hook reduced: kept, not copied into a new one.
      for (const auto& shard : fsdp.parameters()) {
        if (shard.numel() == 0) continue;  // the root holds no parameter of its own
        ASSERT_TRUE(shard.grad().defined());
        EXPECT_NE(std::find(reduced.begin(), reduced.end(), shard.grad().data_ptr()), reduced.end()) << "step " << step;
      }
      opt.step();
    }
  });
}

TEST(FSDP, UnitsAreFreedOutsideTheirCallsUnderFullShard) {
  spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Net net = make_net();
    FullyShardedDataParallel<Net> fsdp(net, pg, FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(40)));
    ASSERT_EQ(fsdp.units().size(), 6u);  // root, body.0, body.2, blocks.0-2
    EXPECT_EQ(fsdp.units()[0].name, "");
    EXPECT_EQ(fsdp.units()[1].name, "body.0");
    EXPECT_EQ(fsdp.units()[3].name, "blocks.0");
    EXPECT_EQ(fsdp.units()[1].shard_numel, 52);  // 7*13 + 13 over 2
    EXPECT_EQ(fsdp.parameters().size(), 6u);
    at::Tensor out = fsdp.forward(input_of(0, rank), false);
    EXPECT_EQ(net->blocks[0]->as<BlockImpl>()->fc->weight.numel(), 0);  // freed after its forward
    EXPECT_EQ(net->head->weight.numel(), 44);                            // the root stays for backward
    out.sum().backward();
    EXPECT_EQ(net->head->weight.numel(), 0);
    for (const auto& p : fsdp.parameters()) EXPECT_TRUE(p.grad().defined());
    EXPECT_FALSE(net->blocks[0]->as<BlockImpl>()->fc->weight.grad().defined());  // no unsharded gradient kept
  });
}

TEST(FSDP, MixedPrecisionStaysWithinItsTolerance) {
  // bf16 compute and reduction, fp32 master shards: 8 bits of mantissa, so within 3% after 3 steps.
  const auto want = reference(2, "sgd", 3);
  for (auto strategy : kStrategies) {
    spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      FsdpRun run;
      run.strategy = strategy;
      run.mixed_precision.param_dtype(at::kBFloat16).reduce_dtype(at::kBFloat16).buffer_dtype(at::kBFloat16);
      auto got = train_fsdp(run, rank, pg, 3);
      expect_close(got, want, 3e-2, "bf16 " + to_string(strategy));
      EXPECT_EQ(got.at("scale").scalar_type(), at::kFloat);  // buffers leave in their own dtype
      expect_ranks_identical(*pg, got);
    });
  }
  // bf16 compute with an fp32 reduction. (fp16 compute needs fp16 matmul on the CPU: libtorch
  // 1.13 has none.)
  spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    FsdpRun run;
    run.mixed_precision.param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
    expect_close(train_fsdp(run, rank, pg, 3), want, 3e-2, "bf16/fp32");
  });
}

TEST(FSDP, EveryFsdpHookCanBeRegistered) {
  const auto want = reference(4, "sgd", 3);
  struct Case {
    ShardingStrategy strategy;
    std::string hook;
    double tolerance;
  };
  for (const Case& c : std::vector<Case>{{ShardingStrategy::kNoShard, "allreduce", 1e-6},
                                         {ShardingStrategy::kFullShard, "reduce_scatter", 1e-6},
                                         {ShardingStrategy::kShardGradOp, "reduce_scatter", 1e-6},
                                         {ShardingStrategy::kFullShard, "fp16", 2e-3},
                                         {ShardingStrategy::kFullShard, "bf16", 2e-2},
                                         {ShardingStrategy::kNoShard, "fp16", 2e-3},
                                         {ShardingStrategy::kHybridShard, "reduce_scatter", 1e-6}}) {
    spawn_ranks(4, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      FsdpRun run;
      run.strategy = c.strategy;
      run.hook = c.hook;
      auto got = train_fsdp(run, rank, pg, 3);
      expect_close(got, want, c.tolerance, c.hook + " on " + to_string(c.strategy));
      expect_ranks_identical(*pg, got);
    });
  }
  // A user hook of the same shape: counts its calls, then reduce-scatters.
  spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Net net = make_net();
    FullyShardedDataParallel<Net> fsdp(net, pg, FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(40)));
    auto calls = std::make_shared<int>(0);
    auto state = std::make_shared<fsdp::DefaultState>(fsdp.shard_group());
    fsdp.register_comm_hook(FsdpReduceScatterHook{[state, calls](const at::Tensor& g, const at::Tensor& out) {
                              ++*calls;
                              return fsdp::reduce_scatter_hook(*state, g, out);
                            }},
                            "counting");
    fsdp.forward(input_of(0, rank), false).sum().backward();
    EXPECT_EQ(*calls, 6);
  });
}

TEST(FSDP, NoSyncAccumulatesLikeOneBigBatch) {
  for (auto strategy : kStrategies) {
    FsdpRun run;
    run.strategy = strategy;
    run.accumulate = true;
    check_run(run, 2, 3, 1e-6, "no_sync " + to_string(strategy));
  }
}

TEST(FSDP, ClipGradNormMatchesClippingTheFullGradient) {
  Net ref = make_net();
  std::vector<at::Tensor> xs, ys;
  for (int r = 0; r < 3; ++r) {
    xs.push_back(input_of(0, r));
    ys.push_back(target_of(0, r));
  }
  torch::mse_loss(ref->forward(at::cat(xs), false), at::cat(ys)).backward();
  const double want = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.05);
  for (auto strategy : kStrategies) {
    spawn_ranks(3, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      FsdpRun run;
      run.strategy = strategy;
      Net net = make_net();
      FullyShardedDataParallel<Net> fsdp(net, pg, options_for(run, rank, pg));
      torch::mse_loss(fsdp.forward(input_of(0, rank), false), target_of(0, rank)).backward();
      const double got = fsdp.clip_grad_norm_(0.05);
      EXPECT_NEAR(got, want, 1e-6 * want) << to_string(strategy);
      // The clipped gradients: each shard's slice of the reference's clipped gradient.
      const bool sharded = strategy != ShardingStrategy::kNoShard;
      const int64_t shard_rank = sharded ? fsdp.shard_group()->rank() : 0;
      const auto shards = fsdp.parameters();
      ASSERT_EQ(shards.size(), fsdp.units().size());
      for (size_t k = 0; k < shards.size(); ++k) {
        const FsdpUnitInfo& info = fsdp.units()[k];
        at::Tensor full = at::zeros({info.shard_numel * (sharded ? fsdp.shard_group()->size() : 1)});
        int64_t offset = 0;
        for (const auto& name : info.parameters) {
          const at::Tensor& g = ref->named_parameters()[name].grad();
          const int64_t n = ref->named_parameters()[name].numel();
          if (g.defined()) full.narrow(0, offset, n).copy_(g.reshape({-1}));
          offset += n;
        }
        at::Tensor want_shard = full.narrow(0, shard_rank * info.shard_numel, info.shard_numel);
        EXPECT_LE(relative_error(shards[k].grad(), want_shard), 1e-5) << info.name;
      }
    });
  }
}

TEST(FSDP, FullStateDictReloadsAtAnotherWorldSizeAndResumesExactly) {
  // 4 uninterrupted steps at W=2, against 2 steps at W=2, a full checkpoint, 2 more at W=3 and W=2.
  FsdpRun run;
  run.optimizer = "adam";
  const auto want = reference(2, "adam", 4);
  torch::OrderedDict<std::string, at::Tensor> model_ck;
  TensorDict optim_ck;
  spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Net net = make_net();
    FullyShardedDataParallel<Net> fsdp(net, pg, options_for(run, rank, pg));
    auto opt = make_optimizer("adam", fsdp.parameters());
    for (int step = 0; step < 2; ++step) {
      opt->zero_grad();
      torch::mse_loss(fsdp.forward(input_of(step, rank), step % 2 == 1), target_of(step, rank)).backward();
      opt->step();
    }
    auto model = fsdp.full_state_dict(/*rank0_only=*/true);
    auto optim = fsdp.full_optimizer_state_dict(*opt);
    if (rank == 0) {
      EXPECT_FALSE(model.is_empty());
      model_ck = model;
      optim_ck = optim;
    } else {
      EXPECT_TRUE(model.is_empty());
    }
  });
  for (int world : {2, 3}) {
    spawn_ranks(world, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      Net net = make_net();
      {
        std::lock_guard<std::mutex> lock(seed_mutex());
        torch::manual_seed(99 + rank);  // other starting values: the load must replace them all
        for (auto& p : net->parameters()) p.detach().normal_();
      }
      FsdpRun r = run;
      FullyShardedDataParallel<Net> fsdp(net, pg, options_for(r, rank, pg).sync_module_states(false));
      fsdp.load_full_state_dict(model_ck);
      auto opt = make_optimizer("adam", fsdp.parameters());
      fsdp.load_full_optimizer_state_dict(*opt, optim_ck);
      // The remaining steps see the same global batch as the W=2 run: rank r of W takes its share.
      for (int step = 2; step < 4; ++step) {
        opt->zero_grad();
        at::Tensor x = at::cat({input_of(step, 0), input_of(step, 1)}), y = at::cat({target_of(step, 0), target_of(step, 1)});
        const int64_t n = x.size(0), begin = n * rank / world, end = n * (rank + 1) / world;
        // Uneven shares: weight each rank's mean by its share of the global batch.
        const double weight = static_cast<double>(end - begin) * world / n;
        torch::mse_loss(fsdp.forward(x.slice(0, begin, end), step % 2 == 1), y.slice(0, begin, end)).mul(weight).backward();
        opt->step();
      }
      std::map<std::string, at::Tensor> got;
      const auto dict = fsdp.full_state_dict(false);
      for (const auto& kv : dict.items()) got[kv.key()] = kv.value();
      expect_close(got, want, 1e-6, "resumed at W=" + std::to_string(world));
    });
  }
}

TEST(FSDP, ShardedStateDictRoundTripsAndRejectsAnotherLayout) {
  TensorDict saved[2];
  spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Net net = make_net();
    FullyShardedDataParallel<Net> fsdp(net, pg, FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(40)));
    auto opt = make_optimizer("sgd", fsdp.parameters());
    fsdp.forward(input_of(0, rank), false).sum().backward();
    opt->step();
    saved[rank] = fsdp.sharded_state_dict();
    const auto want = fsdp.full_state_dict(false);
    // A fresh instance (other values) loads its shard back.
    Net other = make_net();
    FullyShardedDataParallel<Net> fresh(other, pg, FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(40)));
    fresh.load_sharded_state_dict(saved[rank]);
    const auto got = fresh.full_state_dict(false);
    for (const auto& kv : want.items()) EXPECT_TRUE(got[kv.key()].equal(kv.value())) << kv.key();
  });
  spawn_ranks(3, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Net net = make_net();
    FullyShardedDataParallel<Net> fsdp(net, pg, FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(40)));
    EXPECT_THAT(error_of([&] { fsdp.load_sharded_state_dict(saved[rank % 2]); }),
                HasSubstr("load a full state dict to change the world size"));
  });
}

// y = x W^T with a weight it is given: ties a weight to another module's.
struct SharedWeightImpl : torch::nn::Module {
  explicit SharedWeightImpl(at::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  at::Tensor forward(at::Tensor x) { return x.matmul(weight.t()); }
  at::Tensor weight;
};
TORCH_MODULE(SharedWeight);

struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    torch::nn::Linear a(6, 6);
    seq = register_module("seq", torch::nn::Sequential(a, SharedWeight(a->weight)));  // tied across two units
  }
  at::Tensor forward(at::Tensor x) { return seq->forward(x); }
  torch::nn::Sequential seq{nullptr};
};
TORCH_MODULE(Tied);

TEST(FSDP, BadUseGetsANamedError) {
  spawn_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    // A parameter shared by two units.
    Tied tied;
    EXPECT_THAT(error_of([&] {
                  FullyShardedDataParallel<Tied>(tied, pg, FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(1)));
                }),
                HasSubstr("is shared by units 'seq.0' and 'seq.1'"));

    // A unit's module called outside its unit.
    Net net = make_net();
    FullyShardedDataParallel<Net> fsdp(net, pg, FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(40)));
    const std::string outside = error_of([&] {
      fsdp.forward_with([&] { return net->blocks[0]->as<BlockImpl>()->forward(at::randn({2, 11})); });
    });
    EXPECT_THAT(outside, HasSubstr("units 'body.0', 'body.2', 'blocks.0'"));
    EXPECT_THAT(outside, HasSubstr("ddpkit::fsdp::forward_unit"));
    // The model itself, called without its FullyShardedDataParallel.
    EXPECT_THAT(error_of([&] { net->body->forward(input_of(0, rank)); }),
                HasSubstr("module 'body.0' is a unit of a FullyShardedDataParallel"));

    // After the failure the instance still trains.
    fsdp.forward(input_of(0, rank), false).sum().backward();
    // A hook after the first forward.
    auto state = std::make_shared<fsdp::DefaultState>(fsdp.shard_group());
    EXPECT_THAT(error_of([&] { fsdp.register_comm_hook(state, fsdp::reduce_scatter_hook); }),
                HasSubstr("register the hook before the first forward"));
    // An allreduce-shaped hook on a sharded strategy.
    Net net2 = make_net();
    FullyShardedDataParallel<Net> fsdp2(net2, pg);
    EXPECT_THAT(error_of([&] { fsdp2.register_comm_hook(state, fsdp::allreduce_hook); }),
                HasSubstr("its hook takes (state, grad, output)"));

    // Mismatched units across ranks.
    Net net3 = make_net();
    EXPECT_THAT(error_of([&] {
                  FullyShardedDataParallel<Net>(net3, pg,
                      FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(rank == 0 ? 40 : 120)));
                }),
                HasSubstr("units differ across ranks"));
  });
}

TEST(FSDP, AUnitCalledOutsideForwardUnitFailsAtWorldSizeOneAsAtTwo) {
  // At W=1 a unit's shard is the whole unit: its parameters still are empty outside its calls, so
  // a program that bypasses forward_unit fails here, not first at W=2.
  for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kHybridShard}) {
    spawn_ranks(1, [&](int, std::shared_ptr<ProcessGroup> pg) {
      Net net = make_net();
      FullyShardedDataParallel<Net> fsdp(
          net, pg, FullyShardedDataParallelOptions().sharding_strategy(strategy).auto_wrap_policy(size_based_auto_wrap_policy(40)));
      EXPECT_EQ(net->blocks[0]->as<BlockImpl>()->fc->weight.numel(), 0) << to_string(strategy);
      const std::string outside = error_of([&] {
        fsdp.forward_with([&] { return net->blocks[0]->as<BlockImpl>()->forward(at::randn({2, 11})); });
      });
      EXPECT_THAT(outside, HasSubstr("ddpkit::fsdp::forward_unit")) << to_string(strategy);
      // Called through forward_unit it trains, and its unit is empty again afterwards.
      fsdp.forward(input_of(0, 0), false).sum().backward();
      EXPECT_EQ(net->blocks[0]->as<BlockImpl>()->fc->weight.numel(), 0) << to_string(strategy);
      for (const auto& p : fsdp.parameters()) EXPECT_TRUE(p.grad().defined()) << to_string(strategy);
    });
  }
  // kNoShard keeps every parameter whole at every world size: a direct call works at W=1 as at W=2.
  for (int world : {1, 2}) {
    spawn_ranks(world, [&](int, std::shared_ptr<ProcessGroup> pg) {
      Net net = make_net();
      FullyShardedDataParallel<Net> fsdp(net, pg, FullyShardedDataParallelOptions()
                                                      .sharding_strategy(ShardingStrategy::kNoShard)
                                                      .auto_wrap_policy(size_based_auto_wrap_policy(40)));
      EXPECT_EQ(net->blocks[0]->as<BlockImpl>()->forward(at::randn({2, 11})).sizes(), (std::vector<int64_t>{2, 11}));
    });
  }
}

TEST(FSDP, HybridShardBuiltAgainInOneJobTrainsAsTheFirst) {
  // Default hybrid groups are made per construction: a second instance (a reload, a second model)
  // neither meets the first one's store keys nor leaves its own. Rank 0 comes late to the second
  // construction, so rank 1 would read what the first left under the same names.
  const auto want = reference(2, "sgd", 2);
  auto store = c10::make_intrusive<c10d::HashStore>();
  spawn_groups(
      2, [&](const c10::intrusive_ptr<c10d::Store>&, int r) { return make_group(store, r, 2, 2, std::chrono::seconds(20)); },
      [&](int rank, std::shared_ptr<ProcessGroup> pg) {
        set_compute_threads(1);
        FsdpRun run;
        run.strategy = ShardingStrategy::kHybridShard;
        auto train = [&] {
          Net net = make_net();
          FullyShardedDataParallel<Net> fsdp(
              net, pg, FullyShardedDataParallelOptions().sharding_strategy(run.strategy).auto_wrap_policy(size_based_auto_wrap_policy(40)));
          EXPECT_EQ(fsdp.shard_group()->size(), 2);
          // The accessors name what they return: the whole group, the shard group, the replicas'.
          EXPECT_EQ(fsdp.process_group(), pg);
          EXPECT_TRUE(fsdp.replicate_group());
          if (fsdp.replicate_group()) EXPECT_EQ(fsdp.replicate_group()->size() * fsdp.shard_group()->size(), pg->size());
          auto opt = make_optimizer("sgd", fsdp.parameters());
          for (int step = 0; step < 2; ++step) {
            opt->zero_grad();
            torch::mse_loss(fsdp.forward(input_of(step, rank), step % 2 == 1), target_of(step, rank)).backward();
            opt->step();
          }
          std::map<std::string, at::Tensor> out;
          const auto dict = fsdp.full_state_dict(/*rank0_only=*/false);
          for (const auto& kv : dict.items()) out[kv.key()] = kv.value();
          return out;
        };
        // The store's keys once every rank is here (and before any goes on).
        auto keys = [&] {
          ProcessGroup::wait(pg->barrier());
          const int64_t n = store->getNumKeys();
          ProcessGroup::wait(pg->barrier());
          return n;
        };
        const int64_t keys_before = keys();
        expect_close(train(), want, 1e-6, "first instance, rank " + std::to_string(rank));
        EXPECT_EQ(keys(), keys_before) << "the first instance left store keys behind";
        if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
        expect_close(train(), want, 1e-6, "second instance, rank " + std::to_string(rank));
        EXPECT_EQ(keys(), keys_before) << "the second instance left store keys behind";
      });
}

TEST(FSDP, SequentialRootIsWrappedTransparently) {
  // A plain Sequential (no custom module, no forward_unit) under FULL_SHARD equals DDP-style training.
  auto make = [] {
    std::lock_guard<std::mutex> lock(seed_mutex());
    torch::manual_seed(3);
    return torch::nn::Sequential(torch::nn::Linear(5, 9), torch::nn::Functional(torch::relu), torch::nn::Linear(9, 9),
                                 torch::nn::Functional(torch::relu), torch::nn::Linear(9, 2));
  };
  auto ref = make();
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  at::Tensor x = seeded_randn({6, 5}, 1), y = seeded_randn({6, 2}, 2);
  torch::mse_loss(ref->forward(x), y).backward();
  ref_opt.step();
  spawn_ranks(3, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto seq = make();
    FullyShardedDataParallel<torch::nn::Sequential> fsdp(seq, pg,
        FullyShardedDataParallelOptions().auto_wrap_policy(size_based_auto_wrap_policy(20)));
    EXPECT_EQ(fsdp.units().size(), 4u);
    torch::optim::SGD opt(fsdp.parameters(), 0.1);
    torch::mse_loss(fsdp.forward(x.slice(0, 2 * rank, 2 * rank + 2)), y.slice(0, 2 * rank, 2 * rank + 2)).backward();
    opt.step();
    auto got = fsdp.full_state_dict(false);
    for (const auto& p : ref->named_parameters()) EXPECT_LE(relative_error(got[p.key()], p.value()), 1e-6) << p.key();
  });
}

}  // namespace
}  // namespace ddpkit
