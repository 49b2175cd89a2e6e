#!/usr/bin/env python3
"""DiLoCo across "sites": 4 network namespaces of 1 rank each on one switch, every host's uplink
shaped to a rate and a delay (tests/shaped_switch.py: this kernel has no netem), against DDP
across the same sites, to equal tokens (issue 72). Needs root.

  sudo bench/diloco_sites.py [--bin build/ddpkit] [--steps 512] [--rate-mbit 100] [--rtt-ms 50]
                             [--only a,b] [--goodput] [--blackhole S] [--out FILE]

Per configuration, one run over the shaped links and one over unshaped ones ("no network": the
same switch, no rate limit, no delay), printing:
  bytes/step     what a rank sent to other sites per inner step, as its transport counted it
  formula        the same from the algorithm's formula (DDP: 2(n-1)/n x the gradient's wire bytes;
                 DiLoCo: syncs x 2(n-1)/n x the encoded fragment, plus 16 B a chunk), and counted/formula
  wire/step      bytes the rank's interface sent (/proc/net/dev: TCP/IP headers, heartbeats included)
  vs_ddp         fp32 DDP's bytes per step over this configuration's
  steps/s        inner steps per second, shaped; frac = over the same job unshaped
  test_loss      on the held-out text after the run (DiLoCo: the global parameters), and vs DDP fp32's
  hidden         DiLoCo: 1 - (time the training thread waited for averages in flight) / (time they were
                 in flight); quorums and commits are blocking besides (sync_blocked_seconds)
  goodput        DiLoCo: bytes a rank sent per sync / the sync's transfer time, over the shaped rate
Connections are kept warm: net.ipv4.tcp_slow_start_after_idle=0 in every namespace (Linux's
default, 1, restarts a connection idle for an RTO from 10 segments; --slow-start-after-idle keeps it).
Rows torchft-*, torchft-nightly-* and ddpkit-py-* run one Python script (bench/torchft_replica.py:
the same model, text, data order, inner AdamW and outer SGD) under torchft 0.2.0's DiLoCo, torchft-
nightly 2026.10.26's, and ddpkit's Python DiLoCo (ddpkit.diloco, from --pip-build's python/; int4
and int2 too, which torchft has only on CUDA); torchft's bytes are its interface's.
--blackhole S adds two DiLoCo runs in which site 3 goes silent after S seconds (every frame to and
from it dropped), at once and as it next starts sending a sync: when the lighthouse lost it and
formed the first quorum without it (its log), the survivors' inner steps, retries, longest
blocked sync, the new quorum's rendezvous and checksums.
--goodput adds the outer all-reduce alone (build/collective_bench --outer) after idle links, of
16 and 64 MiB of fp32 values in int8: with the cross group's default pieces (1 MiB, 2 Gloo threads)
and DiLoCo's (256 KiB, 4), with Linux's default and with warm connections; then plain TCP streams
between the same hosts (bench/tcp_streams.py), the floor those links and this switch give.
"""
import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import shaped_switch  # noqa: E402
import two_hosts  # noqa: E402
from procs import with_openblas_coretype  # noqa: E402

BATCH = 16
MODEL = ["--model", "transformer", "--dataset", "text", "--layers", "2", "--d-model", "128", "--heads", "4",
         "--seq-len", "64", "--batch-size", str(BATCH), "--threads", "1", "--quiet", "--timeout-s", "600",
         "--epochs", "1000"]
