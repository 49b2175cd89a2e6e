// The NCCL transport: c10d's ProcessGroupNCCL, CUDA tensors, one rank per GPU. Only where
// libtorch was built with NCCL; elsewhere asking for it is an error naming what is available.
#include "transport.h"

#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace ddpkit {

#ifdef USE_C10D_NCCL

using detail::bytes_of;
using detail::describe_tensor;

namespace {

class NcclTransport final : public Transport {
 public:
  NcclTransport(GroupCore& core, const c10::intrusive_ptr<c10d::Store>& store) : Transport(core) {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = core.timeout();
    // NCCL's rendezvous is lazy, at its first collective: it keeps reading the group's store.
    backend_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, core.rank(), core.size(), options);
  }

  std::string name() const override { return "nccl"; }

  FuturePtr allreduce(const at::Tensor& tensor, c10d::ReduceOp op) override {
    const uint64_t n = static_cast<uint64_t>(core_.size());
    return issue("allreduce (" + describe_tensor(tensor) + ")", 2 * (n - 1) * bytes_of(tensor) / n, tensor,
                 [tensor, op](compat::Backend& b, std::chrono::milliseconds timeout) {
                   std::vector<at::Tensor> v{tensor};
                   c10d::AllreduceOptions o;
                   o.reduceOp = op;
                   o.timeout = timeout;
                   return b.allreduce(v, o);
                 });
  }

  FuturePtr broadcast(const at::Tensor& tensor, int root) override {
    const uint64_t n = static_cast<uint64_t>(core_.size());
    return issue("broadcast from rank " + std::to_string(root) + " (" + describe_tensor(tensor) + ")",
                 (n - 1) * bytes_of(tensor) / n, tensor,
                 [tensor, root](compat::Backend& b, std::chrono::milliseconds timeout) {
                   std::vector<at::Tensor> v{tensor};
                   c10d::BroadcastOptions o;
                   o.rootRank = root;
                   o.timeout = timeout;
                   return b.broadcast(v, o);
                 });
  }

  FuturePtr allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input) override {
    const uint64_t n = static_cast<uint64_t>(core_.size());
    return issue("allgather (" + describe_tensor(input) + " per rank)", (n - 1) * bytes_of(input), input,
                 [outputs, input](compat::Backend& b, std::chrono::milliseconds timeout) {
                   std::vector<std::vector<at::Tensor>> out{outputs};
                   std::vector<at::Tensor> in{input};
                   c10d::AllgatherOptions o;
                   o.timeout = timeout;
                   return b.allgather(out, in, o);
                 });
  }

  FuturePtr allgather_into_tensor(const at::Tensor& output, const at::Tensor& input) override {
    const uint64_t n = static_cast<uint64_t>(core_.size());
    return issue("allgather (" + describe_tensor(input) + " per rank)", (n - 1) * bytes_of(input), output,
                 [output, input](compat::Backend& b, std::chrono::milliseconds timeout) {
                   at::Tensor out = output, in = input.contiguous();
                   c10d::AllgatherOptions o;
                   o.timeout = timeout;
                   return compat::all_gather_single(b, out, in, o);
                 });
  }

  FuturePtr alltoall(const at::Tensor& output, const at::Tensor& input) override {
    const uint64_t n = static_cast<uint64_t>(core_.size());
    return issue("alltoall (" + describe_tensor(input) + ")", (n - 1) * bytes_of(input) / n, output,
                 [output, input](compat::Backend& b, std::chrono::milliseconds timeout) {
                   at::Tensor out = output, in = input;
                   std::vector<int64_t> equal;
                   c10d::AllToAllOptions o;
                   o.timeout = timeout;
                   return compat::all_to_all_single(b, out, in, equal, equal, o);
                 });
  }

  FuturePtr reduce_scatter(const at::Tensor& output, const at::Tensor& input) override {
    const uint64_t n = static_cast<uint64_t>(core_.size());
    return issue("reduce_scatter (" + describe_tensor(input) + ")", (n - 1) * bytes_of(input) / n, output,
                 [output, input](compat::Backend& b, std::chrono::milliseconds timeout) {
                   at::Tensor out = output, in = input;
                   c10d::ReduceScatterOptions o;
                   o.timeout = timeout;
                   return compat::reduce_scatter_single(b, out, in, o);
                 });
  }

  FuturePtr barrier() override {
    // An allreduce of one element on this rank's GPU, ordered with the group's other collectives.
    auto t = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
    return issue("barrier", 0, t, [t](compat::Backend& b, std::chrono::milliseconds timeout) {
      std::vector<at::Tensor> v{t};
      c10d::AllreduceOptions o;
      o.timeout = timeout;
      return b.allreduce(v, o);
    });
  }

  FuturePtr two_phase(const std::shared_ptr<TwoPhaseJob>& job, const at::Tensor& value,
                      const std::string& what) override {
    auto result = make_tensor_future(value.device());
    core_.post([this, job, value, what, result] { run_two_phase_over_backend(core_, *this, job, value, what, result); });
    return result;
  }

  // No lock: NCCL's first collective on a group joins the peers' (a lock held across it would wait
  // forever for rank threads of one process).
  detail::BackendCall backend_call() override { return {std::unique_lock<std::mutex>(), backend_.get()}; }

 private:
  using Op = std::function<c10::intrusive_ptr<c10d::Work>(compat::Backend&, std::chrono::milliseconds)>;
  FuturePtr issue(const std::string& what, uint64_t bus_bytes, const at::Tensor& value, Op op) {
    return core_.issue(what, bus_bytes, value, [this, op = std::move(op)] { return op(*backend_, core_.timeout()); });
  }

  c10::intrusive_ptr<compat::Backend> backend_;
};

}  // namespace

std::unique_ptr<Transport> make_nccl_transport(GroupCore& core, const c10::intrusive_ptr<c10d::Store>& store) {
  return std::make_unique<NcclTransport>(core, store);
}

#else

std::unique_ptr<Transport> make_nccl_transport(GroupCore&, const c10::intrusive_ptr<c10d::Store>&) {
  DDPKIT_CHECK(false, "backend 'nccl' is not available: this libtorch was built without CUDA/NCCL (available: gloo)");
  return nullptr;
}

#endif

}  // namespace ddpkit
