#!/usr/bin/python3
"""The control plane at scale: G replica groups of W ranks, simulated by bench/lighthouse_load.cpp
(real gRPC clients, no model), against `ddpkit lighthouse` and torchft's Rust lighthouse
(torchft._torchft.LighthouseServer of the pinned wheel), one lighthouse process at a time on the
same machine, both started with the same heartbeat and join timeouts.

For each side and each G x W it runs the load twice: steady (no kills: quorum latency at the step
rate, heartbeat latency, the lighthouse's CPU and memory) and churn (--kills groups go silent
across the window and restart --restart-after-s later: detection, the survivors' quorum, the
restarted group's join). --sweep-rates finds, per side, the step rate at which quorums start to
lag (more than 1% of ticks skipped, or p99 above the step period).

Columns: q = quorum latency from a group's ask to its reply; rnd = a step's round at the lighthouse,
from the moment the last ask of the step was handed to gRPC to the last reply (the load
generator's own time to issue G asks left out); out = ddpkit's lighthouse's own time to hand a
round's replies to gRPC, as it reports at exit (Lighthouse::round_times; not known for torchft);
skip% = step ticks a group skipped, still waiting;
hb = heartbeat latency and rate per sender; false = heartbeat replies naming a live group lost;
det = detection of a silent group (the first heartbeat reply naming it or the survivors' quorum
without it); surv = the survivors' quorum without it; join = a restarted group's first quorum; LH =
the lighthouse process (cores over the window, peak and idle RSS); drv = the load generator.

Sides: ddpkit (its Manager's protocol: every rank heartbeats), ddpkit-group (ranks beat through
their group: one sender per group, the lighthouse counting the group's ranks from it), torchft
(one heartbeat per group, as its ManagerServer sends).

  python3 bench/lighthouse_scale.py --python /var/cache/ddpkit/pip-torch-2.15.0/bin/python3 \\
      [--groups 10,100,1000] [--ranks 1,8] [--step-rate 5] [--seconds 10] [--sides ddpkit,torchft]
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TORCHFT_SERVER = r"""
import signal, sys, time
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=int(sys.argv[1]),
                          heartbeat_timeout_ms=int(sys.argv[2]))
print("listening", server.address(), flush=True)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
while True:
    time.sleep(3600)
"""


def pin_to(cpus):
    """A preexec_fn that confines the child to `cpus` ("0", "1-3"; "" leaves it free)."""
    if not cpus:
        return None
    chosen = set()
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        chosen.update(range(int(lo), int(hi or lo) + 1))
    return lambda: os.sched_setaffinity(0, chosen)


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return -1.0


class Lighthouse:
    """One lighthouse process; .address is host:port, .pid its process."""

    def __init__(self, side, args, groups):
        env = dict(os.environ)
        if side == "torchft":
            cmd = [args.python, "-c", TORCHFT_SERVER, str(args.join_timeout_ms), str(args.heartbeat_timeout_ms)]
            env.setdefault("RUST_LOG", "warn")  # its per-quorum info lines are off, as in a quiet deployment
        else:
            # --expected-groups as `ddpkit train --fault-tolerant` starts its own: the first quorum
            # waits for the job's groups instead of forming again as each one arrives.
            cmd = [args.bin, "lighthouse", "--address", "127.0.0.1:0", "--quiet",
                   "--heartbeat-timeout-ms", str(args.heartbeat_timeout_ms),
                   "--join-timeout-ms", str(args.join_timeout_ms), "--expected-groups", str(groups)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     preexec_fn=pin_to(args.lighthouse_cpus))
        deadline = time.time() + 60
        self.address = None
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.search(r"listening (?:on )?(?:http://)?(\S+?):(\d+)", line)
            if m:
                self.address = f"127.0.0.1:{m.group(2)}"
                break
        if self.address is None:
            self.stop()
            sys.exit(f"lighthouse_scale: the {side} lighthouse did not start: {' '.join(cmd)}")
        self.pid = self.proc.pid
        time.sleep(0.5)
        self.idle_rss_mib = rss_mib(self.pid)

    def stop(self):
        """Stops it; returns ddpkit's own round times from its last words ({} for torchft's)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rest = self.proc.stdout.read() if self.proc.stdout else ""
        m = re.search(r"rounds: asks in p50 ([\d.]+) p99 ([\d.]+) ms, replies out p50 ([\d.]+) p99 ([\d.]+) max ([\d.]+)",
                      rest)
        if not m:
            return {}
        keys = ("lh_intake_p50_ms", "lh_intake_p99_ms", "lh_replies_p50_ms", "lh_replies_p99_ms", "lh_replies_max_ms")
        return dict(zip(keys, map(float, m.groups())))


