#include <ddpkit/codecs/codec.h>
#include <ddpkit/codecs/quantize.h>
#include <ddpkit/hooks/quantization_hooks.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

namespace ddpkit {
namespace hooks {
namespace {

// A block of the bucket's rows x cols matrix that travels in one allgather: whole rows when there
// are several (each row keeps its own parameters), else a column range of the one row.
struct Block {
  int64_t row = 0, rows = 0, col = 0, cols = 0;
};

std::vector<Block> cut_blocks(int64_t rows, int64_t cols, int64_t pieces) {
  std::vector<Block> blocks;
  if (rows > 1) {
    const int64_t per = (rows + pieces - 1) / pieces;
    for (int64_t r = 0; r < rows; r += per) blocks.push_back({r, std::min(per, rows - r), 0, cols});
  } else {
    const int64_t per = (cols + pieces - 1) / pieces;
    for (int64_t c = 0; c < cols; c += per) blocks.push_back({0, 1, c, std::min(per, cols - c)});
  }
  return blocks;
}

// Quantize `rows` x `cols` (the bucket, zero-padded), allgather, dequantize every rank's part,
// sum, divide by the world size: PyTorch's quantization hooks, with the same parameters (from the
// whole bucket) and the same float32 operations per element. The codes travel in blocks of about
// the group's piece_bytes, one allgather each, so block k+1 is quantized while block k travels and
// block k is decoded as it lands (PyTorch gathers the whole bucket, twice).
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
    DDPKIT_CHECK(buffer.is_contiguous(), name, ": bucket ", bucket.index(), "'s buffer is not contiguous");
    // The bucket as a rows x c matrix, its last row padded with zeros (never materialized: the
    // codecs take the padding as read).
    at::Tensor flat = buffer.view({-1});
    const auto params = codecs::uint8_affine_qparams(flat, c);
    const int world = pg->size();
    // An allgather sends this rank's payload to each of the world - 1 peers.
    const auto blocks = cut_blocks(rows, c, pg->pieces_for(static_cast<uint64_t>(rows * c) * (world - 1)));

    // Every block's allgather completes (or fails) before the result does, so no decode writes
    // into the bucket after the hook's future has completed; the first failure is the result's.
    struct Progress {
      std::mutex mutex;
      size_t remaining = 0;
      std::exception_ptr error;
    };
    auto progress = std::make_shared<Progress>();
    progress->remaining = blocks.size();
    FuturePtr result = make_tensor_future(buffer.device());  // a CUDA result needs its device named
    auto finish_one = [progress, result, buffer](std::exception_ptr error) {
      std::unique_lock<std::mutex> lock(progress->mutex);
      if (error && !progress->error) progress->error = error;
      if (--progress->remaining > 0) return;
      std::exception_ptr first = progress->error;
      lock.unlock();
      if (first) result->setError(first);
      else result->markCompleted(c10::IValue(buffer));
    };
    for (const Block& b : blocks) {
      // The block's elements in the bucket: its rows' span, or its columns of the one row, less
      // the zero padding past the bucket's end.
      const int64_t first = b.row * c + b.col;
      const int64_t count = std::max<int64_t>(0, std::min(first + b.rows * b.cols, numel) - first);
      at::Tensor mine;
      try {
        mine = codecs::uint8_affine_encode(flat.narrow(0, first, count), b.rows, b.cols,
                                           params.first.narrow(0, b.row, b.rows), params.second.narrow(0, b.row, b.rows));
      } catch (...) {
        finish_one(std::current_exception());
        continue;
      }
      std::vector<at::Tensor> parts;
      for (int r = 0; r < world; ++r) parts.push_back(at::empty_like(mine));
      // Decoded straight into the bucket: the callback, on the thread that completes the
      // allgather, allocates nothing (a temporary there would grow that thread's malloc arena).
      pg->allgather(parts, mine)->addCallback([parts, b, first, count, flat, finish_one](c10::ivalue::Future& f) {
        if (f.hasError()) return finish_one(f.exception_ptr());
        try {
          codecs::uint8_affine_decode_mean(parts, b.rows, b.cols, flat.narrow(0, first, count));
          finish_one(nullptr);
        } catch (...) {
          finish_one(std::current_exception());
        }
      });
    }
    return result;
  };
}

}  // namespace

// ---- scalable int8 allreduce ----------------------------------------------------------------------
// (Named, not in the anonymous namespace: Int8State::Impl holds it, and in a unity batch an
// internal-linkage member type of an external class draws -Wsubobject-linkage.)
// The bucket is cut into pieces (ProcessGroup::pieces_for), each of n chunks of `chunk` elements:
// chunk r of piece p goes to rank r, which sums the n copies it receives and sends the int8 sum
// back to everyone. ProcessGroup::two_phase overlaps one piece's codec with others' transfers.
struct Int8BucketState {
  int64_t numel = -1, pieces = 0, chunk = 0, enc = 0;
  at::Tensor send1, recv1, send2, recv2;  // pieces x n encoded chunks each
  at::Tensor reduced;                     // this rank's chunk of every piece, fp32
  at::Tensor worker_error;                // error feedback: this rank's quantization error, numel
  at::Tensor owner_error;                 // error feedback: requantization error of this rank's chunks
};

