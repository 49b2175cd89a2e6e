#!/usr/bin/env python3
"""What changing a group's members costs: the time from the call that changes them to the end of
the first allreduce on the new members, for 2 -> 3 -> 2 members (one host, 3 processes), with

  gloo       torch's ProcessGroupGloo made with enable_reconfigure=True, dist._reconfigure
  ddpkit     the ddpkit backend made with enable_reconfigure=True, dist._reconfigure
  new-group  a new ddpkit group over a fresh store prefix, the old one aborted: what
             ddpkit.torchft's wrapper (and torchft's ProcessGroupWrapper) does on every quorum

The handles are exchanged before the clock starts (that is the lighthouse's part, the same for
all). Each transition's time is the slowest member's; the table gives the median and the worst of
--cycles cycles. Needs torch >= 2.14 (c10d's reconfigure API).

  bench/reconfigure_cost.py [--python /var/cache/ddpkit/pip-torch-2.15.0/bin/python3]
                            [--pythonpath build-pip/python] [--cycles 20] [--out FILE]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

SIDES = ("gloo", "ddpkit", "new-group")
TIMEOUT = timedelta(seconds=30)


def rank_main(side, rank, port, cycles, results):
    import torch
    import torch.distributed as dist
    import ddpkit
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT, use_libuv=False)
    if side == "new-group":
        backend = None
    else:
        dist.init_process_group(side, store=dist.PrefixStore("init", store), rank=rank, world_size=3, timeout=TIMEOUT,
                                enable_reconfigure=True)
    times = []
    plans = [[0, 1], [0, 1, 2]] * cycles  # 2 -> 3 -> 2 ...
    for gen, members in enumerate(plans):
        if rank in members:
            place = members.index(rank)
            if side != "new-group":
                store.set(f"h{gen}/{place}", dist._get_reconfigure_handle())
                store.wait([f"h{gen}/{i}" for i in range(len(members))], TIMEOUT)
                handles = [store.get(f"h{gen}/{i}").decode() for i in range(len(members))]
            store.add(f"ready{gen}", 1)
            while store.add(f"ready{gen}", 0) < len(members):  # all members start the clock together
                time.sleep(0.0002)
            t0 = time.perf_counter()
            if side == "new-group":
                if backend is not None:
                    backend.abort()
                backend = ddpkit._C._make_backend(dist.PrefixStore(f"g{gen}", store), place, len(members),
                                                  TIMEOUT.total_seconds(), 2, True)
                t = torch.ones(1)
                backend.allreduce([t]).wait()
            else:
                dist._reconfigure(uuid=gen + 1, handles=handles, timeout=TIMEOUT).wait()
                t = torch.ones(1)
                dist.all_reduce(t)
            elapsed = time.perf_counter() - t0
            assert t.item() == len(members), (side, gen, t.item())
            store.set(f"t{gen}/{rank}", str(elapsed))
        elif side == "new-group" and backend is not None:
            backend.abort()  # left out of this membership: its group goes
            backend = None
        store.add(f"done{gen}", 1)
        while store.add(f"done{gen}", 0) < 3:
            time.sleep(0.0002)
        if rank == 0:
            times.append((len(members), max(float(store.get(f"t{gen}/{r}")) for r in members)))
    if rank == 0:
        results.put(times)
    if side != "new-group":
        dist.destroy_process_group()


def run_side(side, cycles):
    import multiprocessing
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=False)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(side, r, store.port, cycles, results)) for r in range(3)]
    for p in procs:
        p.start()
    times = results.get(timeout=600)
    for p in procs:
        p.join(60)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--pythonpath", default="build-pip/python")
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in the --python given
    args = ap.parse_args()
    if args.side:
        import json
        print(json.dumps(run_side(args.side, args.cycles)))
        return
    env = dict(os.environ, PYTHONPATH=os.path.abspath(args.pythonpath), OMP_NUM_THREADS="1", USE_LIBUV="0",
               OPENBLAS_CORETYPE=os.environ.get("OPENBLAS_CORETYPE", "Haswell"))
    version = subprocess.run([args.python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, env=env).stdout.strip()
    lines = [f"# reconfigure to the first allreduce on the new members, 3 processes on one host, torch {version}, "
             f"{args.cycles} cycles of 2 -> 3 -> 2; the slowest member's time per transition (ms)",
             f"{'side':<10} {'to':>3} {'median_ms':>10} {'worst_ms':>9} {'vs_gloo':>8}"]
    medians = {}
    for side in SIDES:
        import json
        p = subprocess.run([args.python, os.path.abspath(__file__), "--side", side, "--cycles", str(args.cycles)],
                           capture_output=True, text=True, env=env, timeout=900)
        if p.returncode != 0:
            lines.append(f"{side:<10} FAILED: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
            print(lines[-1], flush=True)
            continue
        times = json.loads(p.stdout.strip().splitlines()[-1])
        for size in (3, 2):
            ms = [t * 1000 for n, t in times[2:] if n == size]  # the first cycle warms up
            medians[(side, size)] = statistics.median(ms)
            ratio = medians[(side, size)] / medians[("gloo", size)] if ("gloo", size) in medians else float("nan")
            lines.append(f"{side:<10} {size:>3} {medians[(side, size)]:>10.2f} {max(ms):>9.2f} {ratio:>8.2f}")
            print(lines[-1], flush=True)
    print("\n".join(lines[:2]))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
