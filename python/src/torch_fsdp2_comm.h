// ddpkit's FSDP communication hooks (hooks/fsdp_hooks.h) as the collectives of PyTorch's FSDP2:
// ddpkit.fsdp2 hands them to fully_shard's set_custom_reduce_scatter and set_all_reduce_hook. Each
// runs on the ddpkit::ProcessGroup of a torch.distributed group of the ddpkit backend, issued as that
// group's work (backend.h), so it keeps its place among the group's other collectives.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace ddpkit {
namespace python {

// Adds ddpkit._C._fsdp_reduce_scatter(backend, output, input, op, codec) and
// ddpkit._C._fsdp_all_reduce(backend, tensor, codec), each returning a torch.distributed Work.
void bind_fsdp2_comm(pybind11::module& m);

}  // namespace python
}  // namespace ddpkit
