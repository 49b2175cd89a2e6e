#!/usr/bin/python3
"""What fault tolerance costs when nothing fails, what a heal costs, and what it saves when ranks die.

    bench/ft_bench.py [--reps 3] [--steps 60] [--ddpkit build/ddpkit] [--heal-dims 64,4096,4096,10] [--heal-steps 400]
                      [--schedule-seconds 600] [--kill-every 20] [--schedule-model small,default]
                      [--link-rates 1gbit,10gbit]
                      [--heal-connections 1,2,4] [--skip step,heal,heal-netns,schedule]

Step: the same job, 2 ranks in all, interleaved --reps times:
  plain   ddpkit train --nproc 2                                  (DDP across both ranks)
  ft      ddpkit train --fault-tolerant --replica-groups 2 --nproc 1  (each rank a replica group:
          the gradient average crosses groups bucket by bucket during backward, under a per-step
          quorum)
Synthetic MLP (--mlp-dims, default the 25.2M-parameter 1024-4096-4096-1024), batch 32 per rank,
one thread per rank, SGD. The table shows each side's median step (FT: the slower group's) and
the ratio ft/plain (the issue's target: <= 1.05).

Heal: 2 groups of 1 rank train --heal-dims with Adam; once both are in their steps, group 1 is
SIGKILLed; it restarts, copies its state from group 0 and trains on. Printed: the bytes healed,
the heal's time (fetch, including the wait for the source's current step, and load), its rate and
route, beside, for scale, writing as many bytes into memory never touched (where a restarted
process's copy lands).
Heal between namespaces (--skip heal-netns to leave out; needs root): the same heal with the two
groups on two network namespaces joined by a veth pair shaped with tc tbf to each --link-rates rate,
the lighthouse and group 0 in one, group 1 in the other, so the state crosses the link, streamed
over the heal's pair group (Gloo) with each of --heal-connections connections. Printed beside
each: the link as a plain TCP stream measures it (the rate a heal could reach) and the heal's rate
against it (the issue's target: >= 0.8x).
Schedule: 4 replica groups of 1 rank train a transformer (--schedule-model: "small", 2 layers,
d_model 128, 4 heads; "default", the 4 layers and d_model 256 `ddpkit train --model transformer`
builds; 64 tokens, batch 16) for the steps a failure-free run takes about --schedule-seconds for;
failures come every --kill-every seconds on average (gaps drawn uniformly from half to 1.5 times
it, seeded: the same failure times for every side), each SIGKILLing a random group's rank (the
group restarts and heals). Printed: job restarts (the launcher's exit), failures, steps the
survivors lost per failure (steps that did not commit), failure to each survivor's next committed
step (p50/p95/max, from --step-log), and the final test loss against a failure-free run of the
same steps. Then the same job as plain DDP (--nproc 4) under --max-restarts with --checkpoint-dir
and --checkpoint-every 100 (--resume) on the same failure times: goodput, completed steps per
second over the whole run, of each side. Last, the plain job once more without failures: the
goodput a fault-tolerant job could at best reach (losing nothing and costing nothing per step),
whose ratio bounds what this machine can show. The two sizes differ in where the checkpoint
interval falls: 100 small steps take less than the mean time between failures, 100 default steps
more.
Both sides run under the same environment (set OPENBLAS_CORETYPE for every side).
"""
import argparse
import glob
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from ft_train import cpu_seconds, ranks_of  # noqa: E402  (finding a replica group's ranks)
from procs import children  # noqa: E402


def reports(out):
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def train(binary, flags, timeout):
    cmd = [binary, "train", "--dataset", "synthetic", "--batch-size", "32", "--threads", "1", "--no-eval",
           "--quiet"] + flags
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"ft_bench: failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return reports(p.stdout)


