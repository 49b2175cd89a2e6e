#!/usr/bin/python3
"""Memory and step time of DDP, ZeRO-1, ZeRO-2 and each FSDP strategy, side by side in one run (issue 31).

    bench/fsdp_bench.py [--bin build/ddpkit] [--worlds 2,4] [--steps 6] [--reps 1] [--malloc pinned|default]
    bench/fsdp_bench.py --pytorch          # + PyTorch's own FSDP FULL_SHARD and DDP on the same MLP
                                           #   (bench/pytorch_fsdp.py, whichever torch python3 has)
    bench/fsdp_bench.py --worlds "" --pytorch   # the PyTorch comparison alone

Every row is `ddpkit train` on local processes: the synthetic-data MLP of about 100M parameters
(1024-4096x6-1024, 92.3M) with Adam, batch 8 per rank, one compute thread per rank, glibc's
thresholds pinned to 1 GiB on every side (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_, which
ddpkit's own tuning also sets). Memory is the largest rank's high-water mark (VmHWM, the
`peak_rss_bytes` of the JSON line): the process floor (libtorch, the data) is in every row, so the
ratios understate what sharding saves on the model state itself. VmHWM also counts shared memory a
rank only reads (FSDP's shards, DDP's gradient arena: every rank maps its peers') and libtorch's
code in every rank, so the rows also give "pss MB", the ranks' mean peak with every page counted
once across the host's processes (`mean_peak_pss_bytes` of `ddpkit train`'s JSON, the figure for
comparing strategies on one host). As root each rank also runs in a memory cgroup of its own:
"charged MB" is the largest rank's peak of memory the kernel charged it (a shared page counts once,
for its first toucher), and "job MB / W" the whole job's peak (the parent cgroup's) per rank: the
host's own figure, which the PSS column should follow. Each FSDP layer is a unit.
With --pytorch, the speed comparison runs the issue's MLP (4 blocks 1024-4096-1024, 33.6M
parameters, SGD, batch 32) under ddpkit and under PyTorch, each Linear a unit on both sides.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
BIG = ["--dataset", "synthetic", "--mlp-dims", "1024,4096,4096,4096,4096,4096,4096,1024", "--synthetic-size", "512",
       "--batch-size", "8", "--optimizer", "adam", "--no-eval", "--quiet", "--fsdp-min-unit-params", "1000000"]
CONFIGS = [("DDP", []), ("ZeRO-1", ["--zero", "1"]), ("ZeRO-2", ["--zero", "2"]),
           ("FSDP full_shard", ["--fsdp", "full_shard"]), ("FSDP shard_grad_op", ["--fsdp", "shard_grad_op"]),
           ("FSDP no_shard", ["--fsdp", "no_shard"]), ("FSDP hybrid_shard", ["--fsdp", "hybrid_shard"])]
ISSUE_MLP = ["--dataset", "synthetic", "--mlp-dims", "1024,4096,1024,4096,1024,4096,1024,4096,1024",
             "--synthetic-size", "2048", "--batch-size", "32", "--no-eval", "--quiet", "--fsdp-min-unit-params", "1000000"]


MALLOC_MODE = "pinned"


def run(binary, args, nproc=None):
    # pinned: glibc's thresholds at 1 GiB (ddpkit's tuning); default: glibc's own on both sides.
    env = dict(os.environ, **MALLOC) if MALLOC_MODE == "pinned" else dict(os.environ, DDPKIT_MALLOC_TUNING="0")
    groups = None
    cmd = [binary, "train"] + args
    if nproc and os.geteuid() == 0:
        from fsdp_capacity import Cgroups  # bench/fsdp_capacity.py
        groups = Cgroups(nproc, 1 << 40)
        script = f"echo $$ > {groups.root}/rank$RANK/cgroup.procs && exec " + " ".join(cmd)
        cmd = [binary, "launch", "--nproc", str(nproc), "/bin/sh", "-c", script]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if out.returncode != 0:
            sys.exit(f"FAILED: ddpkit train {' '.join(args)}\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["charged_bytes"] = groups.peak_bytes() if groups else 0
        r["job_bytes_per_rank"] = groups.job_peak_bytes() / nproc if groups else 0
        return r
    finally:
        if groups:
            groups.remove()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build", "ddpkit"))
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reps", type=int, default=1, help="rounds over the configurations, interleaved; medians shown")
    ap.add_argument("--pytorch", action="store_true")
    ap.add_argument("--malloc", choices=["pinned", "default"], default="pinned")
    ap.add_argument("--configs", default="", help="comma-separated names to run (default: all)")
    a = ap.parse_args()
    global MALLOC_MODE
    MALLOC_MODE = a.malloc
    worlds = [int(x) for x in a.worlds.split(",") if x]
    if worlds:
        print(f"ddpkit train, MLP 1024-4096x6-1024 (92.3M parameters), Adam, batch 8/rank, 1 thread/rank, malloc {a.malloc}")
        print(f"{'config':<20} {'W':>2} {'step ms':>9} {'peak MB':>9} {'vs DDP':>7} {'pss MB':>8} {'vs DDP':>7} "
              f"{'charged MB':>10} {'vs DDP':>7} {'job MB / W':>10} {'vs DDP':>7} {'vs DDP time':>11} {'optim state MB':>14}")
    for w in worlds:
        # --reps rounds, the configurations interleaved within each; the median round per figure.
        runs = {}
        for _ in range(a.reps):
            for name, extra in CONFIGS:
                if a.configs and name not in a.configs.split(","):
                    continue
                runs.setdefault(name, []).append(run(a.bin, BIG + extra + ["--nproc", str(w), "--steps", str(a.steps)], nproc=w))
        med = lambda name, key: statistics.median(r[key] for r in runs[name])
        base = next(iter(runs))
        def mb_and_ratio(name, key, width):
            if not med(base, key):
                return f"{'-':>{width}} {'-':>7}"
            return f"{med(name, key) / 2**20:>{width}.0f} {med(name, key) / med(base, key):>7.2f}"

        for name in runs:
            print(f"{name:<20} {w:>2} {med(name, 'median_step_ms'):>9.1f} {mb_and_ratio(name, 'peak_rss_bytes', 9)} "
                  f"{mb_and_ratio(name, 'mean_peak_pss_bytes', 8)} {mb_and_ratio(name, 'charged_bytes', 10)} "
                  f"{mb_and_ratio(name, 'job_bytes_per_rank', 10)} "
                  f"{med(name, 'median_step_ms') / med(base, 'median_step_ms'):>11.2f} "
                  f"{med(name, 'optimizer_state_bytes') / 2**20:>14.0f}", flush=True)
    if a.pytorch:
        print("\nSpeed against PyTorch (the issue's MLP: 4 blocks 1024-4096-1024, 33.6M parameters, SGD, batch 32/rank, "
              "W=2, 1 thread/rank, each Linear a unit, malloc pinned)")
        steps = max(a.steps, 8)
        ours = {name: run(a.bin, ISSUE_MLP + extra + ["--nproc", "2", "--steps", str(steps)])["median_step_ms"]
                for name, extra in [("ddp", []), ("full_shard", ["--fsdp", "full_shard"])]}
        env = dict(os.environ, **MALLOC)
        theirs = {}
        for mode in ["ddp", "full_shard"]:
            out = subprocess.run([sys.executable, os.path.join(HERE, "pytorch_fsdp.py"), "--mode", mode, "--steps", str(steps)],
                                 env=env, capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                sys.exit(f"FAILED: pytorch_fsdp.py --mode {mode}\n{out.stderr[-3000:]}")
            theirs[mode] = json.loads(out.stdout.strip().splitlines()[-1])["median_step_ms"]
        import torch
        print(f"{'':<22} {'ddpkit ms':>10} {'PyTorch ' + torch.__version__.split('+')[0] + ' ms':>16} {'ratio':>7}")
        for mode in ["ddp", "full_shard"]:
            print(f"{mode:<22} {ours[mode]:>10.1f} {theirs[mode]:>16.1f} {ours[mode] / theirs[mode]:>7.2f}")
        print(f"ddpkit FULL_SHARD / ddpkit DDP: {ours['full_shard'] / ours['ddp']:.2f}")


if __name__ == "__main__":
    main()
