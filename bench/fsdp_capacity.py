#!/usr/bin/python3
"""Capacity under a per-rank memory cap (issue 31): the deepest GPT-style transformer that DDP and
FSDP FULL_SHARD can each train, 4 ranks on this host, every rank in its own memory cgroup.

    sudo bench/fsdp_capacity.py [--bin build/ddpkit] [--cap-mb 1024] [--nproc 4] [--d-model 512]

A configuration "trains" when `ddpkit train --model transformer --layers L ... --steps 2` ends with
its JSON line. When a rank passes its cap, the kernel kills it. The launcher then stops the others:
a clear failure, not a hang (every collective has --timeout-s 120). The rank's cgroup records the
out-of-memory kill, and this script names it. Layers are searched by doubling, then bisection. Both
sides use the same flags and glibc thresholds (ddpkit's own tuning). Needs root (cgroup v1 memory
controller at /sys/fs/cgroup/memory, or v2 at /sys/fs/cgroup); skipped (77) without.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


class Cgroups:
    """One memory cgroup per rank, capped at `cap` bytes, made and removed by this script."""

    def __init__(self, nproc, cap):
        v1 = "/sys/fs/cgroup/memory"
        self.v1 = os.path.isdir(v1)
        self.root = os.path.join(v1 if self.v1 else "/sys/fs/cgroup", f"ddpkit-capacity-{os.getpid()}")
        os.makedirs(self.root)
        if not self.v1:
            with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
                f.write("+memory")
        self.dirs = []
        for r in range(nproc):
            d = os.path.join(self.root, f"rank{r}")
            os.makedirs(d)
            with open(os.path.join(d, "memory.limit_in_bytes" if self.v1 else "memory.max"), "w") as f:
                f.write(str(cap))
            if self.v1 and os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                with open(os.path.join(d, "memory.memsw.limit_in_bytes"), "w") as f:
                    f.write(str(cap))
            self.dirs.append(d)

    def ooms(self):
        """Ranks whose cgroup recorded an out-of-memory kill (or hit the limit) since the last reset."""
        hit = []
        for r, d in enumerate(self.dirs):
            if self.v1:
                fail = int(open(os.path.join(d, "memory.failcnt")).read())
                oom = open(os.path.join(d, "memory.oom_control")).read()
                kills = [int(l.split()[1]) for l in oom.splitlines() if l.startswith("oom_kill ")]
                if fail > 0 or (kills and kills[0] > 0):
                    hit.append(r)
            else:
                ev = dict(l.split() for l in open(os.path.join(d, "memory.events")).read().splitlines())
                if int(ev.get("oom_kill", 0)) > 0:
                    hit.append(r)
        return hit

    def peak_bytes(self):
        """The largest rank's peak of memory charged to its cgroup (a shared page counts once, for
        the rank that first touched it), since the cgroups were made."""
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        return max(int(open(os.path.join(d, name)).read()) for d in self.dirs)

    def job_peak_bytes(self):
        """The whole job's peak (the parent cgroup's: every rank's pages, a shared page once): what
        the host held for it at its busiest moment."""
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        return int(open(os.path.join(self.root, name)).read())

    def reset(self):
        if self.v1:
            for d in self.dirs:
                with open(os.path.join(d, "memory.failcnt"), "w") as f:
                    f.write("0")

    def remove(self):
        for d in self.dirs:
            try:
                os.rmdir(d)
            except OSError:
                pass
        try:
            os.rmdir(self.root)
        except OSError:
            pass


def trains(a, groups, layers, fsdp):
    flags = ["--model", "transformer", "--layers", str(layers), "--d-model", str(a.d_model), "--heads", "8",
             "--seq-len", "64", "--batch-size", "4", "--optimizer", "adam", "--steps", "2", "--no-eval", "--quiet",
             "--timeout-s", "120", "--fsdp", "full_shard" if fsdp else "off", "--fsdp-min-unit-params", "1000"]
    # Each rank moves itself into its cgroup, then becomes `ddpkit train` (torchrun-style rank).
    cmd = " ".join([a.bin, "train"] + flags)
    script = f'echo $$ > {groups.root}/rank$RANK/cgroup.procs && exec {cmd}'
    groups.reset()
    p = subprocess.run([a.bin, "launch", "--nproc", str(a.nproc), "/bin/sh", "-c", script], capture_output=True,
                       text=True, timeout=1800)
    ok = p.returncode == 0 and '"steps": 2' in p.stdout
    oom = groups.ooms()
    mode = "FSDP full_shard" if fsdp else "DDP"
    if ok:
        peak = json.loads(p.stdout.strip().splitlines()[-1])["peak_rss_bytes"] / 2**20
        print(f"  {mode:<16} {layers:>3} layers: trains (peak {peak:.0f} MB)", flush=True)
    else:
        why = f"out of memory on rank(s) {oom}" if oom else "failed: " + (p.stderr.strip().splitlines() or ["?"])[-1]
        print(f"  {mode:<16} {layers:>3} layers: {why}", flush=True)
    return ok


def largest(a, groups, fsdp):
    lo, hi = 0, 1
    while trains(a, groups, hi, fsdp):
        lo, hi = hi, hi * 2
        if hi > a.max_layers:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if trains(a, groups, mid, fsdp):
            lo = mid
        else:
            hi = mid
    return lo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build", "ddpkit"))
    ap.add_argument("--cap-mb", type=int, default=1024)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--max-layers", type=int, default=256)
    a = ap.parse_args()
    a.bin = os.path.abspath(a.bin)
    if os.geteuid() != 0:
        print("fsdp_capacity: needs root for memory cgroups; skipped")
        sys.exit(77)
    groups = Cgroups(a.nproc, a.cap_mb << 20)
    try:
        print(f"GPT d_model {a.d_model}, 8 heads, seq 64, batch 4/rank, Adam, {a.nproc} ranks, each capped at "
              f"{a.cap_mb} MB (block: {12 * a.d_model * a.d_model / 1e6:.2f}M parameters)")
        ddp = largest(a, groups, False)
        fsdp = largest(a, groups, True)
        print(f"largest trainable: DDP {ddp} layers, FSDP full_shard {fsdp} layers: "
              f"{fsdp / ddp if ddp else float('inf'):.2f}x")
    finally:
        groups.remove()


if __name__ == "__main__":
    main()
