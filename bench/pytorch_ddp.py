#!/usr/bin/python3
"""PyTorch's own DDP (Debian python3-torch, Gloo) on the benchmark MLP, for side-by-side numbers.

    /usr/bin/python3 bench/pytorch_ddp.py --hook allreduce --steps 20
    PYTHONPATH=build/python /usr/bin/python3 bench/pytorch_ddp.py --impl ddpkit --hook int8

Prints one JSON line like ddpkit train: hook, world_size, steps, median_step_ms.
--hook: none (DDP's built-in allreduce), allreduce, fp16, bf16, noop, powersgd, batched_powersgd,
quantize_per_tensor, quantize_per_channel, int8 (ddpkit only), local (no DDP, one process),
local-pair (no DDP, --nproc independent processes side by side: the no-communication floor of a
DDP step on this machine; median_step_ms is the mean of their medians).
--impl ddpkit registers ddpkit's hook of that name (the Python package) on the same PyTorch DDP
model instead of PyTorch's, and adds its traffic and per-bucket launch cost to the line.
With RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (torchrun style), runs just that rank in
this process (bench/netns_hooks.sh runs one rank per network namespace this way).
"""
import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks


def fused_cpu_sgd():
    """Whether this PyTorch's SGD takes fused=True for CPU parameters."""
    try:
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9, fused=True)
        return True
    except (TypeError, RuntimeError, ValueError):
        return False


def build(dims):
    layers = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i + 2 < len(dims):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


NO_DDP = ("local", "local-pair")