def heal(binary, dims, steps, timeout):
    cmd = [binary, "train", "--fault-tolerant", "--replica-groups", "2", "--nproc", "1", "--dataset", "synthetic",
           "--mlp-dims", dims, "--optimizer", "adam", "--batch-size", "32", "--threads", "1", "--epochs", "1000",
           "--steps", str(steps), "--no-eval", "--quiet"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.time() + timeout
    killed = False
    while time.time() < end and not killed and p.poll() is None:
        pids = ranks_of(1)
        try:
            if pids and ranks_of(0) and cpu_seconds(pids[0]) > 4 and cpu_seconds(ranks_of(0)[0]) > 4:
                os.kill(pids[0], signal.SIGKILL)
                killed = True
        except OSError:
            pass
        time.sleep(0.1)
    out, err = p.communicate(timeout=max(1, end - time.time()))
    if p.returncode != 0 or not killed:
        raise SystemExit(f"ft_bench: the heal run failed (exit {p.returncode}, killed {killed})\n{err[-2000:]}")
    return {r["replica_group"]: r for r in reports(out)}


# The schedule's model: `ddpkit train --model transformer` at its own size ("default": 4 layers,
# d_model 256) or a smaller one whose 100-step checkpoint interval is shorter than the mean time
# between failures ("small").
TRANSFORMER_SIZES = {"small": ["--layers", "2", "--d-model", "128", "--heads", "4"], "default": []}


def transformer(size):
    return (["--model", "transformer", "--dataset", "text"] + TRANSFORMER_SIZES[size] +
            ["--seq-len", "64", "--batch-size", "16", "--threads", "1", "--epochs", "100000", "--quiet"])


def children_ranks(launcher_pid):
    """pids of the rank processes a launcher started (its children with RANK set)."""
    out = []
    for pid in children(launcher_pid):
        try:
            if any(e.startswith(b"RANK=") for e in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")):
                out.append(pid)
        except OSError:
            continue
    return out


def group_of(pid):
    args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    return int(args[args.index(b"--replica-group") + 1]) if b"--replica-group" in args else None


def kill_times(kill_every, seed, horizon):
    """Seconds from the start at which to kill: gaps drawn uniformly between 0.5 and 1.5 times
    kill_every (mean kill_every), seeded, so both sides of a comparison meet the same failures. A
    fixed period falls in step with a restarted job: each restart costs about the same, so every
    failure would land the same number of steps after a checkpoint, and the steps it loses would be
    set by the step time rather than averaging half a checkpoint interval."""
    rng, t, out = random.Random(seed), 0.0, []
    while t < horizon:
        t += rng.uniform(0.5 * kill_every, 1.5 * kill_every)
        out.append(t)
    return out


def run_with_kills(cmd, kill_every, seed, timeout):
    """Runs cmd; at kill_times(kill_every, seed) SIGKILLs a random rank of it (victims drawn from
    their own seeded generator). Returns (rc, out, err, wall seconds, kills as (unix ms, replica
    group or None))."""
    start = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = {}

    def drain(name, stream):
        outs[name] = stream.read()
    readers = [threading.Thread(target=drain, args=(n, s), daemon=True) for n, s in (("out", p.stdout), ("err", p.stderr))]
    for r in readers:
        r.start()
    victims = random.Random(seed + 1)
    kills, pending = [], kill_times(kill_every, seed, timeout)
    while p.poll() is None and time.time() - start < timeout:
        if pending and time.time() - start >= pending[0]:
            pending.pop(0)
            ranks = children_ranks(p.pid)
            if ranks:
                victim = victims.choice(ranks)
                try:
                    group = group_of(victim)
                    os.kill(victim, signal.SIGKILL)
                    kills.append((time.time() * 1000, group))
                except (OSError, ValueError):
                    pass
        time.sleep(0.05)
    if p.poll() is None:
        # Its ranks too (each leads a process group of its own), found before the launcher goes
        # and they are no longer its children.
        ranks = children_ranks(p.pid)
        p.kill()
        for pid in ranks:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
    p.wait()
    for r in readers:
        r.join()
    return p.returncode, outs.get("out", ""), outs.get("err", ""), time.time() - start, kills


def step_logs(prefix):
    """{group: [(step, end unix ms, ms, committed)]} from --step-log files."""
    logs = {}
    for path in glob.glob(prefix + ".replica-*"):
        g = int(path.rsplit("-", 1)[1])
        logs[g] = [tuple(float(x) for x in line.split()) for line in open(path) if line.strip()]
    return logs


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def schedule(binary, seconds, kill_every, timeout, size):
    model = transformer(size)
    work = tempfile.mkdtemp(prefix="ddpkit-ft-bench-")
    try:
        # How many steps a failure-free run takes `seconds` for: a 60-step probe.
        probe = reports(subprocess.run([binary, "train", "--fault-tolerant", "--replica-groups", "4", "--nproc", "1",
                                        "--steps", "60", "--no-eval"] + model, capture_output=True, text=True,
                                       timeout=timeout).stdout)
        step_ms = max(r["median_step_ms"] for r in probe)
        steps = max(100, int(seconds * 1000 / step_ms))
        ft = [binary, "train", "--fault-tolerant", "--replica-groups", "4", "--nproc", "1", "--steps", str(steps),
              "--max-restarts", "1000"] + model
        print(f"\nschedule ({size} transformer): {steps} steps (failure-free FT step {step_ms:.1f} ms), a random rank "
              f"SIGKILLed every {kill_every:g} s on average", flush=True)
        start = time.time()
        clean = reports(subprocess.run(ft, capture_output=True, text=True, timeout=timeout).stdout)
        clean_wall = time.time() - start
        log = os.path.join(work, "steps")
        rc, out, err, wall, kills = run_with_kills(ft + ["--step-log", log], kill_every, 1, timeout)
        if rc != 0:
            raise SystemExit(f"ft_bench: the fault-tolerant schedule failed (exit {rc})\n{err[-2000:]}")
        reps = reports(out)
        logs = step_logs(log)
        latencies, lost = [], 0
        for t_kill, victim in kills:
            for g, lines in logs.items():
                if g == victim:
                    continue
                after = [end for (_, end, _, ok) in lines if end > t_kill and ok]
                if after:
                    latencies.append((after[0] - t_kill) / 1000)
        for g, lines in logs.items():
            lost += sum(1 for line in lines if not line[3])
        survivors = max(1, len(kills) * (len(logs) - 1))
        ft_loss = statistics.mean(r["test_loss"] for r in reps)
        clean_loss = statistics.mean(r["test_loss"] for r in clean)
        ft_goodput = steps / wall
        print(f"fault-tolerant: exit {rc} (job restarts: 0), {len(kills)} failures, group restarts "
              f"{err.count('restarting every rank')}, wall {wall:.0f} s")
        print(f"  steps lost per failure per survivor: {lost / survivors:.2f} (target <= 1)")
        print(f"  failure -> survivor's next committed step: p50 {percentile(latencies, 50):.2f} s, p95 "
              f"{percentile(latencies, 95):.2f} s, max {max(latencies) if latencies else float('nan'):.2f} s "
              f"({len(latencies)} survivor-failures; target p95 <= 2 s)")
        print(f"  final test loss {ft_loss:.4f} vs failure-free {clean_loss:.4f}: "
              f"{100 * (ft_loss - clean_loss) / clean_loss:+.2f} % (target within 2 %)")
        ckpt = os.path.join(work, "ckpt")
        plain = [binary, "train", "--nproc", "4", "--steps", str(steps), "--max-restarts", "1000", "--checkpoint-dir",
                 ckpt, "--checkpoint-every", "100", "--resume", "--no-eval"] + model
        # Bounded: where failures come faster than a restart plus a checkpoint interval, a restarted
        # job may never finish. Its goodput is then the newest checkpoint's step over the time.
        limit = min(timeout, 2 * wall + 60)
        rc2, out2, err2, wall2, kills2 = run_with_kills(plain, kill_every, 1, limit)
        saved = [int(os.path.basename(f)[len("checkpoint-"):-len(".ddpk")]) for f in glob.glob(os.path.join(ckpt, "checkpoint-*.ddpk"))]
        done = steps if rc2 == 0 else max(saved, default=0)
        plain_goodput = done / wall2
        print(f"--max-restarts + checkpoints every 100: {'finished' if rc2 == 0 else f'stopped after {wall2:.0f} s'}, "
              f"{done} of {steps} steps kept, {len(kills2)} failures, job restarts "
              f"{err2.count('restarting every rank')}, wall {wall2:.0f} s")
        print(f"goodput (steps/s over the run): fault-tolerant {ft_goodput:.2f}, --max-restarts {plain_goodput:.2f}: "
              + (f"{ft_goodput / plain_goodput:.2f}x" if plain_goodput > 0 else "no step kept") + " (target >= 2x)")
        # What bounds the ratio on this machine: the restarted job's failure-free run, checkpoints
        # included. A fault-tolerant job that lost nothing to failures and cost nothing per step
        # would run that long.
        clean_ckpt = os.path.join(work, "ckpt-clean")
        start = time.time()
        subprocess.run([a if a != ckpt else clean_ckpt for a in plain], capture_output=True, timeout=timeout,
                       check=True)
        plain_clean_wall = time.time() - start
        ceiling = (steps / plain_clean_wall) / plain_goodput if plain_goodput > 0 else float("inf")
        print(f"failure-free walls: fault-tolerant {clean_wall:.0f} s, plain DDP with its checkpoints "
              f"{plain_clean_wall:.0f} s; ceiling of the goodput ratio here (a fault-tolerant job that loses and "
              f"costs nothing): {ceiling:.2f}x", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--mlp-dims", default="1024,4096,4096,1024")
    p.add_argument("--heal-dims", default="64,4096,4096,10")
    p.add_argument("--ddpkit", default=os.path.join(ROOT, "build", "ddpkit"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    p.add_argument("--schedule-seconds", type=float, default=600, help="a failure-free run's length")
    p.add_argument("--kill-every", type=float, default=20, help="mean seconds between failures")
    p.add_argument("--schedule-model", default="small,default",
                   help="comma-separated transformer sizes of the schedule, one run each: " + ", ".join(TRANSFORMER_SIZES))
    p.add_argument("--heal-steps", type=int, default=400, help="steps of the heal run (fewer for big --heal-dims)")
    p.add_argument("--link-rates", default="1gbit,10gbit", help="tc tbf rates of the heal between namespaces")
    p.add_argument("--heal-connections", default="1,2,4",
                   help="comma-separated: connections of the heal's pair group between namespaces, one row each")
    p.add_argument("--skip", default="", help="comma-separated: step, heal, heal-netns, schedule")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    common = ["--mlp-dims", args.mlp_dims, "--steps", str(args.steps)]
    sides = {"plain": ["--nproc", "2"], "ft": ["--fault-tolerant", "--replica-groups", "2", "--nproc", "1"]}
    steps = {k: [] for k in sides}
    for rep in range(0 if "step" in skip else args.reps):
        for name, flags in sides.items():
            rs = train(args.ddpkit, common + flags, args.timeout)
            ms = max(r["median_step_ms"] for r in rs)
            steps[name].append(ms)
            print(f"  rep {rep + 1} {name:6s} step {ms:8.1f} ms", flush=True)
    if "step" not in skip:
        plain, ft = statistics.median(steps["plain"]), statistics.median(steps["ft"])
        print(f"\nside    step ms (median of {args.reps})  vs plain")
        print(f"plain   {plain:10.1f}                  1.000")
        print(f"ft      {ft:10.1f}                  {ft / plain:.3f}   (target <= 1.05)")
    if "heal" not in skip:
        print_heal(args)
    if "heal-netns" not in skip:
        print_heal_netns(args)
    if "schedule" not in skip:
        for size in args.schedule_model.split(","):
            schedule(args.ddpkit, args.schedule_seconds, args.kill_every, args.timeout, size)


def fresh_write_seconds(n):
    """This machine's floor for a heal into a new process: writing n bytes into memory never
    touched before (the joiner's optimizer state and decoded tensors are new memory)."""
    src = bytearray(b"\x01") * n
    start = time.perf_counter()
    dst = bytearray(n)
    dst[:] = src
    return time.perf_counter() - start


def print_heal(args):
    groups = heal(args.ddpkit, args.heal_dims, args.heal_steps, args.timeout)
    h = groups[1]
    rate = h["heal_bytes"] / h["heal_seconds"] / 1e9 if h["heal_seconds"] > 0 else float("nan")
    floor = min(fresh_write_seconds(h["heal_bytes"]) for _ in range(3))
    print(f"\nheal of group 1 ({args.heal_dims}, Adam): {h['heal_bytes'] / 1e6:.1f} MB in {h['heal_seconds']:.3f} s "
          f"(fetch {h['heal_fetch_seconds']:.3f} s, route: {h['heal_route']}), "
          f"{rate:.2f} GB/s; the source served for {groups[0]['serve_seconds']:.3f} s; "
          f"parameters equal: {groups[0]['parameter_checksum'] == h['parameter_checksum']}")
    print(f"for scale: writing {h['heal_bytes'] / 1e6:.1f} MB into fresh memory takes {floor:.3f} s "
          f"({h['heal_bytes'] / floor / 1e9:.2f} GB/s); the heal took {h['heal_seconds'] / floor:.1f}x that")


def tcp_rate(ns_from, ns_to, addr, nbytes=400 << 20):
    """Bytes per second of one TCP stream from namespace ns_from to addr in ns_to."""
    sink = ("import socket,sys\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
            f"s.bind(('{addr}',29699));s.listen(1);print('up',flush=True);c,_=s.accept();n=0\n"
            "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\nprint(n,flush=True)")
    rx = subprocess.Popen(["ip", "netns", "exec", ns_to, sys.executable, "-c", sink], stdout=subprocess.PIPE, text=True)
    rx.stdout.readline()
    source = ("import socket,time\ns=socket.create_connection(('" + addr + "',29699));b=bytes(1<<20);t=time.time()\n"
              f"for _ in range({nbytes >> 20}): s.sendall(b)\n"
              "s.shutdown(socket.SHUT_WR);s.recv(1);print(time.time()-t)")
    tx = subprocess.run(["ip", "netns", "exec", ns_from, sys.executable, "-c", source], capture_output=True, text=True,
                        timeout=300)
    rx.wait(timeout=60)
    return nbytes / float(tx.stdout.strip())


def heal_between_namespaces(binary, dims, rate, connections, timeout):
    """The heal of heal(), group 0 (and the lighthouse) in one namespace, group 1 in another, the
    veth between them shaped to `rate`. Returns (the healed group's report, TCP bytes/s of the link)."""
    import two_hosts
    tag = f"dkh{os.getpid() % 10000}"
    a, b = "10.213.0.1", "10.213.0.2"
    lighthouse = None
    try:
        (ns_a, if_a), (ns_b, if_b) = two_hosts.create(tag, a, b)
        for ns, dev in ((ns_a, if_a), (ns_b, if_b)):
            subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "4mb",
                            "latency", "50ms"], check=True)
        link = tcp_rate(ns_a, ns_b, b)
        lighthouse = subprocess.Popen(["ip", "netns", "exec", ns_a, binary, "lighthouse", "--address", f"{a}:29610",
                                       "--expected-groups", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        work = tempfile.mkdtemp(prefix="ddpkit-ft-heal-")
        log = os.path.join(work, "steps")
        common = ["train", "--fault-tolerant", "--replica-groups", "2", "--nproc", "1", "--lighthouse", f"{a}:29610",
                  "--dataset", "synthetic", "--mlp-dims", dims, "--optimizer", "adam", "--batch-size", "32",
                  "--threads", "1", "--epochs", "1000", "--steps", "16", "--no-eval", "--quiet", "--max-restarts", "2",
                  "--step-log", log]
        common += ["--heal-connections", str(connections)]
        # Each "host" its own host name too (a UTS namespace): the groups then know they are on two
        # hosts and the heal crosses the link rather than reading the source's memory.
        groups = [subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                                    f'hostname {ns} && exec "$0" "$@"', binary] + common + ["--replica-group", str(g)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for g, ns in ((0, ns_a), (1, ns_b))]
        end, killed = time.time() + timeout, False
        while time.time() < end and not killed and groups[1].poll() is None:
            try:
                lines = open(log + ".replica-001").read().count("\n")
            except OSError:
                lines = 0
            if lines >= 3 and ranks_of(1):
                os.kill(ranks_of(1)[0], signal.SIGKILL)
                killed = True
            time.sleep(0.05)
        outs = [g.communicate(timeout=max(1, end - time.time())) for g in groups]
        shutil.rmtree(work, ignore_errors=True)
        if any(g.returncode != 0 for g in groups) or not killed:
            raise SystemExit(f"ft_bench: the heal between namespaces failed (exits {[g.returncode for g in groups]}, "
                             f"killed {killed})\n{outs[1][1][-2000:]}")
        reps = {r["replica_group"]: r for o, _ in outs for r in reports(o)}
        if reps[1]["heals"] < 1 or reps[1]["heals_single_copy"] or "gloo" not in reps[1]["heal_route"]:
            raise SystemExit(f"ft_bench: group 1 did not heal across the link: {reps[1]}")
        if reps[0]["parameter_checksum"] != reps[1]["parameter_checksum"]:
            raise SystemExit(f"ft_bench: the groups' parameters differ after the heal: {reps}")
        return reps[1], link
    finally:
        if lighthouse:
            lighthouse.terminate()
            lighthouse.wait()
        two_hosts.remove(tag)


def print_heal_netns(args):
    print(f"\nheal between two network namespaces ({args.heal_dims}, Adam; streamed over the heal's pair group):")
    print(f"{'link (tbf)':>11} {'TCP stream':>11} {'conns':>5} {'healed':>9} {'heal s':>7} {'fetch s':>8} {'rate':>10} "
          f"{'vs link':>8}")
    for rate in filter(None, args.link_rates.split(",")):
        for connections in map(int, filter(None, str(args.heal_connections).split(","))):
            h, link = heal_between_namespaces(args.ddpkit, args.heal_dims, rate, connections, args.timeout)
            healed = h["heal_bytes"] / h["heal_seconds"]
            print(f"{rate:>11} {link * 8 / 1e9:>7.2f} Gb/s {connections:>5} {h['heal_bytes'] / 1e6:>6.1f} MB "
                  f"{h['heal_seconds']:>7.3f} {h['heal_fetch_seconds']:>8.3f} {healed * 8 / 1e9:>5.2f} Gb/s "
                  f"{healed / link:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
