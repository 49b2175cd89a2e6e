"""DiLoCo and Streaming DiLoCo for your own model: ddpkit's outer loop, attached to your optimizer.

Each site (replica group: one torchrun job) trains alone with its own inner optimizer; every
sync_every inner steps the sites average their pseudo-gradients (the last synced parameters minus
the local ones) and take an outer step (SGD, Nesterov momentum). With fragments > 1 (Streaming
DiLoCo) one fragment of layers syncs every sync_every / fragments steps, overlapped with the next
fragment_delay inner steps. The pseudo-gradients cross the sites in `codec` (fp32, bf16, fp16,
int8, int4, int2: ddpkit.diloco.codec_names()), with error feedback if asked.

    manager = ddpkit.ft.Manager(lighthouse="host:29510", group_id=f"site-{site}")
    with ddpkit.diloco.DiLoCo(manager, model, optimizer, sync_every=64, fragments=4, codec="int4") as diloco:
        while diloco.inner_steps < steps:                    # the job's steps: a healed site's too
            x, y = batch(diloco.inner_steps)
            loss_fn(model(x), y).backward()
            optimizer.step()                                 # syncs on schedule, in the step's hook
            optimizer.zero_grad()

The model's and optimizer's state_dict() are registered with the Manager ("model",
"inner_optimizer"), so a site that starts late or comes back copies them, the outer state and your
registered entries from a live site at the next sync; sites that start together begin from the
first site's (by group_id) model and optimizer, whatever each seeded (the Manager's init_sync). A
site lost mid-sync costs the others no inner steps: the sync is redone among the survivors. Every
sync compares the sites' global parameters (a checksum): a site whose differ is left out of that
mean and copies the others' state at once (stats()["checksum_mismatches"], printed to stderr).
See docs/diloco.md.
"""
import collections
import warnings
import weakref

import torch

from . import _C

__all__ = ["DiLoCo", "codec_names", "fragments_of", "layers_of"]


def codec_names():
    """The wire formats a pseudo-gradient may cross the sites in."""
    return list(_C.diloco.codec_names())


def layers_of(module):
    """`module`'s parameters as layers, in order: its own (if any), then each direct child's. For a
    model whose blocks sit in one child (a ModuleList), pass that child's layers, or your own lists."""
    layers = []
    own = list(module.parameters(recurse=False))
    if own:
        layers.append(own)
    for child in module.children():
        params = list(child.parameters())
        if params:
            layers.append(params)
    if not layers:
        raise ValueError("ddpkit.diloco.layers_of: the module has no parameters")
    return layers


def fragments_of(layers, count, layout="strided"):
    """`layers` (lists of parameters, in model order) split into `count` fragments: "strided" (layer
    i to fragment i % count, Streaming DiLoCo's choice) or "sequential" (consecutive runs)."""
    return _C.diloco.fragments_of([list(layer) for layer in layers], int(count), layout)


