#!/usr/bin/python3
"""Soak: long runs must not grow (issue 16). Prints every sample and exits 1 when memory or file
descriptors keep climbing.

    tests/soak.py build            # 10,000 steps each of allreduce, int8, PowerSGD; 10,000 PS requests
    tests/soak.py build --steps 2000 --requests 2000       # shorter

Training: `ddpkit train --report-resources 500` (2 ranks, Fashion-MNIST MLP) reports every rank's
RSS and open descriptors every 500 steps. Parameter server: one `ddpkit ps-server` process takes
rounds of 500 requests from two fresh client processes each (so connections and sessions come and
go), sampled from /proc after each round.

Flat means: after the first two samples (allocator and caches warming up), RSS stays within
max(4 %, 16 MiB) of its value then, and descriptors never exceed theirs then.
"""
import argparse
import json
import os
import re
import subprocess
import sys


def flat(samples):
    """samples: [(label, rss_mb, fds)] -> (ok, growth text)"""
    if len(samples) < 3:
        return False, "too few samples"
    base_rss, base_fds = samples[1][1], samples[1][2]
    later = samples[2:]
    rss_growth = max(s[1] for s in later) - base_rss
    fds_growth = max(s[2] for s in later) - base_fds
    ok = rss_growth <= max(0.04 * base_rss, 16.0) and fds_growth <= 0
    return ok, f"RSS {base_rss:.1f} -> max {base_rss + rss_growth:.1f} MiB ({rss_growth:+.1f}), fds {base_fds} -> max {base_fds + fds_growth}"


def soak_training(build, hook, steps):
    cmd = [os.path.join(build, "ddpkit"), "train", "--quiet", "--no-eval", "--hook", hook, "--steps", str(steps),
           "--epochs", "1000", "--report-resources", "500"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    per_rank = {}
    for line in out.stderr.splitlines():
        if line.startswith("resources "):
            r = json.loads(line[len("resources "):])
            for rank, (rss, fds) in enumerate(zip(r["rss_mb"], r["open_fds"])):
                per_rank.setdefault(rank, []).append((r["step"], rss, fds))
    ok_all = True
    for rank, samples in sorted(per_rank.items()):
        ok, text = flat(samples)
        ok_all &= ok
        print(f"train --hook {hook:9s} rank {rank}: {len(samples)} samples to step {samples[-1][0]}: {text} "
              f"{'flat' if ok else 'GROWING'}")
        print("    rss_mb: " + " ".join(f"{s[1]:.0f}" for s in samples))
        print("    fds:    " + " ".join(str(s[2]) for s in samples))
    return ok_all


def proc_sample(pid):
    with open(f"/proc/{pid}/status") as f:
        rss_kb = int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))
    return rss_kb / 1024.0, len(os.listdir(f"/proc/{pid}/fd"))


def soak_server(build, requests):
    server = subprocess.Popen([os.path.join(build, "ddpkit"), "ps-server", "--trainer-ids", "0,1", "--address",
                               "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        address = re.search(r"listening on (\S+)", line).group(1)
        per_round = 250  # batches per trainer per round: 500 requests
        rounds = max(3, requests // (2 * per_round))
        samples, batch = [], 0
        for k in range(rounds):
            clients = [subprocess.Popen([os.path.join(build, "ps_server_bench"), "--connect", address, "--trainer-id",
                                         str(t), "--batches", str(per_round), "--warmup", "0", "--sizes", "0.01", "--first-batch",
                                         str(batch)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                       for t in (0, 1)]
            for c in clients:
                _, err = c.communicate(timeout=600)
                if c.returncode != 0:
                    sys.exit(f"FAILED: a client exited {c.returncode} in round {k}:\n{err[-2000:]}")
            batch += per_round
            rss, fds = proc_sample(server.pid)
            samples.append(((k + 1) * 2 * per_round, rss, fds))
        ok, text = flat(samples)
        print(f"ps-server: {samples[-1][0]} requests in {rounds} rounds of fresh clients: {text} "
              f"{'flat' if ok else 'GROWING'}")
        print("    rss_mb: " + " ".join(f"{s[1]:.0f}" for s in samples))
        print("    fds:    " + " ".join(str(s[2]) for s in samples))
        return ok
    finally:
        server.terminate()
        server.wait(timeout=30)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--hooks", default="allreduce,int8,powersgd")
    a = ap.parse_args()
    ok = True
    for hook in a.hooks.split(","):
        ok &= soak_training(a.build, hook, a.steps)
    ok &= soak_server(a.build, a.requests)
    if not ok:
        sys.exit("FAILED: something grows")
    print("soak: flat")


if __name__ == "__main__":
    main()
