"""Fault-tolerant training across replica groups, for your own model: ddpkit's Manager.

Each replica group is one torchrun job (its ranks' torch.distributed world); the groups meet at a
lighthouse (`ddpkit lighthouse`). Every rank makes one Manager, registers the state a late or
restarted group must copy, and follows the per-step commit protocol:

    import torch.distributed as dist, ddpkit.ft
    dist.init_process_group("gloo")                      # or "ddpkit"; the group's own ranks
    with ddpkit.ft.Manager(lighthouse="host:29510", group_id="replica-0") as manager:
        manager.register_state_dict("model", model.state_dict, model.load_state_dict)
        manager.register_state_dict("optimizer", optimizer.state_dict, optimizer.load_state_dict)
        while manager.step < steps:
            manager.start_step()                         # asks for the quorum; the step goes on
            loss = loss_fn(model(x), y); loss.backward() # DDP inside the group, if several ranks
            manager.allreduce_gradients(model)           # averaged across the quorum's groups
            if manager.should_commit():                  # every rank of every group succeeded
                optimizer.step()
            optimizer.zero_grad()
    # leaving the block: close() (the group leaves the job; everything is freed at once)

Every group starts from one group's state: at a group's first quorum the registered state is copied
from a group already running, or, when the groups start together, from the first by group_id
(init_sync=False turns this off). A group that dies is out of the next quorum; the survivors go on
without a restart, and a group that comes back copies the registered state from a live one (no
checkpoint is read). State goes through state_dict()-style functions: nested dicts and lists of CPU
tensors and plain values. Once every group has closed its Manager after its last step, the job is
finished: a group started again from an older step gets JobFinished instead of training alone.
See docs/fault_tolerance.md.
"""
import os
import pickle
import weakref

import torch

from . import _C, _seconds

__all__ = ["JobFinished", "Lighthouse", "Manager", "SCOPES"]

# Raised by Manager.start_step when the job this group would join has finished: every group of its
# last quorum closed its Manager after its last step, and this group is behind their step (it has
# nobody to copy the job's state from). A subclass of ddpkit.CommError; a restarted process that
# gets it has nothing left to do.
JobFinished = _C.ft.JobFinished

# Where registered state goes (ddpkit::ft::StateScope): "shared", the same on every rank of every
# group (a heal copies it, a checkpoint keeps one copy); "shared_per_rank", the same across groups
# rank by rank (FSDP shards: a heal copies it rank to rank, a checkpoint keeps each rank's);
# "local", this rank's own (a checkpoint keeps it, a heal never copies it).
SCOPES = ("shared", "shared_per_rank", "local")


class _TensorRef:
    """Where a tensor stood in a pickled state dict's skeleton."""

    def __init__(self, index):
        self.index = index


class _DTensorRef(_TensorRef):
    """Where a DTensor (FSDP2's parameters and their optimizer state) stood: its local shard is
    carried, and its placements and global size, to make it again on the loading rank's mesh."""

    def __init__(self, index, placements, size, stride):
        super().__init__(index)
        self.placements, self.size, self.stride = placements, size, stride


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def _walk(x, path=()):
    """(path, leaf) of every leaf of nested dicts, lists and tuples."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _walk(v, path + (k,))
    elif isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        for i, v in enumerate(x):
            yield from _walk(v, path + (i,))
    else:
        yield path, x


def flatten_state(state, scope="shared"):
    """A state dict (nested dicts, lists and tuples of CPU tensors, FSDP2's DTensors and picklable
    values) as the flat {name: tensor} the Manager carries: the tensors as they are (a DTensor's
    local shard), the rest pickled as bytes. A sharded DTensor under scope "shared" is refused: each
    rank holds its own shard, which a checkpoint of the shared scope would keep one rank's of."""
    tensors = {}
    dtensor = _dtensor_type()

    def strip(x, path):
        if dtensor is not None and isinstance(x, dtensor):
            if scope == "shared" and any(p.is_shard() for p in x.placements):
                raise ValueError(f"ddpkit.ft: state entry {'/'.join(map(str, path))} is a sharded DTensor (FSDP2): "
                                 "each rank holds its own shard; register it with scope='shared_per_rank'")
            index = len(tensors)
            tensors[f"t/{index}"] = x.to_local().detach().contiguous()
            return _DTensorRef(index, tuple(x.placements), tuple(x.size()), tuple(x.stride()))
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                raise ValueError(f"ddpkit.ft: state holds a tensor on {x.device}; the Manager carries CPU tensors")
            index = len(tensors)
            tensors[f"t/{index}"] = x.detach().contiguous()
            return _TensorRef(index)
        if isinstance(x, dict):
            return type(x)((k, strip(v, path + (k,))) for k, v in x.items())
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
            return type(x)(strip(v, path + (i,)) for i, v in enumerate(x))
        return x

    skeleton = pickle.dumps(strip(state, ()))
    tensors["skeleton"] = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
    return tensors


