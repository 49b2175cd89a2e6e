// ddpkit as a torch.distributed backend: `import ddpkit` registers "ddpkit", and
// torch.distributed.init_process_group("ddpkit") then runs every collective on CPU tensors through
// a ddpkit::ProcessGroup (shared memory within a host, Gloo between hosts). docs/python.md.
#pragma once

#include <ddpkit/comm/process_group.h>

#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <functional>
#include <memory>
#include <vector>

namespace ddpkit {
namespace python {

// Adds ddpkit._C.Backend (a subclass of torch's ProcessGroup in 1.13, of its Backend in 2.x) and
// ddpkit._C._make_backend(store, rank, size, timeout_s, gloo_threads, shared_memory).
void bind_backend(pybind11::module& m);

// Issues `start` (a collective on the group's ddpkit::ProcessGroup, returning its future) as the
// work of `backend`, a ddpkit._C.Backend, in that group's issue order: a comm of ddpkit's own
// then interleaves with torch.distributed's calls on the same group as theirs do with each other.
c10::intrusive_ptr<c10d::Work> issue_on_backend(
    const pybind11::handle& backend, c10d::OpType type, std::vector<at::Tensor> outputs,
    std::function<FuturePtr(const std::shared_ptr<ProcessGroup>&)> start);

// Runs `teardown` (of a group) with the GIL released when this thread holds it. A teardown joins
// ddpkit's threads, and one may still be letting go of a collective's Python tensor, which takes
// the GIL (under torch 2.15 whenever C++ lets go of one): held here, that thread, and so the
// teardown, would wait for ever. Python drops objects on a thread holding the GIL (torchft drops
// each quorum's group so, its parameter server each session's).
inline void without_gil(const std::function<void()>& teardown) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    pybind11::gil_scoped_release no_gil;
    teardown();
  } else {
    teardown();
  }
}

}  // namespace python
}  // namespace ddpkit
