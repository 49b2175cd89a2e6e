"""ddpkit's native communication hooks on PyTorch's own DistributedDataParallel.

    import torch.distributed as dist, ddpkit
    dist.init_process_group("gloo")                       # torchrun's env, as usual
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = ddpkit.register_comm_hook(model, "powersgd", matrix_approximation_rank=4,
                                      start_powerSGD_iter=10)
    ...                                                   # train as usual
    state.compression_stats(); state.bucket_traffic()

The hook runs in C++ inside PyTorch's reducer: no Python per bucket, no copy of the bucket, no
GIL. Its collectives go through a ddpkit process group made over torch.distributed's default
store, with ddpkit's ordering rules (PowerSGD cannot hang on Gloo). See docs/python.md.
"""
import itertools
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ._build_info import TORCH_VERSION as _BUILT_FOR

if torch.__version__.split("+")[0].split(".")[:2] != _BUILT_FOR.split(".")[:2]:
    raise ImportError(f"ddpkit was built for torch {_BUILT_FOR}, but this Python has torch {torch.__version__}: "
                      "rebuild it against this torch (pip install --no-build-isolation . in this environment)")

from . import _C  # noqa: E402
from ._C import CommError, HookState, ProcessGroup  # noqa: E402

__all__ = [
    "BACKEND", "CommError", "HookState", "PeriodicModelAverager", "ProcessGroup", "average_parameters",
    "default_group", "hook_names", "new_group", "register_comm_hook",
]
__version__ = "0.1.0"

_group_numbers = itertools.count()
_default_group = None


def hook_names():
    """Every hook register_comm_hook accepts."""
    return list(_C.hook_names())