def run_load(args, side, groups, ranks, rate, kills, seconds):
    lh = Lighthouse(side, args, groups)
    warmup = max(args.warmup, 10.0 / rate)  # at least ten steps before the window
    try:
        protocol = "torchft" if side == "torchft" else "ddpkit"
        cmd = [args.load, "--protocol", protocol, "--address", lh.address, "--pid", str(lh.pid),
               "--groups", str(groups), "--ranks", str(ranks), "--step-rate", str(rate),
               "--seconds", str(seconds), "--warmup", str(warmup), "--heartbeat-ms", str(args.heartbeat_ms),
               "--kills", str(kills), "--restart-after-s", str(args.restart_after_s if kills else 0),
               "--seed", str(args.seed)]
        if protocol == "ddpkit":
            cmd += ["--heartbeat", "group" if side == "ddpkit-group" else "rank"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + warmup + 120,
                           preexec_fn=pin_to(args.load_cpus))
        if p.returncode != 0:
            sys.exit(f"lighthouse_scale: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
        row = json.loads(p.stdout.strip().splitlines()[-1])
        row["side"] = side
        row["lighthouse_idle_rss_mib"] = lh.idle_rss_mib
        row["driver_stderr"] = p.stderr.strip()[-400:]
    finally:
        own = lh.stop()
    row.update(own)
    return row


def fmt(v, digits=1):
    return "-" if v is None or v < 0 else f"{v:.{digits}f}"


def print_header():
    print(f"{'side':<13} {'G':>5} {'W':>2} {'ranks':>6} {'q p50':>8} {'q p99':>8} {'rnd p50':>8} {'rnd p99':>8} "
          f"{'out p50':>8} {'out p99':>8} {'skip%':>6} {'q/g/s':>6} "
          f"{'hb p99':>7} {'hb/s':>5} {'false':>5} {'det p50':>8} {'det max':>8} {'surv p50':>8} {'surv max':>8} "
          f"{'join':>7} {'LH cores':>8} {'LH MiB':>7} {'idle':>5} {'drv':>5}")
    print(f"{'':<13} {'':>5} {'':>2} {'':>6} {'ms':>8} {'ms':>8} {'ms':>8} {'ms':>8} {'ms':>8} {'ms':>8} {'':>6} {'':>6} {'ms':>7} "
          f"{'':>5} {'':>5} "
          f"{'ms':>8} {'ms':>8} {'ms':>8} {'ms':>8} {'ms':>7} {'':>8} {'peak':>7} {'MiB':>5} {'cores':>5}")


def print_row(steady, churn):
    s, c = steady, churn or {}
    print(f"{s['side']:<13} {s['groups']:>5} {s['ranks']:>2} {s['groups'] * s['ranks']:>6} "
          f"{fmt(s['quorum_p50_ms']):>8} {fmt(s['quorum_p99_ms']):>8} {fmt(s['round_p50_ms']):>8} "
          f"{fmt(s['round_p99_ms']):>8} {fmt(s.get('lh_replies_p50_ms', -1)):>8} {fmt(s.get('lh_replies_p99_ms', -1)):>8} "
          f"{100 * s['ticks_skipped']:>6.1f} "
          f"{s['quorums_per_group_s']:>6.2f} {fmt(s['heartbeat_p99_ms']):>7} {s['heartbeats_per_sender_s']:>5.1f} "
          f"{s['false_losses'] + c.get('false_losses', 0):>5} {fmt(c.get('detect_p50_ms', -1), 0):>8} "
          f"{fmt(c.get('detect_max_ms', -1), 0):>8} {fmt(c.get('survivors_p50_ms', -1), 0):>8} "
          f"{fmt(c.get('survivors_max_ms', -1), 0):>8} {fmt(c.get('join_p50_ms', -1), 0):>7} "
          f"{s['lighthouse_cores']:>8.2f} {max(s['lighthouse_peak_rss_mib'], c.get('lighthouse_peak_rss_mib', 0)):>7.0f} "
          f"{s['lighthouse_idle_rss_mib']:>5.0f} {s['driver_cores']:>5.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "ddpkit"), help="the ddpkit CLI (its lighthouse)")
    ap.add_argument("--load", default=os.path.join(ROOT, "build", "lighthouse_load"), help="the load generator")
    ap.add_argument("--python", default="/var/cache/ddpkit/pip-torch-2.15.0/bin/python3",
                    help="a Python with torchft (its Rust lighthouse)")
    ap.add_argument("--sides", default="ddpkit,ddpkit-group,torchft")
    ap.add_argument("--groups", default="10,100,1000")
    ap.add_argument("--ranks", default="1,8")
    ap.add_argument("--step-rate", type=float, default=5.0, help="quorums asked per group per second")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window of each run")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before the window (at least ten steps)")
    ap.add_argument("--kills", type=int, default=4, help="groups killed in each churn run (0: no churn runs)")
    ap.add_argument("--restart-after-s", type=float, default=2.0)
    ap.add_argument("--heartbeat-ms", type=int, default=100, help="heartbeat period (both systems' default)")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    ap.add_argument("--join-timeout-ms", type=int, default=10000)
    ap.add_argument("--sweep-rates", default="", help="e.g. 1,2,5,10,20,50: find where quorums lag (at the largest G x W)")
    ap.add_argument("--lighthouse-cpus", default="",
                    help="CPUs the lighthouse runs on (both sides alike; '' leaves it free)")
    ap.add_argument("--load-cpus", default="",
                    help="CPUs the load generator runs on")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="", help="write every run's row here")
    args = ap.parse_args()
    for path in (args.bin, args.load):
        if not os.access(path, os.X_OK):
            sys.exit(f"lighthouse_scale: {path} is not built (ninja -C build ddpkit_cli lighthouse_load)")
    sides = [s for s in args.sides.split(",") if s]
    for s in sides:
        if s not in ("ddpkit", "ddpkit-group", "torchft"):
            sys.exit(f"lighthouse_scale: unknown side '{s}' (ddpkit, ddpkit-group, torchft)")
    if "torchft" in sides:
        v = subprocess.run([args.python, "-c", "from importlib import metadata as m; print(m.version('torchft'))"],
                           capture_output=True, text=True)
        if v.returncode != 0:
            sys.exit(f"lighthouse_scale: {args.python} has no torchft: {v.stderr.strip()[-300:]}")
        print(f"torchft {v.stdout.strip()} ({args.python})")
    print(f"step rate {args.step_rate}/s, heartbeat every {args.heartbeat_ms} ms, heartbeat timeout "
          f"{args.heartbeat_timeout_ms} ms, join timeout {args.join_timeout_ms} ms, {args.seconds} s measured "
          f"after {args.warmup} s; churn: {args.kills} kills, restart {args.restart_after_s} s later; "
          f"glibc malloc on both sides; lighthouse on CPUs [{args.lighthouse_cpus or 'any'}], load generator on "
          f"[{args.load_cpus or 'any'}] of {os.cpu_count()}")
    rows = []
    print_header()
    for groups in [int(g) for g in args.groups.split(",")]:
        for ranks in [int(w) for w in args.ranks.split(",")]:
            for side in sides:
                steady = run_load(args, side, groups, ranks, args.step_rate, 0, args.seconds)
                churn = run_load(args, side, groups, ranks, args.step_rate, args.kills, args.seconds) if args.kills else None
                rows += [r for r in (steady, churn) if r]
                print_row(steady, churn)
    if args.sweep_rates:
        groups = max(int(g) for g in args.groups.split(","))
        ranks = max(int(w) for w in args.ranks.split(","))
        print(f"\nstep-rate sweep at {groups} groups of {ranks}: lag = more than 1% of ticks skipped or p99 above the period")
        for side in sides:
            lag_at = None
            for rate in [float(r) for r in args.sweep_rates.split(",")]:
                r = run_load(args, side, groups, ranks, rate, 0, args.seconds)
                rows.append(r)
                lags = r["ticks_skipped"] > 0.01 or r["quorum_p99_ms"] > 1000.0 / rate
                print(f"  {side:<13} {rate:>6.1f}/s: p50 {fmt(r['quorum_p50_ms'])} ms, p99 {fmt(r['quorum_p99_ms'])} ms, "
                      f"{100 * r['ticks_skipped']:.1f}% ticks skipped, {r['quorums_per_group_s']:.2f} quorums/group/s"
                      f"{'  <- lags' if lags else ''}", flush=True)
                if lags:
                    lag_at = rate
                    break
            print(f"  {side}: quorums lag from {lag_at}/s" if lag_at else f"  {side}: no lag up to the rates tried")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
