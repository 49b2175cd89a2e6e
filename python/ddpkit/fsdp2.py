"""ddpkit's FSDP communication hooks for PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard).

FSDP2 has no register_comm_hook; its extension points are set_custom_reduce_scatter (a
ReduceScatter: allocate and __call__) and set_all_reduce_hook. This module gives it ddpkit's hooks
(PyTorch's torch.distributed.algorithms._comm_hooks: the plain reduce-scatter and the fp16/bf16
compressed one, whose gradients cross in half the bytes) on the mesh's groups of the ddpkit
backend: shared memory within a host, Gloo between hosts.

    import ddpkit, ddpkit.fsdp2
    dist.init_process_group("ddpkit")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ddpkit.fsdp2.set_comm_hooks(model, "bf16")        # every FSDP module of the model

Or by hand: module.set_custom_reduce_scatter(ddpkit.fsdp2.ReduceScatter("bf16")). For HSDP across
hosts by hand (shard within a host, replicate across), ReplicateHook averages the reduce-scatter
output over a replica group: module.set_all_reduce_hook(ddpkit.fsdp2.ReplicateHook(group, "bf16")).
Needs torch >= 2.9 (set_custom_reduce_scatter); docs/integrations.md, "With FSDP2".
"""
import torch
import torch.distributed as dist

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except (ImportError, ValueError) as e:  # 1.13 on Python 3.11: its fsdp package fails to import (ValueError)
    raise ImportError(f"ddpkit.fsdp2 needs FSDP2's custom collectives (torch >= 2.9; this is torch "
                      f"{torch.__version__}): {e}") from None

from . import _C, _ddpkit_backend_of

__all__ = ["CODECS", "ReduceScatter", "ReplicateHook", "set_comm_hooks"]

# none: the plain hook, in FSDP2's reduce dtype; fp16/bf16: a copy in that precision crosses and the
# result is cast back (the sum itself accumulates in fp32).
CODECS = ("none", "fp16", "bf16")


def _check_codec(codec, caller):
    if codec not in CODECS:
        raise ValueError(f"{caller}: codec must be one of {', '.join(CODECS)}, got {codec!r}")
    return codec


def _backend_of(group, caller):
    """The ddpkit backend under a torch.distributed group, else an error naming the fix."""
    if group is None:
        raise ValueError(f"{caller}: no process group (FSDP2 passes its mesh's group)")
    backend = _ddpkit_backend_of(group)
    if backend is None:
        name = group.name() if hasattr(group, "name") else type(group).__name__
        raise ValueError(f"{caller}: group {name} is not of the ddpkit backend; make the mesh's groups ddpkit's "
                         "(torch.distributed.init_process_group('ddpkit') before init_device_mesh)")
    return backend


class ReduceScatter(_ReduceScatter):
    """FSDP2's gradient reduce-scatter through ddpkit's FSDP hook of `codec`. Honors the op FSDP2
    asks for (AVG, SUM when it divides itself, PREMUL_SUM for set_gradient_divide_factor); AVG is
    divided before and after the sum in two factors, as PyTorch's hooks do."""

    def __init__(self, codec="none"):
        self.codec = _check_codec(codec, "ddpkit.fsdp2.ReduceScatter")

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        backend = _backend_of(group, "ddpkit.fsdp2.ReduceScatter")
        if not isinstance(op, dist.ReduceOp):
            op = dist.ReduceOp(op)
        work = _C._fsdp_reduce_scatter(backend, output_tensor, input_tensor, op, self.codec)
        if async_op:
            return work
        work.wait()
        return None

    def __repr__(self):
        return f"ddpkit.fsdp2.ReduceScatter({self.codec!r})"


class ReplicateHook:
    """An all-reduce hook (FSDPModule.set_all_reduce_hook): averages the reduce-scatter output, in
    place, across `group`, a torch.distributed group of the ddpkit backend holding this rank's
    replicas (the ranks with the same shard), by ddpkit's hook of `codec`."""

    def __init__(self, group, codec="none"):
        self._backend = _backend_of(group, "ddpkit.fsdp2.ReplicateHook")
        self.group = group
        self.codec = _check_codec(codec, "ddpkit.fsdp2.ReplicateHook")

    def __call__(self, output):
        if self.group.size() > 1:
            _C._fsdp_all_reduce(self._backend, output, self.codec).wait()

    def __repr__(self):
        return f"ddpkit.fsdp2.ReplicateHook(size {self.group.size()}, {self.codec!r})"


def set_comm_hooks(module, codec="none", *, replicate_group=None):
    """Gives every FSDP module in `module` (fully_shard'ed, itself or below) ddpkit's reduce-scatter
    of `codec`, and with replicate_group (a ddpkit group of this rank's replicas) a ReplicateHook
    of the same codec. Returns the FSDP modules it set, outermost first."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"ddpkit.fsdp2.set_comm_hooks: expected a torch.nn.Module, got {type(module).__name__}")
    _check_codec(codec, "ddpkit.fsdp2.set_comm_hooks")
    targets = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not targets:
        raise ValueError("ddpkit.fsdp2.set_comm_hooks: no module in it is fully_shard'ed; call fully_shard first")
    reduce_scatter = ReduceScatter(codec)
    hook = ReplicateHook(replicate_group, codec) if replicate_group is not None else None
    for m in targets:
        m.set_custom_reduce_scatter(reduce_scatter)
        if hook is not None:
            m.set_all_reduce_hook(hook)
    return targets
