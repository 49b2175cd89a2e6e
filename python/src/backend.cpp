// ddpkit as a torch.distributed backend. Every collective maps onto one ddpkit::ProcessGroup call
// (issued in program order on its sequencer, bounded by the group's timeout; backend_collectives.h),
// so ranks on one host exchange through shared memory and hosts through Gloo, hierarchically for
// allreduce. What ddpkit's group does not do itself (reductions other than SUM/AVG, uneven
// all-to-all, send/recv) runs on its Gloo backend, the first two on the sequencer so the order
// still holds. From torch 2.14 a group made with enable_reconfigure=True changes members in place
// (c10d's reconfigure API, backend_reconfigure.h) and runs abort hooks.
#include "backend.h"
#include "backend_collectives.h"
#include "backend_reconfigure.h"
#include "backend_work.h"
#include "ft/detached.h"  // src/: the library's own helper for teardown off the caller's path

#include <ddpkit/comm/process_group.h>
#include <ddpkit/compat.h>
#include <ddpkit/error.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_set>
#include <variant>

namespace py = pybind11;

namespace ddpkit {
namespace python {
namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using c10d::OpType;
using c10d::ReduceOp;

using GroupPtr = std::shared_ptr<ddpkit::ProcessGroup>;

// One membership's communicator: its group, and the runner and issue order of its work. A
// reconfigure replaces it whole; the old one's work fails (its group aborted) and it is torn down
// off the caller's path, while a collective issued to it runs on it and nowhere else.
struct Communicator {
  GroupPtr pg;
  std::shared_ptr<CallbackRunner> runner = CallbackRunner::make();
  std::shared_ptr<IssueOrder> order = std::make_shared<IssueOrder>(runner);
};
using CommunicatorPtr = std::shared_ptr<Communicator>;

// Drops `pg` where it may be the group's last owner: on a thread of its own then, as the thread
// this runs on may be one of the group's, which the group's destruction joins (EDEADLK).
void let_go(GroupPtr pg) {
  if (pg.use_count() == 1) std::thread([last = std::move(pg)] {}).detach();
}

// Queued collectives end (each within the timeout), then the group goes, here: a collective being
// started holds it for that moment (work()), so that one is let go of first.
void tear_down(Communicator& c) {
  c.order->drain(c.pg->timeout() * 2);
  c.runner->stop();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (c.pg.use_count() > 1 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  c.pg.reset();
}

class DdpkitBackend : public compat::Backend {
 public:
  // `reconfigurable` (enable_reconfigure=True): no group until the first reconfigure(), whose
  // handles name the members; `store`, `rank` and `size` are then only the group's starting ones.
  DdpkitBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
                int gloo_threads, bool shared_memory, bool reconfigurable)
      : compat::Backend(rank, size),
        options_(ProcessGroupOptions()
                     .timeout(timeout)
                     .gloo_threads(gloo_threads)
                     .shared_memory(shared_memory)
                     .abortable(kAbortable)
                     .group_name("ddpkit")) {
    if (reconfigurable) {
      endpoint_ = std::make_unique<ReconfigureEndpoint>(timeout);
    } else {
      comm_ = std::make_shared<Communicator>();
      comm_->pg = std::make_shared<ddpkit::ProcessGroup>(store, rank, size, options_);
    }
  }

  ~DdpkitBackend() override { close(); }

#if DDPKIT_TORCH_AT_LEAST(2, 7)
  // torch.distributed.destroy_process_group: the collectives issued so far end (each within the
  // timeout), then the group's sockets, threads and shared memory go, before the Python object does.
  void shutdown() override { close(); }
  // ProcessGroup.abort() (and torchft-style callers on a lost peer): the collectives in flight fail
  // now with an error naming the abort, and it returns at once; the group is torn down on a thread
  // of its own (its transport's aborted work ends only by its timeout), so a caller that aborts to
  // reconfigure (torchft, on every quorum) does not wait. A reconfigurable group stays
  // reconfigurable: it has no members until the next reconfigure().
  void abort() override {
    CommunicatorPtr aborted;
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      if (closed_ || !comm_) return;
      aborted = std::move(comm_);
      if (!endpoint_) closed_ = true;  // collectives issued from now fail in current(), naming the abort
    }
    retire(std::move(aborted), "the torch.distributed group was aborted");
  }