def train(rank, world, args, port, queue, master_addr="127.0.0.1"):
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    dims = [int(d) for d in args.mlp_dims.split(",")]
    model = build(dims)
    ddpkit_state = None
    if args.hook not in NO_DDP:
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb,
                                                          gradient_as_bucket_view=args.gradient_as_bucket_view)
        hooks = {
            "allreduce": default_hooks.allreduce_hook,
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook,
            "noop": lambda _, bucket: _noop(bucket),
            "quantize_per_tensor": quantization_hooks.quantization_pertensor_hook,
            "quantize_per_channel": quantization_hooks.quantization_perchannel_hook,
        }
        if args.impl == "ddpkit" and args.hook != "none":
            import ddpkit
            options = {}
            if "powersgd" in args.hook:
                options = {"matrix_approximation_rank": args.powersgd_rank,
                           "start_powerSGD_iter": args.powersgd_start_iter}
            ddpkit_state = ddpkit.register_comm_hook(model, args.hook, **options)
        elif args.hook == "int8":
            raise SystemExit("PyTorch has no int8 hook: use --impl ddpkit")
        elif args.hook in hooks:
            model.register_comm_hook(dist.group.WORLD, hooks[args.hook])
        elif args.hook in ("powersgd", "batched_powersgd"):
            state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                           start_powerSGD_iter=args.powersgd_start_iter)
            model.register_comm_hook(state, powersgd.powerSGD_hook if args.hook == "powersgd"
                                     else powersgd.batched_powerSGD_hook)
    if args.optimizer == "sgd":
        cls, kw = torch.optim.SGD, {"lr": args.lr, "momentum": 0.9}
        if args.fused_sgd:
            kw["fused"] = True
    else:
        cls, kw = (torch.optim.Adam if args.optimizer == "adam" else torch.optim.AdamW), {"lr": args.lr}
    if args.zero:  # PyTorch's ZeRO-1 (its DDP overlap refuses Gloo)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kw)
    else:
        opt = cls(model.parameters(), **kw)
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(args.batch_size, dims[0], generator=gen)
    y = torch.randint(0, dims[-1], (args.batch_size,), generator=gen)
    times = []
    error = None
    try:
        for step in range(args.steps):
            if ddpkit_state is not None and step == 1:  # count traffic from the second step on
                sent_before = sum(b["bytes_sent"] for b in ddpkit_state.bucket_traffic())
                plain_before = sum(b["allreduce_bytes"] for b in ddpkit_state.bucket_traffic())
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=args.zero_grad == "none")
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            times.append((time.perf_counter() - t0) * 1000)
    except Exception as e:  # e.g. bf16 hook refused without CUDA/NCCL
        error = str(e).splitlines()[0][:200]
    state_bytes = sum(t.numel() * t.element_size() for st in (opt.optim if args.zero else opt).state.values()
                      for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    if rank == 0 or args.hook == "local-pair":  # a pair: every process reports
        result = {"hook": args.hook, "impl": args.impl, "world_size": world if args.hook not in NO_DDP else 1,
                  "optimizer": args.optimizer, "zero": "1" if args.zero else "off", "optimizer_state_bytes": state_bytes,
                  "steps": len(times), "median_step_ms": statistics.median(times) if times else None,
                  "error": error}
        if ddpkit_state is not None and len(times) > 1:
            traffic = ddpkit_state.bucket_traffic()
            sent = sum(b["bytes_sent"] for b in traffic) - sent_before
            plain = sum(b["allreduce_bytes"] for b in traffic) - plain_before
            launch = ddpkit_state.launch_stats()
            result.update(bytes_sent_per_step=sent / (len(times) - 1),
                          compression_ratio=plain / sent if sent else None,
                          buckets=len(traffic), python_calls_per_bucket=launch["python_calls_per_bucket"],
                          adapter_us_per_bucket=launch["adapter_us_per_bucket"],
                          launch_us_per_bucket=launch["launch_us_per_bucket"])
        queue.put(result)
    if args.hook not in NO_DDP:
        dist.destroy_process_group()


def _noop(bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def signal_alarm(seconds):
    """Ends a rank that hangs (PyTorch's PowerSGD does on Gloo) with a JSON line instead of forever."""
    import signal

    def expire(*_):
        print(json.dumps({"impl": "pytorch", "error": "no result within %d s (hung)" % seconds}), flush=True)
        os._exit(3)
    signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hook", default="none", choices=["none", "allreduce", "fp16", "bf16", "noop", "local", "local-pair",
                                                      "powersgd",
                                                      "batched_powersgd", "quantize_per_tensor", "quantize_per_channel",
                                                      "int8"])
    p.add_argument("--impl", default="pytorch", choices=["pytorch", "ddpkit"],
                   help="whose hook: PyTorch's, or ddpkit's through its Python package")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--powersgd-start-iter", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    p.add_argument("--gradient-as-bucket-view", action="store_true", help="DDP's option of that name")
    p.add_argument("--mlp-dims", default="1024,4096,4096,1024")
    p.add_argument("--zero-grad", default="none", choices=["none", "zero"],
                   help="none: set grads to None (as ddpkit train; PyTorch 2.x default); zero: zero in place (1.13 default)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    p.add_argument("--zero", action="store_true", help="wrap the optimizer in ZeroRedundancyOptimizer")
    p.add_argument("--fused-sgd", action="store_true",
                   help="SGD(fused=True): one pass per parameter, as ddpkit's SGD (CPU: PyTorch 2.4+)")
    p.add_argument("--timeout", type=int, default=120, help="seconds to wait for a result")
    args = p.parse_args()
    if args.fused_sgd and not fused_cpu_sgd():
        sys.exit("--fused-sgd: PyTorch %s has no fused SGD for CPU tensors (it arrived in 2.4)" % torch.__version__)
    if args.fused_sgd and args.optimizer != "sgd":
        sys.exit("--fused-sgd applies to --optimizer sgd, not %s" % args.optimizer)
    if "RANK" in os.environ and args.hook not in NO_DDP:  # one rank of a torchrun-style job
        import queue as q
        out = q.Queue()
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        signal_alarm(args.timeout)
        train(rank, world, args, int(os.environ["MASTER_PORT"]), out, os.environ["MASTER_ADDR"])
        if rank == 0:
            print(json.dumps(out.get()))
        return 0
    world = 1 if args.hook == "local" else args.nproc
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=train, args=(r, world, args, port, queue)) for r in range(world)]
    for pr in procs:
        pr.start()
    try:
        result = queue.get(timeout=args.timeout)
        if args.hook == "local-pair":
            results = [result] + [queue.get(timeout=args.timeout) for _ in range(world - 1)]
            failed = [r for r in results if r.get("median_step_ms") is None]
            result = failed[0] if failed else dict(
                result, side_by_side=world, median_step_ms=statistics.mean(r["median_step_ms"] for r in results),
                each_median_step_ms=[r["median_step_ms"] for r in results])
    except Exception:
        result = {"hook": args.hook, "impl": "pytorch",
                  "error": "no result within %d s (hung; PyTorch's bf16 hook does this on CPU/Gloo)" % args.timeout}
    for pr in procs:
        pr.join(timeout=5 if result.get("error") else 20)
        if pr.is_alive():  # a rank stuck in a collective its peer abandoned (e.g. bf16 refused)
            pr.kill()
            result["error"] = (result.get("error") or "") + " (a rank hung and was killed)"
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
