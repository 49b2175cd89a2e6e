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
sys.path.insert(0, os.path.join(TESTS, "..", "..", "tests"))  # two_hosts: the namespaces themselves
import two_hosts  # noqa: E402


def run_on_two_hosts(module, function, per_host=2, timeout=400):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and ip")
    tag = f"dkb{os.getpid() % 100000}"
    net = f"10.78.{os.getpid() % 200}"
    master = f"{net}.1"
    procs = []
    try:
        try:
            hosts = two_hosts.create(tag, master, f"{net}.2")
        except subprocess.CalledProcessError:
            pytest.skip("cannot create network namespaces here")
        world = 2 * per_host
        port = 29700 + os.getpid() % 200
        for rank in range(world):
            ns, dev = hosts[rank // per_host]
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_host),
                       LOCAL_WORLD_SIZE=str(per_host), MASTER_ADDR=master, MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME=dev, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", USE_LIBUV="0")
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
        two_hosts.remove(tag)


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
