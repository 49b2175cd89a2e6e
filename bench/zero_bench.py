#!/usr/bin/python3
"""ZeRO: optimizer state per rank and step time, DDP+Adam vs ZeRO-1 vs ZeRO-1 overlapped vs ZeRO-2.

    bench/zero_bench.py [--reps 3] [--steps 30] [--ddpkit build/ddpkit] [--mlp-dims ...]

2 ranks x 1 thread, Gloo on loopback, Adam, synthetic data, batch 32 per rank. Model: MLP
1024-2048-2048-2048-2048-1024 (14.7M parameters; its layers let a whole-parameter partition come
near 1/2). Every configuration runs --reps times, interleaved; each run reports the median step
time of its steps and the largest optimizer state any rank holds (ddpkit: Adam's exp_avg and
exp_avg_sq as torch::optim allocates them); the table shows medians over reps and ratios to
DDP+Adam, all from this one invocation. PyTorch's own ZeRO-1 (Python DDP + ZeroRedundancyOptimizer,
bench/pytorch_ddp.py) runs alongside; its overlap hooks refuse Gloo, so it has no overlapped row.

Targets (issue 4): state per rank <= 1/world + 5% of the unsharded state; overlapped step <=
non-overlapped step.
"""
import argparse
import os
import statistics
import subprocess
import sys

from pytorch_peer import last_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CONFIGS = [
    ("ddp+adam", ["--zero", "off"]),
    ("zero1", ["--zero", "1"]),
    ("zero1 bucket-view", ["--zero", "1", "--zero-bucket-view"]),
    ("zero1 overlap step", ["--zero", "1", "--zero-overlap", "step", "--zero-shard-buckets", "--zero-bucket-view"]),
    ("zero1 overlap interleaved", ["--zero", "1", "--zero-overlap", "interleaved", "--zero-shard-buckets",
                                   "--zero-bucket-view"]),
    ("zero2", ["--zero", "2"]),
    ("zero2 overlap interleaved", ["--zero", "2", "--zero-overlap", "interleaved"]),
    ("pytorch ddp+adam", None),
    ("pytorch zero1", None),
]


def run(name, extra, args):
    if extra is None:
        cmd = [sys.executable, os.path.join(HERE, "pytorch_ddp.py"), "--hook", "none", "--optimizer", "adam",
               "--lr", "1e-3", "--steps", str(args.steps), "--mlp-dims", args.mlp_dims,
               "--bucket-cap-mb", str(args.bucket_cap_mb)]
        if name.endswith("zero1"):
            cmd.append("--zero")
    else:
        cmd = [args.ddpkit, "train", "--model", "mlp", "--dataset", "synthetic", "--batch-size", "32",
               "--steps", str(args.steps), "--threads", "1", "--no-eval", "--quiet", "--nproc", "2",
               "--optimizer", "adam", "--mlp-dims", args.mlp_dims, "--bucket-cap-mb", str(args.bucket_cap_mb)] + extra
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    result = last_json(out.stdout)
    if not result or result.get("error"):
        raise SystemExit("%s failed: %s\n%s" % (name, result, out.stderr[-2000:]))
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ddpkit", default=os.path.join(ROOT, "build", "ddpkit"))
    p.add_argument("--mlp-dims", default="1024,2048,2048,2048,2048,1024")
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    args = p.parse_args()
    times = {name: [] for name, _ in CONFIGS}
    state = {}
    for rep in range(args.reps):
        for name, extra in CONFIGS:
            r = run(name, extra, args)
            times[name].append(r["median_step_ms"])
            state[name] = r["optimizer_state_bytes"]
            print("rep %d %-28s %8.1f ms  state %d B" % (rep + 1, name, r["median_step_ms"], r["optimizer_state_bytes"]),
                  file=sys.stderr, flush=True)
    base_t = statistics.median(times["ddp+adam"])
    base_s = state["ddp+adam"]
    print("2 ranks, Adam, MLP %s, %d steps x %d reps (median of medians)" % (args.mlp_dims, args.steps, args.reps))
    print("%-28s %12s %10s %16s %10s" % ("config", "step ms", "vs ddp", "state B/rank", "vs ddp"))
    for name, _ in CONFIGS:
        t = statistics.median(times[name])
        print("%-28s %12.1f %9.2fx %16d %9.3fx" % (name, t, t / base_t, state[name], state[name] / base_s))
    world = 2
    target = 1.0 / world + 0.05
    print("state target <= %.2fx: zero1 %.3fx, zero2 %.3fx" % (target, state["zero1"] / base_s, state["zero2"] / base_s))
    for over, plain in (("zero1 overlap step", "zero1 bucket-view"), ("zero1 overlap interleaved", "zero1 bucket-view"),
                        ("zero2 overlap interleaved", "zero2")):
        print("overlapped/non-overlapped: %-26s %.3fx" % (over, statistics.median(times[over]) / statistics.median(times[plain])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
