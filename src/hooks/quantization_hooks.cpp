#include <ddpkit/codecs/quantize.h>
#include <ddpkit/hooks/quantization_hooks.h>

#include <limits>
#include <mutex>
#include <vector>

namespace ddpkit {
namespace hooks {
namespace {

// ---- PyTorch parity: uint8 affine quantization ----------------------------------------------------
// MinMaxObserver / PerChannelMinMaxObserver.calculate_qparams for quint8 (quant range 0..255), in
// the same float32 operations, per row of `x` (a 2-D tensor; one row for per-tensor).
std::pair<at::Tensor, at::Tensor> qparams(const at::Tensor& x2d) {
  auto mm = at::aminmax(x2d, 1);
  at::Tensor min_neg = at::clamp_max(std::get<0>(mm), 0.0);
  at::Tensor max_pos = at::clamp_min(std::get<1>(mm), 0.0);
  at::Tensor scale = (max_pos - min_neg) / 255.0;
  scale = at::clamp_min(scale, std::numeric_limits<float>::epsilon());
  at::Tensor zero_point = at::clamp(0 - at::round(min_neg / scale).to(at::kInt), 0, 255);
  return {scale, zero_point.to(at::kFloat)};
}

// The uint8 payload one rank contributes: [rows scales][rows zero points] (float32, first so they
// stay aligned) then [rows * cols codes].
// One allgather moves it (PyTorch issues two, the second from inside a callback).
at::Tensor quantize_rows(const at::Tensor& x2d) {
  const int64_t rows = x2d.size(0), cols = x2d.size(1);
  auto qp = qparams(x2d);
  const at::Tensor& scale = qp.first;
  const at::Tensor& zp = qp.second;
  at::Tensor packed = at::empty({rows * cols + 2 * rows * 4}, x2d.options().dtype(at::kByte));
  packed.narrow(0, 0, rows * 4).view(at::kFloat).copy_(scale);
  packed.narrow(0, rows * 4, rows * 4).view(at::kFloat).copy_(zp);
  at::Tensor codes = packed.narrow(0, 8 * rows, rows * cols).view({rows, cols});
  codes.copy_(at::clamp(at::round(x2d / scale.unsqueeze(1)) + zp.unsqueeze(1), 0, 255));
  return packed;
}

void dequantize_rows_into(const at::Tensor& packed, int64_t rows, int64_t cols, at::Tensor& acc) {
  at::Tensor scale = packed.narrow(0, 0, rows * 4).view(at::kFloat).unsqueeze(1);
  at::Tensor zp = packed.narrow(0, rows * 4, rows * 4).view(at::kFloat).unsqueeze(1);
  at::Tensor codes = packed.narrow(0, 8 * rows, rows * cols).view({rows, cols});
  acc.add_((codes.to(at::kFloat) - zp) * scale);
}

// Quantize `rows` x `cols` (the bucket, zero-padded), allgather, dequantize every rank's part,
// sum, divide by the world size: PyTorch's quantization hooks.
CommHook gathered_uint8_hook(std::shared_ptr<ProcessGroup> pg, int64_t cols, const char* name) {
  DDPKIT_CHECK(pg, name, ": process group is null");
  DDPKIT_CHECK(cols >= 0, name, ": bucket_size must be >= 1, got ", cols);  // 0: one row (per tensor)
  return [pg = std::move(pg), cols, name](GradBucket& bucket) -> FuturePtr {
    DDPKIT_CHECK(!bucket.is_sparse(), name, ": bucket ", bucket.index(), " holds a sparse gradient");
    at::Tensor buffer = bucket.buffer();
    DDPKIT_CHECK(buffer.scalar_type() == at::kFloat, name, " takes float32 buckets; bucket ", bucket.index(), " is ",
                 buffer.scalar_type());
    const int64_t numel = buffer.numel();
    const int64_t c = cols > 0 ? cols : std::max<int64_t>(numel, 1);
    const int64_t rows = std::max<int64_t>((numel + c - 1) / c, 1);
    at::Tensor x2d = at::zeros({rows * c}, buffer.options());
    x2d.narrow(0, 0, numel).copy_(buffer.reshape({-1}));
    x2d = x2d.view({rows, c});
    at::Tensor mine = quantize_rows(x2d);
    std::vector<at::Tensor> parts;
    for (int r = 0; r < pg->size(); ++r) parts.push_back(at::empty_like(mine));
    const int world = pg->size();
    return pg->allgather(parts, mine)->then(
        [parts, rows, c, numel, world, buffer](c10::ivalue::Future& f) -> c10::IValue {
          f.value();  // rethrows a failed allgather
          at::Tensor acc = at::zeros({rows, c}, buffer.options());
          for (const auto& p : parts) dequantize_rows_into(p, rows, c, acc);
          acc.div_(world);
          buffer.copy_(acc.view({-1}).narrow(0, 0, numel).view(buffer.sizes()));
          return c10::IValue(buffer);
        },
        c10::TensorType::get());
  };
}

// ---- scalable int8 allreduce ----------------------------------------------------------------------
struct Int8BucketState {
  int64_t numel = -1;
  at::Tensor send1, recv1, send2, recv2;  // n encoded chunks each
  at::Tensor reduced;                     // this rank's chunk, fp32
  at::Tensor worker_error;                // error feedback: this rank's quantization error, numel
  at::Tensor owner_error;                 // error feedback: requantization error of this rank's chunk
};

class Int8Allreduce {
 public:
  Int8Allreduce(std::shared_ptr<ProcessGroup> pg, Int8Options o) : pg_(std::move(pg)), o_(o) {
    DDPKIT_CHECK(pg_, "int8_allreduce_hook: process group is null");
    codecs::int8_encoded_bytes(0, o_.block());  // validates the block size
  }