INNER = ["--optimizer", "adamw", "--lr", "0.002"]
CONFIGS = {
    "ddp-fp32": ("ddp", []),
    "ddp-int8": ("ddp", ["--hook", "int8"]),
    "ddp-powersgd": ("ddp", ["--hook", "powersgd", "--powersgd-rank", "4"]),
    "diloco-16-fp32": ("diloco", ["--diloco", "16"]),
    "diloco-64-fp32": ("diloco", ["--diloco", "64"]),
    "diloco-128-fp32": ("diloco", ["--diloco", "128"]),
    "diloco-16-int8": ("diloco", ["--diloco", "16", "--outer-codec", "int8"]),
    "diloco-64-int8": ("diloco", ["--diloco", "64", "--outer-codec", "int8"]),
    "diloco-128-int8": ("diloco", ["--diloco", "128", "--outer-codec", "int8"]),
    "streaming-64-int4": ("diloco", ["--diloco", "64", "--fragments", "4", "--fragment-delay", "4",
                                     "--outer-codec", "int4"]),
    # torchft 0.2.0's DiLoCo (bench/torchft_replica.py --diloco), fp32 (its quantization needs CUDA)
    "torchft-64-fp32": ("torchft", ["--diloco", "64"]),
    "torchft-128-fp32": ("torchft", ["--diloco", "128"]),
    # torchft-nightly 2026.10.26's DiLoCo: the same script in the nightly venv
    "torchft-nightly-64-fp32": ("torchft-nightly", ["--diloco", "64"]),
    # ddpkit's Python DiLoCo (ddpkit.diloco) in the same script, model, data and optimizers as torchft's
    "ddpkit-py-64-fp32": ("ddpkit-py", ["--diloco", "64"]),
    "ddpkit-py-64-int8": ("ddpkit-py", ["--diloco", "64", "--codec", "int8"]),
    "ddpkit-py-64-int4": ("ddpkit-py", ["--diloco", "64", "--codec", "int4"]),
    "ddpkit-py-64-int2": ("ddpkit-py", ["--diloco", "64", "--codec", "int2"]),
    "ddpkit-py-streaming-64-int4": ("ddpkit-py", ["--diloco", "64", "--fragments", "4", "--fragment-delay", "4",
                                                  "--codec", "int4"]),
}
# The pip venv with torchft (scripts/pip-torch-env.sh), for the torchft rows.
TORCHFT_PYTHON = "/var/cache/ddpkit/pip-torch-2.15.0/bin/python3"
TORCHFT_NIGHTLY_PYTHON = "/var/cache/ddpkit/pip-torch-2.15.0-torchft-nightly/bin/python3"
TORCHFT_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchft_replica.py")
ENCODED = {"fp32": lambda n: 4 * n, "int8": lambda n: n + 4 * math.ceil(n / 256), "int4": lambda n: n / 2 + 4 * n / 128,
           "int2": lambda n: n / 4 + 4 * n / 128}


def tx_bytes(ns, iface):
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/dev"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.strip().startswith(iface + ":"):
            return int(line.split(":", 1)[1].split()[8])
    return 0


class FailedRun(Exception):
    """A configuration's run that did not finish: a peer's is a failed baseline, ddpkit's a failure."""

    def __init__(self, what, stderr_tail):
        super().__init__(what)
        self.stderr_tail = stderr_tail


