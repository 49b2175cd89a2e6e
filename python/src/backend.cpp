// ddpkit as a torch.distributed backend. Every collective maps onto one ddpkit::ProcessGroup call
// (issued in program order on its sequencer, bounded by the group's timeout), so ranks on one host
// exchange through shared memory and hosts through Gloo, hierarchically for allreduce. What
// ddpkit's group does not do itself (reductions other than SUM/AVG, uneven all-to-all, send/recv)
// runs on its Gloo backend, the first two on the sequencer so the order still holds.
#include "backend.h"
#include "backend_work.h"
#include "ft/detached.h"  // src/: the library's own helper for teardown off the caller's path

#include <ddpkit/comm/process_group.h>
#include <ddpkit/compat.h>
#include <ddpkit/error.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>

namespace py = pybind11;

namespace ddpkit {
namespace python {
namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using c10d::OpType;
using c10d::ReduceOp;

// `f`, then `after` (on the thread that completes f); errors in either reach the result.
FuturePtr then(const FuturePtr& f, std::function<void()> after) {
  auto result = make_tensor_future();
  f->addCallback([result, after = std::move(after)](c10::ivalue::Future& done) {
    if (done.hasError()) return result->setError(done.exception_ptr());
    try {
      after();
      result->markCompleted(done.value());
    } catch (...) {
      result->setError(std::current_exception());
    }
  });
  return result;
}

const char* op_name(const ReduceOp& op) {
  switch (op) {
    case ReduceOp::SUM: return "SUM";
    case ReduceOp::AVG: return "AVG";
    case ReduceOp::PRODUCT: return "PRODUCT";
    case ReduceOp::MIN: return "MIN";
    case ReduceOp::MAX: return "MAX";
    case ReduceOp::BAND: return "BAND";
    case ReduceOp::BOR: return "BOR";
    case ReduceOp::BXOR: return "BXOR";
    case ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "an unsupported op";
  }
}

bool is_sum(const ReduceOp& op) { return op == ReduceOp::SUM || op == ReduceOp::AVG; }

class DdpkitBackend : public compat::Backend {
 public:
  DdpkitBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
                int gloo_threads, bool shared_memory)
      : compat::Backend(rank, size),
        pg_(std::make_shared<ddpkit::ProcessGroup>(store, rank, size,
                                           ProcessGroupOptions()
                                               .timeout(timeout)
                                               .gloo_threads(gloo_threads)
                                               .shared_memory(shared_memory)
                                               .abortable(kAbortable)
                                               .group_name("ddpkit"))) {}

  ~DdpkitBackend() override { close(); }

#if DDPKIT_TORCH_AT_LEAST(2, 7)
  // torch.distributed.destroy_process_group: the collectives issued so far end (each within the
  // timeout), then the group's sockets, threads and shared memory go, before the Python object does.
  void shutdown() override { close(); }
  // ProcessGroup.abort() (and torchft-style callers on a lost peer): the collectives in flight fail
  // now with an error naming the abort, and it returns at once. The teardown (its transport's
  // aborted work ends only by its timeout) runs on a thread of its own, which holds this backend
  // until it is done, so a caller that aborts to reconfigure (torchft, on every quorum) does not wait.
  void abort() override {
    {
      std::lock_guard<std::mutex> lock(close_mutex_);
      if (closed_.load()) return;
      pg_->abort("the torch.distributed group was aborted");
      closed_ = true;  // collectives issued from now fail in work(), naming the abort
    }
    auto self = c10::intrusive_ptr<DdpkitBackend>::unsafe_reclaim_from_nonowning(this);
    AbortTeardowns& teardowns = abort_teardowns();
    teardowns.threads.start([self, &teardowns]() mutable {
      self->tear_down();
      // Letting go of the backend takes the GIL (torch >= 2.7 keeps its Python object alive while
      // C++ holds it). Once Python finalizes, it ends any other thread that asks for the GIL
      // (pthread_exit), and unwinding through torch's noexcept release is std::terminate: so after
      // Python's exit began, the backend is left to the process's end instead.
      std::lock_guard<std::mutex> lock(teardowns.exit_mutex);
      if (teardowns.python_exiting) {
        self.release();
      } else {
        self.reset();
      }
    });
  }

  // Registered with Python's atexit, which runs before the interpreter finalizes: teardowns still
  // running get kExitWait to end (with the GIL released: their last step may take it); from then
  // on a teardown that ends leaves its backend to the process's end.
  static void at_python_exit() {
    AbortTeardowns& teardowns = abort_teardowns();
    py::gil_scoped_release no_gil;
    teardowns.threads.wait_all_done(AbortTeardowns::kExitWait);
    std::lock_guard<std::mutex> lock(teardowns.exit_mutex);
    teardowns.python_exiting = true;
  }
#endif

  const std::string getBackendName() const override { return "ddpkit"; }