  FuturePtr operator()(GradBucket& bucket) {
    DDPKIT_CHECK(!bucket.is_sparse(), "int8_allreduce_hook: bucket ", bucket.index(), " holds a sparse gradient");
    at::Tensor buffer = bucket.buffer();
    DDPKIT_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous(),
                 "int8_allreduce_hook takes contiguous float32 buckets; bucket ", bucket.index(), " is ",
                 buffer.scalar_type());
    const int64_t n = pg_->size(), me = pg_->rank(), block = o_.block();
    const int64_t numel = buffer.numel();
    const int64_t chunk = std::max<int64_t>(((numel + n - 1) / n + block - 1) / block * block, block);
    const int64_t enc = codecs::int8_encoded_bytes(chunk, block);
    std::shared_ptr<Int8BucketState> st = state(bucket.index(), numel, n, chunk, enc, buffer.device());
    at::Tensor flat = buffer.view({-1});
    auto valid = [numel, chunk](int64_t c) { return std::max<int64_t>(0, std::min(chunk, numel - c * chunk)); };

    if (o_.error_feedback()) flat.add_(st->worker_error);
    for (int64_t c = 0; c < n; ++c) {
      const int64_t v = valid(c), off = std::min(c * chunk, numel);
      codecs::int8_encode(flat.narrow(0, off, v), v, chunk, block, st->send1.narrow(0, c * enc, enc),
                          o_.error_feedback() ? st->worker_error.narrow(0, off, v) : at::Tensor());
    }
    const bool ef = o_.error_feedback();
    // A raw pointer in the closures: they may be destroyed on the sequencer or a Gloo thread, which
    // must never drop the last reference to the group (docs/threading.md). The hook owns it.
    ProcessGroup* pg = pg_.get();
    // Both exchanges run on the sequencer so every rank issues them in the same order; the
    // reduction between them is local work on this rank's chunk only.
    return pg_->run_ordered_async([pg, st, buffer, flat, n, me, block, chunk, enc, numel, ef, valid] {
      ProcessGroup::wait(pg->alltoall(st->recv1, st->send1));
      const float inv_n = 1.0f / static_cast<float>(n);
      for (int64_t r = 0; r < n; ++r)
        codecs::int8_decode(st->recv1.narrow(0, r * enc, enc), chunk, block, st->reduced, chunk, inv_n, r > 0);
      if (ef) st->reduced.add_(st->owner_error);
      at::Tensor mine = st->send2.narrow(0, me * enc, enc);
      codecs::int8_encode(st->reduced, chunk, chunk, block, mine, ef ? st->owner_error : at::Tensor());
      for (int64_t r = 0; r < n; ++r)
        if (r != me) st->send2.narrow(0, r * enc, enc).copy_(mine);
      return pg->alltoall(st->recv2, st->send2)
          ->then(
              [st, buffer, flat, n, block, chunk, enc, numel, valid](c10::ivalue::Future& f) -> c10::IValue {
                f.value();
                for (int64_t c = 0; c < n; ++c) {
                  const int64_t v = valid(c);
                  if (v > 0)
                    codecs::int8_decode(st->recv2.narrow(0, c * enc, enc), chunk, block, flat.narrow(0, c * chunk, v), v);
                }
                return c10::IValue(buffer);
              },
              c10::TensorType::get());
    }, buffer.device());
  }

 private:
  std::shared_ptr<Int8BucketState> state(size_t index, int64_t numel, int64_t n, int64_t chunk, int64_t enc,
                                         c10::Device device) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (states_.size() <= index) states_.resize(index + 1);
    auto& st = states_[index];
    if (!st || st->numel != numel || st->send1.device() != device) {  // first use, or buckets were rebuilt
      st = std::make_shared<Int8BucketState>();
      st->numel = numel;
      auto bytes = at::TensorOptions().dtype(at::kByte).device(device);
      auto floats = at::TensorOptions().dtype(at::kFloat).device(device);
      st->send1 = at::empty({n * enc}, bytes);
      st->recv1 = at::empty({n * enc}, bytes);
      st->send2 = at::empty({n * enc}, bytes);
      st->recv2 = at::empty({n * enc}, bytes);
      st->reduced = at::empty({chunk}, floats);
      if (o_.error_feedback()) {
        st->worker_error = at::zeros({numel}, floats);
        st->owner_error = at::zeros({chunk}, floats);
      }
    }
    return st;
  }

  std::shared_ptr<ProcessGroup> pg_;
  Int8Options o_;
  std::mutex mutex_;
  std::vector<std::shared_ptr<Int8BucketState>> states_;
};

}  // namespace

CommHook quantization_pertensor_hook(std::shared_ptr<ProcessGroup> pg) {
  return gathered_uint8_hook(std::move(pg), 0, "quantization_pertensor_hook");
}

CommHook quantization_perchannel_hook(std::shared_ptr<ProcessGroup> pg, int64_t bucket_size) {
  DDPKIT_CHECK(bucket_size >= 1, "quantization_perchannel_hook: bucket_size must be >= 1, got ", bucket_size);
  return gathered_uint8_hook(std::move(pg), bucket_size, "quantization_perchannel_hook");
}

CommHook int8_allreduce_hook(std::shared_ptr<ProcessGroup> pg, Int8Options options) {
  auto impl = std::make_shared<Int8Allreduce>(std::move(pg), options);
  return [impl](GradBucket& bucket) { return (*impl)(bucket); };
}

}  // namespace hooks
}  // namespace ddpkit
