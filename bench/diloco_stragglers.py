#!/usr/bin/env python3
"""A straggler site under DiLoCo: 2 sites on this host, each pinned to a core of its own, site 1
throttled to half a core (cgroup cpu controller: cfs quota 50 ms per 100 ms), side by side:

  steps    rounds of H inner steps (--diloco H): the fast site waits for the slow one each round
  time     time-budgeted rounds (--round-seconds S): each site runs the steps it can in S seconds,
           its pseudo-gradient weighted by them (DyLU)

  sudo bench/diloco_stragglers.py [--bin build/ddpkit] [--h 32] [--rounds 12] [--round-seconds 2]

Per run: each site's inner steps, its own rate (steps / (training time - time waiting in syncs)),
the job's aggregate rate (all inner steps / the slowest site's training time) over the sum of the
sites' own rates, the tokens trained, and the test loss (global parameters) and loss per token."""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from ft_train import ranks_of  # noqa: E402
from procs import with_openblas_coretype  # noqa: E402

CG = "/sys/fs/cgroup/cpu/ddpkit-straggler"
MODEL = ["--model", "transformer", "--dataset", "text", "--layers", "2", "--d-model", "128", "--heads", "4",
         "--seq-len", "64", "--batch-size", "16", "--threads", "1", "--quiet", "--optimizer", "adamw", "--lr", "0.002",
         "--epochs", "1000"]


def run(args, flags, steps):
    p = subprocess.Popen([args.bin, "train", "--fault-tolerant", "--replica-groups", "2", "--nproc", "1",
                          "--steps", str(steps)] + MODEL + flags,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=with_openblas_coretype(os.environ))
    pids = {}
    end = time.time() + 60
    while len(pids) < 2 and time.time() < end:
        for g in (0, 1):
            if g not in pids and ranks_of(g):
                pids[g] = ranks_of(g)[0]
        time.sleep(0.05)
    for g, pid in pids.items():
        subprocess.run(["taskset", "-a", "-p", "-c", str(g), str(pid)], capture_output=True, check=True)
    with open(f"{CG}/tasks", "w") as f:
        f.write(str(pids[1]))
    out, err = p.communicate(timeout=3600)
    if p.returncode != 0:
        sys.exit(f"FAILED: {' '.join(flags)}: exit {p.returncode}\n{err[-3000:]}")
    return sorted((json.loads(l) for l in out.splitlines() if l.startswith("{")), key=lambda r: r["replica_group"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/ddpkit")
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--round-seconds", type=float, default=2.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if os.geteuid() != 0 or not os.path.isdir("/sys/fs/cgroup/cpu"):
        sys.exit("diloco_stragglers.py: needs root and the cgroup cpu controller at /sys/fs/cgroup/cpu")
    os.makedirs(CG, exist_ok=True)
    with open(f"{CG}/cpu.cfs_period_us", "w") as f:
        f.write("100000")
    with open(f"{CG}/cpu.cfs_quota_us", "w") as f:
        f.write("50000")
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)
    try:
        say(f"# DiLoCo with a straggler: 2 sites, one core each, site 1 capped at half a core; H={args.h}, "
            f"{args.rounds} rounds; time-budgeted rounds of {args.round_seconds} s")
        say(f"{'rounds':<8} {'steps0':>7} {'steps1':>7} {'own0/s':>7} {'own1/s':>7} {'aggr/s':>7} {'vs_sum':>7} "
            f"{'tokens':>8} {'test_loss':>9}")
        # The same number of rounds each way (time-budgeted: --steps / H of them, H a cap never reached).
        cap = args.h * 8
        for name, flags, steps in (("steps", ["--diloco", str(args.h)], args.h * args.rounds),
                                   ("time", ["--diloco", str(cap), "--round-seconds", str(args.round_seconds)],
                                    cap * args.rounds)):
            reps = run(args, flags, steps)
            own = [r["steps_run"] / (r["train_seconds"] - r["sync_blocked_seconds"]) for r in reps]
            wall = max(r["train_seconds"] for r in reps)
            aggregate = sum(r["steps_run"] for r in reps) / wall
            tokens = sum(r["steps_run"] for r in reps) * 16 * 64
            say(f"{name:<8} {reps[0]['steps_run']:>7} {reps[1]['steps_run']:>7} {own[0]:>7.2f} {own[1]:>7.2f} "
                f"{aggregate:>7.2f} {aggregate / sum(own):>7.3f} {tokens:>8} {reps[0]['test_loss']:>9.4f}")
    finally:
        try:
            os.rmdir(CG)
        except OSError:
            pass
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
