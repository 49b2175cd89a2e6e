#!/usr/bin/env python3
"""Scaling figures (issue 33, docs/performance.md): step time and bytes per step against world size
and host count, measured here, next to `ddpkit plan`'s projection to 8-1024 ranks.

  bench/scaling.py DDPKIT [--steps N] [--netns] [--no-projection | --projection-only] [--constants FILE]
                         [--link-latency-us X]

Model: the 8.4M-parameter MLP (1024,2048,2048,1024, synthetic data, batch 64 per rank, SGD).
1. Measured on one host, 1-8 ranks (processes sharing this machine's cores), and with --netns on two
   network-namespace hosts joined by a tc-limited veth at 1 and 10 Gbit/s: per strategy and hook,
   the median step of `ddpkit train`, the bytes each rank sent per step between hosts (Gloo) and
   through shared memory, and the plan's prediction for the same job.
2. Projected (no run): `ddpkit plan --json` for 8-1024 ranks, 8 ranks and 8 cores per host, at 10
   and 100 Gbit/s; compute and shared-memory costs are this machine's (docs/plan.md, Projections).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_validation import MLP8, FSDP_UNITS, Hosts  # noqa: E402

# (label, train flags beyond the model, plan's strategy, plan's hook)
RUNS = [
    ("ddp", [], "ddp", "none"),
    ("ddp+fp16", ["--hook", "fp16"], "ddp", "fp16"),
    ("ddp+int8", ["--hook", "int8"], "ddp", "int8"),
    ("ddp+powersgd", ["--hook", "powersgd", "--powersgd-start-iter", "2"], "ddp", "powersgd"),
    ("zero1", ["--zero", "1"], "zero1", "none"),
    ("zero2", ["--zero", "2"], "zero2", "none"),
    ("full_shard", ["--fsdp", "full_shard"] + FSDP_UNITS, "full_shard", "none"),
    ("shard_grad_op", ["--fsdp", "shard_grad_op"] + FSDP_UNITS, "shard_grad_op", "none"),
]
PLAN_MODEL = MLP8 + FSDP_UNITS


def run(cmd, timeout=900):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-1500:]}")
    return out.stdout


def plan(ddpkit, world, hosts, link, cores, constants, model=PLAN_MODEL):
    cmd = [ddpkit, "plan", "--json", "--world-size", str(world), "--hosts", str(hosts), "--link-gbit", str(link)]
    cmd += (["--cores-per-host", str(cores)] if cores else []) + (["--constants", constants] if constants else [])
    rows = json.loads(run(cmd + model))
    return {(r["strategy"], r["hook"]): r for r in rows}


def mb(b):
    return f"{b / 1e6:9.2f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ddpkit")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--netns", action="store_true", help="also two hosts at 1 and 10 Gbit/s (root, ip, tc)")
    ap.add_argument("--no-projection", action="store_true")
    ap.add_argument("--projection-only", action="store_true")
    ap.add_argument("--constants", default="")
    ap.add_argument("--link-latency-us", type=float, default=0,
                    help="the projection's Gloo time per message between hosts (default 0: the calibrated loopback one)")
    a = ap.parse_args()

    print("# measured: median step of `ddpkit train` (ms), bytes each rank sent per step between hosts and")
    print("# through shared memory (MB), and the plan's step and between-host bytes for the same job")
    print(f"{'config':15} {'ranks':>5} {'hosts':>5} {'link':>5} {'step_ms':>8} {'plan_ms':>8} {'net_MB':>9} "
          f"{'plan_net_MB':>11} {'shm_MB':>9}")
    setups = [] if a.projection_only else [(w, 1, 0, None) for w in (1, 2, 4, 8)]
    if a.netns and not a.projection_only:
        setups += [(2, 2, 1, "1gbit"), (4, 2, 1, "1gbit"), (2, 2, 10, "10gbit")]
    hosts_env = Hosts().__enter__() if a.netns else None
    try:
        for world, hosts, link, rate in setups:
            predicted = plan(a.ddpkit, world, hosts, link or 10, 1 if rate else 0, a.constants)
            if rate:
                hosts_env.set_rate(rate)
            for label, flags, strategy, hook in RUNS:
                if world == 1 and label != "ddp":
                    continue  # one rank: nothing to communicate or shard
                if rate:
                    r = hosts_env.train(a.ddpkit, 2, world // 2, MLP8 + flags, a.steps)
                else:
                    r = json.loads(run([a.ddpkit, "train", "--quiet", "--no-eval", "--nproc", str(world), "--steps",
                                        str(a.steps)] + MLP8 + flags).strip().splitlines()[-1])
                p = predicted.get((strategy, hook), {})
                print(f"{label:15} {world:5} {hosts:5} {(str(link) + 'G') if rate else '-':>5} {r['median_step_ms']:8.1f} "
                      f"{p.get('predicted_step_ms', float('nan')):8.1f} {mb(r['bytes_sent_per_step'])} "
                      f"{mb(p.get('wire_bytes_per_step', float('nan'))):>11} {mb(r['shm_bytes_sent_per_step'])}",
                      flush=True)
    finally:
        if hosts_env:
            hosts_env.__exit__(None, None, None)

    if a.no_projection:
        return
    print("\n# projected by `ddpkit plan`: 8 ranks and 8 cores per host; step ms / between-host MB per rank"
          + (f"; {a.link_latency_us:g} us a message between hosts" if a.link_latency_us else ""))
    worlds = [8, 32, 128, 512, 1024]
    # One profile for every cell (a host of 8 cores, as many replicas busy as this machine has),
    # so the cells differ by the model's projection alone, not by this VM's noise between profiles.
    with tempfile.TemporaryDirectory() as tmp:
        profile = os.path.join(tmp, "mlp8.json")
        run([a.ddpkit, "plan", "--world-size", "8", "--cores-per-host", "8", "--save-profile", profile]
            + (["--constants", a.constants] if a.constants else []) + PLAN_MODEL)
        described = ["--describe", profile] + (["--link-latency-us", str(a.link_latency_us)] if a.link_latency_us else [])
        tables = {link: {w: plan(a.ddpkit, w, w // 8, link, 8, a.constants, described) for w in worlds}
                  for link in (10, 100)}
    for link in (10, 100):
        table = tables[link]
        print(f"\n## {link} Gbit/s")
        print(f"{'config':15} " + " ".join(f"{w:>16}" for w in worlds))
        for label, _, strategy, hook in RUNS:
            cells = []
            for w in worlds:
                p = table[w].get((strategy, hook))
                cells.append(f"{p['predicted_step_ms']:7.1f} /{p['wire_bytes_per_step'] / 1e6:7.2f}" if p else f"{'-':>16}")
            print(f"{label:15} " + " ".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
