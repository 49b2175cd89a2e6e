#include <ddpkit/zero/ddp_zero_hook.h>

#include <ddpkit/hooks/fsdp_hooks.h>

#include <unordered_map>

namespace ddpkit {

ZeroOverlap parse_zero_overlap(const std::string& name) {
  if (name == "none") return ZeroOverlap::kNone;
  if (name == "step") return ZeroOverlap::kStep;
  if (name == "interleaved") return ZeroOverlap::kInterleaved;
  DDPKIT_CHECK(false, "unknown ZeRO overlap '", name, "' (known: none, step, interleaved)");
  return ZeroOverlap::kNone;
}

namespace detail {

// Calls `start` for each bucket (the reduction), then posts, in bucket order, one sequencer job per
// bucket that waits for the reduction and runs ZeroRedundancyOptimizer::step_bucket. The hook's
// future completes when that bucket's step and parameter sync are done, so DDP's backward returns
// with every parameter updated.
class ZeroOverlapRunner {
 public:
  using Start = std::function<FuturePtr(GradBucket&)>;

  ZeroOverlapRunner(std::shared_ptr<ZeroRedundancyOptimizer> zero, Start start, ZeroOverlap overlap,
                    std::vector<std::vector<size_t>> buckets)
      : zero_(std::move(zero)), start_(std::move(start)), overlap_(overlap), buckets_(std::move(buckets)) {}

  FuturePtr operator()(GradBucket& bucket) {
    const size_t b = bucket.index();
    DDPKIT_CHECK(b < buckets_.size() && bucket.parameters().size() == buckets_[b].size(),
                 "ZeRO hook: bucket ", b, " (", bucket.parameters().size(),
                 " parameters) does not match the bucket layout the parameters were partitioned by (",
                 buckets_.size(), " buckets)");
    FuturePtr reduced = start_(bucket);
    if (overlap_ == ZeroOverlap::kNone) return reduced;
    Pending mine{bucket, reduced, make_tensor_future(bucket.buffer().device())};
    std::vector<Pending> ready;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.push_back(mine);
      // Interleaved lags one bucket: the job blocks the sequencer until its reduction is done, and
      // by then the next bucket's collectives are already queued ahead of it.
      const size_t keep = bucket.is_last() ? 0 : (overlap_ == ZeroOverlap::kInterleaved ? 1 : pending_.size());
      ready.assign(pending_.begin(), pending_.end() - keep);
      pending_.erase(pending_.begin(), pending_.end() - keep);
    }
    for (auto& p : ready) post(p);
    return mine.result;
  }

 private:
  struct Pending {
    GradBucket bucket;
    FuturePtr reduced;
    FuturePtr result;
  };

  void post(const Pending& p) {
    // Raw pointer: the job runs on the group's sequencer and must not own the group (through the
    // optimizer); the hook (owned by DDP) keeps the optimizer alive.
    ZeroRedundancyOptimizer* zero = zero_.get();
    const size_t n = zero->parameters().size();
    const std::vector<size_t> params = buckets_[p.bucket.index()];
    TrafficScope traffic(static_cast<int64_t>(p.bucket.index()));
    FuturePtr done = zero->process_group().run_ordered_async(
        [zero, p, params, n]() -> FuturePtr {
          at::Tensor value = ProcessGroup::wait(p.reduced);
          std::vector<at::Tensor> grads;
          if (!zero->sharded_gradients()) {
            GradBucket reduced = p.bucket;
            reduced.set_buffer(value);
            const auto views = reduced.gradients();
            grads.assign(n, at::Tensor());
            for (size_t k = 0; k < params.size(); ++k) grads[params[k]] = views[k];
          }
          return zero->step_bucket(p.bucket.index(), value, grads);
        },
        p.bucket.buffer().device());
    FuturePtr result = p.result;
    done->addCallback([result](c10::ivalue::Future& f) {
      if (f.hasError()) {
        result->setError(f.exception_ptr());
      } else {
        result->markCompleted(f.value());
      }
    });
  }

  std::shared_ptr<ZeroRedundancyOptimizer> zero_;
  Start start_;
  ZeroOverlap overlap_;
  std::vector<std::vector<size_t>> buckets_;  // ZeRO parameter indices per DDP bucket
  std::mutex mutex_;
  std::vector<Pending> pending_;
};

}  // namespace detail

namespace {

// DDP's buckets (frozen from now on) as ZeRO parameter indices; DDP and ZeRO must hold the same
// parameters.
std::vector<std::vector<size_t>> zero_buckets(DistributedDataParallelBase& ddp, const ZeroRedundancyOptimizer& zero,
                                              const char* what) {
  DDPKIT_CHECK(ddp.process_group().size() == zero.world_size(), what, ": DDP's process group has ",
               ddp.process_group().size(), " ranks, the ZeroRedundancyOptimizer's ", zero.world_size());
  std::unordered_map<const void*, size_t> index;
  const auto& zp = zero.parameters();
  for (size_t i = 0; i < zp.size(); ++i) index[zp[i].unsafeGetTensorImpl()] = i;
  Reducer& reducer = ddp.reducer();
  const auto& dp = reducer.parameters();
  const auto& names = ddp.parameter_names();
  DDPKIT_CHECK(dp.size() == zp.size(), what, ": DDP has ", dp.size(), " parameters, the ZeroRedundancyOptimizer ",
               zp.size(), "; they must optimize the same parameters");
  reducer.freeze_bucket_layout();
  std::vector<std::vector<size_t>> out;
  for (const auto& bucket : reducer.bucket_indices()) {
    std::vector<size_t> b;
    for (size_t v : bucket) {
      auto it = index.find(dp[v].unsafeGetTensorImpl());
      DDPKIT_CHECK(it != index.end(), what, ": DDP parameter '", (v < names.size() ? names[v] : std::to_string(v)),
                   "' is not among the ZeroRedundancyOptimizer's parameters");
      DDPKIT_CHECK(!dp[v].is_sparse(), what, ": ZeRO needs dense gradients");
      b.push_back(it->second);
    }
    out.push_back(std::move(b));
  }
  return out;
}

CommHook overlapped(CommHook hook, DistributedDataParallelBase& ddp, std::shared_ptr<ZeroRedundancyOptimizer> zero,
                    bool shard_buckets, ZeroOverlap overlap, const char* what) {
  DDPKIT_CHECK(hook, what, ": the hook to wrap is empty");
  DDPKIT_CHECK(zero, what, ": the ZeroRedundancyOptimizer is null");
  DDPKIT_CHECK(zero->options().overlap_with_ddp(), what,
               ": the ZeroRedundancyOptimizer must be constructed with ZeroOptions().overlap_with_ddp(true)");
  DDPKIT_CHECK(!zero->sharded_gradients(), what, ": this optimizer already shards gradients (zero2_hook)");
  auto buckets = zero_buckets(ddp, *zero, what);
  zero->overlap_partition(buckets, shard_buckets);
  auto runner = std::make_shared<detail::ZeroOverlapRunner>(zero, std::move(hook), overlap, std::move(buckets));
  return [runner](GradBucket& bucket) { return (*runner)(bucket); };
}

}  // namespace