  // Registered with Python's atexit, which runs before the interpreter finalizes: teardowns still
  // running get kExitWait to end (with the GIL released: their last step may take it); from then
  // on a teardown that ends leaves its communicator to the process's end.
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
  // The ddpkit group of the current membership.
  GroupPtr group() const { return current()->pg; }
  // A collective of ddpkit's own (its FSDP hooks, torch_fsdp2_comm.cpp) as this group's work, in
  // the order every collective of the group keeps.
  WorkPtr issue(OpType type, std::vector<at::Tensor> outputs, std::function<FuturePtr(const GroupPtr&)> start) {
    return work(type, std::move(outputs), std::move(start));
  }

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    const at::Tensor t = one(tensors, "broadcast");
    check_root(opts.rootRank, "broadcast");
    const int root = static_cast<int>(opts.rootRank);
    // As bytes: Gloo moves no bfloat16 or bool.
    return work(OpType::BROADCAST, {t}, [t, root](const GroupPtr& pg) { return broadcast_any(*pg, t, root); });
  }

  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) return sparse_allreduce(tensors[0], opts);
    const at::Tensor t = one(tensors, "allreduce");
    const ReduceOp op = opts.reduceOp;
    return work(OpType::ALLREDUCE, {t}, [t, op](const GroupPtr& pg) { return reduce_in_place(*pg, t, op, "allreduce"); });
  }

  // Sparse COO on the CPU, summed as Gloo sums it (its own sparse allreduce; SUM only, as there).
  WorkPtr sparse_allreduce(const at::Tensor& t, const c10d::AllreduceOptions& opts) {
    DDPKIT_CHECK(t.device().is_cpu(), "ddpkit backend: allreduce got a sparse tensor on ", t.device(),
                 "; this backend serves CPU tensors");
    DDPKIT_CHECK(opts.reduceOp == ReduceOp::SUM, "ddpkit backend: a sparse allreduce supports SUM only, got ",
                 op_name(opts.reduceOp));
    return work(OpType::ALLREDUCE, {t}, [t](const GroupPtr& pg) { return pg->allreduce(t); });
  }

  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    for (const auto& t : tensors) cpu(t, "allreduce_coalesced");
    const ReduceOp op = opts.reduceOp;
    return work(OpType::ALLREDUCE_COALESCED, tensors, [tensors, op](const GroupPtr& pg) {
      std::vector<FuturePtr> parts;
      for (const auto& t : tensors) parts.push_back(reduce_in_place(*pg, t, op, "allreduce_coalesced"));
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
                [target, op](const GroupPtr& pg) { return reduce_in_place(*pg, target, op, "reduce"); });
  }

  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const c10d::AllgatherOptions&) override {
    const at::Tensor in = one(inputs, "allgather");
    DDPKIT_CHECK(outputs.size() == 1, "ddpkit backend: allgather takes one output list, got ", outputs.size());
    check_list(outputs[0], in, "allgather");
    std::vector<at::Tensor> outs = outputs[0];
    return work(OpType::ALLGATHER, outs, [outs, in](const GroupPtr& pg) { return gather_list(*pg, outs, in); });
  }

  WorkPtr DDPKIT_C10D_ALL_GATHER_SINGLE(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions&) override {
    check_world_times(output, "output", input, "input", "all_gather_into_tensor");
    const at::Tensor out = output, in = input;
    return work(OpType::_ALLGATHER_BASE, {out}, [out, in](const GroupPtr& pg) { return gather_flat(*pg, out, in); });
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
    return work(OpType::ALLGATHER_COALESCED, all, [by_input, ins](const GroupPtr& pg) {
      std::vector<FuturePtr> parts;
      for (size_t i = 0; i < ins.size(); ++i) parts.push_back(gather_list(*pg, by_input[i], ins[i]));
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
    return work(OpType::COALESCED, outs, [outs, ins](const GroupPtr& pg) {
      std::vector<FuturePtr> parts;
      for (size_t i = 0; i < ins.size(); ++i) parts.push_back(gather_flat(*pg, outs[i], ins[i]));
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
    return work(OpType::COALESCED, outs, [outs, ins, op](const GroupPtr& pg) {
      std::vector<FuturePtr> parts;
      for (size_t i = 0; i < ins.size(); ++i)
        parts.push_back(scatter_flat(*pg, outs[i], ins[i], op, "reduce_scatter_tensor"));
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
                [into, in](const GroupPtr& pg) { return gather_list(*pg, into, in); });
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
    return work(OpType::SCATTER, {out}, [all, target, n, rank, root_rank](const GroupPtr& pg) {
      return then(pg->broadcast(as_bytes(all), root_rank), [all, target, n, rank] {
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
    return work(OpType::REDUCE_SCATTER, {out},
                [target, in, op](const GroupPtr& pg) { return scatter_flat(*pg, target, in, op, "reduce_scatter"); });
  }

  WorkPtr DDPKIT_C10D_REDUCE_SCATTER_SINGLE(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    check_world_times(input, "input", output, "output", "reduce_scatter_tensor");
    const at::Tensor out = output, in = input;
    const ReduceOp op = opts.reduceOp;
    return work(OpType::_REDUCE_SCATTER_BASE, {out},
                [out, in, op](const GroupPtr& pg) { return scatter_flat(*pg, out, in, op, "reduce_scatter_tensor"); });
  }

  WorkPtr DDPKIT_C10D_ALL_TO_ALL_SINGLE(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits, const c10d::AllToAllOptions&) override {
    check_alltoall(output, input, output_splits, input_splits);
    const at::Tensor out = output, in = input;
    std::vector<int64_t> os = output_splits, is = input_splits;
    return work(OpType::ALLTOALL_BASE, {out},
                [out, in, os, is](const GroupPtr& pg) { return alltoall_flat(*pg, out, in, os, is); });
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
    return work(OpType::ALLTOALL, outputs, [outs, out, in, even, out_splits, in_splits](const GroupPtr& pg) {
      const std::vector<int64_t> none;
      FuturePtr moved = even ? alltoall_flat(*pg, out, in, none, none) : alltoall_flat(*pg, out, in, out_splits, in_splits);
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
    return work(OpType::BARRIER, {}, [](const GroupPtr& pg) { return pg->barrier(); });
  }
  // A group's own monitored_barrier (torch.distributed.monitored_barrier itself refuses every
  // backend not named gloo). Blocks, as Gloo's does. Not compared across ranks first: it is there
  // to find the rank that does not come.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    const std::chrono::milliseconds timeout = opts.timeout == c10d::kUnsetTimeout ? group()->timeout() : opts.timeout;
    auto w = work(OpType::BARRIER, {}, [timeout, wait_all_ranks](const GroupPtr& pg) {
      return pg->monitored_barrier(timeout, wait_all_ranks);
    });
    w->wait();
  }

  // Point to point: Gloo's own (tags keep them apart from collectives).
  WorkPtr send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    one(tensors, "send");
    check_root(dst, "send");
    check_tag(tag, "send");
    return group()->with_backend([&](compat::Backend& b) { return b.send(tensors, dst, tag); });
  }
  WorkPtr recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    one(tensors, "recv");
    check_root(src, "recv");
    check_tag(tag, "recv");
    return group()->with_backend([&](compat::Backend& b) { return b.recv(tensors, src, tag); });
  }
  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    one(tensors, "recv");
    check_tag(tag, "recv");
    return group()->with_backend([&](compat::Backend& b) { return b.recvAnysource(tensors, tag); });
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
    complete_on_runner(when_all(parts, at::Tensor()), result, current()->runner);
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
    return c10::make_intrusive<Options>("ddpkit", group()->timeout());
  }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    const GroupPtr pg = group();
    const auto at = std::find(ranks.begin(), ranks.end(), getRank());
    if (at == ranks.end()) return nullptr;  // not in this split: no group here (NON_GROUP_MEMBER)
    for (int r : ranks) check_root(r, "split_group");
    const auto& o = pg->options();
    const std::chrono::milliseconds timeout = opts ? opts->timeout : pg->timeout();
    return c10::make_intrusive<DdpkitBackend>(store->clone(), static_cast<int>(at - ranks.begin()),
                                              static_cast<int>(ranks.size()), timeout, o.gloo_threads(),
                                              o.shared_memory(), /*reconfigurable=*/false);
  }
#endif

#ifdef C10D_BACKEND_HAS_RECONFIGURE
  // c10d's fault-tolerance API (torch >= 2.14; torchft's Manager takes such a group). The handle
  // names this rank's endpoint (backend_reconfigure.h); reconfigure() fails the current members'
  // work, tears their group down off this path, and builds the group of the members `opts`
  // names, this rank at its handle's place (an unordered set: in sorted order), within the
  // options' timeout (else the group's). Collectives after it run on the new members.
  bool supportsReconfigure() const override { return endpoint_ != nullptr; }
  c10d::ReconfigureHandle get_reconfigure_handle() const override {
    check_reconfigurable("get_reconfigure_handle");
    return endpoint_->handle();
  }
  WorkPtr reconfigure(const c10d::ReconfigureOptions& opts) override {
    check_reconfigurable("reconfigure");
    std::vector<std::string> handles;
    if (const auto* ordered = std::get_if<std::vector<c10d::ReconfigureHandle>>(&opts.handles)) {
      handles = *ordered;
    } else {
      const auto& set = std::get<std::unordered_set<c10d::ReconfigureHandle>>(opts.handles);
      handles.assign(set.begin(), set.end());
      std::sort(handles.begin(), handles.end());  // every member derives the same order
    }
    const Membership members = endpoint_->place(handles);
    CommunicatorPtr old;
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      DDPKIT_CHECK(!closed_, "ddpkit backend: reconfigure on a group that was shut down (destroy_process_group)");
      DDPKIT_CHECK(opts.uuid != last_uuid_, "ddpkit backend: reconfigure: uuid ", opts.uuid,
                   " was this group's last one; pass a new uuid for every reconfigure");
      last_uuid_ = opts.uuid;
      old = std::move(comm_);
    }
    if (old) retire(std::move(old), "the group was reconfigured (uuid " + std::to_string(opts.uuid) + ")");
    ProcessGroupOptions o = options_;
    if (opts.timeout) o.timeout(*opts.timeout);
    auto next = std::make_shared<Communicator>();
    without_gil([&] { next->pg = endpoint_->connect(members, opts.uuid, o); });
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      if (!closed_) {
        rank_ = members.rank;
        size_ = members.size;
        sequence_ = 0;
        comm_ = next;
        next.reset();
      }
    }
    if (next) {  // shut down while it connected
      without_gil([&next] { tear_down(*next); });
      DDPKIT_CHECK(false, "ddpkit backend: the group was shut down during reconfigure");
    }
    auto done = c10::make_intrusive<FutureWork>(getRank(), OpType::UNKNOWN, std::vector<at::Tensor>{});
    done->complete(nullptr);
    return done;
  }
#endif

#ifdef C10D_BACKEND_HAS_HOOKS
  // Abort hooks run when one of the group's collectives fails (a timeout, a lost peer), on its
  // callback runner, as the group gives up on it: where NCCL's watchdog would abort. A caller's
  // own abort() or a reconfigure is no failure and runs none (torch registers its flight
  // recorder's dump as one).
  bool supportsAbortHooks() const override { return true; }
  void registerAbortHook(int64_t hook_id, c10d::AbortHook hook) override {
    DDPKIT_CHECK(hook, "ddpkit backend: register_abort_hook got no callable (hook ", hook_id, ")");
    std::lock_guard<std::mutex> lock(hooks_->mutex);
    DDPKIT_CHECK(hooks_->by_id.emplace(hook_id, std::move(hook)).second, "ddpkit backend: abort hook ", hook_id,
                 " is registered already; unregister it first");
    hooks_->count = static_cast<int>(hooks_->by_id.size());
  }
  void unregisterAbortHook(int64_t hook_id) override {
    std::lock_guard<std::mutex> lock(hooks_->mutex);
    DDPKIT_CHECK(hooks_->by_id.erase(hook_id) == 1, "ddpkit backend: no abort hook ", hook_id, " is registered");
    hooks_->count = static_cast<int>(hooks_->by_id.size());
  }
#endif

 private:
  // Abort hooks by id, shared with the callbacks that run them (which may outlive a call).
  struct AbortHooks {
    std::mutex mutex;
    std::map<int64_t, std::function<void()>> by_id;
    std::atomic<int> count{0};  // by_id.size(), read without the lock on every collective
    // Each hook once per event; a hook's error is reported, not thrown into the failing path.
    void run(const char* event) {
      std::vector<std::function<void()>> hooks;
      {
        std::lock_guard<std::mutex> lock(mutex);
        for (const auto& kv : by_id) hooks.push_back(kv.second);
      }
      for (const auto& hook : hooks) {
        try {
          hook();
        } catch (const std::exception& e) {
          std::fprintf(stderr, "ddpkit backend: an abort hook (%s) failed: %s\n", event, e.what());
        }
      }
    }
  };
  std::shared_ptr<AbortHooks> hooks_ = std::make_shared<AbortHooks>();
  void check_reconfigurable(const char* call) const {
    DDPKIT_CHECK(endpoint_, "ddpkit backend: ", call, " needs a group made with enable_reconfigure=True "
                 "(init_process_group(\"ddpkit\", ..., enable_reconfigure=True))");
  }

  // The current membership's communicator; names why there is none.
  CommunicatorPtr current() const {
    std::lock_guard<std::mutex> lock(state_mutex_);
    DDPKIT_CHECK(!closed_, "ddpkit backend: this process group was shut down or aborted "
                 "(destroy_process_group, abort); make a new group");
    DDPKIT_CHECK(comm_, "ddpkit backend: this process group (enable_reconfigure=True) has no members ",
                 last_uuid_ < 0 ? "yet" : "since it was aborted", ": call reconfigure() before issuing collectives");
    return comm_;
  }

  // ---- argument checks ----
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

  void check_list(const std::vector<at::Tensor>& outputs, const at::Tensor& input, const char* what) const {
    DDPKIT_CHECK(static_cast<int>(outputs.size()) == getSize(), "ddpkit backend: ", what, " takes ", getSize(),
                 " outputs (one per rank), got ", outputs.size());
    for (const auto& o : outputs) check_same(o, input, what);
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

  // The work of the collective `start` issues on the current membership's group, in the order
  // IssueOrder keeps (backend_work.h). Arguments are checked before, so that bad input is named at
  // the call.
  WorkPtr work(OpType type, std::vector<at::Tensor> outputs, std::function<FuturePtr(const GroupPtr&)> start) {
    const CommunicatorPtr c = current();
    ++sequence_;
    FuturePtr done;
    {
      std::lock_guard<std::mutex> lock(coalescing_mutex_);
      if (coalescing_) {
        done = make_tensor_future();
        coalesced_.push_back(done);
      }
    }
    // Weak: the communicator owns its group until its teardown has drained this queue. A queued
    // collective holding the last reference would destroy the group on the group's own thread,
    // where it completes (which joins that thread: EDEADLK).
    std::weak_ptr<ddpkit::ProcessGroup> weak = c->pg;
    auto on_group = [weak, start = std::move(start)] {
      GroupPtr pg = weak.lock();
      DDPKIT_CHECK(pg, "ddpkit backend: the group this collective was issued to is gone (shut down)");
      FuturePtr issued = start(pg);
      let_go(std::move(pg));
      return issued;
    };
    if (hooks_->count.load() == 0) return c->order->issue(getRank(), type, std::move(outputs), std::move(on_group), done);
    // Abort hooks see a failed collective before its error reaches the caller's wait.
    std::shared_ptr<AbortHooks> hooks = hooks_;
    std::shared_ptr<CallbackRunner> runner = c->runner;
    return c->order->issue(getRank(), type, std::move(outputs), [on_group = std::move(on_group), hooks, runner] {
      FuturePtr f = on_group();
      f->addCallback([hooks, runner](c10::ivalue::Future& landed) {
        if (landed.hasError()) runner->post([hooks] { hooks->run("a collective failed"); }, runner);
      });
      return f;
    }, done);
  }

  // Once: queued collectives end (each within the timeout), then the group goes. A collective
  // issued afterwards fails in current() naming the shutdown.
  void close() {
    CommunicatorPtr c;
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      if (closed_) return;
      closed_ = true;
      c = std::move(comm_);
    }
    if (c) without_gil([&c] { tear_down(*c); });  // the destructor runs where Python drops the group
  }

#if DDPKIT_TORCH_AT_LEAST(2, 7)
  // Fails the work of `c` (no longer current) now, naming `reason`, and tears it down on a thread
  // of its own.
  static void retire(CommunicatorPtr c, const std::string& reason) {
    c->pg->abort(reason);
    AbortTeardowns& teardowns = abort_teardowns();
    teardowns.threads.start([c = std::move(c), &teardowns]() mutable {
      tear_down(*c);
      // Letting go of the queued work's tensors takes the GIL (torch >= 2.7 keeps their Python
      // objects alive while C++ holds them). Once Python finalizes, it ends any other thread that
      // asks for the GIL (pthread_exit), and unwinding through torch's noexcept release is
      // std::terminate: so after Python's exit began, the communicator is left to the process's end.
      std::lock_guard<std::mutex> lock(teardowns.exit_mutex);
      if (teardowns.python_exiting) {
        new CommunicatorPtr(std::move(c));  // deliberately never freed
      } else {
        c.reset();
      }
    });
  }

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
  const ProcessGroupOptions options_;               // of every group this backend makes
  std::unique_ptr<ReconfigureEndpoint> endpoint_;    // reconfigurable groups only
  mutable std::mutex state_mutex_;                   // guards the three below
  bool closed_ = false;
  CommunicatorPtr comm_;                             // null: aborted, or no reconfigure yet
  int64_t last_uuid_ = -1;
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
         bool shared_memory, bool reconfigurable) {
        DDPKIT_CHECK(timeout_s > 0, "ddpkit backend: the timeout must be positive, got ", timeout_s, " s");
        const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
#ifndef C10D_BACKEND_HAS_RECONFIGURE
        DDPKIT_CHECK(!reconfigurable, "ddpkit backend: enable_reconfigure needs torch >= 2.14 (c10d's reconfigure "
                     "API); this build's torch has none");
#endif
        return c10::make_intrusive<DdpkitBackend>(store, rank, size, timeout, gloo_threads, shared_memory,
                                                  reconfigurable);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"), py::arg("gloo_threads"),
      py::arg("shared_memory"), py::arg("reconfigurable") = false, py::call_guard<py::gil_scoped_release>());
#if DDPKIT_TORCH_AT_LEAST(2, 7)
  // torchft aborts a group on every quorum change; see DdpkitBackend::abort.
  py::module::import("atexit").attr("register")(py::cpp_function(&DdpkitBackend::at_python_exit));
#endif
}

}  // namespace python
}  // namespace ddpkit