  // Sequence numbers: every collective counts one, from 0 on every rank, so ranks agree on them
  // (PyTorch's debug wrapper, TORCH_DISTRIBUTED_DEBUG=DETAIL, compares them across the group).
  void setSequenceNumberForGroup() override { sequence_ = 0; }
  uint64_t getSequenceNumberForGroup() override { return sequence_.load(); }
  const std::shared_ptr<ddpkit::ProcessGroup>& group() const {
    check_open();
    return pg_;
  }
  // A collective of ddpkit's own (its FSDP hooks, torch_fsdp2_comm.cpp) as this group's work, in
  // the order every collective of the group keeps.
  WorkPtr issue(OpType type, std::vector<at::Tensor> outputs,
                std::function<FuturePtr(const std::shared_ptr<ddpkit::ProcessGroup>&)> start) {
    std::shared_ptr<ddpkit::ProcessGroup> pg = group();
    return work(type, std::move(outputs), [pg, start] { return start(pg); });
  }

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    const at::Tensor t = one(tensors, "broadcast");
    check_root(opts.rootRank, "broadcast");
    const int root = static_cast<int>(opts.rootRank);
    // As bytes: Gloo moves no bfloat16 or bool.
    return work(OpType::BROADCAST, {t}, [this, t, root] {
      return on_contiguous(t, [&](const at::Tensor& c) { return pg_->broadcast(as_bytes(c), root); });
    });
  }

  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) return sparse_allreduce(tensors[0], opts);
    const at::Tensor t = one(tensors, "allreduce");
    const ReduceOp op = opts.reduceOp;
    return work(OpType::ALLREDUCE, {t}, [this, t, op] { return reduce_in_place(t, op, "allreduce"); });
  }

  // Sparse COO on the CPU, summed as Gloo sums it (its own sparse allreduce; SUM only, as there).
  WorkPtr sparse_allreduce(const at::Tensor& t, const c10d::AllreduceOptions& opts) {
    DDPKIT_CHECK(t.device().is_cpu(), "ddpkit backend: allreduce got a sparse tensor on ", t.device(),
                 "; this backend serves CPU tensors");
    DDPKIT_CHECK(opts.reduceOp == ReduceOp::SUM, "ddpkit backend: a sparse allreduce supports SUM only, got ",
                 op_name(opts.reduceOp));
    return work(OpType::ALLREDUCE, {t}, [this, t] { return pg_->allreduce(t); });
  }

  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    for (const auto& t : tensors) cpu(t, "allreduce_coalesced");
    const ReduceOp op = opts.reduceOp;
    return work(OpType::ALLREDUCE_COALESCED, tensors, [this, tensors, op] {
      std::vector<FuturePtr> parts;
      for (const auto& t : tensors) parts.push_back(reduce_in_place(t, op, "allreduce_coalesced"));
      return when_all(parts, at::Tensor());
    });
  }

  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    const at::Tensor& t = one(tensors, "reduce");
    check_root(opts.rootRank, "reduce");
    // An allreduce; other ranks reduce a copy, so only the root's tensor changes (as with Gloo).
    at::Tensor target = getRank() == opts.rootRank ? t : t.clone();
    const ReduceOp op = opts.reduceOp;
    return work(OpType::REDUCE, {t},
                [this, target, op] { return reduce_in_place(target, op, "reduce"); });
  }

  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const c10d::AllgatherOptions&) override {
    const at::Tensor in = one(inputs, "allgather");
    DDPKIT_CHECK(outputs.size() == 1, "ddpkit backend: allgather takes one output list, got ", outputs.size());
    check_list(outputs[0], in, "allgather");
    std::vector<at::Tensor> outs = outputs[0];
    return work(OpType::ALLGATHER, outs, [this, outs, in] { return gather_list(outs, in); });
  }

  WorkPtr DDPKIT_C10D_ALL_GATHER_SINGLE(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions&) override {
    check_world_times(output, "output", input, "input", "all_gather_into_tensor");
    const at::Tensor out = output, in = input;
    return work(OpType::_ALLGATHER_BASE, {out}, [this, out, in] { return gather_flat(out, in); });
  }

  // outputs[r][i] receives rank r's inputs[i] (one list per rank, as PyTorch passes them and Gloo
  // takes them).
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                              const c10d::AllgatherOptions&) override {
    DDPKIT_CHECK(!inputs.empty(), "ddpkit backend: allgather_coalesced has no input tensors");
    DDPKIT_CHECK(static_cast<int>(outputs.size()) == getSize(), "ddpkit backend: allgather_coalesced needs one output "
                 "list per rank (", getSize(), "), got ", outputs.size());
    for (size_t r = 0; r < outputs.size(); ++r)
      DDPKIT_CHECK(outputs[r].size() == inputs.size(), "ddpkit backend: allgather_coalesced: output list ", r, " has ",
                   outputs[r].size(), " tensors for ", inputs.size(), " inputs");
    std::vector<std::vector<at::Tensor>> by_input(inputs.size());  // by_input[i][r] = outputs[r][i]
    std::vector<at::Tensor> all;
    for (size_t i = 0; i < inputs.size(); ++i) {
      for (const auto& list : outputs) by_input[i].push_back(list[i]);
      check_list(by_input[i], cpu(inputs[i], "allgather_coalesced"), "allgather_coalesced");
    }
    for (const auto& list : outputs) all.insert(all.end(), list.begin(), list.end());
    std::vector<at::Tensor> ins = inputs;
    return work(OpType::ALLGATHER_COALESCED, all, [this, by_input, ins] {
      std::vector<FuturePtr> parts;
      for (size_t i = 0; i < ins.size(); ++i) parts.push_back(gather_list(by_input[i], ins[i]));
      return when_all(parts, at::Tensor());
    });
  }

