#!/usr/bin/python3
"""What ddpkit::tune_allocator_for_training() is worth: `ddpkit train` under its three allocator
settings, interleaved, in one run:

  tuned       the default: glibc's mmap/trim thresholds at 1 GiB, and libtorch's blocks of 1 MiB
              and more in ddpkit's LargeBlockCache (include/ddpkit/runtime/block_cache.h);
  thresholds  the thresholds alone (what the tuning was before the cache), set through glibc's own
              MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_, which also keep the cache out;
  untuned     glibc's defaults (--no-malloc-tuning).

    bench/allocator_bench.py [--reps 3] [--steps 20] [--ddpkit build/ddpkit]

Workloads: the 25M-parameter MLP (1024-4096-4096-1024), batch 32, 2 ranks x 1 thread, fp32 DDP;
and the same model in one process without DDP. Every run is made twice, under a short and a long
path to the same binary: the program's path is one of the small allocations before training, and
under the thresholds alone it moved the peak by whole blocks. Prints the median step, the ratio
to untuned, and the peaks under each path (MB, each rep's).
"""
import argparse
import json
import os
import statistics
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = str(1 << 30)
SETTINGS = {
    "tuned": ([], {}),
    "thresholds": ([], {"MALLOC_MMAP_THRESHOLD_": GIB, "MALLOC_TRIM_THRESHOLD_": GIB}),
    "untuned": (["--no-malloc-tuning"], {}),
}


def run(binary, extra, setting):
    flags, env_extra = SETTINGS[setting]
    cmd = [binary, "train", "--model", "mlp", "--dataset", "synthetic", "--batch-size", "32", "--threads", "1",
           "--no-eval", "--quiet"] + extra + flags
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "DDPKIT_MALLOC_TUNING"}
    env.update(env_extra, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            r = json.loads(line)
            return r["median_step_ms"], r["peak_rss_bytes"] / 2**20
    raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), p.returncode, p.stderr[-1000:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ddpkit", default=os.path.join(ROOT, "build", "ddpkit"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    binary = os.path.abspath(a.ddpkit)
    paths = {"short": os.path.relpath(binary), "long": binary}  # the same file
    version = subprocess.run([binary, "version"], capture_output=True, text=True).stdout.strip()
    workloads = {"ddp 2 ranks": ["--nproc", "2"], "no ddp (1 process)": ["--no-ddp"]}
    steps = {(w, s): [] for w in workloads for s in SETTINGS}
    peaks = {(w, s, p): [] for w in workloads for s in SETTINGS for p in paths}
    for _ in range(a.reps):
        for w, extra in workloads.items():
            for s in SETTINGS:
                for p, path in paths.items():
                    ms, mb = run(path, extra + ["--steps", str(a.steps)], s)
                    steps[(w, s)].append(ms)
                    peaks[(w, s, p)].append(mb)
    print("# %s; MLP 1024-4096-4096-1024, batch 32, one thread a rank; median step ms over %d reps x 2 paths x %d steps"
          % (version, a.reps, a.steps))
    print("# paths: short %s, long %s" % (paths["short"], paths["long"]))
    print("%-20s %-11s %8s %8s  %-22s %-22s" % ("workload", "setting", "step_ms", "/untuned", "peak MB (short path)",
                                              "peak MB (long path)"))
    for w in workloads:
        untuned = statistics.median(steps[(w, "untuned")])
        for s in SETTINGS:
            ms = statistics.median(steps[(w, s)])
            print("%-20s %-11s %8.1f %8.2f  %-22s %-22s" % (
                w, s, ms, ms / untuned, " ".join("%.0f" % v for v in peaks[(w, s, "short")]),
                " ".join("%.0f" % v for v in peaks[(w, s, "long")])))
    print("/untuned: the step against glibc's defaults (below 1: the setting makes the step faster)")


if __name__ == "__main__":
    main()
