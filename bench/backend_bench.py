#!/usr/bin/python3
"""torch.distributed collectives on the ddpkit backend against gloo, nccl-tests style (issue 32).

    PYTHONPATH=build/python bench/backend_bench.py [--nproc 2,4] [--max-mb 256] [--ops all_reduce,...]
                                                   [--train ddp,fsdp] [--steps 10] [--timing blocks]

Each rank is a process running the Python's own torch; both backends run side by side in one job
(a gloo default group and a ddpkit group over the same ranks), one compute thread per rank, glibc's
thresholds pinned on both sides. Per size: time (as nccl-tests: iterations back to back, a block's
time over its count (3-12 iterations); the median of four blocks a backend, the backends' blocks
alternating; the slowest rank's; --timing alternate times single iterations instead, the backends
taking turns),
algbw = bytes / time and busbw = algbw x the collective's factor: 2(n-1)/n for all_reduce, (n-1)/n
for all_gather_into_tensor and reduce_scatter_tensor (what each rank must send, as nccl-tests).
Where gloo lacks the operation (1.13: all_gather_into_tensor, reduce_scatter_tensor) its column
shows the closest form it has: all_gather's list form; reduce_scatter as all_reduce + slice.

--train times whole training steps of PyTorch's own wrappers on each group, side by side: ddp is
DistributedDataParallel on the MLP of bench/ddp_vs_pytorch.py (1024-4096-4096-1024, batch 32 per
rank, SGD with momentum); fsdp (torch 2.x) is FSDP FULL_SHARD, device_id=cpu, every Linear a unit,
on the MLP of bench/pytorch_fsdp.py (1024-4096-1024 x4). After a short warm-up run on each
backend, each runs twice (ddpkit, gloo, gloo, ddpkit); the figure is the median step (first two
steps of each run left out), slowest rank. For ddp it also runs DDP with PyTorch's noop comm hook
(no collective at all: the floor of any backend). For fsdp it also prints the time inside the
collectives FSDP calls (median per step, slowest rank) and the step less it, over gloo's step: the
ratio no backend could beat.
"""
import argparse
import os
import queue
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather_into_tensor": lambda n: (n - 1) / n,
          "reduce_scatter_tensor": lambda n: (n - 1) / n}


def run_op(op, group, backend, buf, out, world):
    """One collective; `buf` is the input (all_reduce: in place), `out` the output."""
    if op == "all_reduce":
        dist.all_reduce(buf, group=group)
    elif op == "all_gather_into_tensor":
        if backend == "gloo" and not hasattr(dist, "all_gather_into_tensor"):
            dist.all_gather(list(out.chunk(world)), buf, group=group)
        else:
            try:
                dist.all_gather_into_tensor(out, buf, group=group)
            except RuntimeError:
                dist.all_gather(list(out.chunk(world)), buf, group=group)
    else:  # reduce_scatter_tensor: buf is the input, out the output
        if backend == "gloo":
            try:
                dist.reduce_scatter_tensor(out, buf, group=group)
            except (RuntimeError, AttributeError):
                dist.all_reduce(buf, group=group)
                out.copy_(buf.chunk(world)[dist.get_rank(group)])
        else:
            dist.reduce_scatter_tensor(out, buf, group=group) if hasattr(dist, "reduce_scatter_tensor") \
                else dist._reduce_scatter_base(out, buf, group=group)


def train_steps(mode, group, rank, steps, free=False):
    """free (ddp): PyTorch's noop comm hook, DDP with every collective left out: its floor."""
    from pytorch_ddp import build
    from pytorch_fsdp import DIMS as FSDP_DIMS
    torch.manual_seed(1)
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(build([1024, 4096, 4096, 1024]), process_group=group)
        if free:
            from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
            net.register_comm_hook(None, noop_hook)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        net = FSDP(build(FSDP_DIMS), process_group=group,
                   sharding_strategy=ShardingStrategy.FULL_SHARD,
                   auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), device_id=torch.device("cpu"))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(32, 1024, generator=gen)
    y = torch.randint(0, 1024, (32,), generator=gen)
    times, inside = [], []
    with CollectiveClock() as clock:
        for _ in range(steps):
            dist.barrier(group=group)
            clock.ms = 0.0
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            inside.append(clock.ms / 1e3)
    return times[2:], inside[2:]


