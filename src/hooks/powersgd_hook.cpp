#include <ddpkit/hooks/powersgd_hook.h>

#include <ATen/CPUGeneratorImpl.h>

#include <iostream>
#include <sstream>
#include <vector>

namespace ddpkit {
namespace hooks {

PowerSGDState::PowerSGDState(std::shared_ptr<ProcessGroup> pg, PowerSGDOptions options)
    : pg_(std::move(pg)), options_(std::move(options)), rng_(options_.random_seed()) {
  DDPKIT_CHECK(pg_, "PowerSGDState: process group is null");
  DDPKIT_CHECK(options_.matrix_approximation_rank() >= 1, "PowerSGDState: matrix_approximation_rank must be >= 1, got ",
               options_.matrix_approximation_rank());
  DDPKIT_CHECK(options_.start_powerSGD_iter() >= 0, "PowerSGDState: start_powerSGD_iter must be >= 0");
  DDPKIT_CHECK(!((options_.use_error_feedback() || options_.warm_start()) && options_.start_powerSGD_iter() <= 1),
               "PowerSGDState: start_powerSGD_iter must be > 1 when use_error_feedback or warm_start is on, got ",
               options_.start_powerSGD_iter(),
               " (DDP rebuilds its buckets after the first iteration, which would invalidate the per-bucket memory)");
  DDPKIT_CHECK(options_.min_compression_rate() >= 0, "PowerSGDState: min_compression_rate must be >= 0");
  DDPKIT_CHECK(options_.orthogonalization_epsilon() >= 0, "PowerSGDState: orthogonalization_epsilon must be >= 0");
  DDPKIT_CHECK(options_.compression_stats_logging_frequency() >= 1,
               "PowerSGDState: compression_stats_logging_frequency must be >= 1");
}

int64_t PowerSGDState::iteration() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return iter_;
}

std::tuple<double, int64_t, int64_t> PowerSGDState::compression_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const double rate = numel_after_ > 0 ? static_cast<double>(numel_before_) / numel_after_ : 0.0;
  return {rate, numel_before_, numel_after_};
}

at::Tensor PowerSGDState::error(size_t bucket_index) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = buckets_.find(bucket_index);
  return it == buckets_.end() || !it->second->error.defined() ? at::Tensor() : it->second->error.clone();
}

TensorDict PowerSGDState::state_dict() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TensorDict d;
  d["iter"] = int_entry(iter_);
  d["seen_bucket"] = int_entry(seen_bucket_);
  d["pass_counted"] = int_entry(pass_counted_);
  d["last_index"] = int_entry(last_index_);
  d["numel_before"] = int_entry(numel_before_);
  d["numel_after"] = int_entry(numel_after_);
  d["next_report"] = int_entry(next_report_);
  std::ostringstream rng;
  rng << rng_;
  d["rng"] = bytes_entry(rng.str());
  for (const auto& kv : buckets_) {
    const std::string prefix = "bucket." + std::to_string(kv.first) + ".";
    const Bucket& b = *kv.second;
    if (b.error.defined()) d[prefix + "error"] = b.error.clone();
    if (b.p.defined()) d[prefix + "p"] = b.p.clone();
    if (b.q.defined()) d[prefix + "q"] = b.q.clone();
    // The batched hook's padded matrix is scratch, but whether it exists decides whether the
    // error feedback is kept: its size is enough.
    if (b.padded.defined()) d[prefix + "padded_numel"] = int_entry(b.padded.numel());
  }
  return d;
}

