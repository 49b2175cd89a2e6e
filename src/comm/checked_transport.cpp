// The checked transport: before each collective the ranks compare what they are about to call
// (which collective, dtype, size, root or op) and, where they differ, every rank fails with an
// error naming each rank's call instead of exchanging mismatched buffers. Gloo cannot survive a
// size mismatch (an enforce on its I/O thread aborts the process), and shared memory names only
// the first difference it meets. One small allgather per collective, waited for on the sequencer
// before the collective is issued: for debugging (ProcessGroupOptions::check_collectives,
// DDPKIT_CHECK_COLLECTIVES=1, or TORCH_DISTRIBUTED_DEBUG=DETAIL as in PyTorch).
#include "transport.h"

#include <sstream>

namespace ddpkit {

using detail::describe_tensor;

namespace {

enum class Kind : int64_t { kAllreduce, kBroadcast, kAllgather, kAlltoall, kReduceScatter, kBarrier, kTwoPhase };

// What one rank calls, as five integers every rank gathers.
struct Call {
  Kind kind;
  int64_t dtype = -1, numel = 0, detail = 0;  // detail: the op (allreduce), the root, the pieces
  c10::Device device = c10::kCPU;
};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllreduce: return "allreduce";
    case Kind::kBroadcast: return "broadcast";
    case Kind::kAllgather: return "allgather";
    case Kind::kAlltoall: return "alltoall";
    case Kind::kReduceScatter: return "reduce_scatter";
    case Kind::kBarrier: return "barrier";
    case Kind::kTwoPhase: return "two_phase";
  }
  return "?";
}

std::string describe(const int64_t* c) {
  std::ostringstream os;
  const Kind kind = static_cast<Kind>(c[0]);
  os << kind_name(kind);
  if (kind == Kind::kBarrier) return os.str();
  os << " of " << c[2] << " " << (c[1] >= 0 ? c10::toString(static_cast<at::ScalarType>(c[1])) : "?");
  if (kind == Kind::kAllreduce) os << " (op " << c[3] << ")";
  if (kind == Kind::kBroadcast) os << " from rank " << c[3];
  if (kind == Kind::kTwoPhase) os << " in " << c[3] << " pieces";
  return os.str();
}

Call call_on(Kind kind, const at::Tensor& t, int64_t detail = 0) {
  return {kind, static_cast<int64_t>(t.scalar_type()), t.numel(), detail, t.device()};
}

class CheckedTransport final : public ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;

  std::string name() const override { return inner_->name() + ", checked"; }

  FuturePtr allreduce(const at::Tensor& t, c10d::ReduceOp op) override {
    return checked(call_on(Kind::kAllreduce, t, static_cast<int64_t>(op)), [this, t, op] { return inner_->allreduce(t, op); });
  }
  FuturePtr broadcast(const at::Tensor& t, int root) override {
    return checked(call_on(Kind::kBroadcast, t, root), [this, t, root] { return inner_->broadcast(t, root); });
  }
  FuturePtr allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input) override {
    return checked(call_on(Kind::kAllgather, input), [this, outputs, input] { return inner_->allgather(outputs, input); });
  }
  FuturePtr allgather_into_tensor(const at::Tensor& output, const at::Tensor& input) override {
    return checked(call_on(Kind::kAllgather, input), [this, output, input] { return inner_->allgather_into_tensor(output, input); });
  }
  FuturePtr alltoall(const at::Tensor& output, const at::Tensor& input) override {
    return checked(call_on(Kind::kAlltoall, input), [this, output, input] { return inner_->alltoall(output, input); });
  }
  FuturePtr reduce_scatter(const at::Tensor& output, const at::Tensor& input) override {
    return checked(call_on(Kind::kReduceScatter, input), [this, output, input] { return inner_->reduce_scatter(output, input); });
  }
  FuturePtr barrier() override {
    Call c{Kind::kBarrier};
    if (core_.options().backend() == "nccl") c.device = c10::Device(c10::kCUDA);
    return checked(c, [this] { return inner_->barrier(); });
  }
  FuturePtr two_phase(const std::shared_ptr<TwoPhaseJob>& job, const at::Tensor& value,
                      const std::string& what) override {
    return checked(call_on(Kind::kTwoPhase, job->send1, job->pieces), [this, job, value, what] { return inner_->two_phase(job, value, what); });
  }
  // The parts' allreduce goes through this transport's allreduce (Transport's default), checked
  // there; where the inner transport sums in place it is checked as an allreduce of the buffer.
  FuturePtr allreduce_parts(const at::Tensor& buffer, const std::vector<at::Tensor>& parts, double scale) override {
    if (!inner_->sums_in_place(buffer)) return Transport::allreduce_parts(buffer, parts, scale);
    return checked(call_on(Kind::kAllreduce, buffer, static_cast<int64_t>(c10d::ReduceOp::SUM)),
                   [this, buffer, parts, scale] { return inner_->allreduce_parts(buffer, parts, scale); });
  }

 private:
  // On the sequencer: every rank's call gathered and compared, then `issue` (which posts inline,
  // so the collective keeps its place in the order).
  FuturePtr checked(const Call& call, std::function<FuturePtr()> issue) {
    auto result = make_tensor_future(call.device);
    core_.post([this, call, result, issue = std::move(issue)] {
      FuturePtr inner;
      try {
        verify(call);
        inner = issue();
      } catch (...) {
        return core_.fail(result, kind_name(call.kind), std::current_exception());
      }
      inner->addCallback([result](c10::ivalue::Future& f) {
        if (f.hasError()) return result->setError(f.exception_ptr());
        result->markCompleted(f.value());
      });
    });
    return result;
  }

  void verify(const Call& call) {
    constexpr int64_t kFields = 4;
    const int64_t n = core_.size();
    const auto on = at::TensorOptions().dtype(at::kLong).device(call.device);
    at::Tensor mine = at::tensor({static_cast<int64_t>(call.kind), call.dtype, call.numel, call.detail}, at::kLong).to(call.device);
    at::Tensor all = at::zeros({n * kFields}, on);
    ProcessGroup::wait(inner_->allgather_into_tensor(all, mine));
    all = all.cpu();
    const int64_t* calls = all.data_ptr<int64_t>();
    bool same = true;
    for (int64_t r = 1; r < n && same; ++r) same = std::equal(calls, calls + kFields, calls + r * kFields);
    if (same) return;
    std::string each;
    for (int64_t r = 0; r < n; ++r)
      each += (r ? "; rank " : "rank ") + std::to_string(r) + ": " + describe(calls + r * kFields);
    throw CommError("ddpkit: the ranks of process group '" + core_.options().group_name() +
                    "' called different collectives (" + each + ")");
  }
};

}  // namespace

std::unique_ptr<Transport> make_checked_transport(GroupCore& core, std::unique_ptr<Transport> inner) {
  return std::make_unique<CheckedTransport>(core, std::move(inner));
}

}  // namespace ddpkit
