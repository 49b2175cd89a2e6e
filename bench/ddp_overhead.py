#!/usr/bin/python3
"""What DDP adds to a training step, phase by phase, against training alone: one run, interleaved.

    bench/ddp_overhead.py [--reps 3] [--steps 30] [--ddpkit build/ddpkit] [-- extra train flags]

Runs `ddpkit train` (synthetic MLP 1024-4096-4096-1024, 25.2M parameters, batch 32 per rank,
one thread per rank, SGD, set-to-none gradients) in these configurations:

  local        --no-ddp: one process training alone
  local-pair   two --no-ddp processes at once: the floor a 2-rank step can reach here, since the
               two ranks share the machine's cores and memory bandwidth as these two do
  ddp1         --nproc 1: DDP with one rank (nothing to reduce)
  ddp1-noop    --nproc 1 --hook noop: one rank, gradients through the buckets and a hook
  ddp2-noop    --nproc 2 --hook noop: two ranks, buckets and hook but no communication
  ddp2         --nproc 2: two ranks, DDP's built-in allreduce

Every configuration runs --reps times, interleaved (a drifting shared machine hits all alike).
Each run reports the median step, forward, backward and optimizer time of its steps, the median
minor page faults per step, and the time DDP's Reducer spent per step in each of its phases (rank
0's); the tables show the median over reps. Ratios are against
`local` (and, for the 2-rank rows, against `local-pair`), all from this one invocation. Every side
runs under the same environment: ddpkit's own allocator settings, and OPENBLAS_CORETYPE as given
(set it: OpenBLAS may not recognise a new CPU).
"""
import argparse
import os
import statistics
import subprocess
import sys

from pytorch_peer import last_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIGS = {
    "local": ["--no-ddp"],
    "local-pair": ["--no-ddp"],
    "ddp1": ["--nproc", "1"],
    "ddp1-noop": ["--nproc", "1", "--hook", "noop"],
    "ddp2-noop": ["--nproc", "2", "--hook", "noop"],
    "ddp2": ["--nproc", "2"],
    # Not in the default run: half the bytes to sum (bf16 hook), to show what the 2-rank floor is made of.
    "ddp2-bf16": ["--nproc", "2", "--hook", "bf16"],
}
DEFAULT_CONFIGS = ["local", "local-pair", "ddp1", "ddp1-noop", "ddp2-noop", "ddp2"]
PHASES = ["median_step_ms", "median_forward_ms", "median_backward_ms", "median_optimizer_ms",
          "median_minor_faults_per_step"]


def run(binary, name, args):
    cmd = [binary, "train", "--model", "mlp", "--dataset", "synthetic", "--batch-size", "32", "--steps",
           str(args.steps), "--threads", "1", "--no-eval", "--quiet"] + CONFIGS[name] + args.extra
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2 if name == "local-pair" else 1)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=args.timeout)
        summary = last_json(out)
        if p.returncode != 0 or summary is None:
            for q in procs:
                q.kill()
            raise SystemExit(f"ddp_overhead: {name} failed (exit {p.returncode}): {' '.join(cmd)}\n{err[-2000:]}")
        results.append(summary)
    # local-pair: each phase as the slower of the two, as a 2-rank step waits for its slower rank.
    out = {k: max(r[k] for r in results) for k in PHASES}
    out["reducer"] = results[0].get("reducer_ms_per_step")  # rank 0's, null without DDP
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ddpkit", default=os.path.join(ROOT, "build", "ddpkit"))
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated, of " + ",".join(CONFIGS) + " (default: all but ddp2-bf16)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("extra", nargs="*", help="after --: more `ddpkit train` flags, for every configuration")
    args = p.parse_args()
    names = [n for n in args.configs.split(",") if n]
    for n in names:
        if n not in CONFIGS:
            p.error(f"unknown configuration '{n}'; choose from {', '.join(CONFIGS)}")
    if args.reps < 1 or args.steps < 5:
        p.error("--reps must be at least 1 and --steps at least 5")
    if not os.access(args.ddpkit, os.X_OK):
        p.error(f"no ddpkit binary at {args.ddpkit} (build first: scripts/build.sh)")
    version = subprocess.run([args.ddpkit, "version"], capture_output=True, text=True).stdout.strip()
    print(f"ddp_overhead: {version}; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}; "
          f"{args.reps} reps x {args.steps} steps, interleaved; extra flags: {' '.join(args.extra) or '-'}", flush=True)
    runs = {n: [] for n in names}
    for rep in range(args.reps):
        for n in names:
            r = run(args.ddpkit, n, args)
            runs[n].append(r)
            print(f"  rep {rep + 1} {n:<10} step {r['median_step_ms']:7.1f} ms  backward {r['median_backward_ms']:6.1f} ms",
                  flush=True)
    table = {n: {k: statistics.median(r[k] for r in runs[n]) for k in PHASES} for n in names}
    print()
    print(f"{'config':<11}{'step ms':>9}{'forward':>9}{'backward':>10}{'optimizer':>11}{'faults/step':>13}"
          f"{'step/local':>12}{'bwd/local':>11}{'step/pair':>11}")
    for n in names:
        t = table[n]
        row = (f"{n:<11}{t['median_step_ms']:9.1f}{t['median_forward_ms']:9.1f}{t['median_backward_ms']:10.1f}"
               f"{t['median_optimizer_ms']:11.1f}{t['median_minor_faults_per_step']:13.0f}")
        if "local" in table:
            l = table["local"]
            row += f"{t['median_step_ms'] / l['median_step_ms']:12.3f}{t['median_backward_ms'] / l['median_backward_ms']:11.3f}"
        if "local-pair" in table and n.startswith(("ddp2", "local-pair")):
            row += f"{t['median_step_ms'] / table['local-pair']['median_step_ms']:11.3f}"
        print(row)
    ddp = [n for n in names if runs[n][0]["reducer"]]
    if ddp:
        print("\nDDP's Reducer, ms per step (rank 0: its median step; median over reps): copy_in = gradients into bucket slots, "
              "launch = issuing buckets (hook call or built-in allreduce), wait = end of backward until every "
              "bucket's result is in, copy_out = results into .grad")
        print(f"{'config':<11}{'copy_in':>9}{'launch':>9}{'wait':>9}{'copy_out':>10}")
        for n in ddp:
            med = {k: statistics.median(r["reducer"][k] for r in runs[n]) for k in ("copy_in", "launch", "wait", "copy_out")}
            print(f"{n:<11}{med['copy_in']:9.1f}{med['launch']:9.1f}{med['wait']:9.1f}{med['copy_out']:10.1f}")
    print("\nstep/local: the step against one process training alone (the issue's targets: ddp1 <= 1.05, ddp2 <= 1.10);"
          "\nstep/pair: a 2-rank step against two local trainings sharing the machine at once.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