void PowerSGDState::load_state_dict(const TensorDict& state) {
  const char* what = "PowerSGDState::load_state_dict";
  std::map<size_t, std::shared_ptr<Bucket>> buckets;
  for (const auto& kv : state) {
    if (kv.first.rfind("bucket.", 0) != 0) continue;
    const size_t dot = kv.first.find('.', 7);
    DDPKIT_CHECK(dot != std::string::npos, what, ": malformed entry '", kv.first, "'");
    char* end = nullptr;
    const unsigned long index = std::strtoul(kv.first.c_str() + 7, &end, 10);
    DDPKIT_CHECK(end == kv.first.c_str() + dot, what, ": malformed entry '", kv.first, "'");
    auto& b = buckets[index];
    if (!b) b = std::make_shared<Bucket>();
    const std::string field = kv.first.substr(dot + 1);
    const at::Tensor& t = kv.second;
    DDPKIT_CHECK(t.defined() && (field == "padded_numel" || t.is_floating_point()), what, ": entry '", kv.first,
                 "' is not a floating-point tensor");
    if (field == "error") {
      b->error = t.clone();
    } else if (field == "p") {
      b->p = t.clone();
    } else if (field == "q") {
      b->q = t.clone();
    } else if (field == "padded_numel") {
      const int64_t n = int_of(state, kv.first, what);
      DDPKIT_CHECK(n >= 0, what, ": entry '", kv.first, "' is negative");
      b->padded = at::empty({n}, at::kFloat);
    } else {
      DDPKIT_CHECK(false, what, ": unknown entry '", kv.first, "'");
    }
  }
  for (auto& kv : buckets) {
    // The scratch matrix takes the dtype and device of the memory it pads.
    Bucket& b = *kv.second;
    const at::Tensor& like = b.error.defined() ? b.error : b.q;
    if (b.padded.defined() && like.defined()) b.padded = at::empty({b.padded.numel()}, like.options());
    DDPKIT_CHECK(b.p.defined() == b.q.defined(), what, ": bucket ", kv.first, " has only one of P and Q");
  }
  std::mt19937_64 rng;
  std::istringstream in(bytes_of(state, "rng", what));
  in >> rng;
  DDPKIT_CHECK(!in.fail(), what, ": entry 'rng' is not a random-number-generator state");
  std::lock_guard<std::mutex> lock(mutex_);
  iter_ = int_of(state, "iter", what);
  seen_bucket_ = int_of(state, "seen_bucket", what) != 0;
  pass_counted_ = int_of(state, "pass_counted", what) != 0;
  last_index_ = int_of(state, "last_index", what);
  numel_before_ = int_of(state, "numel_before", what);
  numel_after_ = int_of(state, "numel_after", what);
  next_report_ = int_of(state, "next_report", what);
  rng_ = rng;
  buckets_ = std::move(buckets);
}

std::shared_ptr<PowerSGDState::Bucket> PowerSGDState::bucket(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& b = buckets_[index];
  if (!b) b = std::make_shared<Bucket>();
  return b;
}

FuturePtr PowerSGDState::allreduce_phase(GradBucket& bucket, const char* hook) {
  DDPKIT_CHECK(!bucket.is_sparse(), hook, ": bucket ", bucket.index(), " holds a sparse gradient");
  bool before;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // An iteration ends with its last bucket. A hook wrapped so that it never sees the last bucket
    // (e.g. sparse buckets routed elsewhere) notices the next iteration by the index going back.
    if (seen_bucket_ && static_cast<int64_t>(bucket.index()) <= last_index_) {
      if (!pass_counted_) ++iter_;
      pass_counted_ = false;
    }
    seen_bucket_ = true;
    last_index_ = static_cast<int64_t>(bucket.index());
    before = iter_ < options_.start_powerSGD_iter();
    if (bucket.is_last()) {
      ++iter_;
      pass_counted_ = true;
    }
  }
  if (!before) return {};
  // PyTorch's default _allreduce_fut: divide first (no fp16 overflow), then SUM.
  bucket.buffer().div_(pg_->size());
  return pg_->allreduce(bucket.buffer());
}

void PowerSGDState::add_stats(int64_t before, int64_t after) {
  double rate = 0;
  bool report = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    numel_before_ += before;
    numel_after_ += after;
    if (iter_ >= next_report_) {
      report = true;
      next_report_ = iter_ + options_.compression_stats_logging_frequency();
      rate = numel_after_ > 0 ? static_cast<double>(numel_before_) / numel_after_ : 0.0;
      before = numel_before_;
      after = numel_after_;
    }
  }
  if (report && options_.stats_logger()) options_.stats_logger()(rate, before, after);
}

uint64_t PowerSGDState::next_seed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return rng_() % 1000000000ULL;
}

