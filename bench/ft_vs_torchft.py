#!/usr/bin/python3
"""ddpkit's fault tolerance against torchft's, side by side on one machine (issue 71).

    bench/ft_vs_torchft.py --python "$(scripts/pip-torch-env.sh)" --bin build-pip/ddpkit
                           [--python-nightly "$(scripts/pip-torch-env.sh --torchft-nightly)"]
                           [--seconds 600] [--kill-every 60] [--probe-steps 30]
                           [--sides torchft,torchft-nightly,torchft-ddpkit,ddpkit]

The same model on every side: a GPT of --layers 7 x --d-model 512 (8 heads, 64 byte tokens, batch 8;
22.4M parameters), AdamW; 4 replica groups of one process each, on this host.
  torchft          torchft 0.2.0 as its users run it: the torchft_lighthouse (Rust) with its own
                   defaults, in each group
                   its Manager, DistributedDataParallel and optimizer wrapper over its
                   ProcessGroupGloo, live recovery over its HTTP transport (bench/torchft_replica.py;
                   --recovery pg: its PGTransport, over the Manager's own group); a killed group's process is
                   started again (as torchx or Slurm would) and heals from a peer
  torchft-ddpkit   the same Python job with ddpkit's ProcessGroupDdpkit between the groups
                   (torchft 0.2.0's DistributedDataParallel hook asserts on the bucket after a
                   peer's failure, torchft/ddp.py _comm_hook, so its survivors die too: counted as
                   "crashes", each started again as a killed group is)
  torchft-nightly  the same with torchft-nightly (--python-nightly: the newest torchft on PyPI, whose
                   DDP hook gives DDP the bucket back after a peer's failure where 0.2.0 asserts)
  nightly-native-gloo    torchft-nightly's Manager handed a native torch group, as its docs offer and
                   its manager_integ_test builds one: c10d's ProcessGroupGloo with enable_reconfigure=True,
                   reconfigured in place per quorum with the handles the lighthouse gathers; Gloo's
                   handles rendezvous on a bootstrap store every group shares (one TCPStore process
                   the harness starts, as a job would run it beside the lighthouse)
  nightly-native-ddpkit  the same with ddpkit.torchft.native_group (ddpkit's backend, enable_reconfigure):
                   each rank's handle names its own endpoint, no shared store
  ddpkit           ddpkit train --fault-tolerant --replica-groups 4 --nproc 1 --model transformer
Detection, the same on every side: the lighthouse as torchft's own launch instructions start it
(torchft/examples/slurm/README.md: `torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100
--join_timeout_ms 10000`; its default heartbeat timeout, 5000 ms), and `ddpkit lighthouse
--heartbeat-timeout-ms 5000 --join-timeout-ms 10000 --expected-groups 4` for ddpkit; heartbeats
every 100 ms on both (torchft's Manager default, ddpkit's ManagerOptions default); torchft's
Manager with its default timeouts (60 s). torchft's default join timeout (60 s) is not usable with
its own default quorum timeout (60 s): a restarted replica heartbeats before it asks for a quorum,
the lighthouse waits the join timeout for it, and the survivors' quorum call times out first, so
they die (measured: survivors died at every kill with 60 s against the harness's 30 s). A side whose
survivors die (a process that was not killed exits and is started again) is a failed baseline: its
row is printed, and no ratio is drawn against it.
Failure-free: each side's step over --probe-steps steps against plain DDP of 4 ranks on the same
model (torch DDP on Gloo for the Python sides, ddpkit train --nproc 4 for ddpkit's): the overhead
of fault tolerance. Then each side runs the steps a failure-free run takes --seconds for, while a
random group's process is SIGKILLed at the same drawn times (gaps uniform in 0.5-1.5 x
--kill-every, seeded; the victim group drawn from its own seeded generator): steps lost per
failure (survivors' steps that did not commit; and the committed progress a failure rolled back),
failure to each survivor's next committed step
(p50, p95), the heal of each restarted group's state (fetch and load, as each side reports it),
and goodput (steps over the run's wall time). glibc's malloc thresholds and one compute thread per
process the same on every side. Results: bench/results/ft-vs-torchft-*.txt.
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
sys.path.insert(0, HERE)
from fsdp_bench import MALLOC as FSDP_MALLOC  # noqa: E402  glibc's thresholds pinned, as the other benchmarks
from ft_bench import children_ranks, group_of, kill_times, percentile, reports, step_logs  # noqa: E402
from ports import free_port  # noqa: E402  (tests/, put on the path by ft_bench: below the ephemeral range)

GROUPS = 4
NIGHTLY_SIDES = ("torchft-nightly", "nightly-native-gloo", "nightly-native-ddpkit")  # --python-nightly's
# The detection settings of both sides' lighthouses: torchft_lighthouse's heartbeat timeout default
# and the join timeout of torchft's launch instructions (its examples' README).
HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS = 5000, 10000
MALLOC = dict(FSDP_MALLOC, MALLOC_TOP_PAD_=str(1 << 26), OMP_NUM_THREADS="1")


class Model:
    def __init__(self, a):
        self.a = a

    def python_flags(self):
        a = self.a
        return ["--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", str(a.heads), "--seq-len", "64",
                "--batch-size", "8"]

    def ddpkit_flags(self):
        a = self.a
        return ["--model", "transformer", "--dataset", "text", "--layers", str(a.layers), "--d-model", str(a.d_model),
                "--heads", str(a.heads), "--seq-len", "64", "--batch-size", "8", "--threads", "1", "--epochs",
                "100000", "--optimizer", "adamw", "--lr", "0.001", "--no-eval", "--quiet"]


class TorchftJob:
    """4 groups of bench/torchft_replica.py under a torchft_lighthouse; a group whose process dies is
    started again until it finishes its steps."""

    def __init__(self, a, model, pg, steps, work, python):
        self.a, self.model, self.pg, self.steps, self.work, self.python = a, model, pg, steps, work, python
        self.native_store = None  # the bootstrap store of native Gloo groups
        self.recovery = a.recovery
        self.procs, self.incarnations, self.outputs = {}, {}, {g: [] for g in range(GROUPS)}
        self.lock = threading.Lock()
        self.restarts = 0  # processes started again (killed, or died of a peer's failure)
        self.lighthouse = None
        self.stop = False

    def start(self, step_log):
        port = free_port()
        lighthouse = os.path.join(os.path.dirname(self.python), "torchft_lighthouse")
        # As torchft's launch instructions start it (HEARTBEAT_TIMEOUT_MS is its default).
        self.lighthouse = subprocess.Popen([lighthouse, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}",
                                            "--quorum_tick_ms", "100", "--join_timeout_ms", str(JOIN_TIMEOUT_MS),
                                            "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.address = f"127.0.0.1:{port}"
        if self.pg == "native-gloo":
            self.native_store = subprocess.Popen(
                [self.python, "-c", "import time, torch.distributed as d\n"
                 "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
                 "print(s.port, flush=True)\ntime.sleep(1e9)"], stdout=subprocess.PIPE, text=True)
            self.store_address = f"127.0.0.1:{int(self.native_store.stdout.readline())}"
        time.sleep(1)
        self.step_log = step_log
        self.threads = [threading.Thread(target=self.supervise, args=(g,), daemon=True) for g in range(GROUPS)]
        for t in self.threads:
            t.start()

    def supervise(self, g):
        env = dict(os.environ, **MALLOC, PYTHONPATH=os.path.join(os.path.dirname(os.path.abspath(self.a.bin)), "python"))
        incarnation = 0
        while not self.stop:
            cmd = [self.python, os.path.join(HERE, "torchft_replica.py"), "--group", str(g), "--groups", str(GROUPS),
                   "--lighthouse", self.address, "--pg", self.pg, "--recovery", self.recovery, "--steps",
                   str(self.steps), "--incarnation", str(incarnation)] + self.model.python_flags()
            if self.native_store:
                cmd += ["--native-store", self.store_address]
            if self.step_log:
                cmd += ["--step-log", self.step_log]
            with open(os.path.join(self.work, f"group{g}.{incarnation}.log"), "w") as err:
                p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
                with self.lock:
                    self.procs[g] = p
                out, _ = p.communicate()
            self.outputs[g] += reports(out)
            if p.returncode == 0 or self.stop:
                return
            incarnation += 1
            with self.lock:
                self.restarts += 1

    def kill(self, g):
        with self.lock:
            p = self.procs.get(g)
        if p and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            return True
        return False

    def done(self):
        return all(not t.is_alive() for t in self.threads)

    def finish(self):
        self.stop = True
        for g in range(GROUPS):
            self.kill(g)
        for t in self.threads:
            t.join(timeout=60)
        for server in (self.lighthouse, self.native_store):
            if server:
                server.kill()
                server.wait()
        return [r for g in range(GROUPS) for r in self.outputs[g]]


class DdpkitJob:
    def __init__(self, a, model, steps, work):
        self.a, self.model, self.steps, self.work = a, model, steps, work

    def start(self, step_log):
        # Its own lighthouse with torchft's detection settings (train's built-in one times out in 1 s).
        self.lighthouse = subprocess.Popen([self.a.bin, "lighthouse", "--address", "127.0.0.1:0", "--quiet",
                                            "--heartbeat-timeout-ms", str(HEARTBEAT_TIMEOUT_MS),
                                            "--join-timeout-ms", str(JOIN_TIMEOUT_MS),
                                            "--expected-groups", str(GROUPS)],
                                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.lighthouse.stdout.readline()
        if "listening on" not in line:
            sys.exit(f"ft_vs_torchft: ddpkit lighthouse did not start: {line!r}")
        address = line.split("listening on ")[1].split()[0]
        cmd = [self.a.bin, "train", "--fault-tolerant", "--replica-groups", str(GROUPS), "--nproc", "1", "--steps",
               str(self.steps), "--max-restarts", "1000", "--lighthouse", address] + self.model.ddpkit_flags()
        if step_log:
            cmd += ["--step-log", step_log]
        self.err = open(os.path.join(self.work, "ddpkit.log"), "w")
        self.p = subprocess.Popen(cmd, env=dict(os.environ, **MALLOC), stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.out = []
        self.reader = threading.Thread(target=lambda: self.out.append(self.p.stdout.read()), daemon=True)
        self.reader.start()

    def kill(self, g):
        for pid in children_ranks(self.p.pid):
            try:
                if group_of(pid) == g:
                    os.kill(pid, signal.SIGKILL)
                    return True
            except (OSError, ValueError):
                continue
        return False

    def done(self):
        return self.p.poll() is not None

    def finish(self):
        if self.p.poll() is None:
            ranks = children_ranks(self.p.pid)
            self.p.kill()
            for pid in ranks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self.p.wait()
        self.lighthouse.kill()
        self.lighthouse.wait()
        self.reader.join(timeout=30)
        self.err.close()
        if self.p.returncode != 0:
            sys.exit(f"ft_vs_torchft: ddpkit train failed (exit {self.p.returncode}); see {self.work}/ddpkit.log")
        return reports("".join(self.out))


def make_job(a, model, side, steps, work):
    if side == "ddpkit":
        return DdpkitJob(a, model, steps, work)
    pg = {"torchft-ddpkit": "ddpkit", "nightly-native-gloo": "native-gloo", "nightly-native-ddpkit": "native-ddpkit"}
    return TorchftJob(a, model, pg.get(side, "gloo"), steps, work, sys_python(a, side))


def run(job, step_log, kills, timeout):
    """Starts the job; SIGKILLs group g at each (seconds, g) of kills; returns (wall s, [(unix ms, g)])."""
    start = time.time()
    job.start(step_log)
    done, pending = [], list(kills)
    while not job.done() and time.time() - start < timeout:
        if pending and time.time() - start >= pending[0][0]:
            _, g = pending.pop(0)
            if job.kill(g):
                done.append((time.time() * 1000, g))
        time.sleep(0.05)
    wall = time.time() - start
    return wall, done


def rolled_back(logs, kills):
    """Committed progress a failure undid, summed over failures: the highest step committed before
    the kill, less the highest step any group commits first after it (plus one). 0 where the
    survivors go on; the whole run so far where every group starts again from step 0."""
    total = 0
    for t_kill, _ in kills:
        before = max((int(s) for lines in logs.values() for (s, end, _, ok) in lines if ok and end <= t_kill),
                     default=-1)
        firsts = [next((int(s) for (s, end, _, ok) in lines if ok and end > t_kill), None) for lines in logs.values()]
        firsts = [f for f in firsts if f is not None]
        if firsts and before >= 0:
            total += max(0, before + 1 - max(firsts))
    return total


def sys_python(a, side):
    return a.python_nightly if side in NIGHTLY_SIDES else a.python


def plain_step_ms(a, model, side):
    """Plain DDP of 4 ranks on the model, failure-free: the baseline of the side's overhead."""
    steps = a.probe_steps
    if side == "ddpkit":
        p = subprocess.run([a.bin, "train", "--nproc", str(GROUPS), "--steps", str(steps)] + model.ddpkit_flags(),
                           env=dict(os.environ, **MALLOC), capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            sys.exit(f"ft_vs_torchft: plain ddpkit train failed\n{p.stderr[-2000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])["median_step_ms"]
    port = free_port()
    procs = [subprocess.Popen([sys_python(a, side), os.path.join(HERE, "torchft_replica.py"), "--plain", "--steps", str(steps)]
                              + model.python_flags(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, **MALLOC, RANK=str(r), WORLD_SIZE=str(GROUPS), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), USE_LIBUV="0")) for r in range(GROUPS)]
    outs = [p.communicate(timeout=3600) for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("ft_vs_torchft: plain torch DDP failed (exits " + str([p.returncode for p in procs]) + "):\n"
                 + "\n".join(err[-1500:] for _, err in outs))
    return max(reports(out)[-1]["median_step_ms"] for out, _ in outs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", required=True, help="the interpreter with torch 2.15, torchft 0.2.0 (pip-torch-env.sh)")
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build-pip", "ddpkit"))
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--kill-every", type=float, default=60)
    ap.add_argument("--probe-steps", type=int, default=30)
    ap.add_argument("--python-nightly", help="the venv with torchft-nightly (pip-torch-env.sh --torchft-nightly)")
    ap.add_argument("--sides", default="torchft,torchft-nightly,torchft-ddpkit,ddpkit")
    ap.add_argument("--recovery", choices=["http", "pg"], default="http", help="torchft's live recovery transport")
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep-logs", action="store_true", help="keep each side's process logs and step logs")
    a = ap.parse_args()
    a.bin = os.path.abspath(a.bin)
    model = Model(a)
    sides = a.sides.split(",")
    if any(side in NIGHTLY_SIDES for side in sides) and not a.python_nightly:
        sys.exit("ft_vs_torchft: the torchft-nightly sides need --python-nightly (scripts/pip-torch-env.sh --torchft-nightly)")
    d, L = a.d_model, a.layers
    params = L * (12 * d * d + 13 * d) + (256 + 64) * d + 2 * d + d * 256 + 256
    print(f"fault tolerance, ddpkit vs torchft: GPT {L} x d_model {d} ({params / 1e6:.1f}M parameters), AdamW, "
          f"{GROUPS} replica groups x 1 process, 1 thread each, on this host; torchft recovery: {a.recovery}", flush=True)
    times = kill_times(a.kill_every, a.seed, a.seconds)
    victims = random.Random(a.seed + 1)
    kills = [(t, victims.randrange(GROUPS)) for t in times if t < a.seconds]
    print(f"failure schedule: {len(kills)} SIGKILLs at {', '.join(f'{t:.0f}s->g{g}' for t, g in kills)}", flush=True)
    results = {}
    for side in sides:
        work = tempfile.mkdtemp(prefix=f"ft-vs-torchft-{side}-")
        try:
            probe_work = os.path.join(work, "probe")  # its logs apart from the run's
            os.makedirs(probe_work)
            probe = make_job(a, model, side, a.probe_steps, probe_work)
            wall, _ = run(probe, None, [], 3600)
            step_ms = max(r["median_step_ms"] for r in probe.finish())
            base = plain_step_ms(a, model, side)
            steps = max(20, int(a.seconds * 1000 / step_ms))
            log = os.path.join(work, "steps")
            job = make_job(a, model, side, steps, work)
            wall, done = run(job, log, kills, 4 * a.seconds + 600)
            reps = job.finish()
            logs = step_logs(log)
            latencies, lost = [], 0
            for t_kill, victim in done:
                for g, lines in logs.items():
                    if g != victim:
                        after = [end for (_, end, _, ok) in lines if end > t_kill and ok]
                        if after:
                            latencies.append((after[0] - t_kill) / 1000)
            for lines in logs.values():  # a killed group's own last step is never logged
                lost += sum(1 for line in lines if not line[3])
            rollback = rolled_back(logs, done)
            if side == "ddpkit":
                heals = [(r["heal_seconds"], r["heal_bytes"]) for r in reps if r["heals"] > 0 and r["heal_seconds"] > 0]
            else:
                heals = [(h["recv_s"] + (h.get("load_s") or 0), h["bytes"]) for r in reps if r.get("incarnation", 0) > 0
                         for h in r["heals"]]
            last = max((int(line[0]) for lines in logs.values() for line in lines if line[3]), default=0)
            results[side] = dict(step_ms=step_ms, base_ms=base, steps=steps, wall=wall, failures=len(done),
                                 lost=lost / max(1, len(done) * (GROUPS - 1)), p50=percentile(latencies, 50),
                                 rollback=rollback / max(1, len(done)),
                                 p95=percentile(latencies, 95), heal=statistics.median(h for h, _ in heals) if heals else float("nan"),
                                 heal_mb=statistics.median(b for _, b in heals) / 1e6 if heals else float("nan"),
                                 heals=len(heals), goodput=last / wall,
                                 # Groups that died besides the ones killed (ddpkit's survivors go on)
                                 crashes=getattr(job, "restarts", len(done)) - len(done))
            r = results[side]
            print(f"{side:<21} step {step_ms:7.1f} ms vs plain DDP {base:7.1f} ms (overhead {100 * (step_ms / base - 1):+.1f} %); "
                  f"{steps} steps, {len(done)} failures, wall {wall:.0f} s, lost/failure/survivor {r['lost']:.2f}, "
                  f"rolled back/failure {r['rollback']:.1f}, "
                  f"failure->next commit p50 {r['p50']:.2f} s p95 {r['p95']:.2f} s, heal {r['heal']:.3f} s of "
                  f"{r['heal_mb']:.0f} MB ({len(heals)} heals), goodput {r['goodput']:.3f} steps/s, survivors that died "
                  f"{r['crashes']}", flush=True)
        finally:
            if a.keep_logs:
                print(f"{side}: logs kept in {work}", flush=True)
            else:
                shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'side':<21} {'step ms':>8} {'plain ms':>9} {'overhead':>9} {'lost/fail':>10} {'rollback':>9} {'p50 s':>7} "
          f"{'p95 s':>7} "
          f"{'heal s':>7} {'heal MB':>8} {'goodput':>8} {'crashes':>8}")
    for side, r in results.items():
        print(f"{side:<21} {r['step_ms']:>8.1f} {r['base_ms']:>9.1f} {100 * (r['step_ms'] / r['base_ms'] - 1):>8.1f}% "
              f"{r['lost']:>10.2f} {r['rollback']:>9.1f} {r['p50']:>7.2f} {r['p95']:>7.2f} {r['heal']:>7.3f} {r['heal_mb']:>8.0f} "
              f"{r['goodput']:>8.3f} {r['crashes']:>8}")
    print(f"detection on every side: heartbeat timeout {HEARTBEAT_TIMEOUT_MS} ms, join timeout {JOIN_TIMEOUT_MS} ms "
          "(torchft's launch instructions), heartbeats every 100 ms; torchft's Manager timeouts 60 s (its defaults)")
    for peer in ("torchft",) + NIGHTLY_SIDES:
        if "ddpkit" not in results or peer not in results:
            continue
        dk, tf = results["ddpkit"], results[peer]
        version = subprocess.run([sys_python(a, peer), "-c", "import importlib.metadata as m, torchft\n"
                                  "for n in ('torchft-nightly', 'torchft'):\n"
                                  "    try: print(n, m.version(n)); break\n"
                                  "    except m.PackageNotFoundError: pass"],
                                 capture_output=True, text=True).stdout.strip()
        if tf["crashes"] > 0:  # not the peer as its users run it: no ratio against it
            print(f"ddpkit vs {peer} ({version}): failed baseline: {tf['crashes']} of its survivors died (a process "
                  "that was not killed exited), so no ratio is drawn")
            continue
        over = lambda r: r["step_ms"] / r["base_ms"] - 1  # noqa: E731
        print(f"ddpkit vs {peer} ({version}): heal {tf['heal'] / dk['heal']:.1f}x faster; steady-state overhead "
              f"{100 * over(dk):+.1f} % vs {100 * over(tf):+.1f} %; goodput "
              f"{dk['goodput'] / tf['goodput']:.2f}x; failure->next commit p95 {dk['p95']:.2f} s vs {tf['p95']:.2f} s")
    native = [results.get(side) for side in ("nightly-native-ddpkit", "nightly-native-gloo")]
    if all(native):  # the same Manager and lighthouse, only the native group's backend differs
        dk, gl = native
        if dk["crashes"] or gl["crashes"]:
            print("native groups under torchft-nightly's Manager: a side lost survivors, no ratio is drawn")
        else:
            print(f"torchft-nightly's Manager, native ddpkit group vs native Gloo group: step {dk['step_ms']:.1f} ms vs "
                  f"{gl['step_ms']:.1f} ms ({gl['step_ms'] / dk['step_ms']:.2f}x); goodput {dk['goodput'] / gl['goodput']:.2f}x; "
                  f"failure->next commit p95 {dk['p95']:.2f} s vs {gl['p95']:.2f} s")


if __name__ == "__main__":
    main()
