#!/usr/bin/python3
"""PyTorch's own DDP, FSDP FULL_SHARD or FSDP2 (fully_shard) on CPU, the workload bench/fsdp_bench.py
--pytorch and bench/fsdp2_backend.py run under ddpkit: ddpkit's MLP (Linear layers, ReLU between)
1024-4096-1024 x4, synthetic data, cross entropy, SGD(lr 0.05, momentum 0.9), batch 32 per rank,
2 ranks, one thread each, every Linear an FSDP unit (ModuleWrapPolicy; for FSDP2 fully_shard on each
Linear, then the root), device_id=cpu. Prints one JSON line: {"mode", "backend", "median_step_ms"}.
FSDP needs PyTorch 2.x (1.13's cannot be imported on Debian 12's Python 3.11), fully_shard on CPU 2.7.

    python3 bench/pytorch_fsdp.py --mode ddp|full_shard|fsdp2 [--backend gloo|ddpkit] [--steps 8]
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pytorch_ddp import build  # ddpkit's MLP layout (bench/pytorch_ddp.py)

DIMS = [1024, 4096, 1024, 4096, 1024, 4096, 1024, 4096, 1024]


def worker(rank, world, port, mode, backend, steps, out, comm_hooks):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0")
    torch.set_num_threads(1)
    if backend == "ddpkit":
        import ddpkit  # noqa: F401  registers the backend
    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.manual_seed(1)
    net = build(DIMS)
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(net)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in net.modules():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(net)
        if comm_hooks:  # ddpkit's FSDP hooks as FSDP2's reduce-scatter (ddpkit.fsdp2)
            import ddpkit.fsdp2
            ddpkit.fsdp2.set_comm_hooks(net, comm_hooks)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        net = FSDP(net, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                   device_id=torch.device("cpu"))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(32, DIMS[0], generator=gen)
    y = torch.randint(0, DIMS[-1], (32,), generator=gen)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1000)
    dist.barrier()
    if rank == 0:
        out.put(statistics.median(times[2:]))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "full_shard", "fsdp2"], required=True)
    ap.add_argument("--backend", choices=["gloo", "ddpkit"], default="gloo")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--comm-hooks", choices=["none", "fp16", "bf16"], default=None,
                    help="fsdp2 on ddpkit: ddpkit.fsdp2.set_comm_hooks(model, CODEC)")
    a = ap.parse_args()
    if a.comm_hooks and (a.mode != "fsdp2" or a.backend != "ddpkit"):
        ap.error("--comm-hooks needs --mode fsdp2 --backend ddpkit")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, a.mode, a.backend, a.steps, q, a.comm_hooks)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"pytorch_fsdp: a rank failed ({[p.exitcode for p in procs]})")
    print(json.dumps({"mode": a.mode, "backend": a.backend, "comm_hooks": a.comm_hooks, "torch": torch.__version__,
                      "median_step_ms": q.get()}))


if __name__ == "__main__":
    main()