namespace {

// Orthonormalizes the columns of each matrix of a batch [b, n, r] in place: Gram-Schmidt for
// r <= 2 or half types (QR is slower there, and unavailable for half), QR otherwise.
// Unlike PyTorch's, a column that depends on the previous ones (the gradient's rank is below r)
// becomes zero instead of normalized rounding noise: that noise need not be orthogonal to the
// other columns (it is parallel to them when the rows of M are equal), and P P^T M then stops
// being M. Columns are projected out twice ("twice is enough") so the rest stay orthogonal.
void orthogonalize(const at::Tensor& m, double epsilon) {
  const int64_t r = m.size(2);
  const bool half = m.scalar_type() == at::kHalf || m.scalar_type() == at::kBFloat16;
  if (r > 2 && !half) {
    m.copy_(std::get<0>(at::linalg_qr(m)));
    return;
  }
  const double tolerance = 64 * (half ? 1e-3 : (m.scalar_type() == at::kDouble ? 2.2e-16 : 1.2e-7));
  for (int64_t i = 0; i < r; ++i) {
    at::Tensor col = m.narrow(2, i, 1);
    if (i > 0) {
      const at::Tensor before = at::norm(col, 2, {1}, /*keepdim=*/true);
      const at::Tensor previous = m.narrow(2, 0, i);
      for (int pass = 0; pass < 2; ++pass) col.sub_(at::bmm(previous, at::bmm(previous.transpose(1, 2), col)));
      col.mul_(at::norm(col, 2, {1}, /*keepdim=*/true) > before * tolerance);  // dependent: zero
    }
    at::Tensor norm = at::norm(col, 2, {1}, /*keepdim=*/true);
    if (epsilon == 0) {
      // An all-zero column stays zero (PyTorch would divide by zero and produce NaN).
      col.div_(at::where(norm == 0, at::ones_like(norm), norm));
    } else {
      col.div_(norm + epsilon);
    }
  }
}

void fill_random(const at::Tensor& q, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  q.copy_(at::randn(q.sizes(), gen, at::TensorOptions().dtype(q.scalar_type())));
}

// Rows per block for the blockwise passes below: about 2 MB of the matrix, so a block read for
// one operation is still in cache for the next.
int64_t rows_per_block(int64_t cols) { return std::max<int64_t>(1, (512 * 1024) / std::max<int64_t>(cols, 1)); }

// P = (M + E) Q, adding E into M on the way (E undefined: P = M Q). Blockwise, M crosses memory once.
void add_error_and_project(const at::Tensor& m, const at::Tensor& e, const at::Tensor& q, const at::Tensor& p) {
  const int64_t rows = m.size(0), step = rows_per_block(m.size(1));
  for (int64_t r0 = 0; r0 < rows; r0 += step) {
    const int64_t len = std::min(step, rows - r0);
    at::Tensor mb = m.narrow(0, r0, len);
    if (e.defined()) mb.add_(e.narrow(0, r0, len));
    at::Tensor pb = p.narrow(0, r0, len);
    at::mm_out(pb, mb, q);
  }
}

// M <- P Q^T; with error feedback also E <- M - P Q^T first (M holding gradient plus old error).
// Blockwise through a cached scratch block: M is read once and written once, E written once.
void approximate(const at::Tensor& m, const at::Tensor& e, const at::Tensor& p, const at::Tensor& q) {
  const int64_t rows = m.size(0), cols = m.size(1), step = rows_per_block(cols);
  const at::Tensor qt = q.t();
  at::Tensor scratch = e.defined() ? at::empty({std::min(step, rows), cols}, m.options()) : at::Tensor();
  for (int64_t r0 = 0; r0 < rows; r0 += step) {
    const int64_t len = std::min(step, rows - r0);
    at::Tensor mb = m.narrow(0, r0, len);
    const at::Tensor pb = p.narrow(0, r0, len);
    if (!e.defined()) {
      at::mm_out(mb, pb, qt);
      continue;
    }
    at::Tensor a = scratch.narrow(0, 0, len);
    at::mm_out(a, pb, qt);
    at::Tensor eb = e.narrow(0, r0, len);
    at::sub_out(eb, mb, a);
    mb.copy_(a);
  }
}

}  // namespace

