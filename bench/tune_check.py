#!/usr/bin/env python3
"""`ddpkit tune`'s pick against every configuration measured (issue 33's target: within 5 % of the
best), on three workloads.

  bench/tune_check.py DDPKIT [--constants FILE] [--trial-steps 30] [--trial-rounds 3] [--top 4] [--only WORKLOAD,...]

Per workload: `ddpkit tune --top 99` trials every configuration the plan lists that fits (the
exhaustive measurement), then `ddpkit tune --top K` picks; the pick's step in the exhaustive table
is compared with the fastest there. Both runs measure with the same trial length and rounds (each
configuration's step the median of its trials, one per round); this 2-core VM's run-to-run noise
(10-20 % on some jobs) is in both.
"""
import argparse
import re
import subprocess
import sys

WORKLOADS = {
    "mlp25 x2": ["--dataset", "synthetic", "--world-size", "2", "--fsdp-min-unit-params", "1000"],
    "mlp8 x4": ["--dataset", "synthetic", "--mlp-dims", "1024,2048,2048,1024", "--world-size", "4",
                "--fsdp-min-unit-params", "1000"],
    "gpt x2": ["--model", "transformer", "--batch-size", "16", "--world-size", "2"],
}
# strategy, hook, cap_MB, predicted_ms, measured_ms, memory_MB, trial
ROW = re.compile(r"^(\S+)\s+(\S+)\s+(\S+)\s+([\d.]+)\s+([\d.]+|-)\s+(\d+|-)\s+(ok|diverged|failed)$")


def tune(ddpkit, flags, top, steps, rounds, constants):
    cmd = [ddpkit, "tune", "--top", str(top), "--trial-steps", str(steps), "--trial-rounds", str(rounds)] + flags
    if constants:
        cmd += ["--constants", constants]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stdout[-1500:]} {out.stderr[-1500:]}")
    rows = {}
    for line in out.stdout.splitlines():
        m = ROW.match(line.strip())
        if m and m.group(7) == "ok":
            rows[(m.group(1), m.group(2))] = float(m.group(5))
    if not rows:
        raise RuntimeError(f"{' '.join(cmd)}: no trial that finished ok in its output:\n{out.stdout[-1500:]}")
    return rows, out.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ddpkit")
    ap.add_argument("--constants", default="")
    ap.add_argument("--trial-steps", type=int, default=30)
    ap.add_argument("--trial-rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated workloads (default: all): " + ", ".join(WORKLOADS))
    a = ap.parse_args()
    only = [w for w in a.only.split(",") if w]
    for w in only:
        if w not in WORKLOADS:
            sys.exit(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    worst = 0
    for name, flags in WORKLOADS.items():
        if only and name not in only:
            continue
        every, table = tune(a.ddpkit, flags, 99, a.trial_steps, a.trial_rounds, a.constants)
        print(f"## {name}: every configuration that fits\n{table}", flush=True)
        trials, _ = tune(a.ddpkit, flags, a.top, a.trial_steps, a.trial_rounds, a.constants)
        pick = min(trials, key=trials.get)  # the trial tune found fastest: its pick
        best = min(every, key=every.get)
        ratio = every[pick] / every[best] if pick in every else float("nan")
        worst = max(worst, ratio)
        print(f"{name}: tune --top {a.top} picked {pick[0]}/{pick[1]} ({every.get(pick, float('nan')):.1f} ms in the "
              f"exhaustive run); fastest there {best[0]}/{best[1]} ({every[best]:.1f} ms): {ratio:.3f}x\n", flush=True)
    print(f"worst pick / best: {worst:.3f}x (target <= 1.05)")
    return 0 if worst <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
