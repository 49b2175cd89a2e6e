#!/usr/bin/python3
"""What the control plane costs a step: ddpkit's synchronous and asynchronous quorum and
torchft-nightly's Manager (its async quorum), each side's lighthouse made slow by a round as long
as it takes at 100 and 1,000 groups of 8 here (issue 96).

    bench/ft_async.py --bin build-pip/ddpkit \\
        --python-nightly /var/cache/ddpkit/pip-torch-2.15.0-torchft-nightly/bin/python3 \\
        [--round-ms 0,50,116] [--reps 3] [--steps 30] [--layers 4] [--d-model 384]
    bench/ft_async.py --bin build-pip/ddpkit --python-nightly ... --heal [--heal-steps 100] [--kill-after 15]

Two replica groups of one process each train the GPT of bench/ft_vs_torchft.py (byte tokens,
AdamW) on this host, every side against its own lighthouse (`ddpkit lighthouse`, torchft's
`torchft_lighthouse` with the settings of its launch instructions) reached through a proxy that
holds every byte round_ms/2 in each direction: each quorum round takes round_ms longer, as a
lighthouse answering 1,000 groups does (bench/results/lighthouse-scale-2026-12-07.txt: round p50
48-65 ms, p99 89-116 ms here). Heartbeats cross the same proxy. Each side's median step against
the same model's plain DDP over 2 ranks (ddpkit train --nproc 2; torch DDP on Gloo for torchft):
the overhead of fault tolerance at that round cost. `quorum wait` is what ddpkit's step waited for
its quorum (ManagerStats::quorum_wait_seconds, per step).

--heal: a heal of the 268 MB state of bench/ft_vs_torchft.py's GPT (7 x d_model 512, 22.4M parameters,
AdamW) under the async quorum: 2 groups, group 1's process SIGKILLed after --kill-after steps of its
own and started again by `ddpkit train`: the survivor's step at which it copied the state it served
(ddpkit train's serving_step_ms) against its median step, and the restarted group's time from its
start to its first commit (first_commit_s), of which the heal (fetch and load). The goodput of a run
with kills against torchft-nightly is bench/ft_vs_torchft.py's (run it with --sides
ddpkit,torchft-nightly: ddpkit's side takes the async quorum by default).

Why not real groups amid simulated ones on one lighthouse: a simulated group (bench/lighthouse_load)
speaks the lighthouse's protocol but has no process behind it, and every participant of a quorum
is a rank of its cross-group process group, whose rendezvous the real groups would wait on for
the simulated ones. What it takes: simulated groups that are real processes with an empty model
(1,000 x 8 of them do not fit on this machine), or a lighthouse that forms quorums over jobs apart.

glibc's malloc thresholds and one compute thread per process, the same on every side.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from ft_async import DelayProxy  # noqa: E402  (tests/ft_async.py: the same proxy its slow-lighthouse test uses)
from ft_bench import reports  # noqa: E402
from ft_vs_torchft import MALLOC, Model  # noqa: E402
from ports import free_port  # noqa: E402

GROUPS = 2


def ddpkit_lighthouse(a):
    p = subprocess.Popen([a.bin, "lighthouse", "--address", "127.0.0.1:0", "--quiet", "--heartbeat-timeout-ms", "5000",
                          "--join-timeout-ms", "10000", "--expected-groups", str(GROUPS)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if "listening on" not in line:
        sys.exit(f"ft_async: ddpkit lighthouse did not start: {line!r}")
    return p, int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])


def torchft_lighthouse(a):
    port = free_port()
    p = subprocess.Popen([os.path.join(os.path.dirname(a.python_nightly), "torchft_lighthouse"), "--min_replicas", "1",
                          "--bind", f"127.0.0.1:{port}", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                          "--heartbeat_timeout_ms", "5000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    return p, port


def ddpkit_side(a, model, mode, port):
    p = subprocess.run([a.bin, "train", "--fault-tolerant", "--replica-groups", str(GROUPS), "--nproc", "1", "--steps",
                        str(a.steps), "--lighthouse", f"127.0.0.1:{port}", "--quorum-mode", mode] + model.ddpkit_flags(),
                       env=dict(os.environ, **MALLOC), capture_output=True, text=True, timeout=3600)
    reps = reports(p.stdout)
    if p.returncode != 0 or len(reps) != GROUPS:
        return None, f"exit {p.returncode}: {p.stderr[-500:]}"
    step = max(r["median_step_ms"] for r in reps)
    wait = max(r["quorum_wait_seconds"] for r in reps) * 1000 / max(1, reps[0]["steps_committed"])
    return step, wait


def torchft_side(a, model, port):
    env = dict(os.environ, **MALLOC, PYTHONPATH=os.path.join(os.path.dirname(os.path.abspath(a.bin)), "python"))
    procs = [subprocess.Popen([a.python_nightly, os.path.join(HERE, "torchft_replica.py"), "--group", str(g), "--groups",
                               str(GROUPS), "--lighthouse", f"127.0.0.1:{port}", "--pg", "gloo", "--steps", str(a.steps)]
                              + model.python_flags(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for g in range(GROUPS)]
    outs = [p.communicate(timeout=3600) for p in procs]
    if any(p.returncode for p in procs):
        return None, "exits " + str([p.returncode for p in procs]) + ": " + outs[0][1][-500:]
    return max(reports(out)[-1]["median_step_ms"] for out, _ in outs), None


def plain_ddpkit(a, model):
    p = subprocess.run([a.bin, "train", "--nproc", str(GROUPS), "--steps", str(a.steps)] + model.ddpkit_flags(),
                       env=dict(os.environ, **MALLOC), capture_output=True, text=True, timeout=3600, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])["median_step_ms"]


def plain_torch(a, model):
    port = free_port()
    procs = [subprocess.Popen([a.python_nightly, os.path.join(HERE, "torchft_replica.py"), "--plain", "--steps",
                               str(a.steps)] + model.python_flags(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, **MALLOC, RANK=str(r), WORLD_SIZE=str(GROUPS),
                                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0"))
             for r in range(GROUPS)]
    outs = [p.communicate(timeout=3600) for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("ft_async: plain torch DDP failed:\n" + outs[0][1][-1500:])
    return max(reports(out)[-1]["median_step_ms"] for out, _ in outs)


def heal_under_load(a):
    """One kill of group 1 under the async quorum; the survivor's serving step and the healer's first commit."""
    sys.path.insert(0, HERE)
    from ft_bench import children_ranks, group_of  # noqa: E402
    a.layers, a.d_model, a.heads = 7, 512, 8
    model = Model(a)
    work = tempfile.mkdtemp(prefix="ddpkit-ft-async-")
    log = os.path.join(work, "steps")
    p = subprocess.Popen([a.bin, "train", "--fault-tolerant", "--replica-groups", str(GROUPS), "--nproc", "1", "--steps",
                          str(a.heal_steps), "--max-restarts", "3", "--step-log", log] + model.ddpkit_flags(),
                         env=dict(os.environ, **MALLOC), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        victim = log + ".replica-001"
        while not (os.path.exists(victim) and sum(1 for _ in open(victim)) >= a.kill_after):
            if p.poll() is not None:
                sys.exit("ft_async --heal: the job ended before the kill:\n" + p.stderr.read()[-2000:])
            time.sleep(0.2)
        for pid in children_ranks(p.pid):
            if group_of(pid) == 1:
                os.kill(pid, signal.SIGKILL)
                break
        out, err = p.communicate(timeout=3600)
    finally:
        if p.poll() is None:
            p.kill()
    reps = sorted(reports(out), key=lambda r: r["replica_group"])
    if p.returncode != 0 or len(reps) != GROUPS:
        sys.exit(f"ft_async --heal: exit {p.returncode}\n{err[-2000:]}")
    survivor, healer = reps
    shutil.rmtree(work, ignore_errors=True)
    print(f"heal of {healer['heal_bytes'] / 1e6:.0f} MB under the async quorum (GPT 7 x 512, AdamW, {GROUPS} groups x 1 process):")
    print(f"  survivor: steady step {survivor['median_step_ms']:.1f} ms, the step it copied its state to serve "
          f"{survivor['serving_step_ms']:.1f} ms ({(survivor['serving_step_ms'] / survivor['median_step_ms'] - 1) * 100:+.1f} %; "
          f"the copy {survivor['snapshot_seconds'] * 1e3:.1f} ms, served beside its steps for {survivor['serve_seconds'] * 1e3:.0f} ms); "
          f"steps lost {survivor['steps_not_committed']} (the failure's), to the heal {survivor['steps_healing']}")
    print(f"  restarted group: first commit {healer['first_commit_s']:.2f} s after its start, of which the heal "
          f"{healer['heal_seconds']:.3f} s (route {healer['heal_route']}), {healer['steps_healing']} step(s) of zeros; "
          f"parameters equal: {survivor['parameter_checksum'] == healer['parameter_checksum']}")


def run_side(a, model, side, round_ms):
    """(median step ms, ddpkit's quorum wait ms a step or None) of one run, or (None, why)."""
    lh, port = torchft_lighthouse(a) if side == "torchft-nightly" else ddpkit_lighthouse(a)
    proxy = DelayProxy(port, round_ms / 2000) if round_ms else None
    try:
        target = proxy.port if proxy else port
        if side == "torchft-nightly":
            step, why = torchft_side(a, model, target)
            return (step, None) if step is not None else (None, why)
        return ddpkit_side(a, model, side.split()[1], target)
    finally:
        lh.kill()
        lh.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--python-nightly", required=True, help="torch 2.15 with torchft-nightly (pip-torch-env.sh --torchft-nightly)")
    ap.add_argument("--round-ms", default="0,50,116", help="extra milliseconds per lighthouse round trip")
    ap.add_argument("--reps", type=int, default=3, help="runs of each configuration (their median is reported)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--heal", action="store_true", help="the heal of 268 MB under load instead")
    ap.add_argument("--heal-steps", type=int, default=100)
    ap.add_argument("--kill-after", type=int, default=15, help="--heal: group 1's steps before the kill")
    a = ap.parse_args()
    if a.heal:
        heal_under_load(a)
        return
    model = Model(a)
    # Every configuration --reps times, in turn, and its median: this machine's speed drifts by tens
    # of percent between runs a minute apart, which one run per row would read as the protocol's.
    plains = {"ddpkit": [], "torch": []}
    samples = {}
    for rep in range(a.reps):
        plains["ddpkit"].append(plain_ddpkit(a, model))
        plains["torch"].append(plain_torch(a, model))
        for round_ms in (int(x) for x in a.round_ms.split(",")):
            for side in ("ddpkit sync", "ddpkit async", "torchft-nightly"):
                samples.setdefault((side, round_ms), []).append(run_side(a, model, side, round_ms))
    plain = {k: statistics.median(v) for k, v in plains.items()}
    print(f"GPT {a.layers} x d_model {a.d_model}, {GROUPS} replica groups x 1 process; plain DDP over {GROUPS} ranks: "
          f"ddpkit {plain['ddpkit']:.1f} ms {[round(x, 1) for x in plains['ddpkit']]}, "
          f"torch {plain['torch']:.1f} ms {[round(x, 1) for x in plains['torch']]}", flush=True)
    rows = []
    for (side, round_ms), runs in samples.items():
        steps = [s for s, _ in runs if s is not None]
        if len(steps) < len(runs):
            print(f"{side:16} round +{round_ms:3d} ms  failed baseline: " + "; ".join(w for s, w in runs if s is None))
            continue
        step = statistics.median(steps)
        waits = [w for _, w in runs if w is not None]
        wait = statistics.median(waits) if waits else None
        base = plain["torch"] if side == "torchft-nightly" else plain["ddpkit"]
        rows.append((side, round_ms, step, base, wait))
        print(f"{side:16} round +{round_ms:3d} ms  step {step:8.1f} ms {[round(x, 1) for x in steps]}  vs plain {base:8.1f} ms  "
              f"overhead {(step / base - 1) * 100:+6.1f} %" + (f"  quorum wait {wait:6.1f} ms/step" if wait is not None else ""))
    print("\nside             round+ms  step ms  plain ms  overhead  quorum wait ms/step (medians of runs)")
    for side, round_ms, step, base, wait in rows:
        print(f"{side:16} {round_ms:8d} {step:8.1f} {base:9.1f} {(step / base - 1) * 100:+8.1f}%  "
              + (f"{wait:8.1f}" if wait is not None else "       -"))




if __name__ == "__main__":
    main()
