"""ddpkit for PyTorch users: a torch.distributed backend, and ddpkit's hooks on PyTorch's own DDP.

`import ddpkit` registers the "ddpkit" backend with torch.distributed (nothing else happens at
import: no group is made, no thread starts). Then:

    import torch.distributed as dist, ddpkit
    dist.init_process_group("ddpkit")                     # torchrun's env, as for "gloo"
    dist.init_process_group("ddpkit", pg_options=ddpkit.Options(gloo_threads=4))   # with options
    sub = dist.new_group([0, 1], backend="ddpkit")        # subgroups, as usual

    model = torch.nn.parallel.DistributedDataParallel(net)
    state = ddpkit.register_comm_hook(model, "powersgd", matrix_approximation_rank=4,
                                      start_powerSGD_iter=10)
    ...                                                   # train as usual
    state.compression_stats(); state.bucket_traffic()

The backend's groups exchange through shared memory within a host and Gloo between hosts. A hook
runs in C++ inside PyTorch's reducer: no Python per bucket, no copy of the bucket, no GIL; its
collectives go through a ddpkit process group (the model's own on the ddpkit backend, else one
made over torch.distributed's default store: `new_group`, `default_group`). Options are
`Options` fields or keyword arguments; the environment (DDPKIT_GLOO_THREADS, DDPKIT_SHM,
DDPKIT_TIMEOUT_S) gives the values left unset. See docs/python.md.

Alongside: ddpkit.ft (fault-tolerant replica groups for your own model: the Manager),
ddpkit.diloco (DiLoCo and Streaming DiLoCo attached to your optimizer), ddpkit.fsdp2 (ddpkit's FSDP
hooks as FSDP2's custom reduce-scatter), ddpkit.torchft (torchft's process group on ddpkit's
backend), ddpkit.register (the backend, for Ray's worker_process_setup_hook).
"""
import itertools
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

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
    "BACKEND", "CommError", "HookState", "Options", "PeriodicModelAverager", "ProcessGroup", "average_parameters",
    "default_group", "hook_names", "launch_environment", "new_group", "register", "register_comm_hook",
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


def _env_number(name, default, kind, what):
    """The environment variable `name` (else `default`) as a `kind`; an error naming it otherwise."""
    text = os.environ.get(name, default)
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"ddpkit: {name} must be {what}, got '{text}'") from None


@dataclass(frozen=True)
class Options:
    """How ddpkit makes a process group: `pg_options` of torch.distributed.init_process_group and
    new_group with backend "ddpkit", or the same keywords to ddpkit.new_group. A field left None
    takes the environment's value, else the default.

    gloo_threads: Gloo worker threads, collectives in flight between hosts (DDPKIT_GLOO_THREADS; 2).
    shared_memory: ranks on one host exchange through shared memory rather than loopback TCP
        (DDPKIT_SHM=0 turns it off; on).
    """
    gloo_threads: Optional[int] = None
    shared_memory: Optional[bool] = None

    def resolved(self):
        """These options with every unset field filled from the environment or the default."""
        threads = self.gloo_threads
        if threads is None:
            threads = _env_number("DDPKIT_GLOO_THREADS", "2", int, "a whole number")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"ddpkit.Options: gloo_threads must be a whole number >= 1, got {threads!r}")
        shm = self.shared_memory
        if shm is None:
            shm = os.environ.get("DDPKIT_SHM", "1") != "0"
        if not isinstance(shm, bool):
            raise TypeError(f"ddpkit.Options: shared_memory must be True or False, got {shm!r}")
        return Options(threads, shm)


def _seconds(timeout, caller):
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{caller}: timeout must be a datetime.timedelta or seconds, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"{caller}: timeout must be positive, got {seconds} s")
    return seconds


def _group_ranks(ranks, world, caller):
    """Sorted, checked member ranks (None: the whole world)."""
    if ranks is None:
        return list(range(world))
    try:
        members = sorted(int(r) for r in ranks)
    except (TypeError, ValueError):
        raise TypeError(f"{caller}: ranks must be a list of ranks (ints), got {ranks!r}") from None
    if not members:
        raise ValueError(f"{caller}: ranks is empty; a group needs at least one rank")
    if len(set(members)) != len(members):
        raise ValueError(f"{caller}: ranks {members} name a rank more than once")
    if members[0] < 0 or members[-1] >= world:
        raise ValueError(f"{caller}: ranks {members} must lie in [0, {world}) (the world size is {world})")
    return members


def new_group(ranks=None, *, timeout=timedelta(minutes=5), gloo_threads=None, shared_memory=None,
              gloo_hostname=""):
    """A ddpkit process group of `ranks` (default: every rank) over torch.distributed's default store.

    As torch.distributed.new_group: every rank of the job calls it, members or not, in the same
    order as its other new_group calls; a member's rank in the group is its place in sorted(ranks);
    a rank outside `ranks` gets None. timeout bounds every collective and the rendezvous (a
    timedelta or seconds); gloo_threads and shared_memory as in Options (None: the environment's,
    else the default); gloo_hostname: the address Gloo listens on (default: GLOO_SOCKET_IFNAME's,
    else loopback when MASTER_ADDR is loopback, else this host's name).
    """
    _require_initialized("ddpkit.new_group")
    timeout_s = _seconds(timeout, "ddpkit.new_group")
    options = Options(gloo_threads, shared_memory).resolved()
    members = _group_ranks(ranks, dist.get_world_size(), "ddpkit.new_group")
    name = f"python/{next(_group_numbers)}"  # counted on every rank, so names agree across ranks
    me = dist.get_rank()
    if me not in members:
        return None
    store = dist.distributed_c10d._get_default_store()
    return _C.ProcessGroup(store, members.index(me), len(members), name, options.gloo_threads, timeout_s,
                           gloo_hostname, options.shared_memory)


