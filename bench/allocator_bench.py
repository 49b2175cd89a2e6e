#!/usr/bin/python3
"""What ddpkit::tune_allocator_for_training() is worth: `ddpkit train` with it (the default) and
without it (--no-malloc-tuning), interleaved, in one run.

    bench/allocator_bench.py [--reps 3] [--steps 20] [--ddpkit build/ddpkit] [--model-args ...]

Default workload: the 25M-parameter MLP (1024-4096-4096-1024), batch 32, 2 ranks x 1 thread, Gloo,
fp32 DDP; also the same model without DDP (one process). Prints the median step per configuration
and the ratio tuned / untuned.
"""
import argparse
import json
import os
import statistics
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_ms(binary, extra, tuned):
    cmd = [binary, "train", "--model", "mlp", "--dataset", "synthetic", "--batch-size", "32", "--threads", "1",
           "--no-eval", "--quiet"] + extra + ([] if tuned else ["--no-malloc-tuning"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "DDPKIT_MALLOC_TUNING"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)["median_step_ms"]
    raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), p.returncode, p.stderr[-1000:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ddpkit", default=os.path.join(ROOT, "build", "ddpkit"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    version = subprocess.run([a.ddpkit, "version"], capture_output=True, text=True).stdout.strip()
    workloads = {"ddp 2 ranks": ["--nproc", "2"], "no ddp (1 process)": ["--no-ddp"]}
    results = {(w, t): [] for w in workloads for t in (True, False)}
    for _ in range(a.reps):
        for w, extra in workloads.items():
            for tuned in (True, False):
                results[(w, tuned)].append(step_ms(a.ddpkit, extra + ["--steps", str(a.steps)], tuned))
    print("# %s; MLP 1024-4096-4096-1024, batch 32, median step ms over %d reps x %d steps" % (version, a.reps, a.steps))
    print("%-20s %10s %10s %8s" % ("workload", "tuned", "untuned", "ratio"))
    for w in workloads:
        t, u = statistics.median(results[(w, True)]), statistics.median(results[(w, False)])
        print("%-20s %10.1f %10.1f %8.2f" % (w, t, u, t / u))
    print("ratio = tuned / untuned (below 1: tune_allocator_for_training makes the step faster)")


if __name__ == "__main__":
    main()