class Int8State::Impl {
 public:
  Impl(std::shared_ptr<ProcessGroup> pg, Int8Options o) : pg_(std::move(pg)), o_(o) {
    DDPKIT_CHECK(pg_, "int8_allreduce_hook: process group is null");
    codec_ = codecs::make_int8_codec(o_.block());  // validates the block size
  }

  FuturePtr operator()(GradBucket& bucket) {
    DDPKIT_CHECK(!bucket.is_sparse(), "int8_allreduce_hook: bucket ", bucket.index(), " holds a sparse gradient");
    at::Tensor buffer = bucket.buffer();
    DDPKIT_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous(),
                 "int8_allreduce_hook takes contiguous float32 buckets; bucket ", bucket.index(), " is ",
                 buffer.scalar_type());
    const int64_t n = pg_->size(), me = pg_->rank(), block = codec_->block();
    const int64_t numel = buffer.numel();
    // One byte per element on the wire, (n-1)/n of it to the peers in each phase.
    const int64_t pieces = pg_->pieces_for(static_cast<uint64_t>(numel) * (n - 1) / n);
    const int64_t per_chunk = (numel + n * pieces - 1) / (n * pieces);
    const int64_t chunk = std::max<int64_t>((per_chunk + block - 1) / block * block, block);
    std::shared_ptr<Int8BucketState> st = state(bucket.index(), numel, n, pieces, chunk, buffer.device());
    const int64_t enc = st->enc;
    const bool ef = o_.error_feedback();
    const at::Tensor flat = buffer.view({-1});
    // Elements [offset, offset + valid) of the bucket are chunk r of piece p (the rest is padding).
    auto offset = [numel, n, chunk](int64_t p, int64_t r) { return std::min((p * n + r) * chunk, numel); };
    auto valid = [numel, chunk, offset](int64_t p, int64_t r) { return std::min(chunk, numel - offset(p, r)); };

