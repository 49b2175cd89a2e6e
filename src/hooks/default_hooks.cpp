#include <ddpkit/codecs/cast.h>
#include <ddpkit/codecs/sparse.h>
#include <ddpkit/hooks/default_hooks.h>
#include <ddpkit/reducer/reducer.h>

#include <mutex>
#include <vector>

namespace ddpkit {
namespace hooks {
namespace {

// Per-bucket low-precision buffers, reused every iteration: a new 50 MB tensor per bucket and
// step would cost more in page faults than the cast. Bucket i of the next iteration starts only
// after this iteration's futures completed, so reuse is safe.
class BufferCache {
 public:
  at::Tensor get(size_t bucket, const at::Tensor& like, at::ScalarType dtype) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (buffers_.size() <= bucket) buffers_.resize(bucket + 1);
    at::Tensor& b = buffers_[bucket];
    if (!b.defined() || b.numel() != like.numel() || b.scalar_type() != dtype || b.device() != like.device())
      b = at::empty({like.numel()}, like.options().dtype(dtype));
    return b;
  }

 private:
  std::mutex mutex_;
  std::vector<at::Tensor> buffers_;
};

// Low-precision allreduce of the bucket: cast+scale in one pass, allreduce, cast back in place.
// The cast back runs in the future's callback: local work, no collective.
CommHook compress_hook(std::shared_ptr<ProcessGroup> pg, at::ScalarType dtype, const char* name) {
  return [pg = std::move(pg), dtype, name, cache = std::make_shared<BufferCache>()](GradBucket& bucket) -> FuturePtr {
    DDPKIT_CHECK(!bucket.is_sparse(), name, ": bucket ", bucket.index(),
                 " holds a sparse gradient; compression hooks take dense buckets only");
    at::Tensor buffer = bucket.buffer();
    at::Tensor compressed = cache->get(bucket.index(), buffer, dtype);
    codecs::cast_scaled_into(buffer.reshape({-1}), compressed, 1.0 / pg->size());
    return pg->allreduce(compressed)->then(
        [buffer, compressed](c10::ivalue::Future& f) -> c10::IValue {
          f.value();  // rethrows a failed allreduce
          codecs::cast_scaled_into(compressed, buffer, 1.0);
          return c10::IValue(buffer);
        },
        c10::TensorType::get());
  };
}

CommHook compress_wrapper(CommHook inner, at::ScalarType dtype, const char* name) {
  DDPKIT_CHECK(inner, name, ": the wrapped hook is empty");
  return [inner = std::move(inner), dtype, name, cache = std::make_shared<BufferCache>()](GradBucket& bucket) -> FuturePtr {
    DDPKIT_CHECK(!bucket.is_sparse(), name, ": bucket ", bucket.index(), " holds a sparse gradient");
    at::Tensor original = bucket.buffer();
    at::Tensor compressed = cache->get(bucket.index(), original, dtype);
    codecs::cast_scaled_into(original.reshape({-1}), compressed, 1.0);
    bucket.set_buffer(compressed);
    return inner(bucket)->then(
        [original](c10::ivalue::Future& f) -> c10::IValue {
          codecs::cast_scaled_into(f.value().toTensor(), original, 1.0);
          return c10::IValue(original);
        },
        c10::TensorType::get());
  };
}

}  // namespace

CommHook allreduce_hook(std::shared_ptr<ProcessGroup> pg) {
  DDPKIT_CHECK(pg, "allreduce_hook: process group is null");
  return [pg = std::move(pg)](GradBucket& bucket) -> FuturePtr {
    at::Tensor buffer = bucket.buffer();
    // Gloo coalesces a sparse tensor before sending it anyway; doing it here first halves the
    // division's work and makes the traffic count what goes on the wire.
    if (buffer.is_sparse()) buffer = codecs::coalesce(buffer);
    buffer.div_(pg->size());
    return pg->allreduce(buffer);
  };
}

CommHook fp16_compress_hook(std::shared_ptr<ProcessGroup> pg) {
  DDPKIT_CHECK(pg, "fp16_compress_hook: process group is null");
  return compress_hook(std::move(pg), at::kHalf, "fp16_compress_hook");
}

CommHook bf16_compress_hook(std::shared_ptr<ProcessGroup> pg) {
  DDPKIT_CHECK(pg, "bf16_compress_hook: process group is null");
  return compress_hook(std::move(pg), at::kBFloat16, "bf16_compress_hook");
}

CommHook fp16_compress_wrapper(CommHook hook) { return compress_wrapper(std::move(hook), at::kHalf, "fp16_compress_wrapper"); }
CommHook bf16_compress_wrapper(CommHook hook) {
  return compress_wrapper(std::move(hook), at::kBFloat16, "bf16_compress_wrapper");
}

CommHook noop_hook() {
  return [](GradBucket& bucket) -> FuturePtr { return completed_future(bucket.buffer()); };
}

std::vector<std::string> hook_names() {
  return {"allreduce", "fp16", "bf16", "noop", "fp16_wrapper", "bf16_wrapper", "int8", "quantize_per_tensor",
          "quantize_per_channel", "powersgd", "batched_powersgd"};
}

bool moves_pieces(const std::string& hook) {
  for (const char* codec : {"fp16", "bf16", "fp16_wrapper", "bf16_wrapper", "int8", "quantize_per_tensor", "quantize_per_channel"})
    if (hook == codec) return true;
  return false;
}

double default_bucket_cap_mb(const std::string& hook) {
  return moves_pieces(hook) ? kCompressingHookBucketCapMb : kDefaultBucketCapMb;
}

int default_powersgd_rank(const std::string& hook) { return hook == "batched_powersgd" ? 32 : 4; }

BuiltHook build_hook(const std::string& name, std::shared_ptr<ProcessGroup> pg, const HookOptions& options) {
  if (name == "allreduce") return {allreduce_hook(pg), nullptr};
  if (name == "fp16") return {fp16_compress_hook(pg), nullptr};
  if (name == "bf16") return {bf16_compress_hook(pg), nullptr};
  if (name == "noop") return {noop_hook(), nullptr};
  if (name == "fp16_wrapper") return {fp16_compress_wrapper(allreduce_hook(pg)), nullptr};
  if (name == "bf16_wrapper") return {bf16_compress_wrapper(allreduce_hook(pg)), nullptr};
  if (name == "int8") {
    auto state = std::make_shared<Int8State>(pg, options.int8());
    return {int8_allreduce_hook(state), state};
  }
  if (name == "quantize_per_tensor") return {quantization_pertensor_hook(pg), nullptr};
  if (name == "quantize_per_channel") return {quantization_perchannel_hook(pg, options.perchannel_bucket_size()), nullptr};
  if (name == "powersgd" || name == "batched_powersgd") {
    auto state = std::make_shared<PowerSGDState>(pg, options.powersgd());
    return {name == "powersgd" ? powerSGD_hook(state) : batched_powerSGD_hook(state), state};
  }
  std::string known;
  for (const auto& n : hook_names()) known += (known.empty() ? "" : ", ") + n;
  DDPKIT_CHECK(false, "unknown comm hook '", name, "' (known: ", known, ")");
  return {};
}

CommHook make_hook(const std::string& name, std::shared_ptr<ProcessGroup> pg, const HookOptions& options) {
  return build_hook(name, std::move(pg), options).hook;
}

}  // namespace hooks
}  // namespace ddpkit
