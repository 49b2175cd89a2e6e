#include <ddpkit/codecs/codec.h>
#include <ddpkit/codecs/sparse.h>
#include <ddpkit/hooks/default_hooks.h>
#include <ddpkit/reducer/reducer.h>

#include <mutex>
#include <vector>

namespace ddpkit {
namespace hooks {
namespace {

// Per-bucket encoded buffers, reused every iteration: a new 50 MB tensor per bucket and step
// would cost more in page faults than the cast. Bucket i of the next iteration starts only after
// this iteration's futures completed, so reuse is safe.
class BufferCache {
 public:
  at::Tensor get(size_t bucket, int64_t bytes, c10::Device device) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (buffers_.size() <= bucket) buffers_.resize(bucket + 1);
    at::Tensor& b = buffers_[bucket];
    if (!b.defined() || b.numel() != bytes || b.device() != device)
      b = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
    return b;
  }

 private:
  std::mutex mutex_;
  std::vector<at::Tensor> buffers_;
};

// The codec of a compress hook: one the process group can sum (codecs::Codec::summable_type).
std::shared_ptr<const codecs::Codec> summable_codec(const char* codec, const char* hook) {
  auto c = codecs::make_codec(codec);
  DDPKIT_CHECK(c->summable_type() != at::ScalarType::Undefined, hook, ": the ", codec,
               " codec cannot be summed by an allreduce");
  return c;
}

at::Tensor flat_buffer(GradBucket& bucket, const char* hook) {
  DDPKIT_CHECK(!bucket.is_sparse(), hook, ": bucket ", bucket.index(),
               " holds a sparse gradient; compression hooks take dense buckets only");
  const at::Tensor& buffer = bucket.buffer();
  DDPKIT_CHECK(buffer.is_contiguous(), hook, ": bucket ", bucket.index(), "'s buffer is not contiguous");
  return buffer.view({-1});
}

// Low-precision allreduce of the bucket: encode (cast and scale by 1/n in one pass), allreduce
// the encoding as its element type, decode back in place. The decode runs in the future's
// callback: local work, no collective.
CommHook compress_hook(std::shared_ptr<ProcessGroup> pg, const char* codec_name, const char* name) {
  auto codec = summable_codec(codec_name, name);
  return [pg = std::move(pg), codec, name, cache = std::make_shared<BufferCache>()](GradBucket& bucket) -> FuturePtr {
    at::Tensor buffer = bucket.buffer();
    at::Tensor flat = flat_buffer(bucket, name);
    at::Tensor encoded = cache->get(bucket.index(), codec->encoded_bytes(flat.numel()), flat.device());
    codec->encode_padded(flat, flat.numel(), encoded, 1.0f / static_cast<float>(pg->size()));
    return pg->allreduce(encoded.view(codec->summable_type()))
        ->then(
            [buffer, flat, encoded, codec](c10::ivalue::Future& f) -> c10::IValue {
              f.value();  // rethrows a failed allreduce
              codec->decode_prefix(encoded, flat.numel(), flat);
              return c10::IValue(buffer);
            },
            c10::TensorType::get());
  };
}

// The bucket encoded for the wrapped hook, which sees a low-precision bucket; its result is
// decoded back into the original (a result of another type is copied, as PyTorch's wrapper does).
CommHook compress_wrapper(CommHook inner, const char* codec_name, const char* name) {
  DDPKIT_CHECK(inner, name, ": the wrapped hook is empty");
  auto codec = summable_codec(codec_name, name);
  return [inner = std::move(inner), codec, name, cache = std::make_shared<BufferCache>()](GradBucket& bucket) -> FuturePtr {
    at::Tensor original = bucket.buffer();
    at::Tensor flat = flat_buffer(bucket, name);
    at::Tensor encoded = cache->get(bucket.index(), codec->encoded_bytes(flat.numel()), flat.device());
    codec->encode_padded(flat, flat.numel(), encoded);
    bucket.set_buffer(encoded.view(codec->summable_type()));
    return inner(bucket)->then(
        [original, flat, codec](c10::ivalue::Future& f) -> c10::IValue {
          const at::Tensor result = f.value().toTensor();
          if (result.scalar_type() == codec->summable_type() && result.numel() == flat.numel())
            codec->decode_prefix(result.contiguous().view({-1}).view(at::kByte), flat.numel(), flat);
          else
            original.copy_(result.view(original.sizes()));
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
  return compress_hook(std::move(pg), "fp16", "fp16_compress_hook");
}

CommHook bf16_compress_hook(std::shared_ptr<ProcessGroup> pg) {
  DDPKIT_CHECK(pg, "bf16_compress_hook: process group is null");
  return compress_hook(std::move(pg), "bf16", "bf16_compress_hook");
}

CommHook fp16_compress_wrapper(CommHook hook) { return compress_wrapper(std::move(hook), "fp16", "fp16_compress_wrapper"); }
CommHook bf16_compress_wrapper(CommHook hook) {
  return compress_wrapper(std::move(hook), "bf16", "bf16_compress_wrapper");
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