def _require_initialized(caller):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{caller}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group('gloo') first (ddpkit's group uses its store and ranks)")


def new_group(*, gloo_threads=2, timeout=timedelta(minutes=5), gloo_hostname="", shared_memory=True):
    """A ddpkit process group over torch.distributed's default store, with its ranks.

    Every rank must call it, in the same order as its other new_group calls. gloo_threads: Gloo
    worker threads (collectives in flight); timeout bounds every collective and the rendezvous;
    gloo_hostname: the address Gloo listens on (default: GLOO_SOCKET_IFNAME's, else loopback when
    MASTER_ADDR is loopback, else this host's name); shared_memory: ranks on one host exchange
    through a shared-memory segment instead of loopback TCP (DDPKIT_SHM=0 turns it off too).
    """
    _require_initialized("ddpkit.new_group")
    if isinstance(timeout, timedelta):
        timeout_s = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout_s = float(timeout)
    else:
        raise TypeError(f"ddpkit.new_group: timeout must be a datetime.timedelta or seconds, got {timeout!r}")
    store = dist.distributed_c10d._get_default_store()
    name = f"python/{next(_group_numbers)}"
    return _C.ProcessGroup(store, dist.get_rank(), dist.get_world_size(), name, gloo_threads, timeout_s,
                           gloo_hostname, bool(shared_memory))


def default_group():
    """The group hooks use unless given one: made on first use (a collective call) with new_group's
    defaults, or DDPKIT_GLOO_THREADS / DDPKIT_TIMEOUT_S from the environment."""
    global _default_group
    _require_initialized("ddpkit.default_group")
    if _default_group is None:
        _default_group = new_group(gloo_threads=int(os.environ.get("DDPKIT_GLOO_THREADS", "2")),
                                   timeout=float(os.environ.get("DDPKIT_TIMEOUT_S", "300")))
    return _default_group


def register_comm_hook(ddp_model, hook, *, group=None, dense_group=None, **options):
    """Registers ddpkit's hook `hook` (see hook_names()) on a DistributedDataParallel model.

    Options are keyword arguments named as PyTorch names them (PowerSGDState's for powersgd and
    batched_powersgd, PostLocalSGDState's for post_local_sgd), plus wrapper="fp16"|"bf16" to run
    any hook on a low-precision copy. group: a ddpkit ProcessGroup (default: the model's own when
    its process group is of the ddpkit backend, else default_group());
    dense_group: hybrid's group for dense buckets (default: group). Returns the HookState.
    Every rank must call it, like DDP's own register_comm_hook.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError("ddpkit.register_comm_hook: expected a torch.nn.parallel.DistributedDataParallel, got "
                        f"{type(ddp_model).__name__}; wrap the model in DistributedDataParallel first")
    if not isinstance(hook, str):
        raise TypeError(f"ddpkit.register_comm_hook: hook must be a name (one of {', '.join(hook_names())}), "
                        f"got {type(hook).__name__}")
    if hook not in _C.hook_names():
        raise ValueError(f"ddpkit.register_comm_hook: unknown hook '{hook}' (known: {', '.join(hook_names())})")
    _require_initialized("ddpkit.register_comm_hook")
    previous = getattr(ddp_model, "_ddpkit_hook_state", None)
    if previous is not None:
        raise RuntimeError(f"ddpkit.register_comm_hook: this model already has ddpkit's '{previous.name}' hook; "
                           "DDP takes one communication hook per model")
    for name, g in (("group", group), ("dense_group", dense_group)):
        if g is not None and not isinstance(g, ProcessGroup):
            raise TypeError(f"ddpkit.register_comm_hook: {name} must be a ddpkit.ProcessGroup (ddpkit.new_group()), "
                            f"got {type(g).__name__}")
    ddp_group = ddp_model.process_group
    if group is None:
        group = _ddpkit_group_of(ddp_group) or default_group()
    if ddp_group.size() != group.size() or ddp_group.rank() != group.rank():
        raise ValueError(f"ddpkit.register_comm_hook: the model's process group (rank {ddp_group.rank()} of "
                         f"{ddp_group.size()}) differs from ddpkit's group (rank {group.rank()} of {group.size()}); "
                         "pass group= a ddpkit group with the same ranks")
    state = _C.make_hook(hook, group, options, dense_group)
    _C.install(ddp_model.reducer, state)
    ddp_model._ddpkit_hook_state = state
    logger = getattr(ddp_model, "logger", None)
    if logger is not None and hasattr(logger, "_set_comm_hook_name"):
        logger._set_comm_hook_name(f"ddpkit.{hook}")
    return state


def _tensors(params):
    """model.parameters(), a list of tensors, or optimizer-style param groups."""
    out = []
    for p in params:
        if isinstance(p, dict):
            out.extend(p["params"])
        else:
            out.append(p)
    return out


class PeriodicModelAverager:
    """torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager, on a ddpkit group:
    average_parameters(params) after optimizer.step() averages the parameters across the group on
    step warmup_steps, warmup_steps + period, ... of its own count (one call = one step)."""

    def __init__(self, period, warmup_steps=0, group=None):
        self._averager = _C.PeriodicModelAverager(period, warmup_steps, group if group is not None else default_group())

    @property
    def step(self):
        return self._averager.step

    def average_parameters(self, params):
        """Returns True if it averaged on this call."""
        return self._averager.average_parameters(_tensors(params))


def average_parameters(params, group=None):
    """Averages `params` in place across the group now (blocking)."""
    _C.average_parameters(_tensors(params), group if group is not None else default_group())


# ---- torch.distributed backend -------------------------------------------------------------------

BACKEND = "ddpkit"


def _ddpkit_group_of(process_group):
    """The ddpkit ProcessGroup under a torch.distributed group of the ddpkit backend, else None."""
    backend = process_group
    if hasattr(process_group, "_get_backend"):  # 2.x: a ProcessGroup holds a backend per device
        try:
            backend = process_group._get_backend(torch.device("cpu"))
        except RuntimeError:
            return None
    return backend._ddpkit_group() if isinstance(backend, _C.Backend) else None


def _create_backend(store, rank, size, timeout):
    """torch.distributed calls this once per group (init_process_group, new_group)."""
    return _C._make_backend(store, rank, size, timeout.total_seconds(),
                            int(os.environ.get("DDPKIT_GLOO_THREADS", "2")),
                            os.environ.get("DDPKIT_SHM", "1") != "0")


def _register_backend():
    if BACKEND.upper() in dist.Backend._plugins:
        return
    import inspect
    kwargs = {}
    if "devices" in inspect.signature(dist.Backend.register_backend).parameters:
        kwargs["devices"] = ["cpu"]  # 2.x: this backend serves CPU tensors only
    dist.Backend.register_backend(BACKEND, _create_backend, **kwargs)


if dist.is_available():
    _register_backend()
