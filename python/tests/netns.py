"""Ranks on two "hosts": two network namespaces joined by a veth pair, `per_host` rank processes in
each. Ranks in one namespace share memory (ddpkit tells hosts apart by network namespace); between
the namespaces traffic goes over the veth. The namespaces are removed on every exit. Needs root
and `ip`; run_on_two_hosts skips the calling test otherwise.

A rank runs `python3 netns.py MODULE FUNCTION` in its namespace: torch.distributed's default
group (Gloo, env://) is made, then MODULE.FUNCTION(rank, world) runs; a rank that raises fails."""
import os
import shutil
import subprocess
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def run_on_two_hosts(module, function, per_host=2, timeout=400):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and ip")
    tag = f"dkb{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    net = f"10.78.{os.getpid() % 200}"
    addr = {a: f"{net}.1", b: f"{net}.2"}
    dev = {a: f"{tag}x", b: f"{tag}y"}
    procs = []
    try:
        try:
            _ip("netns", "add", a)
        except subprocess.CalledProcessError:
            pytest.skip("cannot create network namespaces here")
        _ip("netns", "add", b)
        _ip("link", "add", dev[a], "type", "veth", "peer", "name", dev[b])
        for ns in (a, b):
            _ip("link", "set", dev[ns], "netns", ns)
            _ip("-n", ns, "addr", "add", addr[ns] + "/24", "dev", dev[ns])
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev[ns], "up")
        world = 2 * per_host
        port = 29700 + os.getpid() % 200
        for rank in range(world):
            ns = a if rank < per_host else b
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_host),
                       LOCAL_WORLD_SIZE=str(per_host), MASTER_ADDR=addr[a], MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME=dev[ns], OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", USE_LIBUV="0")
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, os.path.join(TESTS, "netns.py"),
                                           module, function], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        failures = []
        for rank, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failures.append(f"rank {rank}: no result within {timeout} s")
                continue
            if p.returncode != 0:
                failures.append(f"rank {rank} (exit {p.returncode}):\n{out[-3000:]}")
        assert not failures, "\n".join(failures)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


if __name__ == "__main__":
    import datetime
    import importlib

    import torch
    import torch.distributed as dist
    sys.path.insert(0, TESTS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    getattr(importlib.import_module(sys.argv[1]), sys.argv[2])(dist.get_rank(), dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()
    print("ok")