    auto job = std::make_shared<TwoPhaseJob>();
    job->pieces = pieces;
    job->send1 = st->send1;
    job->recv1 = st->recv1;
    job->send2 = st->send2;
    job->recv2 = st->recv2;
    std::shared_ptr<const codecs::Codec> codec = codec_;
    job->encode = [st, codec, flat, n, chunk, enc, ef, offset, valid](int64_t p) {
      for (int64_t r = 0; r < n; ++r) {
        const int64_t off = offset(p, r), v = valid(p, r);
        at::Tensor x = flat.narrow(0, off, v);
        if (ef) x.add_(st->worker_error.narrow(0, off, v));
        codec->encode_padded(x, chunk, st->send1.narrow(0, (p * n + r) * enc, enc), 1.0f,
                             ef ? st->worker_error.narrow(0, off, v) : at::Tensor());
      }
    };
    job->reduce = [st, codec, n, me, chunk, enc, ef](int64_t p) {
      const float inv_n = 1.0f / static_cast<float>(n);
      at::Tensor reduced = st->reduced.narrow(0, p * chunk, chunk);
      for (int64_t r = 0; r < n; ++r)
        codec->decode_prefix(st->recv1.narrow(0, (p * n + r) * enc, enc), chunk, reduced, inv_n, r > 0);
      at::Tensor owner_error = ef ? st->owner_error.narrow(0, p * chunk, chunk) : at::Tensor();
      if (ef) reduced.add_(owner_error);
      at::Tensor mine = st->send2.narrow(0, (p * n + me) * enc, enc);
      codec->encode_padded(reduced, chunk, mine, 1.0f, owner_error);
      for (int64_t r = 0; r < n; ++r)
        if (r != me) st->send2.narrow(0, (p * n + r) * enc, enc).copy_(mine);
    };
    job->decode = [st, codec, flat, n, chunk, enc, offset, valid](int64_t p) {
      for (int64_t r = 0; r < n; ++r) {
        const int64_t v = valid(p, r);
        if (v > 0)
          codec->decode_prefix(st->recv2.narrow(0, (p * n + r) * enc, enc), chunk, flat.narrow(0, offset(p, r), v));
      }
    };
    return pg_->two_phase(std::move(job), buffer, "int8 allreduce of bucket " + std::to_string(bucket.index()));
  }

  std::shared_ptr<Int8BucketState> state(size_t index, int64_t numel, int64_t n, int64_t pieces, int64_t chunk,
                                         c10::Device device) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (states_.size() <= index) states_.resize(index + 1);
    auto& st = states_[index];
    // First use, or buckets were rebuilt (the error feedback of a changed bucket starts over).
    if (!st || st->numel != numel || st->pieces != pieces || st->chunk != chunk || st->send1.device() != device)
      st = fresh(numel, n, pieces, chunk, device);
    return st;
  }

  TensorDict state_dict() const {
    std::lock_guard<std::mutex> lock(mutex_);
    TensorDict d;
    for (size_t i = 0; i < states_.size(); ++i) {
      const auto& st = states_[i];
      if (!st || !st->worker_error.defined()) continue;
      const std::string prefix = "bucket." + std::to_string(i) + ".";
      d[prefix + "layout"] = at::tensor({st->numel, st->pieces, st->chunk}, at::kLong);
      d[prefix + "worker_error"] = st->worker_error.clone();
      d[prefix + "owner_error"] = st->owner_error.clone();
    }
    return d;
  }

  void load_state_dict(const TensorDict& state) {
    const char* what = "Int8State::load_state_dict";
    const int64_t n = pg_->size();
    std::vector<std::shared_ptr<Int8BucketState>> states;
    for (const auto& kv : state) {
      const size_t dot = kv.first.rfind('.');
      DDPKIT_CHECK(kv.first.rfind("bucket.", 0) == 0 && dot > 7, what, ": unknown entry '", kv.first, "'");
      const std::string prefix = kv.first.substr(0, dot + 1);
      if (kv.first.substr(dot + 1) != "layout") continue;
      DDPKIT_CHECK(o_.error_feedback(), what, ": the state holds error feedback but the hook runs without it");
      const size_t index = std::stoul(prefix.substr(7));
      const at::Tensor layout = entry_of(state, kv.first, what);
      DDPKIT_CHECK(layout.scalar_type() == at::kLong && layout.numel() == 3, what, ": malformed '", kv.first, "'");
      const int64_t numel = layout[0].item<int64_t>(), pieces = layout[1].item<int64_t>(), chunk = layout[2].item<int64_t>();
      DDPKIT_CHECK(numel > 0 && pieces > 0 && chunk > 0 && chunk % o_.block() == 0 && pieces * n * chunk >= numel, what,
                   ": bucket ", index, "'s layout (", numel, " elements, ", pieces, " pieces of ", chunk,
                   ") does not fit this hook (world size ", n, ", block ", o_.block(), ")");
      auto st = fresh(numel, n, pieces, chunk, c10::kCPU);
      const at::Tensor worker = entry_of(state, prefix + "worker_error", what);
      const at::Tensor owner = entry_of(state, prefix + "owner_error", what);
      DDPKIT_CHECK(worker.sizes() == st->worker_error.sizes() && owner.sizes() == st->owner_error.sizes(), what,
                   ": bucket ", index, "'s error feedback has the wrong size");
      st->worker_error.copy_(worker);
      st->owner_error.copy_(owner);
      if (states.size() <= index) states.resize(index + 1);
      states[index] = std::move(st);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    states_ = std::move(states);
  }

 private:
  // The bucket's buffers, and zero error feedback.
  std::shared_ptr<Int8BucketState> fresh(int64_t numel, int64_t n, int64_t pieces, int64_t chunk, c10::Device device) const {
    auto st = std::make_shared<Int8BucketState>();
    st->numel = numel;
    st->pieces = pieces;
    st->chunk = chunk;
    st->enc = codec_->encoded_bytes(chunk);
    auto bytes = at::TensorOptions().dtype(at::kByte).device(device);
    auto floats = at::TensorOptions().dtype(at::kFloat).device(device);
    for (at::Tensor* t : {&st->send1, &st->recv1, &st->send2, &st->recv2}) *t = at::empty({pieces * n * st->enc}, bytes);
    st->reduced = at::empty({pieces * chunk}, floats);
    if (o_.error_feedback()) {
      st->worker_error = at::zeros({numel}, floats);
      st->owner_error = at::zeros({pieces * chunk}, floats);
    }
    return st;
  }

  std::shared_ptr<ProcessGroup> pg_;
  Int8Options o_;
  std::shared_ptr<const codecs::Codec> codec_;  // block int8, o_.block() values per scale
  mutable std::mutex mutex_;
  std::vector<std::shared_ptr<Int8BucketState>> states_;
};

Int8State::Int8State(std::shared_ptr<ProcessGroup> pg, Int8Options options)
    : impl_(std::make_shared<Impl>(std::move(pg), options)) {}
TensorDict Int8State::state_dict() const { return impl_->state_dict(); }
void Int8State::load_state_dict(const TensorDict& state) { impl_->load_state_dict(state); }

CommHook quantization_pertensor_hook(std::shared_ptr<ProcessGroup> pg) {
  return gathered_uint8_hook(std::move(pg), 0, "quantization_pertensor_hook");
}

CommHook quantization_perchannel_hook(std::shared_ptr<ProcessGroup> pg, int64_t bucket_size) {
  DDPKIT_CHECK(bucket_size >= 1, "quantization_perchannel_hook: bucket_size must be >= 1, got ", bucket_size);
  return gathered_uint8_hook(std::move(pg), bucket_size, "quantization_perchannel_hook");
}

CommHook int8_allreduce_hook(std::shared_ptr<Int8State> state) {
  DDPKIT_CHECK(state, "int8_allreduce_hook: state is null");
  return [impl = state->impl_](GradBucket& bucket) { return (*impl)(bucket); };
}

CommHook int8_allreduce_hook(std::shared_ptr<ProcessGroup> pg, Int8Options options) {
  return int8_allreduce_hook(std::make_shared<Int8State>(std::move(pg), options));
}

}  // namespace hooks
}  // namespace ddpkit