def unflatten_state(tensors, like=None, known_meshes=None):
    """flatten_state's input back from its output. `like`: this rank's state dict of the same
    structure (called only when the state holds DTensors), whose DTensors give the device meshes
    the copied shards are placed on; an entry it lacks (a fresh optimizer's state) goes on the one
    mesh this rank's states have shown (`known_meshes`, a list kept across calls)."""
    if "skeleton" not in tensors:
        raise ValueError("ddpkit.ft: the state holds no skeleton (not made by flatten_state)")
    meshes = None
    known = known_meshes if known_meshes is not None else []

    def mesh_for(path):
        nonlocal meshes
        if meshes is None:
            if like is None:
                raise ValueError("ddpkit.ft: the state holds DTensors and no state dict to place them like")
            meshes = {p: v.device_mesh for p, v in _walk(like()) if hasattr(v, "device_mesh")}
            known.extend(m for m in meshes.values() if m not in known)
        if path in meshes:
            return meshes[path]
        if len(known) == 1:
            return known[0]
        raise ValueError(f"ddpkit.ft: state entry {'/'.join(map(str, path))} is a DTensor in the copy; this rank's "
                         f"state dict has none there and {len(known)} device meshes to choose from")

    def fill(x, path):
        if isinstance(x, _DTensorRef):
            return _dtensor_type().from_local(tensors[f"t/{x.index}"], mesh_for(path), x.placements, run_check=False,
                                              shape=torch.Size(x.size), stride=x.stride)
        if isinstance(x, _TensorRef):
            return tensors[f"t/{x.index}"]
        if isinstance(x, dict):
            return type(x)((k, fill(v, path + (k,))) for k, v in x.items())
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
            return type(x)(fill(v, path + (i,)) for i, v in enumerate(x))
        return x

    return fill(pickle.loads(tensors["skeleton"].numpy().tobytes()), ())