// ---- powerSGD_hook --------------------------------------------------------------------------------
class PowerSGDHook {
 public:
  explicit PowerSGDHook(std::shared_ptr<PowerSGDState> s) : s_(std::move(s)) {
    DDPKIT_CHECK(s_, "powerSGD_hook: state is null");
  }

  FuturePtr operator()(GradBucket& bucket) {
    if (FuturePtr plain = s_->allreduce_phase(bucket, "powerSGD_hook")) return plain;
    // Raw pointers in closures: they may be destroyed on the sequencer or a Gloo thread, which
    // must never drop the last reference to the group (docs/threading.md). The hook owns both.
    ProcessGroup* pg = s_->pg_.get();
    const at::Tensor buffer = bucket.buffer();

    const PowerSGDOptions& o = s_->options_;
    auto b = s_->bucket(bucket.index());
    // Error feedback as PyTorch's: the bucket plus last step's error is what gets compressed, and
    // the new error is that minus what the bucket becomes. Kept per bucket, updated in place (a
    // fresh bucket-sized tensor per step costs more in page faults than the arithmetic).
    const bool ef = o.use_error_feedback();
    if (ef && (!b->error.defined() || b->error.numel() != buffer.numel()))
      b->error = at::zeros({buffer.numel()}, buffer.options());
    const at::Tensor error = ef ? b->error : at::Tensor();
    const int64_t base = buffer.storage_offset();
    auto error_of = [error, base](const at::Tensor& t) {
      return error.defined() ? error.narrow(0, t.storage_offset() - base, t.numel()).view(t.sizes()) : at::Tensor();
    };

    // Split into matrices worth compressing and the rest.
    std::vector<at::Tensor> compress, uncompressed;
    int64_t total_p = 0, total_q = 0, before = 0, after = 0;
    for (const at::Tensor& t : bucket.gradients()) {
      if (t.dim() == 0) {
        uncompressed.push_back(t);
        before += 1;
        after += 1;
        continue;
      }
      at::Tensor matrix = t.view({t.size(0), -1});
      const int64_t n = matrix.size(0), m = matrix.size(1);
      const int64_t r = std::min({n, m, o.matrix_approximation_rank()});
      before += n * m;
      if (static_cast<double>((n + m) * r) * o.min_compression_rate() < static_cast<double>(n * m)) {
        compress.push_back(matrix);
        total_p += n * r;
        total_q += m * r;
        after += (n + m) * r;
      } else {
        uncompressed.push_back(t);
        after += n * m;
      }
    }
    s_->add_stats(before, after);
    at::Tensor uncompressed_memory, uncompressed_input;
    if (!uncompressed.empty()) {
      std::vector<at::Tensor> flat;
      for (const auto& t : uncompressed) {
        if (ef) t.add_(error_of(t));
        flat.push_back(t.reshape({-1}));
      }
      uncompressed_memory = at::cat(flat);
      if (ef) uncompressed_input = uncompressed_memory.clone();
    }

    bool randomize = false;
    if (!o.warm_start() || !b->p.defined() || b->p.numel() != total_p || b->q.numel() != total_q) {
      randomize = true;
      b->p = at::empty({total_p}, buffer.options());
      b->q = at::empty({total_q}, buffer.options());
    }

    // Same-shaped matrices, in order of first appearance; batched into one [b, n, m] if asked.
    std::vector<std::pair<std::vector<int64_t>, std::vector<at::Tensor>>> by_shape;
    for (const auto& mtx : compress) {
      auto shape = mtx.sizes().vec();
      auto it = std::find_if(by_shape.begin(), by_shape.end(), [&](const auto& e) { return e.first == shape; });
      if (it == by_shape.end()) {
        by_shape.push_back({shape, {mtx}});
      } else {
        it->second.push_back(mtx);
      }
    }
    struct Batch {
      at::Tensor matrices;               // [b, n, m]: a view of the bucket, or a stacked copy
      std::vector<at::Tensor> originals; // the bucket's matrices (views)
      at::Tensor p, q;                   // [b, n, r], [b, m, r] views of the P/Q memory
      bool stacked = false;
    };
    auto batches = std::make_shared<std::vector<Batch>>();
    for (auto& entry : by_shape) {
      if (o.batch_tensors_with_same_shape() && entry.second.size() > 1) {
        Batch bt;
        bt.originals = entry.second;
        bt.stacked = true;
        batches->push_back(bt);
      } else {
        for (auto& mtx : entry.second) {
          Batch bt;
          bt.matrices = mtx.unsqueeze(0);
          bt.originals = {mtx};
          batches->push_back(bt);
        }
      }
    }
    int64_t p_off = 0, q_off = 0;
    for (Batch& bt : *batches) {
      const int64_t bs = static_cast<int64_t>(bt.originals.size());
      const int64_t n = bt.originals[0].size(0), m = bt.originals[0].size(1);
      const int64_t r = std::min({n, m, o.matrix_approximation_rank()});
      bt.p = b->p.narrow(0, p_off, bs * n * r).view({bs, n, r});
      bt.q = b->q.narrow(0, q_off, bs * m * r).view({bs, m, r});
      p_off += bs * n * r;
      q_off += bs * m * r;
    }
    for (Batch& bt : *batches) {
      if (randomize) fill_random(bt.q, s_->next_seed());
      orthogonalize(bt.q, o.orthogonalization_epsilon());  // warm start: last iteration's Q
      if (bt.stacked) {
        for (const auto& mtx : bt.originals)
          if (ef) mtx.add_(error_of(mtx));
        bt.matrices = at::stack(bt.originals);
        at::bmm_out(bt.p, bt.matrices, bt.q);
      } else {
        add_error_and_project(bt.originals[0], error_of(bt.originals[0]), bt.q[0], bt.p[0]);
      }
    }

    PowerSGDState* state = s_.get();
    at::Tensor p_memory = b->p, q_memory = b->q;
    const double eps = o.orthogonalization_epsilon();
    const int64_t world = pg->size();
    // Writes the decompressed bucket and, with error feedback, the new error: the compensated input
    // (the bucket now, or uncompressed_input) minus the result.
    auto finish = [=]() {
      std::lock_guard<std::mutex> lock(state->mutex_);  // error() reads it from other threads
      int64_t off = 0;
      for (const auto& t : uncompressed) {
        const at::Tensor avg = uncompressed_memory.narrow(0, off, t.numel()).view(t.sizes());
        if (ef) {
          at::Tensor e = error_of(t);
          at::sub_out(e, uncompressed_input.narrow(0, off, t.numel()).view(t.sizes()), avg);
        }
        t.copy_(avg);
        off += t.numel();
      }
      for (const Batch& bt : *batches)
        for (size_t i = 0; i < bt.originals.size(); ++i)
          approximate(bt.originals[i], error_of(bt.originals[i]), bt.p[i], bt.q[i]);
      if (!state->options_.warm_start()) {
        b->p = at::Tensor();
        b->q = at::Tensor();
      }
      return buffer;
    };
    // Collectives are issued on the sequencer (blocking there is allowed); the last one
    // completes the hook's future, and decompression runs in its callback: local work only.
    return pg->run_ordered_async([=]() -> FuturePtr {
      FuturePtr un = uncompressed_memory.defined() ? pg->allreduce(uncompressed_memory) : FuturePtr();
      FuturePtr pf = batches->empty() ? FuturePtr() : pg->allreduce(p_memory);
      if (un) {
        ProcessGroup::wait(un);
        uncompressed_memory.div_(world);
      }
      if (!pf) return completed_future(finish());
      ProcessGroup::wait(pf);
      for (Batch& bt : *batches) {
        orthogonalize(bt.p, eps);
        at::bmm_out(bt.q, bt.matrices.transpose(1, 2), bt.p);
      }
      return pg->allreduce(q_memory)->then(
          [=](c10::ivalue::Future& f) -> c10::IValue {
            f.value();
            q_memory.div_(world);
            return c10::IValue(finish());
          },
          c10::TensorType::get());
    });
  }

