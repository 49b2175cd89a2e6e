#!/usr/bin/python3
"""Two builds of ddpkit side by side, for a change that must not slow anything (the transport
interface of issue 54, say): collective_bench's table, and `ddpkit train` steps under DDP and FSDP,
each build's runs interleaved, printing after/before ratios.

    bench/build_compare.py --before DIR --after DIR [--reps 3] [--steps 20] [--max-mb 64]

DIR holds a build's `ddpkit`, `collective_bench` and its shared libraries (a copy of build/ made
before the change will do: `cp build/ddpkit build/collective_bench build/lib*.so DIR`); each runs
with LD_LIBRARY_PATH=DIR. Every run gets the same environment (OPENBLAS_CORETYPE as given, one
intra-op thread). Ratios are after/before medians: below 1 is faster after.

Workloads (25M-parameter MLP 1024-4096-4096-1024, batch 32, 2 ranks x 1 thread, synthetic data):
DDP (built-in allreduce, in place in shared memory), DDP with the bf16 hook (two-phase pieces
through shared memory), FSDP full_shard; the same DDP over Gloo (DDPKIT_SHM=0).
"""
import argparse
import json
import os
import re
import statistics
import subprocess

WORKLOADS = {
    "ddp": ([], {}),
    "ddp bf16 hook": (["--hook", "bf16"], {}),
    "fsdp full_shard": (["--fsdp", "full_shard", "--fsdp-min-unit-params", "1000"], {}),
    "ddp over gloo": ([], {"DDPKIT_SHM": "0"}),
}
ROW = re.compile(r"^(\S.*?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+x$")


def env_for(build, extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "DDPKIT_SHM"}
    env.update(LD_LIBRARY_PATH=build, OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


def train(build, flags, extra_env, steps):
    cmd = [os.path.join(build, "ddpkit"), "train", "--model", "mlp", "--dataset", "synthetic", "--batch-size", "32",
           "--threads", "1", "--nproc", "2", "--steps", str(steps), "--no-eval", "--quiet"] + flags
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env_for(build, extra_env))
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)["median_step_ms"]
    raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), p.returncode, p.stderr[-1500:]))


def collectives(build, max_mb):
    cmd = [os.path.join(build, "collective_bench"), "--ranks", "2", "--reps", "5", "--max-mb", str(max_mb)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env_for(build))
    if p.returncode:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), p.returncode, p.stderr[-1500:]))
    rows = {}
    for line in p.stdout.splitlines():
        m = ROW.match(line)
        if m:
            rows[(m.group(1).strip(), int(m.group(2)))] = (float(m.group(3)), float(m.group(4)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-mb", type=int, default=64)
    a = ap.parse_args()
    builds = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after)}
    print("# bench/build_compare.py --reps %d --steps %d --max-mb %d; OPENBLAS_CORETYPE=%s" %
          (a.reps, a.steps, a.max_mb, os.environ.get("OPENBLAS_CORETYPE", "(unset)")))
    for name, path in builds.items():
        print("# %s: %s" % (name, path))
    tables = {name: [] for name in builds}
    steps = {(w, name): [] for w in WORKLOADS for name in builds}
    for rep in range(a.reps):
        order = list(builds) if rep % 2 == 0 else list(reversed(builds))
        for name in order:
            tables[name].append(collectives(builds[name], a.max_mb))
        for w, (flags, extra_env) in WORKLOADS.items():
            for name in order:
                steps[(w, name)].append(train(builds[name], flags, extra_env, a.steps))
    print("\n# collective_bench, 2 ranks as threads: median ms over the runs, after/before")
    print("%-20s %10s %11s %11s %7s %11s %11s %7s" %
          ("op", "bytes", "gloo_before", "gloo_after", "ratio", "shm_before", "shm_after", "ratio"))
    for key in tables["before"][0]:
        if not all(key in t for ts in tables.values() for t in ts):
            continue
        med = {name: [statistics.median(t[key][i] for t in tables[name]) for i in (0, 1)] for name in builds}
        b, f = med["before"], med["after"]
        print("%-20s %10d %11.3f %11.3f %7.3f %11.3f %11.3f %7.3f" %
              (key[0], key[1], b[0], f[0], f[0] / b[0], b[1], f[1], f[1] / b[1]))
    print("\n# ddpkit train, 25M MLP, batch 32, 2 ranks: median step ms (each run's median), after/before")
    print("%-18s %12s %12s %7s   runs before / after" % ("workload", "before_ms", "after_ms", "ratio"))
    for w in WORKLOADS:
        b, f = statistics.median(steps[(w, "before")]), statistics.median(steps[(w, "after")])
        print("%-18s %12.1f %12.1f %7.3f   %s / %s" % (w, b, f, f / b, ["%.1f" % x for x in steps[(w, "before")]],
                                                    ["%.1f" % x for x in steps[(w, "after")]]))


if __name__ == "__main__":
    main()