def run_job(args, hosts, addrs, kind, flags, port):
    env = with_openblas_coretype(os.environ)
    before = [tx_bytes(ns, ifc) for ns, ifc in hosts]
    procs, lighthouse, logs = [], None, []
    start = time.time()
    try:
        if kind == "ddp":
            for i, (ns, ifc) in enumerate(hosts):
                e = dict(env, RANK=str(i), WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR=addrs[0],
                         MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=ifc)
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, args.bin, "train", "--steps", str(args.steps)]
                                              + MODEL + INNER + flags, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True, env=e))
        elif kind in ("torchft", "torchft-nightly", "ddpkit-py"):
            python = TORCHFT_NIGHTLY_PYTHON if kind == "torchft-nightly" else TORCHFT_PYTHON
            site_env = dict(env)
            if kind == "ddpkit-py":
                # ddpkit's lighthouse of the same build (its store's wire format is that torch's), the
                # quorum waiting for a site as long as the sites wait for it.
                lighthouse = subprocess.Popen(["ip", "netns", "exec", hosts[0][0],
                                               os.path.join(args.pip_build, "ddpkit"), "lighthouse", "--address",
                                               f"{addrs[0]}:{port}", "--expected-groups", "4", "--join-timeout-ms",
                                               "120000", "--quiet"], stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL, env=env)
                site_env["PYTHONPATH"] = os.path.abspath(os.path.join(args.pip_build, "python"))
                flags = flags + ["--impl", "ddpkit"]
            else:
                tool = os.path.join(os.path.dirname(python), "torchft_lighthouse")
                lighthouse = subprocess.Popen(["ip", "netns", "exec", hosts[0][0], tool, "--min_replicas", "4", "--bind",
                                               f"{addrs[0]}:{port}", "--join_timeout_ms", "60000", "--quorum_tick_ms",
                                               "50"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            time.sleep(1.0)
            for i, (ns, ifc) in enumerate(hosts):
                # torchft logs every quorum: to a file, as a full stderr pipe would block a site.
                logs.append(tempfile.TemporaryFile(mode="w+"))
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, python, TORCHFT_SITE, "--group", str(i),
                                               "--groups", "4", "--lighthouse", f"{addrs[0]}:{port}", "--host", addrs[i],
                                               "--steps", str(args.steps), "--layers", "2", "--d-model", "128",
                                               "--heads", "4", "--seq-len", "64", "--batch-size", str(BATCH),
                                               "--lr", "0.002", "--timeout-s", "120"] + flags,
                                              stdout=subprocess.PIPE, stderr=logs[-1], text=True,
                                              env=dict(site_env, GLOO_SOCKET_IFNAME=ifc)))
        else:
            lighthouse = subprocess.Popen(["ip", "netns", "exec", hosts[0][0], args.bin, "lighthouse", "--address",
                                           f"{addrs[0]}:{port}", "--expected-groups", "4", "--join-timeout-ms",
                                           "600000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
            time.sleep(1.0)
            for i, (ns, _) in enumerate(hosts):
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, args.bin, "train", "--fault-tolerant",
                                               "--replica-groups", "4", "--replica-group", str(i), "--lighthouse",
                                               f"{addrs[0]}:{port}", "--nproc", "1", "--steps", str(args.steps)]
                                              + MODEL + INNER + flags, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True, env=env))
        outs = [p.communicate(timeout=3600) for p in procs]
        for i, log in enumerate(logs):
            log.seek(0)
            outs[i] = (outs[i][0], log.read())
            log.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if lighthouse:
            lighthouse.kill()
            lighthouse.wait()
    wall = time.time() - start
    for p, (o, e) in zip(procs, outs):
        if p.returncode != 0:
            raise FailedRun(f"{kind} {' '.join(flags)}: exit {p.returncode}", e[-3000:])
    reps = [json.loads(l) for o, _ in outs for l in o.splitlines() if l.startswith("{")]
    wire = [tx_bytes(ns, ifc) - b for (ns, ifc), b in zip(hosts, before)]
    return reps, wire, wall


def last_line(text):
    lines = [l for l in text.splitlines() if l.strip()]
    return lines[-1].strip()[:300] if lines else "(none)"


def set_slow_start_after_idle(hosts, value):
    for ns, _ in hosts:
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_slow_start_after_idle={value}"],
                       check=True)


def goodput_rows(args, hosts, addrs, port, say):
    """The outer all-reduce alone after idle links: the cross group's defaults and DiLoCo's pieces,
    Linux's default (slow start after idle) and warm connections."""
    bench = os.path.join(os.path.dirname(os.path.abspath(args.bin)), "collective_bench")
    env = with_openblas_coretype(os.environ)
    n, idle = len(hosts), 3.0
    say(f"# goodput of one sync after {idle:g} s idle, {args.rate_mbit:g} Mbit/s, RTT {args.rtt_ms:g} ms; goodput = bytes "
        "a rank sends / the slowest rank's time / the link's rate (payload ceiling 1448/1538 = 0.941)")
    for value in (1, 0):
        set_slow_start_after_idle(hosts, value)
        for piece_mb, threads in ((1, 2), (0.25, 4)):
            port += 3
            procs = []
            for i, (ns, ifc) in enumerate(hosts):
                e = dict(env, RANK=str(i), WORLD_SIZE=str(n), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                         MASTER_ADDR=addrs[0], MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=ifc)
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, bench, "--processes", "--outer", "int8",
                                               "--sizes-mb", "16,64", "--idle-s", str(idle), "--reps", "4",
                                               "--rate-mbit", str(args.rate_mbit), "--piece-mb", str(piece_mb),
                                               "--gloo-threads", str(threads)],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e))
            outs = [p.communicate(timeout=1200) for p in procs]
            for p, (_, err) in zip(procs, outs):
                if p.returncode != 0:
                    sys.exit(f"FAILED: collective_bench --outer: exit {p.returncode}\n{err[-3000:]}")
            for line in outs[0][0].splitlines():
                say(line)
    # The floor: plain TCP, every host streaming to the other three at once, as many bytes as a
    # rank sends in the 16M-value sync (8 MiB a peer), warm connections.
    port += 3
    streams = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tcp_streams.py")
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, streams, str(i), ",".join(addrs), "8", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i, (ns, _) in enumerate(hosts)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            sys.exit(f"FAILED: bench/tcp_streams.py: exit {p.returncode}\n{err[-3000:]}")
    rows = [json.loads(o) for o, _ in outs]
    rate = args.rate_mbit * 1e6 / 8
    say("# plain TCP, each host to the other 3 at once, 8 MiB a peer (bench/tcp_streams.py), goodput per host: " +
        " ".join(f"{r['bytes'] / r['seconds'] / rate:.3f}" for r in rows) +
        f"; slowest {min(r['bytes'] / r['seconds'] / rate for r in rows):.3f}")
    return port


