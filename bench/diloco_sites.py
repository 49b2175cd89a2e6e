#!/usr/bin/env python3
"""DiLoCo across "sites": 4 network namespaces of 1 rank each on one switch, every host's link
shaped (tc tbf), against DDP across the same sites, to equal tokens (issue 72). Needs root.

  sudo bench/diloco_sites.py [--bin build/ddpkit] [--steps 512] [--rate 100mbit] [--only a,b] [--out FILE]

Per configuration, one run over the shaped links and one over unshaped ones ("no network": the
veth pairs, loopback-fast), printing:
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
This kernel has no netem (tc: "Specified qdisc kind is unknown"): links are rate-limited, with no
added delay; a kernel with sch_netem would let --rtt-ms add it.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import two_hosts  # noqa: E402

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
}
ENCODED = {"fp32": lambda n: 4 * n, "int8": lambda n: n + 4 * math.ceil(n / 256), "int4": lambda n: n / 2 + 4 * n / 128}


def tx_bytes(ns, iface):
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/dev"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.strip().startswith(iface + ":"):
            return int(line.split(":", 1)[1].split()[8])
    return 0


def run_job(args, hosts, addrs, kind, flags, port):
    env = dict(os.environ, OPENBLAS_CORETYPE=os.environ.get("OPENBLAS_CORETYPE", "Haswell"))
    before = [tx_bytes(ns, ifc) for ns, ifc in hosts]
    procs, lighthouse = [], None
    start = time.time()
    try:
        if kind == "ddp":
            for i, (ns, ifc) in enumerate(hosts):
                e = dict(env, RANK=str(i), WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR=addrs[0],
                         MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=ifc)
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, args.bin, "train", "--steps", str(args.steps)]
                                              + MODEL + INNER + flags, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True, env=e))
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
            sys.exit(f"FAILED: {kind} {' '.join(flags)}: exit {p.returncode}\n{e[-3000:]}")
    reps = [json.loads(l) for o, _ in outs for l in o.splitlines() if l.startswith("{")]
    wire = [tx_bytes(ns, ifc) - b for (ns, ifc), b in zip(hosts, before)]
    return reps, wire, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/ddpkit")
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("diloco_sites.py: needs root (network namespaces, tc)")
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    tag = f"dlc{os.getpid() % 10000}"
    addrs = [f"10.216.0.{i + 1}" for i in range(4)]
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)
    try:
        hosts = two_hosts.create_switched(tag, addrs)
        say(f"# DiLoCo across 4 sites (network namespaces on one switch, 1 rank each), {args.steps} inner steps each, "
            f"transformer 2 x d_model 128 on the text corpus, AdamW inner lr 0.002; links: tbf {args.rate} per host egress, "
            "no added delay (no netem here)")
        say(f"{'config':<18} {'bytes/step':>11} {'formula':>11} {'cnt/form':>8} {'wire/step':>11} {'vs_ddp':>8} "
            f"{'steps/s':>8} {'frac':>6} {'test_loss':>9} {'vs_ddp':>7} {'hidden':>7} {'goodput':>8}")
        results = {}
        port = 29700
        for name in names:
            kind, flags = CONFIGS[name]
            for shaped in (False, True):
                for ns, ifc in hosts:
                    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", ifc, "root"],
                                   capture_output=True)
                    if shaped:
                        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ifc, "root", "tbf",
                                        "rate", args.rate, "burst", "64kb", "latency", "200ms"], check=True)
                port += 3
                results[(name, shaped)] = run_job(args, hosts, addrs, kind, flags, port)
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
                rate_bytes = float(args.rate.replace("mbit", "e6").replace("gbit", "e9")) / 8
                per_sync_sent = r["cross_bytes_sent"] / max(r["outer_syncs"], 1)
                goodput = per_sync_sent / (r["sync_transfer_seconds"] / max(r["outer_syncs"], 1)) / rate_bytes
            if name == "ddp-fp32":
                results["ddp"] = (counted, loss)
            ddp_bytes, ddp_loss = results.get("ddp", (float("nan"), float("nan")))
            say(f"{name:<18} {counted:>11.0f} {formula:>11.0f} {counted / formula if formula else float('nan'):>8.4f} "
                f"{wire[0] / steps:>11.0f} {ddp_bytes / counted if counted else float('inf'):>8.1f} {rate:>8.2f} "
                f"{rate / rate0:>6.3f} {loss:>9.4f} {loss / ddp_loss:>7.4f} {hidden:>7.3f} {goodput:>8.3f}")
    finally:
        two_hosts.remove(tag)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