#if DDPKIT_TORCH_AT_LEAST(2, 1)
  WorkPtr DDPKIT_C10D_ALL_GATHER_SINGLE_COALESCED(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllgatherOptions&) override {
    DDPKIT_CHECK(outputs.size() == inputs.size(), "ddpkit backend: allgather_into_tensor_coalesced has ",
                 outputs.size(), " outputs for ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); ++i)
      check_world_times(outputs[i], "output", inputs[i], "input", "all_gather_into_tensor");
    std::vector<at::Tensor> outs = outputs, ins = inputs;
    return work(OpType::COALESCED, outs, [this, outs, ins] {
      std::vector<FuturePtr> parts;
      for (size_t i = 0; i < ins.size(); ++i) parts.push_back(gather_flat(outs[i], ins[i]));
      return when_all(parts, at::Tensor());
    });
  }

  WorkPtr DDPKIT_C10D_REDUCE_SCATTER_SINGLE_COALESCED(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    DDPKIT_CHECK(outputs.size() == inputs.size(), "ddpkit backend: reduce_scatter_tensor_coalesced has ",
                 outputs.size(), " outputs for ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); ++i)
      check_world_times(inputs[i], "input", outputs[i], "output", "reduce_scatter_tensor");
    std::vector<at::Tensor> outs = outputs, ins = inputs;
    const ReduceOp op = opts.reduceOp;
    return work(OpType::COALESCED, outs, [this, outs, ins, op] {
      std::vector<FuturePtr> parts;
      for (size_t i = 0; i < ins.size(); ++i) parts.push_back(scatter_flat(outs[i], ins[i], op, "reduce_scatter_tensor"));
      return when_all(parts, at::Tensor());
    });
  }
#endif

  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts) override {
    const at::Tensor in = one(inputs, "gather");
    check_root(opts.rootRank, "gather");
    const bool root = getRank() == opts.rootRank;
    DDPKIT_CHECK(root ? outputs.size() == 1 : outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                 "ddpkit backend: gather takes one output list on the root (rank ", opts.rootRank, ") and none elsewhere");
    // An allgather whose result only the root keeps.
    std::vector<at::Tensor> into;
    if (root) {
      into = outputs[0];
    } else {
      for (int r = 0; r < getSize(); ++r) into.push_back(at::empty_like(in));
    }
    check_list(into, in, "gather");
    return work(OpType::GATHER, root ? outputs[0] : std::vector<at::Tensor>{},
                [this, into, in] { return gather_list(into, in); });
  }

  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts) override {
    const at::Tensor& out = one(outputs, "scatter");
    check_root(opts.rootRank, "scatter");
    const bool root = getRank() == opts.rootRank;
    // The root's pieces go out as one broadcast; each rank keeps its own.
    at::Tensor all;
    if (root) {
      DDPKIT_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(), "ddpkit backend: scatter ",
                   "takes ", getSize(), " inputs on the root");
      std::vector<at::Tensor> flat;
      for (const auto& t : inputs[0]) {
        check_same(t, out, "scatter");
        flat.push_back(t.reshape({-1}));
      }
      all = at::cat(flat);
    } else {
      all = at::empty({out.numel() * getSize()}, out.options());
    }
    const int64_t n = out.numel(), rank = getRank();
    const int root_rank = static_cast<int>(opts.rootRank);
    at::Tensor target = out;
    return work(OpType::SCATTER, {out}, [this, all, target, n, rank, root_rank] {
      return then(pg_->broadcast(as_bytes(all), root_rank), [all, target, n, rank] {
        at::Tensor t = target;
        t.copy_(all.narrow(0, rank * n, n).view(t.sizes()));
      });
    });
  }

  WorkPtr reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                         const c10d::ReduceScatterOptions& opts) override {
    const at::Tensor& out = one(outputs, "reduce_scatter");
    DDPKIT_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                 "ddpkit backend: reduce_scatter takes a list of ", getSize(), " inputs (one per rank)");
    std::vector<at::Tensor> flat;
    for (const auto& t : inputs[0]) {
      check_same(t, out, "reduce_scatter");
      flat.push_back(t.reshape({-1}));
    }
    at::Tensor in = at::cat(flat), target = out;
    const ReduceOp op = opts.reduceOp;
    return work(OpType::REDUCE_SCATTER, {out}, [this, target, in, op] { return scatter_flat(target, in, op, "reduce_scatter"); });
  }

  WorkPtr DDPKIT_C10D_REDUCE_SCATTER_SINGLE(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    check_world_times(input, "input", output, "output", "reduce_scatter_tensor");
    const at::Tensor out = output, in = input;
    const ReduceOp op = opts.reduceOp;
    return work(OpType::_REDUCE_SCATTER_BASE, {out},
                [this, out, in, op] {
      return scatter_flat(out, in, op, "reduce_scatter_tensor");
    });
  }

  WorkPtr DDPKIT_C10D_ALL_TO_ALL_SINGLE(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits, const c10d::AllToAllOptions&) override {
    check_alltoall(output, input, output_splits, input_splits);
    const at::Tensor out = output, in = input;
    std::vector<int64_t> os = output_splits, is = input_splits;
    return work(OpType::ALLTOALL_BASE, {out}, [this, out, in, os, is] { return alltoall_flat(out, in, os, is); });
  }

  WorkPtr alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                   const c10d::AllToAllOptions&) override {
    DDPKIT_CHECK(static_cast<int>(outputs.size()) == getSize() && static_cast<int>(inputs.size()) == getSize(),
                 "ddpkit backend: all_to_all takes ", getSize(), " inputs and outputs, got ", inputs.size(), " and ",
                 outputs.size());
    std::vector<at::Tensor> flat_in;
    std::vector<int64_t> in_splits, out_splits;
    for (auto& t : inputs) {
      cpu(t, "all_to_all");
      flat_in.push_back(t.reshape({-1}));
      in_splits.push_back(t.numel());
    }
    int64_t total_out = 0;
    for (auto& t : outputs) {
      cpu(t, "all_to_all");
      DDPKIT_CHECK(t.scalar_type() == inputs[0].scalar_type(), "ddpkit backend: all_to_all: outputs and inputs must share a dtype");
      out_splits.push_back(t.numel());
      total_out += t.numel();
    }
    at::Tensor in = at::cat(flat_in);
    at::Tensor out = at::empty({total_out}, in.options());
    const bool even = std::all_of(in_splits.begin(), in_splits.end(), [&](int64_t s) { return s == in_splits[0]; }) &&
                      std::all_of(out_splits.begin(), out_splits.end(), [&](int64_t s) { return s == in_splits[0]; });
    std::vector<at::Tensor> outs = outputs;
    return work(OpType::ALLTOALL, outputs, [this, outs, out, in, even, out_splits, in_splits] {
      const std::vector<int64_t> none;
      FuturePtr moved = even ? alltoall_flat(out, in, none, none) : alltoall_flat(out, in, out_splits, in_splits);
      return then(moved, [outs, out, out_splits] {
        int64_t off = 0;
        for (size_t i = 0; i < outs.size(); ++i) {
          at::Tensor o = outs[i];
          o.copy_(out.narrow(0, off, out_splits[i]).view(o.sizes()));
          off += out_splits[i];
        }
      });
    });
  }

  WorkPtr barrier(const c10d::BarrierOptions&) override {
    return work(OpType::BARRIER, {}, [this] { return pg_->barrier(); });
  }
  // A group's own monitored_barrier (torch.distributed.monitored_barrier itself refuses every
  // backend not named gloo). Blocks, as Gloo's does. Not compared across ranks first: it is there
  // to find the rank that does not come.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    const std::chrono::milliseconds timeout = opts.timeout == c10d::kUnsetTimeout ? pg_->timeout() : opts.timeout;
    auto w = work(OpType::BARRIER, {},
                  [this, timeout, wait_all_ranks] { return pg_->monitored_barrier(timeout, wait_all_ranks); });
    w->wait();
  }

  // Point to point: Gloo's own (tags keep them apart from collectives).
  WorkPtr send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    check_open();
    one(tensors, "send");
    check_root(dst, "send");
    check_tag(tag, "send");
    return pg_->with_backend([&](compat::Backend& b) { return b.send(tensors, dst, tag); });
  }
  WorkPtr recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    check_open();
    one(tensors, "recv");
    check_root(src, "recv");
    check_tag(tag, "recv");
    return pg_->with_backend([&](compat::Backend& b) { return b.recv(tensors, src, tag); });
  }
  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    check_open();
    one(tensors, "recv");
    check_tag(tag, "recv");
    return pg_->with_backend([&](compat::Backend& b) { return b.recvAnysource(tensors, tag); });
  }
  // Tags from ddpkit::ProcessGroup::kFirstInternalTag up are the backend's own allgathers and alltoalls.
  static void check_tag(int tag, const char* op) {
    DDPKIT_CHECK(tag >= 0 && tag < ddpkit::ProcessGroup::kFirstInternalTag, "ddpkit backend: ", op, " tag ", tag,
                " is outside [0, ", ddpkit::ProcessGroup::kFirstInternalTag, "): larger tags are the backend's own");
  }

