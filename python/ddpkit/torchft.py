"""ddpkit as torchft's process group: torchft's replica groups exchange over ddpkit's collectives.

torchft (pytorch/torchft) reconfigures the process group across replica groups on every quorum:
`configure(store_addr, replica_id, rank, world_size, ...)` with a fresh store prefix, `abort()` when a
peer is lost, `errored()` asked before committing. ProcessGroupDdpkit is torchft's ProcessGroupGloo
with ddpkit's backend under it: shared memory between replica groups on one host, Gloo between
hosts, every collective bounded by the timeout, abort failing the ones in flight at once, and
reduce_scatter (which torchft's Gloo group refuses) supported.

    from torchft import Manager, DistributedDataParallel
    from ddpkit.torchft import ProcessGroupDdpkit

    manager = Manager(pg=ProcessGroupDdpkit(timeout=timedelta(seconds=10)), ...)
    model = DistributedDataParallel(manager, net)

Requires torchft (pip install torchft==0.2.0) and torch >= 2.7 (torchft's own floor).
"""
from datetime import timedelta
from typing import Optional

import torch
from torch.distributed import ProcessGroup as _TorchProcessGroup

try:
    from torchft.process_group import ProcessGroupWrapper as _Wrapper
except ImportError as e:  # said once, with the fix, instead of torchft's name missing later
    raise ImportError(f"ddpkit.torchft needs torchft (pip install torchft==0.2.0): {e}") from None

from . import Options, _C, _seconds

__all__ = ["ProcessGroupDdpkit", "native_group"]


def native_group(store, rank: int, world_size: int, timeout: timedelta = timedelta(seconds=60), *,
                 gloo_threads: Optional[int] = None, shared_memory: Optional[bool] = None) -> _TorchProcessGroup:
    """A native torch group on ddpkit's backend that changes members in place (enable_reconfigure,
    torch >= 2.14): what torchft's current Manager takes as `pg=` and reconfigures per quorum with
    the handles its lighthouse gathers. No members until the first reconfigure; `store`, `rank`
    and `world_size` are only its starting ones (torch's ProcessGroup wants them)."""
    if not hasattr(_TorchProcessGroup, "reconfigure"):
        raise RuntimeError(f"ddpkit.torchft.native_group needs torch >= 2.14 (c10d's reconfigure API); "
                           f"this is torch {torch.__version__}: use ProcessGroupDdpkit")
    o = Options(gloo_threads, shared_memory).resolved()
    backend = _C._make_backend(store, rank, world_size, _seconds(timeout, "ddpkit.torchft.native_group"),
                               o.gloo_threads, o.shared_memory, True)
    pg = _TorchProcessGroup(store, rank, world_size)
    kind = _TorchProcessGroup.BackendType.CUSTOM
    pg._set_default_backend(kind)
    pg._register_backend(torch.device("cpu"), kind, backend)
    return pg


class ProcessGroupDdpkit(_Wrapper):
    """A torchft process group on ddpkit's backend, made anew on each `configure` (each quorum).

    timeout: bounds reconfiguration (the store) and every collective, as torchft's timeout does;
    gloo_threads, shared_memory: as in ddpkit.Options (None: the environment's, else the default).
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60), *, gloo_threads: Optional[int] = None,
                 shared_memory: Optional[bool] = None, pg=None) -> None:
        _seconds(timeout, "ddpkit.torchft.ProcessGroupDdpkit")  # checked now, not at the first quorum
        self._options = Options(gloo_threads, shared_memory).resolved()
        super().__init__(timeout=timeout, pg=pg)

    def _create_pg(self, store, rank: int, world_size: int) -> _TorchProcessGroup:
        o = self._options
        backend = _C._make_backend(store, rank, world_size, _seconds(self._timeout, "ProcessGroupDdpkit"),
                                   o.gloo_threads, o.shared_memory)
        pg = _TorchProcessGroup(store, rank, world_size)
        kind = _TorchProcessGroup.BackendType.CUSTOM
        pg._set_default_backend(kind)
        pg._register_backend(torch.device("cpu"), kind, backend)
        return pg

    def getBackendName(self) -> str:
        return "torchft-ddpkit"

    def __repr__(self) -> str:
        o = self._options
        return (f"ProcessGroupDdpkit(timeout={self._timeout}, gloo_threads={o.gloo_threads}, "
                f"shared_memory={o.shared_memory})")
