#!/usr/bin/env python3
"""The Python API's cost over the C++ one: DiLoCo's share of a training step, in the Python example
(examples/python/diloco_sites.py: ddpkit.diloco on the user's optimizer) and in the C++ one
(examples/fault_tolerance/diloco_sites: diloco::DiLoCo), on the same model (MLP 32-64-64-10, batch
32), one site of one rank against a local lighthouse.

Each side runs --steps inner steps twice: syncing every --sync-every steps, and syncing once (H =
steps); the difference over the steps is what DiLoCo costs a step on that side (its syncs, quorums
and the call after every inner step), and the Python side's minus the C++ side's is the binding's
cost. The loops around it differ (Python's SGD and per-parameter allreduce, C++'s AdamW under DDP)
and cancel in the difference. Best of --repeats runs each.

  bench/diloco_binding.py [--bin build/ddpkit] [--example build/examples/fault_tolerance/diloco_sites]
                          [--python /usr/bin/python3] [--pythonpath build/python] [--steps 3000] [--out FILE]
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from ports import free_port  # noqa: E402
from procs import with_openblas_coretype  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, side, sync_every):
    lh = subprocess.Popen([args.bin, "lighthouse", "--address", "127.0.0.1:0", "--expected-groups", "1", "--quiet"],
                          stdout=subprocess.PIPE, text=True)
    try:
        address = lh.stdout.readline().split("listening on ")[1].split()[0]
        env = dict(with_openblas_coretype(os.environ), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.path.abspath(args.pythonpath))
        common = ["--lighthouse", address, "--site", "0", "--sites", "1", "--steps", str(args.steps), "--sync-every",
                  str(sync_every), "--fragments", "1", "--codec", "fp32"]
        cmd = [args.python, os.path.join(ROOT, "examples", "python", "diloco_sites.py")] if side == "python" \
            else [args.example]
        out = subprocess.run(cmd + common, env=env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            sys.exit(f"FAILED: {side} H={sync_every}: {out.stdout[-2000:]}{out.stderr[-2000:]}")
        report = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
        return report["train_seconds"]
    finally:
        lh.terminate()
        lh.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/ddpkit")
    ap.add_argument("--example", default="build/examples/fault_tolerance/diloco_sites")
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--pythonpath", default="build/python")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--sync-every", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch_version = subprocess.run([args.python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                   text=True).stdout.strip()
    lines = [f"# DiLoCo's cost per inner step, Python API (torch {torch_version}) against C++, MLP 32-64-64-10, "
             f"batch 32, {args.steps} steps, one site; best of {args.repeats}",
             f"{'side':<8} {'H':>6} {'train_s':>9} {'us/step':>9} {'diloco_us/step':>15}"]
    cost = {}
    for side in ("cpp", "python"):
        best = {h: min(run(args, side, h) for _ in range(args.repeats)) for h in (args.sync_every, args.steps)}
        cost[side] = (best[args.sync_every] - best[args.steps]) / args.steps * 1e6
        for h, seconds in best.items():
            lines.append(f"{side:<8} {h:>6} {seconds:>9.3f} {seconds / args.steps * 1e6:>9.1f} "
                         f"{cost[side] if h == args.sync_every else 0:>15.1f}")
    lines.append(f"# binding's cost: {cost['python'] - cost['cpp']:.1f} us per inner step "
                 f"(DiLoCo's share of a step: Python {cost['python']:.1f} us, C++ {cost['cpp']:.1f} us; "
                 f"{args.steps // args.sync_every} syncs)")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