#if DDPKIT_TORCH_AT_LEAST(2, 0)
  // Coalescing: the collectives between start and end run as issued; end's work waits for them.
  void startCoalescing() override {
    std::lock_guard<std::mutex> lock(coalescing_mutex_);
    coalescing_ = true;
    coalesced_.clear();
  }
  WorkPtr endCoalescing() override {
    std::vector<FuturePtr> parts;
    {
      std::lock_guard<std::mutex> lock(coalescing_mutex_);
      coalescing_ = false;
      parts.swap(coalesced_);
    }
    auto result = c10::make_intrusive<FutureWork>(getRank(), OpType::COALESCED, std::vector<at::Tensor>{});
    complete_on_runner(when_all(parts, at::Tensor()), result, runner_);
    return result;
  }
#endif

#if DDPKIT_C10D_BACKEND_HAS_SPLIT
  // torch.distributed.split_group: the child is a ddpkit group of `ranks` (ranks of this group, in
  // the order that gives the child's ranks), made with this group's options over `store`, which
  // PyTorch prefixes per child. The store is cloned: the child's rendezvous blocks on it and must
  // not share the parent's connection (pytorch#196665).
  bool supportsSplitting() const override { return true; }
  // What split_group copies for each child (and may change: its timeout, group name).
  c10::intrusive_ptr<Options> getBackendOptions() override {
    check_open();
    return c10::make_intrusive<Options>("ddpkit", pg_->timeout());
  }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    check_open();
    const auto at = std::find(ranks.begin(), ranks.end(), getRank());
    if (at == ranks.end()) return nullptr;  // not in this split: no group here (NON_GROUP_MEMBER)
    for (int r : ranks) check_root(r, "split_group");
    const auto& o = pg_->options();
    const std::chrono::milliseconds timeout = opts ? opts->timeout : pg_->timeout();
    return c10::make_intrusive<DdpkitBackend>(store->clone(), static_cast<int>(at - ranks.begin()),
                                              static_cast<int>(ranks.size()), timeout, o.gloo_threads(),
                                              o.shared_memory());
  }