def default_group():
    """The group hooks use unless given one: every rank, made on first use (a collective call) with
    new_group's defaults; DDPKIT_TIMEOUT_S (seconds) sets its timeout."""
    global _default_group
    _require_initialized("ddpkit.default_group")
    if _default_group is None:
        _default_group = new_group(timeout=_env_number("DDPKIT_TIMEOUT_S", "300", float, "seconds"))
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


def _ddpkit_backend_of(process_group):
    """The ddpkit._C.Backend under a torch.distributed group of the ddpkit backend, else None."""
    backend = process_group
    if hasattr(process_group, "_get_backend"):  # 2.x: a ProcessGroup holds a backend per device
        try:
            backend = process_group._get_backend(torch.device("cpu"))
        except RuntimeError:
            return None
    # TORCH_DISTRIBUTED_DEBUG=DETAIL: 2.x wraps every backend in a ProcessGroupWrapper that checks
    # each collective across ranks (over a helper Gloo group) before passing it on to the backend.
    backend = getattr(backend, "wrapped_pg", backend)
    return backend if isinstance(backend, _C.Backend) else None


def _ddpkit_group_of(process_group):
    """The ddpkit ProcessGroup under a torch.distributed group of the ddpkit backend, else None."""
    backend = _ddpkit_backend_of(process_group)
    return backend._ddpkit_group() if backend is not None else None


def _create_backend(backend_options, pg_options):
    """torch.distributed calls this once per group (init_process_group, new_group), with its store,
    rank, size and timeout in backend_options and the caller's pg_options (an Options, or None)."""
    if pg_options is None:
        pg_options = Options()
    elif not isinstance(pg_options, Options):
        raise TypeError(f"ddpkit backend: pg_options must be a ddpkit.Options, got {type(pg_options).__name__}")
    options = pg_options.resolved()
    o = backend_options
    # enable_reconfigure=True (torch >= 2.14): no members until the first reconfigure().
    return _C._make_backend(o.store, o.group_rank, o.group_size, o.timeout.total_seconds(), options.gloo_threads,
                            options.shared_memory, getattr(o, "enable_reconfigure", False))


def _register_backend():
    if BACKEND.upper() in dist.Backend._plugins:
        return
    import inspect
    kwargs = {"extended_api": True}  # the creator gets the caller's pg_options (1.13 and 2.x alike)
    if "devices" in inspect.signature(dist.Backend.register_backend).parameters:
        kwargs["devices"] = ["cpu"]  # 2.x: this backend serves CPU tensors only
    dist.Backend.register_backend(BACKEND, _create_backend, **kwargs)


def register():
    """Registers the "ddpkit" backend with torch.distributed (importing ddpkit already does; this
    is the callable a launcher's per-process setup names, e.g. Ray's runtime_env
    {"worker_process_setup_hook": "ddpkit.register"}). Idempotent."""
    if not dist.is_available():
        raise RuntimeError("ddpkit.register: this torch has no torch.distributed")
    _register_backend()


def launch_environment():
    """The engine that started this process (torchrun, slurm, openmpi, mpich, kubeflow-pytorchjob,
    kubeflow-trainer, ray-train, ddpkit-launch, env, or '' for none) and the rank, world size and
    rendezvous it implies, as a dict (docs/launching.md). Raises on a partial or contradictory
    environment, naming the variables."""
    return _C.launch_environment()


def _fill_torchrun_env():
    """torch.distributed's env:// reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT only. Under
    srun, mpirun or Kubeflow Trainer (one process per node) those are derived here from the
    engine's own variables, so init_process_group("ddpkit") works as under torchrun. Variables
    already set are left alone."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return  # torchrun's variables (or some of them, with the rank passed in code): torch's business
    try:
        env = launch_environment()
    except RuntimeError as e:  # a partial engine environment: said now, and again by init_process_group
        warnings.warn(f"ddpkit: {e}", RuntimeWarning, stacklevel=2)
        return
    if not env["engine"] or env["per_node"]:
        return
    derived = {"RANK": env["rank"], "WORLD_SIZE": env["world_size"], "LOCAL_RANK": env["local_rank"],
               "LOCAL_WORLD_SIZE": env["local_world_size"], "MASTER_ADDR": env["master_addr"],
               "MASTER_PORT": env["master_port"]}
    for name, value in derived.items():
        if value not in (-1, "") and name not in os.environ:
            os.environ[name] = str(value)
    if env["rank"] == 0:
        print(env["summary"], file=sys.stderr, flush=True)


if dist.is_available():
    _register_backend()
    _fill_torchrun_env()
