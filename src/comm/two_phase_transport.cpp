// The two-phase transport: allreduce as two alltoalls over the transport it wraps, for the
// reductions Gloo does badly or not at all (fp16/bf16, which Gloo has no bf16 and sums fp16 one
// element at a time; fp32/fp64 from ProcessGroupOptions::two_phase_min_bytes up). Also the
// piece-by-piece runner of two-phase jobs over a c10d backend, which Gloo and NCCL use.
//   1. reduce-scatter: alltoall, so rank r holds everyone's chunk r;
//   2. sum the n copies of chunk r (fp32 accumulation for fp16/bf16: one rounding);
//   3. allgather: alltoall of the reduced chunk replicated n times, straight into the tensor.
// Per rank it sends 2(n-1)/n of the tensor, like a ring allreduce.
#include <ddpkit/codecs/cast.h>

#include "transport.h"

#include <algorithm>
#include <atomic>

namespace ddpkit {

using detail::bytes_of;
using detail::describe_tensor;

at::Tensor two_phase_block(const at::Tensor& t, int64_t pieces, int64_t p) {
  const int64_t len = t.numel() / pieces;
  return t.view({-1}).narrow(0, p * len, len);
}

namespace {

// What one rank sends of a two-phase buffer's piece (counted like alltoall).
uint64_t two_phase_bytes(const at::Tensor& t, int64_t pieces, int64_t n) {
  return bytes_of(t) / pieces * (n - 1) / n;
}

bool low_precision(at::ScalarType dt) { return dt == at::kHalf || dt == at::kBFloat16; }

class TwoPhaseTransport final : public ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;

  std::string name() const override { return inner_->name() + " + two-phase allreduce"; }

  FuturePtr allreduce(const at::Tensor& tensor, c10d::ReduceOp op) override {
    if (!takes(tensor, op)) return inner_->allreduce(tensor, op);
    auto sum = make_tensor_future(tensor.device());
    core_.post([this, tensor, sum] { run_allreduce(tensor, sum); });
    return op == c10d::ReduceOp::AVG ? core_.divided_by_size(sum, tensor) : sum;
  }

 private:
  bool takes(const at::Tensor& tensor, c10d::ReduceOp op) const {
    if (tensor.is_sparse() || !tensor.device().is_cpu()) return false;
    const auto dt = tensor.scalar_type();
    const bool sum = op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::AVG;
    if (low_precision(dt)) {
      DDPKIT_CHECK(sum, "allreduce of ", dt, " on gloo supports only SUM and AVG");
      return true;
    }
    const int64_t min_bytes = core_.options().two_phase_min_bytes();
    return sum && (dt == at::kFloat || dt == at::kDouble) && min_bytes > 0 &&
           bytes_of(tensor) >= static_cast<uint64_t>(min_bytes);
  }

  // On the sequencer.
  void run_allreduce(const at::Tensor& tensor, const FuturePtr& result) {
    const std::string what = "allreduce (" + describe_tensor(tensor) + ", two-phase alltoall path)";
    try {
      const int64_t n = core_.size();
      const int64_t numel = tensor.numel();
      const int64_t pieces = core_.pieces_for(bytes_of(tensor) * (n - 1) / n);
      const int64_t chunk = (numel + n * pieces - 1) / (n * pieces);
      const int64_t total = chunk * n * pieces;
      const bool padded = total != numel || !tensor.is_contiguous();
      const at::Tensor flat = tensor.reshape({-1});
      at::Tensor data = flat;
      if (padded) {
        data = core_.take_workspace(tensor.scalar_type(), total);
        data.narrow(0, 0, numel).copy_(flat);
        data.narrow(0, numel, total - numel).zero_();
      }
      // Gloo refuses bf16 (and has no use for the dtype when only moving bytes): low-precision
      // tensors travel as float16 bits.
      const bool lowp = low_precision(tensor.scalar_type());
      auto wire = [lowp](const at::Tensor& t) { return lowp ? t.view(at::kHalf) : t; };
      at::Tensor scratch = core_.take_workspace(tensor.scalar_type(), total);
      auto job = std::make_shared<TwoPhaseJob>();
      job->pieces = pieces;
      job->send1 = job->recv2 = wire(data);
      job->recv1 = job->send2 = wire(scratch);
      const int me = core_.rank();
      job->reduce = [scratch, n, chunk, me, lowp](int64_t p) {
        const at::Tensor parts = scratch.narrow(0, p * n * chunk, n * chunk).view({n, chunk});
        // Reduce into this rank's own chunk, then replicate it over the others: phase 2's send block.
        at::Tensor mine = parts[me];
        if (lowp) {
          codecs::sum_low_precision_into(parts.unbind(0), mine);
        } else {
          for (int64_t k = 0; k < n; ++k)
            if (k != me) mine.add_(parts[k]);
        }
        for (int64_t k = 0; k < n; ++k)
          if (k != me) parts[k].copy_(mine);
      };
      GroupCore* core = &core_;
      inner_->two_phase(job, data, what)
          ->addCallback([core, tensor, data, scratch, numel, padded, result, what](c10::ivalue::Future& f) {
            core->give_workspace(scratch);  // phase 2's send buffer had to outlive the transfer
            if (f.hasError()) return result->setError(f.exception_ptr());  // already names the operation
            try {
              if (padded) {
                tensor.copy_(data.narrow(0, 0, numel).view(tensor.sizes()));  // tensor may be strided
                core->give_workspace(data);
              }
              result->markCompleted(c10::IValue(tensor));
            } catch (...) {
              core->fail(result, what, std::current_exception());
            }
          });
    } catch (...) {
      core_.fail(result, what, std::current_exception());
    }
  }
};

}  // namespace