#endif

 private:
  static at::Tensor as_bytes(const at::Tensor& contiguous) { return contiguous.reshape({-1}).view(at::kByte); }

  // ---- argument checks ----
  void check_open() const {
    DDPKIT_CHECK(!closed_.load(), "ddpkit backend: this process group was shut down or aborted "
                 "(destroy_process_group, abort); make a new group");
  }
  const at::Tensor& cpu(const at::Tensor& t, const char* op) const {
    DDPKIT_CHECK(t.defined(), "ddpkit backend: ", op, " got an undefined tensor");
    DDPKIT_CHECK(t.device().is_cpu(), "ddpkit backend: ", op, " got a tensor on ", t.device(),
                 "; this backend serves CPU tensors (use nccl for CUDA, or a device_id of cpu)");
    DDPKIT_CHECK(t.layout() == c10::kStrided, "ddpkit backend: ", op, " takes dense tensors, got ", t.layout());
    return t;
  }
  const at::Tensor& one(const std::vector<at::Tensor>& tensors, const char* op) const {
    DDPKIT_CHECK(tensors.size() == 1, "ddpkit backend: ", op, " takes one tensor per rank, got ", tensors.size());
    return cpu(tensors[0], op);
  }
  void check_root(int64_t root, const char* op) const {
    DDPKIT_CHECK(root >= 0 && root < getSize(), "ddpkit backend: ", op, ": rank ", root, " is outside this group (size ",
                 getSize(), ")");
  }
  void check_same(const at::Tensor& t, const at::Tensor& like, const char* op) const {
    cpu(t, op);
    DDPKIT_CHECK(t.numel() == like.numel() && t.scalar_type() == like.scalar_type(), "ddpkit backend: ", op,
                 ": every tensor in the list must have ", like.numel(), " elements of ", like.scalar_type(), ", got ",
                 t.numel(), " of ", t.scalar_type());
  }

  // `whole` must hold world size x `part`'s elements, of its dtype.
  void check_world_times(const at::Tensor& whole, const char* whole_name, const at::Tensor& part, const char* part_name,
                         const char* op) const {
    cpu(whole, op);
    cpu(part, op);
    DDPKIT_CHECK(whole.numel() == part.numel() * getSize() && whole.scalar_type() == part.scalar_type(),
                 "ddpkit backend: ", op, ": the ", whole_name, " must hold world size (", getSize(), ") x the ",
                 part_name, "'s ", part.numel(), " elements of ", part.scalar_type(), ", got ", whole.numel(), " of ",
                 whole.scalar_type());
  }

  // The work of the collective `start` issues, in the order IssueOrder keeps (backend_work.h).
  // Arguments are checked before, so that bad input is named at the call.
  WorkPtr work(OpType type, std::vector<at::Tensor> outputs, std::function<FuturePtr()> start) {
    check_open();
    ++sequence_;
    FuturePtr done;
    {
      std::lock_guard<std::mutex> lock(coalescing_mutex_);
      if (coalescing_) {
        done = make_tensor_future();
        coalesced_.push_back(done);
      }
    }
    return order_->issue(getRank(), type, std::move(outputs), std::move(start), done);
  }
  template <class Op>
  FuturePtr on_contiguous(const at::Tensor& t, Op&& op) {
    if (t.is_contiguous()) return op(t);
    at::Tensor c = t.contiguous(), target = t;
    return then(op(c), [c, target] {
      at::Tensor t2 = target;
      t2.copy_(c);
    });
  }

  // A reduction of t into itself on every rank, for every op and dtype torch.distributed names.
  // PREMUL_SUM (FSDP2 with set_gradient_divide_factor; Gloo refuses it): SUM of the inputs times
  // the factor. The factor, checked; `op` must be PREMUL_SUM.
  double premul_factor(const ReduceOp& op, const at::Tensor& t, const char* what) const {
    const compat::optional<double> f = compat::premul_sum_factor(op);
    DDPKIT_CHECK(f.has_value(), "ddpkit backend: ", what, " with PREMUL_SUM takes a number as its factor "
                 "(ReduceOp.PREMUL_SUM(x) / _make_nccl_premul_sum(x)), not a tensor");
    DDPKIT_CHECK(at::isFloatingType(t.scalar_type()), "ddpkit backend: ", what,
                 " with PREMUL_SUM needs a floating-point tensor, got ", t.scalar_type());
    return *f;
  }

  FuturePtr reduce_in_place(const at::Tensor& t, const ReduceOp& op, const char* what) {
    if (op == ReduceOp::PREMUL_SUM) {
      at::Tensor scaled = t;
      scaled.mul_(premul_factor(op, t, what));
      return reduce_in_place(t, ReduceOp::SUM, what);
    }
    DDPKIT_CHECK(is_sum(op) || op == ReduceOp::PRODUCT || op == ReduceOp::MIN || op == ReduceOp::MAX ||
                     op == ReduceOp::BAND || op == ReduceOp::BOR || op == ReduceOp::BXOR,
                 "ddpkit backend: ", what, " does not support ", op_name(op));
    const at::ScalarType dtype = t.scalar_type();
    const bool bitwise = op == ReduceOp::BAND || op == ReduceOp::BOR || op == ReduceOp::BXOR;
    DDPKIT_CHECK(!bitwise || !at::isFloatingType(dtype), "ddpkit backend: ", what, " with ", op_name(op),
                 " needs an integer or bool tensor, got ", dtype);
    DDPKIT_CHECK(op != ReduceOp::AVG || at::isFloatingType(dtype), "ddpkit backend: ", what,
                 " with AVG needs a floating-point tensor, got ", dtype);
    if (dtype == at::kBool) {
      // As uint8: any (SUM, MAX, BOR), all (MIN, PRODUCT, BAND), parity (BXOR).
      const ReduceOp as = op == ReduceOp::BXOR ? ReduceOp::BXOR
                          : (op == ReduceOp::MIN || op == ReduceOp::PRODUCT || op == ReduceOp::BAND) ? ReduceOp::MIN
                                                                                                     : ReduceOp::MAX;
      return via_copy(t, t.to(at::kByte).contiguous(), as);
    }
    // SUM/AVG of fp16/bf16 are ddpkit's own (summed in fp32). Other ops go to Gloo, which has no
    // bfloat16 before 2.x's and no fp16 MIN/MAX on every version: in fp32, exact for MIN/MAX, one
    // rounding for PRODUCT.
    if (!is_sum(op) && (dtype == at::kBFloat16 || dtype == at::kHalf))
      return via_copy(t, t.to(at::kFloat).contiguous(), op);
    return on_contiguous(t, [&](const at::Tensor& c) { return pg_->allreduce(c, op); });
  }
  FuturePtr via_copy(const at::Tensor& t, const at::Tensor& copy, const ReduceOp& op) {
    at::Tensor target = t;
    return then(pg_->allreduce(copy, op), [copy, target] {
      at::Tensor t2 = target;
      t2.copy_(copy);
    });
  }

  void check_list(const std::vector<at::Tensor>& outputs, const at::Tensor& input, const char* what) const {
    DDPKIT_CHECK(static_cast<int>(outputs.size()) == getSize(), "ddpkit backend: ", what, " takes ", getSize(),
                 " outputs (one per rank), got ", outputs.size());
    for (const auto& o : outputs) check_same(o, input, what);
  }
  // Outputs that are consecutive pieces of one buffer in rank order (FSDP gathers its flat
  // parameter on CPU into its chunks): that buffer, as one tensor.
  static at::Tensor consecutive_span(const std::vector<at::Tensor>& outputs) {
    const at::Tensor& first = outputs.front();
    const int64_t bytes = first.numel() * static_cast<int64_t>(first.element_size());
    for (size_t r = 0; r < outputs.size(); ++r) {
      const at::Tensor& o = outputs[r];
      if (!o.is_contiguous() || !o.storage().is_alias_of(first.storage()) ||
          static_cast<const char*>(o.data_ptr()) != static_cast<const char*>(first.data_ptr()) + r * bytes)
        return {};
    }
    return first.as_strided({first.numel() * static_cast<int64_t>(outputs.size())}, {1});
  }

  FuturePtr gather_list(const std::vector<at::Tensor>& outputs, const at::Tensor& input) {
    const bool contiguous = std::all_of(outputs.begin(), outputs.end(), [](const at::Tensor& o) { return o.is_contiguous(); });
    if (contiguous && input.numel() > 0) {
      // One flat gather: about twice as fast as a list's at FSDP's 8 MB chunks (6.4 -> 3.4 ms).
      const at::Tensor span = consecutive_span(outputs);
      if (span.defined()) return pg_->allgather_into_tensor(as_bytes(span), as_bytes(input.contiguous()));
    }
    if (contiguous) {
      std::vector<at::Tensor> bytes;
      for (const auto& o : outputs) bytes.push_back(as_bytes(o));
      return pg_->allgather(bytes, as_bytes(input.contiguous()));
    }
    at::Tensor flat = at::empty({input.numel() * getSize()}, input.options());
    const int64_t n = input.numel();
    return then(pg_->allgather_into_tensor(as_bytes(flat), as_bytes(input.contiguous())), [outputs, flat, n] {
      for (size_t r = 0; r < outputs.size(); ++r) {
        at::Tensor o = outputs[r];
        o.copy_(flat.narrow(0, static_cast<int64_t>(r) * n, n).view(o.sizes()));
      }
    });
  }

  FuturePtr gather_flat(const at::Tensor& output, const at::Tensor& input) {
    at::Tensor in = input.contiguous();
    return on_contiguous(output, [&](const at::Tensor& o) { return pg_->allgather_into_tensor(as_bytes(o), as_bytes(in)); });
  }

  // output = chunk rank() of the reduction of every rank's input.
  FuturePtr scatter_flat(const at::Tensor& output, const at::Tensor& input, const ReduceOp& op, const char* what) {
    if (op == ReduceOp::PREMUL_SUM)
      return scatter_flat(output, input * premul_factor(op, input, what), ReduceOp::SUM, what);
    const at::ScalarType dtype = input.scalar_type();
    const int64_t n = output.numel(), rank = getRank();
    at::Tensor target = output;
    if (is_sum(op) && dtype != at::kBool && (op == ReduceOp::SUM || at::isFloatingType(dtype))) {
      const double scale = op == ReduceOp::AVG ? 1.0 / getSize() : 1.0;
      at::Tensor in = input.contiguous().view({-1});
      return on_contiguous(output, [&](const at::Tensor& o) {
        at::Tensor flat = o.view({-1});
        FuturePtr f = pg_->reduce_scatter(flat, in);
        if (scale == 1.0) return f;
        return then(f, [flat, scale] { flat.mul_(scale); });
      });
    }
    // Other ops: a reduction of the whole input, of which this rank keeps its chunk.
    at::Tensor whole = input.reshape({-1}).clone();
    return then(reduce_in_place(whole, op, what), [whole, target, n, rank] {
      at::Tensor t = target;
      t.copy_(whole.narrow(0, rank * n, n).view(t.sizes()));
    });
  }

  void check_alltoall(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_splits,
                      const std::vector<int64_t>& input_splits) const {
    cpu(output, "all_to_all_single");
    cpu(input, "all_to_all_single");
    DDPKIT_CHECK(output.scalar_type() == input.scalar_type(), "ddpkit backend: all_to_all_single: output is ",
                 output.scalar_type(), ", input ", input.scalar_type());
    if (output_splits.empty() && input_splits.empty()) {
      DDPKIT_CHECK(input.dim() > 0 && input.size(0) % getSize() == 0, "ddpkit backend: all_to_all_single: dim 0 of ",
                   "the input (", input.dim() ? input.size(0) : 0, ") must divide by the world size (", getSize(), ")");
    } else {
      DDPKIT_CHECK(output.is_contiguous(), "ddpkit backend: all_to_all_single with splits needs a contiguous output");
    }
  }
  FuturePtr alltoall_flat(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_splits,
                          const std::vector<int64_t>& input_splits) {
    if (output_splits.empty() && input_splits.empty()) {
      at::Tensor in = input.contiguous();
      // As bytes, rows of dim 0 kept whole.
      const int64_t rows = input.size(0);
      return on_contiguous(output, [&](const at::Tensor& o) {
        return pg_->alltoall(o.reshape({rows, -1}).view(at::kByte), in.reshape({rows, -1}).view(at::kByte));
      });
    }
    // Uneven splits: Gloo's, ordered with the other collectives, moving bytes (Gloo has no
    // bfloat16 or bool). Splits count rows of dim 0.
    const int64_t elt = static_cast<int64_t>(c10::elementSize(input.scalar_type()));
    const int64_t in_row = input.dim() && input.size(0) ? input.numel() / input.size(0) * elt : elt;
    const int64_t out_row = output.dim() && output.size(0) ? output.numel() / output.size(0) * elt : elt;
    at::Tensor out = output.reshape({-1}).view(at::kByte), in = input.contiguous().reshape({-1}).view(at::kByte);
    std::vector<int64_t> os, is;
    for (int64_t v : output_splits) os.push_back(v * out_row);
    for (int64_t v : input_splits) is.push_back(v * in_row);
    ddpkit::ProcessGroup* pg = pg_.get();
    const std::chrono::milliseconds timeout = pg_->timeout();
    const std::string what = "all_to_all with splits (" + std::string(c10::toString(input.scalar_type())) + ")";
    at::Tensor result = output;
    return pg_->run_ordered([pg, out, in, os, is, timeout, what, result]() mutable {
      c10d::AllToAllOptions o;
      o.timeout = timeout;
      try {
        pg->with_backend([&](compat::Backend& b) { return b.alltoall_base(out, in, os, is, o); })->wait();
      } catch (const std::exception& e) {
        throw std::runtime_error(what + ": " + e.what());
      }
      return result;
    });
  }

  // Once: queued collectives end (each within the timeout), then the group goes. A collective
  // issued afterwards fails in work() naming the shutdown.
  void close() {
    {
      std::lock_guard<std::mutex> lock(close_mutex_);
      if (closed_.exchange(true)) return;  // closed, or aborted (whose thread tears down)
    }
    without_gil([this] { tear_down(); });  // the destructor runs where Python drops the group
  }
  void tear_down() {
    std::lock_guard<std::mutex> lock(close_mutex_);
    if (!pg_) return;
    order_->drain(pg_->timeout() * 2);
    runner_->stop();
    pg_.reset();
  }