CommHook hook_with_zero_step(CommHook hook, DistributedDataParallelBase& ddp,
                             std::shared_ptr<ZeroRedundancyOptimizer> zero, bool shard_buckets) {
  return overlapped(std::move(hook), ddp, std::move(zero), shard_buckets, ZeroOverlap::kStep, "hook_with_zero_step");
}

CommHook hook_with_zero_step_interleaved(CommHook hook, DistributedDataParallelBase& ddp,
                                         std::shared_ptr<ZeroRedundancyOptimizer> zero, bool shard_buckets) {
  return overlapped(std::move(hook), ddp, std::move(zero), shard_buckets, ZeroOverlap::kInterleaved,
                    "hook_with_zero_step_interleaved");
}

ShardedReduce fsdp_sharded_reduce(std::shared_ptr<ProcessGroup> pg, const std::string& precision,
                                  at::ScalarType parameter_type) {
  if (precision == "fp32") {
    auto state = std::make_shared<fsdp::DefaultState>(std::move(pg));
    return [state](const at::Tensor& grad, const at::Tensor& shard) {
      return fsdp::reduce_scatter_hook(*state, grad, shard);
    };
  }
  DDPKIT_CHECK(precision == "fp16" || precision == "bf16", "unknown ZeRO-2 reduce precision '", precision,
               "' (known: fp32, fp16, bf16)");
  auto state = std::make_shared<fsdp::LowPrecisionState>(std::move(pg), parameter_type);
  if (precision == "fp16")
    return [state](const at::Tensor& grad, const at::Tensor& shard) {
      return fsdp::fp16_compress_hook(*state, grad, shard);
    };
  return [state](const at::Tensor& grad, const at::Tensor& shard) {
    return fsdp::bf16_compress_hook(*state, grad, shard);
  };
}

CommHook zero2_hook(DistributedDataParallelBase& ddp, std::shared_ptr<ZeroRedundancyOptimizer> zero,
                    ShardedReduce reduce, ZeroOverlap overlap) {
  const char* what = "zero2_hook";
  DDPKIT_CHECK(zero, what, ": the ZeroRedundancyOptimizer is null");
  DDPKIT_CHECK(reduce, what, ": the reduction is empty");
  DDPKIT_CHECK(zero->options().overlap_with_ddp() == (overlap != ZeroOverlap::kNone), what,
               ": overlap '", (overlap == ZeroOverlap::kNone ? "none" : "step/interleaved"),
               "' needs ZeroOptions().overlap_with_ddp(", (overlap != ZeroOverlap::kNone ? "true" : "false"), ")");
  auto buckets = zero_buckets(ddp, *zero, what);
  zero->shard_gradients(buckets);
  ZeroRedundancyOptimizer* z = zero.get();
  const int world = zero->world_size(), me = zero->rank();
  // The reduction: the bucket padded to world equal shards, averaged into this rank's gradient
  // shard; then the bucket itself is rewritten to hold that shard and zeros elsewhere.
  auto start = [z, reduce, world, me](GradBucket& bucket) -> FuturePtr {
    auto& shard = z->bucket_shard(bucket.index());
    const at::Tensor buffer = bucket.buffer();
    DDPKIT_CHECK(buffer.numel() == shard.numel, "zero2_hook: bucket ", bucket.index(), " holds ", buffer.numel(),
                 " elements, its shards were laid out for ", shard.numel);
    shard.padded_grad.narrow(0, 0, shard.numel).copy_(buffer);
    const at::Tensor grad_shard = shard.grad_shard;
    const int64_t begin = std::min<int64_t>(me * shard.shard_numel, shard.numel);
    const int64_t valid = std::min<int64_t>(shard.shard_numel, shard.numel - begin);
    (void)world;
    return reduce(shard.padded_grad, grad_shard)
        ->then(
            [buffer, grad_shard, begin, valid](c10::ivalue::Future& f) -> c10::IValue {
              f.value();
              buffer.zero_();
              if (valid > 0) buffer.narrow(0, begin, valid).copy_(grad_shard.narrow(0, 0, valid));
              return c10::IValue(buffer);
            },
            c10::TensorType::get());
  };
  auto runner = std::make_shared<detail::ZeroOverlapRunner>(zero, start, overlap, std::move(buckets));
  return [runner](GradBucket& bucket) { return (*runner)(bucket); };
}

}  // namespace ddpkit