 private:
  std::shared_ptr<PowerSGDState> s_;
};

// ---- batched_powerSGD_hook ------------------------------------------------------------------------
class BatchedPowerSGDHook {
 public:
  explicit BatchedPowerSGDHook(std::shared_ptr<PowerSGDState> s) : s_(std::move(s)) {
    DDPKIT_CHECK(s_, "batched_powerSGD_hook: state is null");
  }

  FuturePtr operator()(GradBucket& bucket) {
    if (FuturePtr plain = s_->allreduce_phase(bucket, "batched_powerSGD_hook")) return plain;
    // Raw pointers in closures: they may be destroyed on the sequencer or a Gloo thread, which
    // must never drop the last reference to the group (docs/threading.md). The hook owns both.
    ProcessGroup* pg = s_->pg_.get();
    const at::Tensor buffer = bucket.buffer();

    const PowerSGDOptions& o = s_->options_;
    auto b = s_->bucket(bucket.index());
    const int64_t numel = buffer.numel();
    const int64_t side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(numel))));
    const int64_t padded_numel = side * side;
    const int64_t r = std::min(side, o.matrix_approximation_rank());
    s_->add_stats(padded_numel, 2 * side * r);

    if (!b->padded.defined() || b->padded.numel() != padded_numel) {
      b->padded = at::empty({padded_numel}, buffer.options());
      b->error = at::Tensor();
      b->p = at::Tensor();
    }
    at::Tensor padded = b->padded;
    padded.narrow(0, 0, numel).copy_(buffer.reshape({-1}));
    padded.narrow(0, numel, padded_numel - numel).zero_();
    at::Tensor input_copy;
    if (o.use_error_feedback()) {
      // Over the padded length, like PyTorch: the padding's share of the approximation error is
      // fed back too.
      if (b->error.defined()) {
        padded.add_(b->error);
      } else {
        b->error = at::zeros({padded_numel}, buffer.options());
      }
      if (!b->input.defined() || b->input.numel() != padded_numel) b->input = at::empty_like(padded);
      input_copy = b->input.copy_(padded);
    }
    if (!o.warm_start() || !b->p.defined()) {
      b->p = at::empty({1, side, r}, buffer.options());
      b->q = at::empty({1, side, r}, buffer.options());
      fill_random(b->q, s_->next_seed());
    }
    orthogonalize(b->q, o.orthogonalization_epsilon());
    at::Tensor matrix = padded.view({1, side, side});
    at::Tensor p = b->p, q = b->q;
    at::bmm_out(p, matrix, q);

    PowerSGDState* state = s_.get();
    const double eps = o.orthogonalization_epsilon();
    const int64_t world = pg->size();
    return pg->run_ordered_async([=]() mutable -> FuturePtr {
      ProcessGroup::wait(pg->allreduce(p));
      orthogonalize(p, eps);
      at::bmm_out(q, matrix.transpose(1, 2), p);
      // 2.x calls then()'s callback as const: no mutable captures, so the out-argument is a local.
      return pg->allreduce(q)->then(
          [=](c10::ivalue::Future& f) -> c10::IValue {
            f.value();
            q.div_(world);
            at::Tensor approximation = matrix;
            at::bmm_out(approximation, p, q.transpose(1, 2));
            {
              std::lock_guard<std::mutex> lock(state->mutex_);
              if (state->options_.use_error_feedback()) at::sub_out(b->error, input_copy, padded);
              if (!state->options_.warm_start()) b->p = at::Tensor();
            }
            buffer.copy_(padded.narrow(0, 0, numel).view(buffer.sizes()));
            return c10::IValue(buffer);
          },
          c10::TensorType::get());
    });
  }

 private:
  std::shared_ptr<PowerSGDState> s_;
};

CommHook powerSGD_hook(std::shared_ptr<PowerSGDState> state) {
  auto impl = std::make_shared<PowerSGDHook>(std::move(state));
  return [impl](GradBucket& bucket) { return (*impl)(bucket); };
}

CommHook batched_powerSGD_hook(std::shared_ptr<PowerSGDState> state) {
  auto impl = std::make_shared<BatchedPowerSGDHook>(std::move(state));
  return [impl](GradBucket& bucket) { return (*impl)(bucket); };
}

}  // namespace hooks
}  // namespace ddpkit
