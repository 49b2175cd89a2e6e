"""Ranks as real processes for the Python tests: run_ranks(fn, world, *args) starts `world`
spawned processes, each with torch.distributed (Gloo) initialized from torchrun's variables, runs
fn(rank, world, *args) in each and returns their results in rank order. A rank that raises, hangs
past the deadline or dies fails the test with its traceback."""
import io
import multiprocessing
import os
import queue
import sys
import time
import traceback
from datetime import timedelta

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(TESTS)), "tests"))
from ports import free_port  # noqa: E402,F401  (the repository's one way to pick a port; tests import it from here)

# torch's (major, minor): the tests that depend on the release compare against it.
TORCH_MINOR = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def _rank_main(fn, rank, world, port, args, kwargs, results, env, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), USE_LIBUV="0")
    os.environ.update(env or {})
    torch.set_num_threads(1)
    import torch.distributed as dist
    try:
        if backend == "ddpkit":
            import ddpkit  # noqa: F401  registers the backend
        if backend:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        value = fn(rank, world, *args, **kwargs)
        buf = io.BytesIO()
        torch.save(value, buf)  # tensors by value: the rank exits before the parent reads
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world=2, *args, timeout=180, env=None, backend="gloo", kwargs=None):
    """backend: the default group's ("gloo", "ddpkit"), or None to leave initialization to fn;
    kwargs: keyword arguments for fn."""
    # One compute thread per rank, OpenBLAS's included (read when a rank imports torch), as the
    # C++ side runs: results are then reproducible bit for bit.
    os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, args, kwargs or {}, results, env, backend))
             for r in range(world)]
    for p in procs:
        p.start()
    out, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                errors.append(f"timed out after {timeout} s with ranks {sorted(out)} done")
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        errors.append(f"rank(s) {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
                        break
                continue
            if status == "ok":
                out[rank] = torch.load(io.BytesIO(value))
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    return [out[r] for r in range(world)]


def build_binary(env_name):
    path = os.environ.get(env_name)
    if not path or not os.path.exists(path):
        pytest.fail(f"{env_name} is not set to a built binary: run the tests through ctest (scripts/test.sh)",
                    pytrace=False)
    return path