class CollectiveClock:
    """Time spent inside the torch.distributed calls a wrapper makes from Python (FSDP's gathers
    and reduce-scatters; DDP's reducer calls its group from C++ and is not seen): a step less it is
    the step with free collectives, the floor any backend could reach."""
    NAMES = ("all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor", "_reduce_scatter_base",
             "all_reduce", "broadcast", "all_gather")

    def __enter__(self):
        self.ms, self.saved = 0.0, {}
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def timed(*args, _fn=fn, **kwargs):
                t0 = time.perf_counter()
                work = _fn(*args, **kwargs)
                if work is not None and kwargs.get("async_op"):
                    work.wait()
                self.ms += (time.perf_counter() - t0) * 1e3
                return work
            setattr(dist, name, timed)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def rank_main(rank, world, port, sizes, ops, results, train, steps, timing):
    # USE_LIBUV=0: Debian's torch 2.x is built without libuv, which its TCPStore asks for by default.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0")
    torch.set_num_threads(1)
    import ddpkit  # noqa: F401
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = {"gloo": dist.group.WORLD, "ddpkit": dist.new_group(backend="ddpkit")}
    rows = []
    for op in ops:
        for size in sizes:
            n = max(world, size // 4 // world * world)  # fp32 elements, divisible by the world
            bufs = {}
            for backend in ("ddpkit", "gloo"):
                if op == "all_gather_into_tensor":
                    bufs[backend] = (torch.ones(n // world), torch.empty(n))
                elif op == "reduce_scatter_tensor":
                    bufs[backend] = (torch.ones(n), torch.empty(n // world))
                else:
                    bufs[backend] = (torch.ones(n), None)
                run_op(op, groups[backend], backend, *bufs[backend], world)  # warm-up
            times = {"ddpkit": [], "gloo": []}
            if timing == "blocks":
                # nccl-tests' way: iterations back to back, the time a block took over its count; the
                # two backends' blocks alternate (ddpkit, gloo, gloo, ddpkit, ...), so both see the
                # same moments of this machine.
                blocks, per_block = 4, max(3, min(12, int(2.5e8 // max(size, 1))))
                for i in range(blocks):
                    for backend in (("ddpkit", "gloo") if i % 2 == 0 else ("gloo", "ddpkit")):
                        dist.barrier(group=groups["ddpkit"])
                        t0 = time.perf_counter()
                        for _ in range(per_block):
                            run_op(op, groups[backend], backend, *bufs[backend], world)
                        times[backend].append((time.perf_counter() - t0) / per_block)
            else:
                iters = max(3, min(50, int(2e8 // max(size, 1))))
                # One iteration at a time after a barrier, the backends alternating: each starts with
                # the other's data in the caches and its own threads asleep.
                for _ in range(iters):
                    for backend in ("ddpkit", "gloo"):
                        dist.barrier(group=groups["ddpkit"])
                        t0 = time.perf_counter()
                        run_op(op, groups[backend], backend, *bufs[backend], world)
                        times[backend].append(time.perf_counter() - t0)
            for backend in ("ddpkit", "gloo"):
                t = torch.tensor([statistics.median(times[backend])], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups["ddpkit"])
                rows.append((op, n * 4, backend, t.item()))
    for mode in train:
        times = {"ddpkit": [], "gloo": []}
        inside = {"ddpkit": [], "gloo": []}
        for backend in ("gloo", "ddpkit"):  # warm-up: a process's first model pays its heap's page faults
            train_steps(mode, groups[backend], rank, 3)
        order = ("ddpkit", "gloo", "gloo", "ddpkit")
        if mode == "ddp":
            times["free"], inside["free"] = [], []
            order = ("ddpkit", "gloo", "free", "free", "gloo", "ddpkit")
        for backend in order:
            step, coll = train_steps(mode, groups["ddpkit" if backend == "free" else backend], rank, steps,
                                     free=backend == "free")
            times[backend] += step
            inside[backend] += coll
        for backend in times:
            t = torch.tensor([statistics.median(times[backend]), statistics.median(inside[backend])],
                             dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups["gloo"])
            rows.append(("train:" + mode, 0, backend, t[0].item()))
            rows.append(("collectives:" + mode, 0, backend, t[1].item()))
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", default="2,4")
    ap.add_argument("--min-kb", type=int, default=1)
    ap.add_argument("--max-mb", type=int, default=256)
    ap.add_argument("--ops", default="all_reduce,all_gather_into_tensor,reduce_scatter_tensor")
    ap.add_argument("--train", default="", help="ddp,fsdp: training steps of PyTorch's wrappers on each group")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--timing", choices=("blocks", "alternate"), default="blocks",
                    help="blocks: iterations back to back, as nccl-tests (default); alternate: one at a time, "
                         "the backends taking turns")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # pytorch_ddp's and pytorch_fsdp's MLPs
    # One compute thread per rank, BLAS included (the ranks inherit this before importing torch).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
    sizes, s = [], a.min_kb * 1024
    while s <= a.max_mb << 20:
        sizes.append(s)
        s *= 4
    ops = [o for o in a.ops.split(",") if o]
    train = [t for t in a.train.split(",") if t]
    how = ("the median block of back-to-back iterations (time / count)" if a.timing == "blocks"
           else "the median iteration, one at a time")
    print(f"torch {torch.__version__}; fp32; time = {how}, slowest rank; "
          "busbw factor 2(n-1)/n (all_reduce), (n-1)/n (gather/scatter)")
    for world in [int(x) for x in a.nproc.split(",")]:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = [ctx.Process(target=rank_main, args=(r, world, port, sizes, ops, q, train, a.steps, a.timing)) for r in range(world)]
        for p in procs:
            p.start()
        rows = None
        while rows is None:  # a rank that dies ends the bench instead of leaving it waiting
            try:
                rows = q.get(timeout=5)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    sys.exit(f"backend_bench: a rank failed (exit codes {[p.exitcode for p in procs]})")
        for p in procs:
            p.join()
        by = {(op, b, backend): t for op, b, backend, t in rows}
        for op in ops:
            print(f"\n{op}, {world} ranks")
            print(f"{'size':>10} {'ddpkit us':>11} {'algbw GB/s':>10} {'busbw GB/s':>10} {'gloo us':>11} "
                  f"{'busbw GB/s':>10} {'speedup':>8}")
            for b in sorted({b for (o, b, _) in by if o == op}):
                td, tg = by[(op, b, "ddpkit")], by[(op, b, "gloo")]
                f = FACTOR[op](world)
                print(f"{b:>10} {td * 1e6:>11.1f} {b / td / 1e9:>10.2f} {b / td / 1e9 * f:>10.2f} {tg * 1e6:>11.1f} "
                      f"{b / tg / 1e9 * f:>10.2f} {tg / td:>8.2f}")
        for mode in train:
            td, tg = by[("train:" + mode, 0, "ddpkit")], by[("train:" + mode, 0, "gloo")]
            print(f"\n{mode} step, {world} ranks: ddpkit {td * 1e3:.1f} ms, gloo {tg * 1e3:.1f} ms, "
                  f"ddpkit/gloo {td / tg:.2f}x")
            if ("train:" + mode, 0, "free") in by:
                tf = by[("train:" + mode, 0, "free")]
                print(f"  with no collectives (PyTorch's noop hook): {tf * 1e3:.1f} ms, {tf / tg:.2f}x gloo's: "
                      f"ddpkit's collectives add {(td - tf) * 1e3:.1f} ms, gloo's {(tg - tf) * 1e3:.1f} ms")
            cd, cg = by[("collectives:" + mode, 0, "ddpkit")], by[("collectives:" + mode, 0, "gloo")]
            if cd > 0 and cg > 0:  # the wrapper's collectives are called from Python (FSDP, not DDP)
                print(f"  inside its collectives: ddpkit {cd * 1e3:.1f} ms, gloo {cg * 1e3:.1f} ms; the rest of the "
                      f"step {(td - cd) * 1e3:.1f} / {(tg - cg) * 1e3:.1f} ms: with free collectives the step "
                      f"would be {(td - cd) / tg:.2f}x gloo's")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
