#!/usr/bin/env python3
"""`ddpkit plan`'s predictions against measured `ddpkit train` steps (issue 33, docs/plan.md).

  bench/plan_validation.py DDPKIT [--only NAME,...] [--steps N] [--out FILE] [--max-step-error X]
                           [--max-memory-error X] [--constants FILE]

For each configuration: `ddpkit plan --json` predicts the step time and peak memory per rank of
exactly that job (same model, world size, strategy, hook, bucket cap, batch, optimizer), then
`ddpkit train` runs it for --steps steps and reports its median step and the largest rank's peak
resident memory. Prints one row per configuration with both and the relative errors, and exits 1
when any error is beyond the limits (default 20 % step, 10 % memory): the test that fails when the
model drifts (ctest plan.validation runs a fixed subset).

Measured steps on this 2-core VM vary by up to +-40 % between runs of the same job; each job is
run once, after one warm-up job that is not scored.
"""
import argparse
import json
import os
import subprocess
import sys
import time

MLP25 = ["--dataset", "synthetic"]                                     # 1024,4096,4096,1024: 25.2M
MLP8 = ["--dataset", "synthetic", "--mlp-dims", "1024,2048,2048,1024"]  # 8.4M
MLP_FASHION = ["--model", "mlp"]                                         # 784,512,256,10: 0.5M
CNN = ["--model", "cnn"]
GPT = ["--model", "transformer", "--batch-size", "16"]
FSDP_UNITS = ["--fsdp-min-unit-params", "1000"]

# name: (world, train flags). Names say model, world, strategy/hook.
CONFIGS = {
    "mlp25-w1-ddp": (1, MLP25),
    "mlp25-w2-ddp": (2, MLP25),
    "mlp25-w4-ddp": (4, MLP25),
    "mlp25-w2-fp16": (2, MLP25 + ["--hook", "fp16"]),
    "mlp25-w2-int8": (2, MLP25 + ["--hook", "int8"]),
    "mlp25-w2-powersgd": (2, MLP25 + ["--hook", "powersgd", "--powersgd-start-iter", "2"]),
    "mlp25-w2-allreduce": (2, MLP25 + ["--hook", "allreduce"]),
    "mlp25-w2-zero1": (2, MLP25 + ["--zero", "1"]),
    "mlp25-w2-zero2": (2, MLP25 + ["--zero", "2"]),
    "mlp25-w2-full_shard": (2, MLP25 + ["--fsdp", "full_shard"] + FSDP_UNITS),
    "mlp25-w4-full_shard": (4, MLP25 + ["--fsdp", "full_shard"] + FSDP_UNITS),
    "mlp25-w2-shard_grad_op": (2, MLP25 + ["--fsdp", "shard_grad_op"] + FSDP_UNITS),
    "mlp25-w2-no_shard": (2, MLP25 + ["--fsdp", "no_shard"] + FSDP_UNITS),
    "mlp25-w2-adam": (2, MLP25 + ["--optimizer", "adam"]),
    "mlp8-w2-ddp": (2, MLP8),
    "mlp8-w4-fp16": (4, MLP8 + ["--hook", "fp16"]),
    "mlp8-w8-ddp": (8, MLP8),
    "mlp8-w4-zero1": (4, MLP8 + ["--zero", "1"]),
    "mlp8-w4-full_shard": (4, MLP8 + ["--fsdp", "full_shard"] + FSDP_UNITS),
    "mlp8-w2-bf16": (2, MLP8 + ["--hook", "bf16"]),
    "mlp8-w1-ddp": (1, MLP8),
    "gpt-w2-ddp": (2, GPT),
    "gpt-w2-full_shard": (2, GPT + ["--fsdp", "full_shard"]),
    "gpt-w4-fp16": (4, GPT + ["--hook", "fp16"]),
    "cnn-w2-ddp": (2, CNN),
    "fashion-w2-ddp": (2, MLP_FASHION),
}
SUBSET = ["mlp8-w2-ddp", "mlp8-w2-bf16", "mlp8-w4-full_shard", "mlp8-w4-zero1"]


