#!/usr/bin/python3
"""ddpkit's FSDP on one CUDA device over NCCL beside PyTorch's FSDP (FSDP1, FullyShardedDataParallel)
on the same device, same workload, in one run (scripts/check-pip-torch.sh's build, a GPU machine):

    python3 bench/fsdp_cuda_vs_pytorch.py build-pip/fsdp_cuda_bench [--steps 30] [--batch 4096]

Workload: bench/fsdp_cuda_bench.cpp's (MLP 1024-4096-1024 x4, every Linear a unit, cross entropy,
SGD momentum 0.9, batch 4096), one rank: with one GPU, NCCL refuses a second rank on the same
device, so this measures what each FSDP adds to a step around the same kernels, not communication.
Each side trains without FSDP too (`local`; `local bf16`: the whole model in bf16), and each row's
last ratios are over that side's local fp32 and local bf16.
PyTorch runs in this process after ddpkit's runs (one GPU: never at the same time).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from pytorch_ddp import build  # ddpkit's MLP layout (bench/pytorch_ddp.py)

DIMS = [1024, 4096, 1024, 4096, 1024, 4096, 1024, 4096, 1024]
ROWS = [("local", False), ("full_shard", False), ("shard_grad_op", False), ("no_shard", False), ("local", True),
        ("full_shard", True)]


def pytorch_step_ms(mode, bf16, steps, batch, profile=False):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(1)
    net = build(DIMS).cuda()
    if mode == "local" and bf16:
        net = net.bfloat16()
    elif mode != "local":
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
        net = FSDP(net, sharding_strategy=getattr(ShardingStrategy, mode.upper()), mixed_precision=mp,
                   auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), device_id=torch.device("cuda", 0))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(batch, DIMS[0], device="cuda")
    y = torch.randint(0, DIMS[-1], (batch,), device="cuda")
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        inp = x.bfloat16() if mode == "local" and bf16 else x
        torch.nn.functional.cross_entropy(net(inp).float(), y).backward()
        opt.step()
        torch.cuda.synchronize()
        if s >= 3:
            times.append((time.perf_counter() - t0) * 1000)
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(net(x).float(), y).backward()
                opt.step()
            torch.cuda.synchronize()
        print(f"# PyTorch {mode}{' bf16' if bf16 else ''}: its CUDA kernels over 3 steps")
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench", help="path of fsdp_cuda_bench")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--profile", action="store_true", help="print PyTorch's top CUDA kernels for its bf16 FSDP row")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fsdp_cuda_vs_pytorch: no CUDA device")
    ours = {}
    for mode, bf16 in ROWS:
        cmd = [a.bench, "--mode", mode, "--steps", str(a.steps), "--batch", str(a.batch)] + (["--bf16"] if bf16 else [])
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            sys.exit(f"fsdp_cuda_vs_pytorch: {' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
        ours[(mode, bf16)] = json.loads(out.stdout.strip().splitlines()[-1])["median_step_ms"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    theirs = {row: pytorch_step_ms(*row, a.steps, a.batch, a.profile and row == ("full_shard", True)) for row in ROWS}
    dist.destroy_process_group()
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, one rank over NCCL, batch {a.batch}, "
          f"median of {a.steps - 3} steps (3 warm-up)")
    print(f"{'mode':<22}{'ddpkit ms':>11}{'PyTorch ms':>12}{'ddpkit/PyTorch':>16}{'ddpkit/local':>14}{'PyTorch/local':>15}")
    for mode, bf16 in ROWS:
        name = mode + (" bf16" if bf16 else "")
        o, t = ours[(mode, bf16)], theirs[(mode, bf16)]
        print(f"{name:<22}{o:>11.2f}{t:>12.2f}{o / t:>16.3f}{o / ours[('local', bf16)]:>14.3f}"
              f"{t / theirs[('local', bf16)]:>15.3f}")


if __name__ == "__main__":
    main()
