#!/usr/bin/python3
"""FSDP2 (torch.distributed.fsdp.fully_shard) on the ddpkit backend against FSDP2 on Gloo, and
against ddpkit's own C++ FullyShardedDataParallel (FULL_SHARD), and FSDP2 on ddpkit with ddpkit's
FSDP hooks as its reduce-scatter (ddpkit.fsdp2.set_comm_hooks: "none", plain; "bf16", compressed),
on the same model, side by side in one run (issues 70, 71). The model is bench/fsdp_bench.py's "issue MLP": 4 blocks 1024-4096-1024 (33.6M
parameters), synthetic data, cross entropy, SGD(lr 0.05, momentum 0.9), batch 32 a rank, 2 ranks
on this host, one compute thread each, every Linear a unit; glibc's thresholds pinned to 1 GiB on
every side. The rows are interleaved over --reps rounds; each figure is the median round's median
step after two warm-up steps.

    bench/fsdp2_backend.py --bin build-pip/ddpkit --python "$(scripts/pip-torch-env.sh)" [--steps 10] [--reps 3]

--python must have a torch that runs fully_shard on CPU (2.7 or later: pip's 2.15 here) and be the
one the build's Python package (BIN's folder/python) was built for.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fsdp_bench import ISSUE_MLP, MALLOC  # noqa: E402  the same model and malloc settings


def fsdp2_step_ms(python, build, backend, steps, comm_hooks=None):
    env = dict(os.environ, **MALLOC, PYTHONPATH=os.path.join(build, "python"))
    hooks = ["--comm-hooks", comm_hooks] if comm_hooks else []
    out = subprocess.run([python, os.path.join(HERE, "pytorch_fsdp.py"), "--mode", "fsdp2", "--backend", backend,
                          "--steps", str(steps)] + hooks, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"FAILED: FSDP2 on {backend}\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["median_step_ms"], r["torch"]


def ddpkit_fsdp_step_ms(binary, steps):
    out = subprocess.run([binary, "train"] + ISSUE_MLP + ["--fsdp", "full_shard", "--nproc", "2", "--steps", str(steps)],
                         env=dict(os.environ, **MALLOC), capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"FAILED: ddpkit train --fsdp full_shard\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["median_step_ms"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build-pip", "ddpkit"))
    ap.add_argument("--python", required=True, help="the interpreter whose torch runs fully_shard (2.7+)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    build = os.path.dirname(os.path.abspath(a.bin))
    rows = {"FSDP2 on ddpkit": [], "FSDP2 on Gloo": [], "+ ddpkit RS": [], "+ ddpkit bf16 RS": [],
            "ddpkit C++ FSDP": []}
    version = ""
    for _ in range(a.reps):
        ms, version = fsdp2_step_ms(a.python, build, "ddpkit", a.steps)
        rows["FSDP2 on ddpkit"].append(ms)
        rows["FSDP2 on Gloo"].append(fsdp2_step_ms(a.python, build, "gloo", a.steps)[0])
        rows["+ ddpkit RS"].append(fsdp2_step_ms(a.python, build, "ddpkit", a.steps, "none")[0])
        rows["+ ddpkit bf16 RS"].append(fsdp2_step_ms(a.python, build, "ddpkit", a.steps, "bf16")[0])
        rows["ddpkit C++ FSDP"].append(ddpkit_fsdp_step_ms(a.bin, a.steps))
    med = {name: statistics.median(v) for name, v in rows.items()}
    print(f"FSDP2 (torch {version}) vs ddpkit, MLP 4x(1024-4096-1024) 33.6M parameters, SGD, batch 32/rank, W=2, "
          f"1 thread/rank, each Linear a unit, malloc pinned; median of {a.reps} interleaved rounds")
    print(f"{'':<18} {'step ms':>9} {'rounds':>24} {'vs FSDP2 on Gloo':>17}")
    for name, ms in med.items():
        rounds = " ".join(f"{x:.1f}" for x in rows[name])
        print(f"{name:<18} {ms:>9.1f} {rounds:>24} {ms / med['FSDP2 on Gloo']:>17.2f}")
    print(f"FSDP2 on ddpkit / FSDP2 on Gloo: {med['FSDP2 on ddpkit'] / med['FSDP2 on Gloo']:.2f}")
    print(f"ddpkit C++ FSDP / FSDP2 on ddpkit: {med['ddpkit C++ FSDP'] / med['FSDP2 on ddpkit']:.2f}")
    for name in ("+ ddpkit RS", "+ ddpkit bf16 RS"):
        print(f"FSDP2 on ddpkit {name} (ddpkit.fsdp2.set_comm_hooks) / FSDP2 on ddpkit: "
              f"{med[name] / med['FSDP2 on ddpkit']:.2f}; / FSDP2 on Gloo: {med[name] / med['FSDP2 on Gloo']:.2f}")


if __name__ == "__main__":
    main()