std::unique_ptr<Transport> make_two_phase_transport(GroupCore& core, std::unique_ptr<Transport> inner) {
  return std::make_unique<TwoPhaseTransport>(core, std::move(inner));
}

// On the sequencer. Issue order is fixed by the piece count alone (phase 1 of pieces 0 and 1,
// then per piece p: phase 2 of p, phase 1 of p + 2), so every rank issues the same sequence. With
// two Gloo threads one transfer runs while the next piece is reduced here.
void run_two_phase_over_backend(GroupCore& core, Transport& transport, const std::shared_ptr<TwoPhaseJob>& job,
                                const at::Tensor& value, const std::string& what, const FuturePtr& result) {
  struct Progress {
    std::atomic<int64_t> remaining;
    std::atomic<bool> failed{false};
  };
  const int64_t pieces = job->pieces, n = core.size();
  auto progress = std::make_shared<Progress>();
  progress->remaining = pieces;
  GroupCore* c = &core;
  auto fail_once = [progress, result, what, c](std::exception_ptr cause) {
    if (!progress->failed.exchange(true)) c->fail(result, what, cause);
  };
  auto alltoall = [&](at::Tensor recv, at::Tensor send) {
    std::vector<int64_t> equal;
    c10d::AllToAllOptions o;
    o.timeout = core.timeout();
    detail::BackendCall call = transport.backend_call();
    return compat::all_to_all_single(*call.backend, recv, send, equal, equal, o);
  };
  try {
    check_two_phase(core, *job, what);
    auto block = [pieces](const at::Tensor& t, int64_t p) { return two_phase_block(t, pieces, p); };
    auto phase_bytes = [&](const at::Tensor& t) { return two_phase_bytes(t, pieces, n); };
    std::vector<c10::intrusive_ptr<c10d::Work>> first(pieces);
    auto send_first = [&](int64_t p) {
      if (job->encode) job->encode(p);
      core.count(phase_bytes(job->send1), phase_bytes(job->send1));
      first[p] = alltoall(block(job->recv1, p), block(job->send1, p));
    };
    // Pieces whose first phase is in flight: as many as the group has Gloo workers (at least 2),
    // so that over a long round trip a piece's wait for its peers overlaps others' transfers.
    const int64_t window = std::max<int64_t>(2, core.options().gloo_threads());
    for (int64_t p = 0; p < std::min(window, pieces); ++p) send_first(p);
    for (int64_t p = 0; p < pieces; ++p) {
      first[p]->wait(core.timeout());
      first[p].reset();
      job->reduce(p);
      core.count(phase_bytes(job->send2), phase_bytes(job->send2));
      auto second = alltoall(block(job->recv2, p), block(job->send2, p));
      second->getFuture()->addCallback([job, p, progress, result, value, fail_once](c10::ivalue::Future& f) {
        if (f.hasError()) return fail_once(f.exception_ptr());
        if (progress->failed) return;
        try {
          if (job->decode) job->decode(p);
        } catch (...) {
          return fail_once(std::current_exception());
        }
        if (progress->remaining.fetch_sub(1) == 1 && !progress->failed) result->markCompleted(c10::IValue(value));
      });
      if (p + window < pieces) send_first(p + window);
    }
  } catch (...) {
    fail_once(std::current_exception());
  }
}

}  // namespace ddpkit