# The lighthouse's heartbeat timeout in the blackhole run: a silent site is lost this long after
# its last heartbeat (every 100 ms), so out of the quorum within 1 s; a live site's heartbeat may
# queue behind a sync in its uplink (200 ms of queue) or wait out one retransmission.
BLACKHOLE_HEARTBEAT_TIMEOUT_MS = 750


def lighthouse_events(log):
    """(unix time, text) of each line `ddpkit lighthouse` printed: '<UTC ISO time> <event>'."""
    events = []
    for line in log.splitlines():
        stamp, _, text = line.partition(" ")
        try:
            t = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc)
        except ValueError:
            continue
        events.append((t.timestamp(), text))
    return events


def blackhole_run(args, switch, addrs, port, say, mid_sync):
    """DiLoCo H=16 int8 over the shaped links; after `args.blackhole` seconds site 3 goes silent
    (the switch drops all it sends and all sent to it: netem loss 100%): at once (most likely in
    its inner steps), or with `mid_sync` as it next starts sending a sync's data. The survivors
    must run every inner step, stay identical and lose little time; the lighthouse's log says when
    site 3 was lost and when a quorum went on without it. The silent site is killed at the end."""
    hosts = switch.hosts
    env = with_openblas_coretype(os.environ)
    flags = ["--diloco", "16", "--outer-codec", "int8"]
    log = tempfile.TemporaryFile(mode="w+")
    lighthouse = subprocess.Popen(["ip", "netns", "exec", hosts[0][0], args.bin, "lighthouse", "--address",
                                   f"{addrs[0]}:{port}", "--expected-groups", "4", "--join-timeout-ms", "600000",
                                   "--heartbeat-timeout-ms", str(BLACKHOLE_HEARTBEAT_TIMEOUT_MS)],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
    time.sleep(1.0)
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, args.bin, "train", "--fault-tolerant", "--replica-groups", "4",
                               "--replica-group", str(i), "--lighthouse", f"{addrs[0]}:{port}", "--nproc", "1",
                               "--steps", str(args.steps)] + MODEL + INNER + flags,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i, (ns, _) in enumerate(hosts)]
    try:
        time.sleep(args.blackhole)
        if mid_sync:
            silenced = switch.blackhole_mid_transfer(3)
        else:
            switch.blackhole(3)
            silenced = time.time()
        outs = [p.communicate(timeout=1800) for p in procs[:3]]
        survivors_done = time.time() - silenced
    finally:
        for p in procs + [lighthouse]:
            if p.poll() is None:
                p.kill()
            p.wait()
        switch.restore(3)
        log.seek(0)
        events = lighthouse_events(log.read())
        log.close()
    for i, (p, (o, e)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            sys.exit(f"FAILED: blackhole run, site {i}: exit {p.returncode}\n{e[-3000:]}")
    reps = [json.loads(l) for o, _ in outs for l in o.splitlines() if l.startswith("{")]
    same = len({r["parameter_checksum"] for r in reps}) == 1
    when = "as it started sending its part of a sync" if mid_sync else "at once"
    say(f"# blackhole: site 3 silent after {args.blackhole:g} s, {when}, of {args.steps} inner steps (DiLoCo H=16 int8, "
        f"lighthouse heartbeat timeout {BLACKHOLE_HEARTBEAT_TIMEOUT_MS} ms); survivors finished {survivors_done:.1f} s later")
    # Within 10 s of the silence (later, the sites that finish stop heartbeating too).
    events = [(t, text) for t, text in events if silenced - 0.5 <= t < silenced + 10]
    for t, text in events:
        if "lost" in text or "dropped" in text:
            say(f"#   lighthouse +{t - silenced:.3f} s: {text}")
    lost = [t - silenced for t, text in events if t >= silenced and " lost: " in text]
    without = [t - silenced for t, text in events if t >= silenced and "dropped [" in text]
    say(f"#   out of the quorum: lost {lost[0] if lost else float('nan'):.3f} s after it went silent, the first "
        f"quorum without it {without[0] if without else float('nan'):.3f} s after; live sites lost meanwhile: "
        f"{max(0, len(lost) - 1)}")
    for r in reps:
        say(f"#   site {r['replica_group']}: steps_run {r['steps_run']}/{args.steps}, sync_retries {r['sync_retries']}, "
            f"longest sync blocked {r['longest_sync_blocked_seconds']:.2f} s (after the first: "
            f"{r['longest_later_sync_blocked_seconds']:.2f} s), cross groups built {r['reconfigurations']} "
            f"(longest {r['longest_reconfiguration_seconds']:.2f} s), last sites {r['last_sites']}, "
            f"checksum_mismatches {r['checksum_mismatches']}, test loss {r['test_loss']:.4f}")
    say(f"#   survivors identical: {'yes' if same else 'NO'}; every inner step run: "
        f"{'yes' if all(r['steps_run'] == args.steps for r in reps) else 'NO'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/ddpkit")
    ap.add_argument("--pip-build", default="build-pip", help="the pip torch build, whose python/ the ddpkit-py rows "
                                                             "import (scripts/check-pip-torch.sh makes it)")
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--rate-mbit", type=float, default=100)
    ap.add_argument("--rtt-ms", type=float, default=50)
    ap.add_argument("--only", default="", help="configurations, comma-separated (none: every one; 'none': the "
                                               "table is left out)")
    ap.add_argument("--goodput", action="store_true")
    ap.add_argument("--blackhole", type=float, default=0, help="also: site 3 goes silent after this many seconds "
                                                                 "of a DiLoCo run (0: not run)")
    ap.add_argument("--slow-start-after-idle", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("diloco_sites.py: needs root (network namespaces, tap devices)")
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    tag = f"dlc{os.getpid() % 10000}"
    addrs = [f"10.216.0.{i + 1}" for i in range(4)]
    lines = []
    rate_bytes = args.rate_mbit * 1e6 / 8

    def say(s):
        print(s, flush=True)
        lines.append(s)
    switch = None
    try:
        switch = shaped_switch.Switch(tag, addrs)
        hosts = switch.hosts
        set_slow_start_after_idle(hosts, 1 if args.slow_start_after_idle else 0)
        say(f"# DiLoCo across 4 sites (network namespaces on one switch, 1 rank each), {args.steps} inner steps each, "
            f"transformer 2 x d_model 128 on the text corpus, AdamW inner lr 0.002; links: {args.rate_mbit:g} Mbit/s "
            f"per host uplink, RTT {args.rtt_ms:g} ms (tests/shaped_switch.py), tcp_slow_start_after_idle="
            f"{1 if args.slow_start_after_idle else 0}")
        if names:
            say(f"{'config':<18} {'bytes/step':>11} {'formula':>11} {'cnt/form':>8} {'wire/step':>11} {'vs_ddp':>8} "
                f"{'steps/s':>8} {'frac':>6} {'test_loss':>9} {'vs_ddp':>7} {'hidden':>7} {'goodput':>8}")
        results = {}
        failures = 0
        port = 29700
        for name in names:
            kind, flags = CONFIGS[name]
            try:
                for shaped in (False, True):
                    switch.shape(args.rate_mbit if shaped else 0, args.rtt_ms / 2 if shaped else 0)
                    port += 3
                    results[(name, shaped)] = run_job(args, hosts, addrs, kind, flags, port)
            except FailedRun as e:
                peer = kind.startswith("torchft")
                say(f"{name:<18} {'FAILED BASELINE' if peer else 'FAILED'} ({'shaped' if shaped else 'unshaped'} "
                    f"run): {e}; last stderr line: {last_line(e.stderr_tail)}")
                print(e.stderr_tail, file=sys.stderr)
                failures += 0 if peer else 1
                continue
            (reps, wire, wall), (reps0, _, wall0) = results[(name, True)], results[(name, False)]
            r = min(reps, key=lambda x: x.get("replica_group", 0))
            steps = args.steps
            if kind == "ddp":
                counted = r["bytes_sent_per_step"]
                loss = math.log(r["test_perplexity"])
                rate = r["samples_per_s"] / (BATCH * 4)
                rate0 = reps0[0]["samples_per_s"] / (BATCH * 4)
                formula = counted  # the hooks' own traffic tables check theirs (docs/hooks.md)
                hidden = goodput = float("nan")
            elif kind.startswith("torchft"):
                # No transport count: the interface's bytes (TCP/IP headers, quorum RPCs included); the
                # formula is Gloo's ring allreduce of the fp32 parameters once per sync.
                counted = wire[0] / steps
                formula = r["outer_syncs"] * 2 * 3 / 4 * 4 * r["parameters"] / steps
                loss = r["test_loss"]
                rate = steps / r["train_seconds"]
                rate0 = steps / [x for x in reps0 if x["replica_group"] == r["replica_group"]][0]["train_seconds"]
                hidden = goodput = float("nan")
            else:
                counted = r["cross_bytes_per_step"]
                sizes, codec = r["fragment_parameters"], r["outer_codec"]
                # The first (weightless) sync carries fragment 0, then the fragments in turn.
                carried = [sizes[0]] + [sizes[i % len(sizes)] for i in range(r["outer_syncs"] - 1)]
                formula = sum(2 * 3 / 4 * ENCODED[codec](n) for n in carried) / r["steps_run"]
                loss = r["test_loss"]
                rate = steps / r["train_seconds"]
                rate0 = steps / [x for x in reps0 if x["replica_group"] == r["replica_group"]][0]["train_seconds"]
                hidden = max(0.0, 1 - r["sync_wait_seconds"] / r["sync_transfer_seconds"]) \
                    if r["sync_transfer_seconds"] > 0 else float("nan")
                per_sync_sent = r["cross_bytes_sent"] / max(r["outer_syncs"], 1)
                goodput = per_sync_sent / (r["sync_transfer_seconds"] / max(r["outer_syncs"], 1)) / rate_bytes
            if name == "ddp-fp32":
                results["ddp"] = (counted, loss)
            ddp_bytes, ddp_loss = results.get("ddp", (float("nan"), float("nan")))
            say(f"{name:<18} {counted:>11.0f} {formula:>11.0f} {counted / formula if formula else float('nan'):>8.4f} "
                f"{wire[0] / steps:>11.0f} {ddp_bytes / counted if counted else float('inf'):>8.1f} {rate:>8.2f} "
                f"{rate / rate0:>6.3f} {loss:>9.4f} {loss / ddp_loss:>7.4f} {hidden:>7.3f} {goodput:>8.3f}")
        switch.shape(args.rate_mbit, args.rtt_ms / 2)
        if args.blackhole:
            for mid_sync in (False, True):
                port += 3
                blackhole_run(args, switch, addrs, port, say, mid_sync)
        if args.goodput:
            port = goodput_rows(args, hosts, addrs, port + 3, say)
        say("# switch: " + " ".join(f"{k}={v}" for k, v in switch.stats().items()))
    finally:
        if switch:
            switch.close()
        two_hosts.remove(tag)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if failures:
        sys.exit(f"diloco_sites.py: {failures} of ddpkit's configurations failed (above)")


if __name__ == "__main__":
    main()