#if DDPKIT_TORCH_AT_LEAST(2, 7)
  // Aborted groups being torn down. Never destroyed: joining them in static destruction at exit
  // aborted the process (std::terminate, after torchft's tests had passed). At Python's exit they
  // get kExitWait (at_python_exit); one still running then ends with the process.
  struct AbortTeardowns {
    static constexpr std::chrono::seconds kExitWait{10};
    ft::DetachedThreads threads;
    std::mutex exit_mutex;
    bool python_exiting = false;  // set by at_python_exit, under exit_mutex
  };
  static AbortTeardowns& abort_teardowns() {
    static auto* teardowns = new AbortTeardowns;
    return *teardowns;
  }

  static constexpr bool kAbortable = true;  // Backend::abort() exists from 2.7
#else
  static constexpr bool kAbortable = false;
#endif
  std::mutex close_mutex_;
  std::atomic<bool> closed_{false};
  std::shared_ptr<ddpkit::ProcessGroup> pg_;
  std::shared_ptr<CallbackRunner> runner_ = CallbackRunner::make();
  std::shared_ptr<IssueOrder> order_ = std::make_shared<IssueOrder>(runner_);
  std::mutex coalescing_mutex_;
  bool coalescing_ = false;
  std::vector<FuturePtr> coalesced_;
  std::atomic<uint64_t> sequence_{0};
};

}  // namespace

