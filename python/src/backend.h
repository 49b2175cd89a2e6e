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

}  // namespace python
}  // namespace ddpkit
