// ddpkit as a torch.distributed backend: `import ddpkit` registers "ddpkit", and
// torch.distributed.init_process_group("ddpkit") then runs every collective on CPU tensors through
// a ddpkit::ProcessGroup (shared memory within a host, Gloo between hosts). docs/python.md.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace ddpkit {
namespace python {

// Adds ddpkit._C.Backend (a subclass of torch's ProcessGroup in 1.13, of its Backend in 2.x) and
// ddpkit._C._make_backend(store, rank, size, timeout_s, gloo_threads, shared_memory).
void bind_backend(pybind11::module& m);

}  // namespace python
}  // namespace ddpkit