def _ddpkit_group(group):
    """The ddpkit ProcessGroup a Manager runs its group's collectives on."""
    from . import ProcessGroup, _ddpkit_group_of, default_group
    import torch.distributed as dist

    if isinstance(group, ProcessGroup):
        return group
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ddpkit.ft.Manager: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first (the replica group's ranks), or pass group=")
        return _ddpkit_group_of(dist.group.WORLD) or default_group()
    own = _ddpkit_group_of(group)
    if own is None:
        raise TypeError("ddpkit.ft.Manager: group must be a ddpkit.ProcessGroup or a torch.distributed group of the "
                        f"'ddpkit' backend, got {group!r} (for gloo's world, leave group out)")
    return own


class Lighthouse:
    """The quorum service, in this process (as `ddpkit lighthouse` runs it): the groups' Managers
    reach it at `address`. It hands out a c10d TCPStore, whose wire format is this torch's: Managers
    of another torch major version cannot use it (nor a lighthouse built for another torch).

    min_replicas: fewest groups a quorum may have. join_timeout: how long a quorum waits for a live
    group that has not asked (for DiLoCo: as long as the sites' quorum_timeout, as a site asks only
    at its syncs). expected_groups: the first quorum waits up to join_timeout for that many.
    on_event: called with a line for each event `ddpkit lighthouse` prints (on the lighthouse's own
    thread, in order, within ~20 ms of the change; keep it short, e.g. print or queue.put):
        "quorum Q: groups [a, b]" (", dropped [c]", ", joined [d]": the participants changed)
        "group G lost: rank R silent for N ms" / "group G lost: restarted (incarnation I)"
        "group G left after step S"            (its Manager closed after its last step)
        "job finished at step S: every group of quorum Q left"
        "group G: refused a second process (...): a duplicate group id"
        "group G refused: the job has finished ..."  (started again after the job finished)
    An exception it raises is reported through sys.unraisablehook and the lighthouse goes on.
    """

    def __init__(self, address="0.0.0.0:29510", *, min_replicas=1, join_timeout=10.0, expected_groups=0,
                 heartbeat_timeout=1.0, token=None, on_event=None):
        if token is None:
            token = os.environ.get("DDPKIT_FT_TOKEN", "")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"ddpkit.ft.Lighthouse: on_event must be callable, got {on_event!r}")
        self._lighthouse = _C.ft.Lighthouse(address, int(min_replicas), _seconds(join_timeout, "join_timeout"),
                                            int(expected_groups), _seconds(heartbeat_timeout, "heartbeat_timeout"),
                                            token, on_event)

    @property
    def address(self):
        """host:port, as the groups reach it."""
        return self._lighthouse.address

    @property
    def quorums_formed(self):
        return self._lighthouse.quorums_formed

    @property
    def round_times(self):
        """The lighthouse's own part of its last 1,024 steady rounds (every reply a delta), in ms:
        intake_p50_ms/intake_p99_ms (a round's first ask to the one completing it),
        replies_p50_ms/replies_p99_ms/replies_max_ms (the quorum formed to its last reply handed
        to gRPC); rounds, and sampled (those the percentiles are over); whole_rounds and
        whole_replies_max_ms for rounds that sent a whole quorum."""
        return self._lighthouse.round_times

    def shutdown(self):
        self._lighthouse.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False


