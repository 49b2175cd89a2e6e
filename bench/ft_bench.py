#!/usr/bin/python3
"""What fault tolerance costs when nothing fails, and what a heal costs: one run, side by side.

    bench/ft_bench.py [--reps 3] [--steps 60] [--ddpkit build/ddpkit] [--heal-dims 64,4096,4096,10]

Step: the same job, 2 ranks in all, interleaved --reps times:
  plain   ddpkit train --nproc 2                                  (DDP across both ranks)
  ft      ddpkit train --fault-tolerant --replica-groups 2 --nproc 1  (each rank a replica group:
          the gradient average crosses groups, after backward, under a per-step quorum)
Synthetic MLP (--mlp-dims, default the 25.2M-parameter 1024-4096-4096-1024), batch 32 per rank,
one thread per rank, SGD. The table shows each side's median step (FT: the slower group's) and
the ratio ft/plain (the issue's target: <= 1.05).

Heal: 2 groups of 1 rank train --heal-dims with Adam; once both are in their steps, group 1 is
SIGKILLed; it restarts, copies its state from group 0 and trains on. Printed: the bytes healed,
the heal's time (fetch, including the wait for the source's current step, and load) and its rate.
Both sides run under the same environment (set OPENBLAS_CORETYPE for every side).
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from ft_train import cpu_seconds, ranks_of  # noqa: E402  (finding a replica group's ranks)


def reports(out):
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def train(binary, flags, timeout):
    cmd = [binary, "train", "--dataset", "synthetic", "--batch-size", "32", "--threads", "1", "--no-eval",
           "--quiet"] + flags
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"ft_bench: failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return reports(p.stdout)


def heal(binary, dims, timeout):
    cmd = [binary, "train", "--fault-tolerant", "--replica-groups", "2", "--nproc", "1", "--dataset", "synthetic",
           "--mlp-dims", dims, "--optimizer", "adam", "--batch-size", "32", "--threads", "1", "--epochs", "1000",
           "--steps", "400", "--no-eval", "--quiet"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.time() + timeout
    killed = False
    while time.time() < end and not killed and p.poll() is None:
        pids = ranks_of(1)
        try:
            if pids and ranks_of(0) and cpu_seconds(pids[0]) > 4 and cpu_seconds(ranks_of(0)[0]) > 4:
                os.kill(pids[0], signal.SIGKILL)
                killed = True
        except OSError:
            pass
        time.sleep(0.1)
    out, err = p.communicate(timeout=max(1, end - time.time()))
    if p.returncode != 0 or not killed:
        raise SystemExit(f"ft_bench: the heal run failed (exit {p.returncode}, killed {killed})\n{err[-2000:]}")
    return {r["replica_group"]: r for r in reports(out)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--mlp-dims", default="1024,4096,4096,1024")
    p.add_argument("--heal-dims", default="64,4096,4096,10")
    p.add_argument("--ddpkit", default=os.path.join(ROOT, "build", "ddpkit"))
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    args = p.parse_args()
    common = ["--mlp-dims", args.mlp_dims, "--steps", str(args.steps)]
    sides = {"plain": ["--nproc", "2"], "ft": ["--fault-tolerant", "--replica-groups", "2", "--nproc", "1"]}
    steps = {k: [] for k in sides}
    for rep in range(args.reps):
        for name, flags in sides.items():
            rs = train(args.ddpkit, common + flags, args.timeout)
            ms = max(r["median_step_ms"] for r in rs)
            steps[name].append(ms)
            print(f"  rep {rep + 1} {name:6s} step {ms:8.1f} ms", flush=True)
    plain, ft = statistics.median(steps["plain"]), statistics.median(steps["ft"])
    print(f"\nside    step ms (median of {args.reps})  vs plain")
    print(f"plain   {plain:10.1f}                  1.000")
    print(f"ft      {ft:10.1f}                  {ft / plain:.3f}   (target <= 1.05)")

    groups = heal(args.ddpkit, args.heal_dims, args.timeout)
    h = groups[1]
    rate = h["heal_bytes"] / h["heal_seconds"] / 1e9 if h["heal_seconds"] > 0 else float("nan")
    print(f"\nheal of group 1 ({args.heal_dims}, Adam): {h['heal_bytes'] / 1e6:.1f} MB in {h['heal_seconds']:.3f} s "
          f"(fetch {h['heal_fetch_seconds']:.3f} s, through the memory file: {h['heals_through_memory_file']}), "
          f"{rate:.2f} GB/s; the source's snapshots took {groups[0]['snapshot_seconds']:.3f} s; "
          f"parameters equal: {groups[0]['parameter_checksum'] == h['parameter_checksum']}")


if __name__ == "__main__":
    main()