class DiLoCo:
    """DiLoCo over `manager`'s sites for `model`, driven by `inner_optimizer`'s steps.

    fragments: 1 (the whole model), a count (that many fragments of layers_of(model), `layout`
        "strided": layer i to fragment i % count; "sequential": consecutive runs), or a list of
        fragments (each a module or a list of parameters).
    outer_lr, outer_momentum, nesterov: the outer optimizer. codec, error_feedback: the wire format.
    fragment_delay (tau), fragment_alpha: Streaming DiLoCo's overlap and mixing.
    round_seconds > 0: time-budgeted rounds (a site's pseudo-gradient weighted by its inner steps).
    parameters_sharded: the site's ranks each hold their own shards (FSDP).
    register_state: register the model's and optimizer's state_dict with the manager (a heal copies them).

    sync_every (H) must be a multiple of the number of fragments P (a fragment syncs every H / P
    inner steps, in turn), and fragment_delay < H / P.

    start() (entering the `with` block) is itself a sync: the first quorum, in which a late site
    heals (and sites seeded differently take the first site's state), and one exchange at weight 0
    of the first fragment's size (the whole model when fragments=1) that applies no outer step. A
    run of N syncs therefore moves N + 1 pseudo-gradients' bytes; stats()["outer_syncs"] counts it.
    """

    def __init__(self, manager, model, inner_optimizer, sync_every, *, fragments=1, layout="strided", outer_lr=0.7,
                 outer_momentum=0.9, nesterov=True, codec="fp32", error_feedback=False, fragment_delay=0,
                 fragment_alpha=0.0, round_seconds=0.0, parameters_sharded=False, piece_bytes=256 << 10,
                 register_state=True):
        self._model = model
        self._optimizer = inner_optimizer
        if register_state:
            # Before DiLoCo registers its own state: a heal loads the model first, then the outer state.
            manager.register_state_dict("model", model.state_dict, model.load_state_dict)
            manager.register_state_dict("inner_optimizer", inner_optimizer.state_dict, inner_optimizer.load_state_dict)
        self._registered = ["model", "inner_optimizer"] if register_state else []
        self._inner_steps = 0
        # The job's inner steps: a healed site takes its source's (a data position that heals). Held
        # through a weak reference: the Manager's callbacks must not keep this object alive (a cycle
        # through the C++ Manager is one Python's collector cannot see).
        me = weakref.ref(self)
        manager.register_state_dict("diloco_inner_steps", lambda: {"inner_steps": torch.tensor([me()._inner_steps])},
                                    lambda d: setattr(me(), "_inner_steps", int(d["inner_steps"][0])))
        self._registered.append("diloco_inner_steps")
        self._fragments = self._fragment_lists(model, fragments, layout)
        self._diloco = _C.diloco.DiLoCo(
            manager._manager, self._fragments, int(sync_every), float(outer_lr), float(outer_momentum), bool(nesterov),
            str(codec), bool(error_feedback), int(fragment_delay), float(fragment_alpha), float(round_seconds),
            bool(parameters_sharded), int(piece_bytes))
        self._manager = manager
        manager._attach(self)  # Manager.close() closes this first
        self._started = False
        self._closed = False
        self.last_step_synced = False  # whether the last inner step applied an outer step
        if hasattr(inner_optimizer, "register_step_post_hook"):
            self._hook = inner_optimizer.register_step_post_hook(lambda opt, args, kwargs: me().after_inner_step())
            self._wrapped_step = False
        else:  # torch < 2.0: wrap this optimizer's step
            step = inner_optimizer.step

            def step_then_sync(*args, **kwargs):
                out = step(*args, **kwargs)
                me().after_inner_step()
                return out

            inner_optimizer.step = step_then_sync
            self._hook = None
            self._wrapped_step = True

    @staticmethod
    def _fragment_lists(model, fragments, layout):
        if isinstance(fragments, int):
            if fragments == 1:
                return [list(model.parameters())]
            return fragments_of(layers_of(model), fragments, layout)
        out = []
        for f in fragments:
            out.append(list(f.parameters()) if isinstance(f, torch.nn.Module) else list(f))
        return out

    def start(self):
        """Collective over the site, before the first inner step: the first quorum (a site that
        starts late heals here)."""
        if not self._started:
            self._diloco.start()
            self._started = True

    def after_inner_step(self):
        """Called by the inner optimizer's step (its post hook): syncs fragments on their schedule.
        Returns True when an outer step was applied."""
        if not self._started:
            raise RuntimeError("ddpkit.diloco.DiLoCo: call start() (or enter `with DiLoCo(...)`) before the first "
                               "inner step")
        self._inner_steps += 1
        self.last_step_synced = self._diloco.after_inner_step()
        return self.last_step_synced

    def finish(self):
        """Waits for the fragment in flight, if any, and applies it (the end of training)."""
        self._diloco.finish()

    def load_global_parameters(self):
        """Copies the parameters the sites agree on (the last sync's) into the model, for evaluation."""
        with torch.no_grad():
            for i, params in enumerate(self._fragments):
                flat = self._diloco.global_parameters(i)
                offset = 0
                for p in params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def close(self):
        """Detaches from the optimizer and the Manager (the DiLoCo is done): the optimizer's hook
        and the state it registered go. stats(), outer_steps and load_global_parameters() still
        answer. Manager.close() calls it; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for key in self._registered:
            self._manager.unregister_state_dict(key)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._wrapped_step:
            del self._optimizer.step  # the class's own step again
            self._wrapped_step = False

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, kind, value, traceback):
        if kind is None:
            self.finish()
        self.close()
        return False

    @property
    def inner_steps(self):
        """The job's inner steps so far (a site that heals takes its source's): a data position."""
        return self._inner_steps

    @property
    def outer_steps(self):
        """Outer steps applied to the first fragment: the job's rounds, the same on every site."""
        return self._diloco.outer_steps

    @property
    def fragments(self):
        return self._fragments

    def stats(self):
        """This rank's figures, a dict (the same names as `ddpkit train --diloco`'s JSON):

        inner_steps                 inner steps this rank ran
        outer_syncs                 syncs committed, start()'s (weight 0) included
        sync_retries                attempts redone among the survivors after a site was lost mid-sync
        heals                       times this site copied another's state (it came back, or its global
                                    parameters differed); the first quorum's copy (init sync) is not one
        checksum_mismatches         syncs that found sites whose global parameters differed (should be
                                    0): those were left out of that mean and healed at once
        last_checksum_mismatch      which sites and at which outer step ("" if none)
        last_sites, last_sites_weighted   sites in the last sync, and those whose pseudo-gradient counted
        sync_blocked_seconds        the training thread waiting in syncs (quorum, transfer, commit)
        longest_sync_blocked_seconds, longest_later_sync_blocked_seconds  the longest such wait, of
                                    any sync and of the syncs after the first
        sync_transfer_seconds       from issuing each average to its completion
        sync_wait_seconds           of sync_blocked_seconds, waiting for averages in flight
        site_gather_seconds         all-gathering the mean inside the site (sites of several ranks)
        last_error                  why the last failed attempt failed

        What the site sent across sites is the Manager's stats()["cross_bytes_sent"] (this rank's).
        The names of ddpkit 0.1.0 (syncs, blocked_seconds, longest_blocked_seconds, transfer_seconds,
        wait_seconds) still answer for this release, with a DeprecationWarning naming the new key."""
        return _Stats(self._diloco.stats())


class _Stats(dict):
    """DiLoCo's stats: the keys renamed to the CLI's JSON names still answer for one release."""

    _RENAMED = {"syncs": "outer_syncs", "blocked_seconds": "sync_blocked_seconds",
                "longest_blocked_seconds": "longest_sync_blocked_seconds",
                "transfer_seconds": "sync_transfer_seconds", "wait_seconds": "sync_wait_seconds"}

    def _renamed(self, key):
        new = self._RENAMED[key]
        warnings.warn(f"ddpkit.diloco.DiLoCo.stats()['{key}'] is deprecated: use ['{new}']", DeprecationWarning,
                      stacklevel=3)
        return new

    def __getitem__(self, key):
        if key in self._RENAMED and not dict.__contains__(self, key):
            key = self._renamed(key)
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        if key in self._RENAMED and not dict.__contains__(self, key):
            key = self._renamed(key)
        return dict.get(self, key, default)

    def __reduce__(self):
        # Pickled as an OrderedDict (what a state_dict is): torch.load(weights_only=True), the
        # default from torch 2.6, reads it without this class.
        return (collections.OrderedDict, (), None, None, iter(self.items()))
