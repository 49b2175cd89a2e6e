// Two-phase reductions on Gloo: allreduce as two alltoalls, and the piece-by-piece two_phase
// jobs the fp16/bf16 allreduce and the int8 hook run (in shared memory when the group has it).
#include <ddpkit/codecs/cast.h>
#include <ddpkit/comm/process_group.h>

#include "process_group_internal.h"

#include <algorithm>
#include <atomic>

namespace ddpkit {

using detail::bytes_of;
using detail::describe_tensor;
using detail::fail;

namespace {

// Piece p of a two-phase buffer, and what one rank sends of it (counted like alltoall).
at::Tensor two_phase_block(const at::Tensor& t, int64_t pieces, int64_t p) {
  const int64_t len = t.numel() / pieces;
  return t.view({-1}).narrow(0, p * len, len);
}
uint64_t two_phase_bytes(const at::Tensor& t, int64_t pieces, int64_t n) {
  return bytes_of(t) / pieces * (n - 1) / n;
}

}  // namespace

// Allreduce as two alltoalls (Gloo's alltoall moves ~2.5x the bytes per second of its ring
// allreduce or list allgather here; bench/collective_bench prints all three):
//   1. reduce-scatter: alltoall, so rank r holds everyone's chunk r;
//   2. sum the n copies of chunk r (fp32 accumulation for fp16/bf16: one rounding);
//   3. allgather: alltoall of the reduced chunk replicated n times, straight into the tensor.
// Per rank it sends 2(n-1)/n of the tensor, like a ring allreduce. Done in pieces by two_phase.
void ProcessGroup::two_phase_allreduce(const at::Tensor& tensor, const FuturePtr& result) {
  const std::string what = "allreduce (" + describe_tensor(tensor) + ", two-phase alltoall path)";
  try {
    const int64_t n = world_size_;
    const int64_t numel = tensor.numel();
    const int64_t pieces = pieces_for(bytes_of(tensor) * (n - 1) / n);
    const int64_t chunk = (numel + n * pieces - 1) / (n * pieces);
    const int64_t total = chunk * n * pieces;
    const bool padded = total != numel || !tensor.is_contiguous();
    const at::Tensor flat = tensor.reshape({-1});
    at::Tensor data = flat;
    if (padded) {
      data = take_workspace(tensor.scalar_type(), total);
      data.narrow(0, 0, numel).copy_(flat);
      data.narrow(0, numel, total - numel).zero_();
    }
    // Gloo refuses bf16 (and has no use for the dtype when only moving bytes): low-precision
    // tensors travel as float16 bits.
    const bool lowp = tensor.scalar_type() == at::kHalf || tensor.scalar_type() == at::kBFloat16;
    auto wire = [lowp](const at::Tensor& t) { return lowp ? t.view(at::kHalf) : t; };
    at::Tensor scratch = take_workspace(tensor.scalar_type(), total);
    auto job = std::make_shared<TwoPhaseJob>();
    job->pieces = pieces;
    job->send1 = job->recv2 = wire(data);
    job->recv1 = job->send2 = wire(scratch);
    const int me = rank_;
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
    FuturePtr pieces_done = make_tensor_future(tensor.device());
    run_two_phase(job, data, what, pieces_done);
    pieces_done->addCallback([this, tensor, data, scratch, numel, padded, result, what](c10::ivalue::Future& f) {
      give_workspace(scratch);  // phase 2's send buffer had to outlive the transfer
      if (f.hasError()) {
        result->setError(f.exception_ptr());  // already names the operation
        return;
      }
      try {
        if (padded) {
          tensor.copy_(data.narrow(0, 0, numel).view(tensor.sizes()));  // tensor may be strided
          give_workspace(data);
        }
        result->markCompleted(c10::IValue(tensor));
      } catch (...) {
        fail(result, what, rank_, world_size_, std::current_exception());
      }
    });
  } catch (...) {
    fail(result, what, rank_, world_size_, std::current_exception());
  }
}

int64_t ProcessGroup::pieces_for(uint64_t bytes_per_rank) const {
  const uint64_t per_peer = bytes_per_rank / std::max(1, world_size_ - 1);
  const uint64_t piece = static_cast<uint64_t>(piece_bytes());  // >= 1: checked when set
  return static_cast<int64_t>(std::max<uint64_t>(1, (per_peer + piece - 1) / piece));
}

FuturePtr ProcessGroup::two_phase(std::shared_ptr<TwoPhaseJob> job, const at::Tensor& value, const std::string& what) {
  DDPKIT_CHECK(job && job->pieces >= 1, what, ": two_phase needs a job with at least one piece");
  DDPKIT_CHECK(job->reduce, what, ": two_phase needs a reduce step");
  if (shm_takes(job->send1)) {
    // In shared memory, piece by piece: each exchange runs at memory speed, nothing to overlap.
    return shm_issue(
        what, value,
        [this, job, what] {
          check_two_phase(*job, what);
          for (int64_t p = 0; p < job->pieces; ++p)
            for (const at::Tensor* t : {&job->send1, &job->send2})
              count(two_phase_bytes(*t, job->pieces, world_size_), two_phase_bytes(*t, job->pieces, world_size_), true);
        },
        [this, job] {
          auto exchange = [&](const at::Tensor& send, const at::Tensor& recv, int64_t p) {
            const at::Tensor s = two_phase_block(send, job->pieces, p);
            shm_->domain->alltoall(s.data_ptr(), two_phase_block(recv, job->pieces, p).data_ptr(), bytes_of(s) / world_size_);
          };
          for (int64_t p = 0; p < job->pieces; ++p) {
            if (job->encode) job->encode(p);
            exchange(job->send1, job->recv1, p);
            job->reduce(p);
            exchange(job->send2, job->recv2, p);
            if (job->decode) job->decode(p);
          }
        });
  }
  auto result = make_tensor_future(value.device());
  post([this, job = std::move(job), value, what, result] { run_two_phase(job, value, what, result); });
  return result;
}

void ProcessGroup::check_two_phase(const TwoPhaseJob& job, const std::string& what) const {
  for (const at::Tensor* t : {&job.send1, &job.recv1, &job.send2, &job.recv2})
    DDPKIT_CHECK(t->defined() && t->is_contiguous() && t->numel() % (job.pieces * world_size_) == 0, what,
                 ": two_phase buffers must be contiguous and split into ", job.pieces, " x ", world_size_,
                 " equal chunks");
}

// On the sequencer. Issue order is fixed by the piece count alone (phase 1 of pieces 0 and 1,
// then per piece p: phase 2 of p, phase 1 of p + 2), so every rank issues the same sequence. With
// two Gloo threads one transfer runs while the next piece is reduced here.
void ProcessGroup::run_two_phase(const std::shared_ptr<TwoPhaseJob>& job, const at::Tensor& value,
                                 const std::string& what, const FuturePtr& result) {
  struct Progress {
    std::atomic<int64_t> remaining;
    std::atomic<bool> failed{false};
  };
  const int64_t pieces = job->pieces, n = world_size_;
  auto progress = std::make_shared<Progress>();
  progress->remaining = pieces;
  const int rank = rank_, world = world_size_;
  auto fail_once = [progress, result, what, rank, world](std::exception_ptr cause) {
    if (!progress->failed.exchange(true)) fail(result, what, rank, world, cause);
  };
  try {
    check_two_phase(*job, what);
    auto block = [pieces](const at::Tensor& t, int64_t p) { return two_phase_block(t, pieces, p); };
    std::vector<int64_t> equal;
    c10d::AllToAllOptions ao;
    ao.timeout = options_.timeout();
    auto phase_bytes = [&](const at::Tensor& t) { return two_phase_bytes(t, pieces, n); };
    std::vector<c10::intrusive_ptr<c10d::Work>> first(pieces);
    auto send_first = [&](int64_t p) {
      if (job->encode) job->encode(p);
      count(phase_bytes(job->send1), phase_bytes(job->send1));
      at::Tensor recv = block(job->recv1, p), send = block(job->send1, p);
      first[p] = with_backend([&](compat::Backend& b) { return b.alltoall_base(recv, send, equal, equal, ao); });
    };
    const int64_t window = 2;
    for (int64_t p = 0; p < std::min(window, pieces); ++p) send_first(p);
    for (int64_t p = 0; p < pieces; ++p) {
      first[p]->wait(options_.timeout());
      first[p].reset();
      job->reduce(p);
      count(phase_bytes(job->send2), phase_bytes(job->send2));
      at::Tensor recv = block(job->recv2, p), send = block(job->send2, p);
      auto second = with_backend([&](compat::Backend& b) { return b.alltoall_base(recv, send, equal, equal, ao); });
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
