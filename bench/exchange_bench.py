#!/usr/bin/env python3
"""Gloo's allgather and alltoall against ddpkit's (point to point per peer, src/comm/gloo_exchange.cpp),
through torch.distributed, one rank per process (torchrun-style environment).

  BK=ddpkit|gloo MB=8 RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. PYTHONPATH=build/python \
      /usr/bin/python3 bench/exchange_bench.py

Run with DDPKIT_SHM=0 on one host (loopback), or in two network namespaces with a shaped link
(bench/plan_validation.py's Hosts); rank 0 prints the median of 5 timed calls per collective.
"""
import os, time, torch, torch.distributed as dist
import ddpkit
backend = os.environ.get("BK", "ddpkit")
dist.init_process_group(backend)
r = dist.get_rank(); w = dist.get_world_size()
def t(f, reps=5):
    f(); ts = []
    for _ in range(reps):
        dist.barrier(); a = time.perf_counter(); f(); ts.append((time.perf_counter() - a) * 1e3)
    return sorted(ts)[len(ts) // 2]
for mb in (int(os.environ.get("MB", "8")),):
    n = mb * 1024 * 1024 // 4
    x = torch.ones(n); out = torch.empty(n * w); src = torch.ones(n * w)
    res = {}
    if backend == "ddpkit" or torch.__version__ >= "2":
        res[f"all_gather_into_tensor, {mb} MiB a rank"] = t(lambda: dist.all_gather_into_tensor(out, x))
    res[f"all_gather (list), {mb} MiB a rank"] = t(lambda: dist.all_gather([torch.empty(n) for _ in range(w)], x))
    res[f"all_to_all_single, {mb} MiB to each peer"] = t(lambda: dist.all_to_all_single(out, src))
    if backend == "ddpkit":
        res[f"reduce_scatter_tensor, {mb} MiB a rank"] = t(lambda: dist.reduce_scatter_tensor(x, src))
    res[f"all_reduce, {mb} MiB"] = t(lambda: dist.all_reduce(x))
    if r == 0:
        for k, v in res.items(): print(f"{backend:6} {k:44} {v:8.1f} ms")