class Manager:
    """One rank's part in fault-tolerant training across replica groups (see the module's doc).

    lighthouse: host:port of `ddpkit lighthouse` (default: $DDPKIT_LIGHTHOUSE).
    group_id: this replica group's id, the same on its every rank (default: $DDPKIT_REPLICA_GROUP_ID).
    group: the replica group's own process group: None (torch.distributed's world: its ddpkit
        group on the ddpkit backend, else ddpkit.default_group() over its store), a
        ddpkit.ProcessGroup, or a group of the ddpkit backend.
    quorum_timeout: how long start_step waits for a quorum (a timedelta or seconds). For DiLoCo,
        start the lighthouse with --join-timeout-ms of the same length.
    cross_group_timeout: the cross-group collectives' and heals' timeout.
    cross_lazy_connections: cross groups connect two groups when a collective first needs them
        (rings and trees) instead of every pair at each quorum change: for tens of groups or
        sites (docs/scale.md).
    init_sync: at this group's first quorum, copy the registered state from a group already
        running, or, when the groups start together, from the first by group_id (which copies
        nothing): groups seeded differently still train one model. False: they must start equal.
        A group that resumed from a checkpoint (restore_checkpoint) keeps the state it loaded.
    quorum_mode: "async" (default): start_step asks for the quorum and returns; forward and
        backward run while it forms (and while a new membership's process group is made), and the
        first allreduce waits for it. A group that must heal trains that step on its old state,
        adds zeros to the allreduce (which divides by the groups adding their own), copies the
        source's state meanwhile and loads it in should_commit, before its optimizer step:
        should_commit is False for the step in between (skip optimizer.step() then, as always).
        The source calls the registered state_dict functions at its next start_step, a step
        boundary, so an FSDP2 model is read sharded, never mid-forward. "sync": every step
        waits for its quorum and heals in start_step. Every group of a job takes the same.

    Use it as a context manager, or call close() after the last step: the group leaves the job at
    once and its threads, sockets and cross-group process groups are freed before close returns.
    A block left by an exception frees the same, without leaving (the others see the group lost,
    and it may come back). A lighthouse that cannot be reached is named on stderr at the first
    refused attempt and asked again until quorum_timeout.
    """

    def __init__(self, lighthouse=None, group_id=None, group=None, *, token=None, quorum_timeout=60.0,
                 cross_group_timeout=30.0, heartbeat_interval=0.1, cross_gloo_threads=0, heal_connections=1,
                 cross_lazy_connections=False, init_sync=True, quorum_mode="async"):
        lighthouse = lighthouse or os.environ.get("DDPKIT_LIGHTHOUSE", "")
        if not lighthouse:
            raise ValueError("ddpkit.ft.Manager: no lighthouse (host:port): pass lighthouse= or set DDPKIT_LIGHTHOUSE")
        group_id = group_id or os.environ.get("DDPKIT_REPLICA_GROUP_ID", "")
        if not group_id:
            raise ValueError("ddpkit.ft.Manager: no group_id: pass group_id= or set DDPKIT_REPLICA_GROUP_ID")
        if token is None:
            token = os.environ.get("DDPKIT_FT_TOKEN", "")
        self._manager = _C.ft.Manager(
            _ddpkit_group(group), lighthouse, group_id, token, _seconds(quorum_timeout, "quorum_timeout"),
            _seconds(cross_group_timeout, "cross_group_timeout"),
            _seconds(heartbeat_interval, "heartbeat_interval"), int(cross_gloo_threads), int(heal_connections),
            bool(cross_lazy_connections), bool(init_sync), str(quorum_mode))
        self._attached = weakref.WeakSet()  # DiLoCo objects over this Manager: closed first
        self._meshes = []  # the device meshes of the DTensors its states hold (FSDP2): a copy is placed on them
        self._closed = False

    def register_state_dict(self, key, state_dict, load_state_dict, scope="shared"):
        """What a heal copies and a checkpoint keeps under `key`: state_dict() gives it (as
        torch.nn.Module.state_dict does), load_state_dict(d) takes back what one gave on a matching
        rank. Called only when a heal or a checkpoint needs it, on the thread that calls
        start_step/should_commit, at a step boundary (a source's start_step: an FSDP2 model is
        sharded then, never mid-forward); loaded in the order registered. An FSDP2 model's and its
        optimizer's state_dict hold DTensors: register them with scope="shared_per_rank" (each
        rank's shard crosses to the matching rank, and is placed on that rank's device mesh)."""
        if scope not in SCOPES:
            raise ValueError(f"ddpkit.ft: scope must be one of {SCOPES}, got {scope!r}")
        self._manager.register_state(key, lambda: flatten_state(state_dict(), scope),
                                     lambda d: load_state_dict(unflatten_state(d, state_dict, self._meshes)), scope)

    def unregister_state_dict(self, key):
        self._manager.unregister_state(key)

    def request_heal(self, why):
        """This group's state differs from the others' (a check of your own found it): the next
        start_step copies the registered state from a group at the quorum's step. Call it on every
        rank of the group. (DiLoCo does this itself when a sync's checksums disagree.)"""
        self._manager.request_heal(str(why))

    def close(self, leave=True):
        """After the last step, on every rank: the group leaves the job (the lighthouse drops it at
        once; when every group has left, the job is finished), then heartbeats, the state service
        and the cross-group process groups are stopped and freed before this returns, and the
        registered state_dict functions are dropped (no reference cycle is left through them).
        leave=False frees the same without leaving (a group stopping on a failure). stats(), step
        and the other properties still answer; nothing else may be called. A second call does nothing."""
        if self._closed:
            return
        for diloco in list(self._attached):
            diloco.close()
        self._manager.close(bool(leave))  # which drops the registered functions too
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        self.close(leave=kind is None)
        return False

    def _attach(self, diloco):
        if self._closed:
            raise RuntimeError("ddpkit.diloco.DiLoCo: the Manager is closed")
        self._attached.add(diloco)

    def start_step(self):
        """Collective over the group: joins the quorum for the next step; a group behind heals (and,
        with init_sync, every group at its first quorum but the one the others copy). Raises
        ddpkit.CommError when no quorum forms within quorum_timeout (the message names the live and
        lost groups, a duplicate group id, or an unreachable lighthouse), JobFinished when the job
        has finished."""
        self._manager.start_step()

    def allreduce(self, tensors):
        """Averages CPU `tensors` across the quorum's groups, in place (a DTensor's local shard: FSDP2's
        gradients, rank r of every group holding the same elements); a failure leaves them as they
        were and marks the step not to commit. Under the async quorum the first call waits for the
        step's quorum, and a group healing this step adds zeros (the average is the others')."""
        dtensor = _dtensor_type()
        self._manager.allreduce([t.to_local() if dtensor is not None and isinstance(t, dtensor) else t
                                 for t in tensors])

    def allreduce_gradients(self, module_or_parameters):
        """allreduce of the gradients of a module's (or a list of) parameters."""
        params = module_or_parameters.parameters() if isinstance(module_or_parameters, torch.nn.Module) \
            else module_or_parameters
        self.allreduce([p.grad for p in params if p.grad is not None])

    def should_commit(self):
        """Collective over the group: True when every rank's step succeeded (then step advances)."""
        return self._manager.should_commit()

    def fail_step(self, why):
        self._manager.fail_step(why)

    def save_checkpoint(self, directory, keep=3):
        """Collective over the group: the registered state and the step, as DIR/checkpoint-<step>.ddpk."""
        return self._manager.save_checkpoint(os.fspath(directory), keep)

    def restore_checkpoint(self, directory):
        """Collective, before the first start_step: the newest checkpoint in `directory` loaded into
        the registered state; returns its step, or -1 when there is none."""
        return self._manager.restore_checkpoint(os.fspath(directory))

    @property
    def step(self):
        """Steps committed."""
        return self._manager.step

    @property
    def replica_rank(self):
        return self._manager.replica_rank

    @property
    def replica_count(self):
        return self._manager.replica_count

    @property
    def group_id(self):
        return self._manager.group_id

    def stats(self):
        """This rank's figures, a dict (the same names as `ddpkit train --fault-tolerant`'s JSON):

        quorums                 quorums taken part in
        reconfigurations        cross-group process groups built (a group alone builds none)
        reconfiguration_seconds, longest_reconfiguration_seconds   building them
        heals                   times this rank copied its state from another group: it was
                                behind the quorum, or asked to (request_heal; DiLoCo's checksums)
        init_syncs              1 once the first quorum copied the state from another group (init_sync)
        heal_bytes, heal_seconds, heal_fetch_seconds   all copies: bytes, fetch and load, fetch alone
        serve_seconds           as a source: serving the state until the healers released it
        heals_single_copy       copies read from the source's memory (same host)
        heal_route              how the last copy was read: "process_vm_readv", or the pair group's transport
        steps_committed, steps_not_committed
        steps_healing           steps trained on a state a heal was replacing ("async"): not committed, not failures
        quorum_wait_seconds     the steps' waits for their quorum
        snapshot_seconds        as a source ("async"): copying the state it serves, at step boundaries
        last_error              why the last step did not commit ("" if none failed)
        cross_transport         what the last cross-group process group runs on
        cross_bytes_sent        bytes this rank sent to the other groups, all quorums so far
        """
        return self._manager.stats()