c10::intrusive_ptr<c10d::Work> issue_on_backend(
    const py::handle& backend, c10d::OpType type, std::vector<at::Tensor> outputs,
    std::function<FuturePtr(const std::shared_ptr<ddpkit::ProcessGroup>&)> start) {
  DDPKIT_CHECK(py::isinstance<DdpkitBackend>(backend), "expected a process group of the ddpkit backend, got one of ",
               std::string(py::str(py::type::of(backend).attr("__name__"))));
  DdpkitBackend& b = backend.cast<DdpkitBackend&>();
  py::gil_scoped_release no_gil;
  return b.issue(type, std::move(outputs), std::move(start));
}

void bind_backend(py::module& m) {
#if DDPKIT_TORCH_AT_LEAST(2, 0)
  const char* base = "Backend";
#else
  const char* base = "ProcessGroup";
#endif
  py::object torch_base = py::module::import("torch._C._distributed_c10d").attr(base);
  py::class_<DdpkitBackend, c10::intrusive_ptr<DdpkitBackend>>(m, "Backend", torch_base,
                                                              "ddpkit's collectives as a torch.distributed backend")
      // The ddpkit ProcessGroup it runs on, for ddpkit's hooks on a model of this group.
      .def("_ddpkit_group", &DdpkitBackend::group);
  m.def(
      "_make_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeout_s, int gloo_threads,
         bool shared_memory) {
        DDPKIT_CHECK(timeout_s > 0, "ddpkit backend: the timeout must be positive, got ", timeout_s, " s");
        const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
        return c10::make_intrusive<DdpkitBackend>(store, rank, size, timeout, gloo_threads, shared_memory);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"), py::arg("gloo_threads"),
      py::arg("shared_memory"), py::call_guard<py::gil_scoped_release>());
#if DDPKIT_TORCH_AT_LEAST(2, 7)
  // torchft aborts a group on every quorum change; see DdpkitBackend::abort.
  py::module::import("atexit").attr("register")(py::cpp_function(&DdpkitBackend::at_python_exit));
#endif
}

}  // namespace python
}  // namespace ddpkit