def train(ddpkit, world, flags, steps):
    cmd = [ddpkit, "train", "--quiet", "--no-eval", "--nproc", str(world), "--steps", str(steps)] + flags
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plan_flags(flags):
    """`ddpkit train` flags as `ddpkit plan` takes them: one strategy and hook."""
    out, strategy, hook, i = [], "ddp", "none", 0
    while i < len(flags):
        name, value = flags[i], flags[i + 1] if i + 1 < len(flags) else None
        if name == "--zero":
            strategy = "zero" + value
        elif name == "--fsdp":
            strategy = value
        elif name == "--hook":
            hook = value
        elif name == "--powersgd-start-iter":
            pass  # the steps measured are PowerSGD's; the plan predicts those
        else:
            out.append(name)
            if value is not None and not value.startswith("--"):
                out.append(value)
            else:
                i -= 1
        i += 2
    return out + ["--strategy", strategy, "--hook", hook]


def predict(ddpkit, world, flags, constants):
    cmd = [ddpkit, "plan", "--json", "--world-size", str(world)] + plan_flags(flags)
    if constants:
        cmd += ["--constants", constants]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    rows = json.loads(out.stdout)
    if len(rows) != 1:
        raise RuntimeError(f"{' '.join(cmd)} gave {len(rows)} rows, expected the one configuration")
    return rows[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ddpkit")
    ap.add_argument("--only", default="", help="comma-separated names, or 'subset'")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="")
    ap.add_argument("--constants", default="")
    ap.add_argument("--measure-only", action="store_true")
    ap.add_argument("--max-step-error", type=float, default=0.20)
    ap.add_argument("--max-memory-error", type=float, default=0.10)
    a = ap.parse_args()
    names = list(CONFIGS) if not a.only else SUBSET if a.only == "subset" else a.only.split(",")
    for n in names:
        if n not in CONFIGS:
            sys.exit(f"unknown configuration {n!r}; known: {', '.join(CONFIGS)}")
    train(a.ddpkit, 2, MLP8, 10)  # warm-up: page cache, first-run costs; not scored
    print(f"{'configuration':24} {'pred_ms':>8} {'meas_ms':>8} {'err':>6}  {'pred_MB':>8} {'meas_MB':>8} {'err':>6}")
    rows, failed = [], []
    for n in names:
        world, flags = CONFIGS[n]
        pred = None if a.measure_only else predict(a.ddpkit, world, flags, a.constants)
        t0 = time.time()
        meas = train(a.ddpkit, world, flags, a.steps)
        row = {"name": n, "world": world, "flags": flags, "measured_step_ms": meas["median_step_ms"],
               "measured_peak_rss_bytes": meas["peak_rss_bytes"], "measured_forward_ms": meas["median_forward_ms"],
               "measured_backward_ms": meas["median_backward_ms"], "measured_optimizer_ms": meas["median_optimizer_ms"],
               "seconds": round(time.time() - t0, 1)}
        line = f"{n:24} "
        if pred:
            row.update(predicted_step_ms=pred["predicted_step_ms"], predicted_memory_bytes=pred["memory_per_rank_bytes"])
            step_err = pred["predicted_step_ms"] / meas["median_step_ms"] - 1
            mem_err = pred["memory_per_rank_bytes"] / meas["peak_rss_bytes"] - 1
            row.update(step_error=step_err, memory_error=mem_err)
            line += f"{pred['predicted_step_ms']:8.1f} {meas['median_step_ms']:8.1f} {step_err:+6.1%}  "
            line += f"{pred['memory_per_rank_bytes'] / 2**20:8.0f} {meas['peak_rss_bytes'] / 2**20:8.0f} {mem_err:+6.1%}"
            if abs(step_err) > a.max_step_error or abs(mem_err) > a.max_memory_error:
                failed.append(n)
                line += "  <- beyond the limits"
        else:
            line += f"{'':8} {meas['median_step_ms']:8.1f} {'':6}  {'':8} {meas['peak_rss_bytes'] / 2**20:8.0f}"
        print(line, flush=True)
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    if failed:
        print(f"beyond {a.max_step_error:.0%} step / {a.max_memory_error:.0%} memory: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
