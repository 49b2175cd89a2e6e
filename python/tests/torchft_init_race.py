"""A pytest plugin closing a race in torchft's own manager_integ_test (0.2.0 and nightly 2026.10.26),
whatever the process group: with it torchft's tests pass or fail on the backend alone.

ddp_train_loop runs each replica as a thread of one process. Each seeds the shared global RNG and
builds its model under INIT_LOCK ("all threads share the same RNG"), but draws its inputs with
torch.rand outside that lock, so a replica already training can draw between another's
manual_seed(42) and its model's initialisation. test_ddp_skip_init_sync (init_sync=False: the
models are never synced) then ends with replicas that differ: it failed once in three runs on ddpkit,
and fails every time on Gloo once the window is widened (test_torchft.py shows both).

The fix: the test module's torch.rand takes INIT_LOCK, so draws and seeded builds never interleave.
Nothing else in the tests changes. `-p torchft_init_race_widened` adds a sleep inside the lock to
hit the window on purpose (the demonstration)."""
import threading

import torch

try:
    import torchft.manager_integ_test as _integ
except Exception:  # torchft absent or its layout changed: nothing to close
    _integ = None


class _TorchDrawingUnderInitLock:
    """torch, as the test module sees it, whose rand takes the module's INIT_LOCK."""

    def __init__(self, lock):
        self._lock = lock

    def __getattr__(self, name):
        return getattr(torch, name)

    def rand(self, *args, **kwargs):
        with self._lock:
            return torch.rand(*args, **kwargs)


if _integ is not None and isinstance(getattr(_integ, "INIT_LOCK", None), type(threading.Lock())):
    _integ.torch = _TorchDrawingUnderInitLock(_integ.INIT_LOCK)
