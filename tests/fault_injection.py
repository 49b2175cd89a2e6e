#!/usr/bin/python3
"""Fault injection (issue 16): faults on random ranks at random moments; every trial must end the
way the error rules say.

    tests/fault_injection.py build [--trials 100] [--timeout-s 5] [--seed 1] [--faults kill,stop,link]

A trial starts a job, waits a random 0.5-3 s into training, then
  kill  SIGKILLs a random rank,
  stop  SIGSTOPs a random rank (hung: no error from the kernel, only the timeout tells),
  link  takes down the veth between two network namespaces (2 ranks in each; needs root),
through one of: DDP allreduce, the fp16 hook, the int8 hook, PowerSGD, ZeRO-1 with Adam, and the
parameter server (`ddpkit bench --hook rpc`, 2 trainers + 1 server). It passes only if
  - every surviving rank prints an error naming the operation that failed within timeout + 2 s
    of the fault (a line "ddpkit: <operation> ... failed ..." or the server's "AverageGradient"),
  - the launcher (or, for link faults, every rank) exits non-zero,
  - no process of the job, no /dev/shm segment its ranks created and no namespace is left.
Prints one line per trial and the counts per fault and workload; exits 1 if any trial failed.
"""
import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import two_hosts  # tests/two_hosts.py
from procs import alive, children  # tests/procs.py

TRAIN = ["--dataset", "synthetic", "--mlp-dims", "256,1024,1024,10", "--synthetic-size", "8192", "--epochs", "100000",
         "--quiet", "--no-eval", "--no-divergence-guard", "--report-resources", "50"]
WORKLOADS = {
    "allreduce": ["train", "--hook", "none"] + TRAIN,
    "fp16": ["train", "--hook", "fp16"] + TRAIN,
    "int8": ["train", "--hook", "int8"] + TRAIN,
    "powersgd": ["train", "--hook", "powersgd", "--powersgd-start-iter", "2"] + TRAIN,
    "zero": ["train", "--zero", "1", "--optimizer", "adam"] + TRAIN,
    "ps": ["bench", "--hook", "rpc", "--trainers", "2", "--servers", "1", "--max-iterations", "100000",
           "--epochs", "1000", "--out-dir", "/tmp/ddpkit-fault-bench"],
}
# What a survivor's report looks like: the operation is named before "failed".
REPORT = re.compile(r"ddpkit: (?:ddpkit ps: )?([A-Za-z_][\w ()./-]*?) .*(failed|did not)")


def wait_for_training(job, seconds):
    """Until rank 0 has reported resources (training runs: --report-resources), at most `seconds`."""
    deadline = time.time() + seconds
    while time.time() < deadline and job.proc.poll() is None:
        if any(l.startswith("resources ") for _, l in job.lines):
            return True
        time.sleep(0.05)
    return False


class Job:
    """A process whose stderr lines are kept with their arrival times."""

    def __init__(self, cmd, env=None, preexec=None):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True, preexec_fn=preexec)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append((time.time(), line.rstrip()))


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = children(p)
        out += kids
        todo += kids
    return out


def rank_of(pid):
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    for e in env:
        if e.startswith(b"RANK="):
            return int(e[5:])
    return None


def leftovers(pids):
    left = [f"process {p}" for p in pids if alive(p)]
    for name in os.listdir("/dev/shm"):
        m = re.match(r"ddpkit-(\d+)-", name)
        if m and int(m.group(1)) in pids:
            left.append(f"/dev/shm/{name}")
    return left


def reports(job, t0, ranks, timeout_s):
    """rank -> seconds from the fault to its first error report naming an operation."""
    seen = {}
    for t, line in job.lines:
        # One report per "ddpkit: " (older builds could interleave two ranks' reports on one line).
        for part in re.split(r"(?=ddpkit: )", line):
            m = re.search(r"failed on rank (\d+) of", part)
            if not REPORT.search(part) or not m:
                continue
            r = int(m.group(1))
            if r in ranks and r not in seen:
                op = "AverageGradient" if "AverageGradient" in part else REPORT.search(part).group(1)
                seen[r] = (t - t0, op)
    return seen


def judge(got, expected, timeout_s, pids, context):
    """What is wrong with a trial: a rank in `expected` that did not report, or late; leftovers."""
    problems = []
    for r in expected:
        if r not in got:
            problems.append(f"rank {r} reported no error ({context(r)})")
        elif got[r][0] > timeout_s + 2:
            problems.append(f"rank {r} reported after {got[r][0]:.1f} s")
    time.sleep(0.2)
    left = leftovers(pids)
    if left:
        problems.append("left behind: " + ", ".join(left[:5]))
    return problems


def trial_local(build, fault, workload, timeout_s, rng):
    cmd = [os.path.join(build, "ddpkit")] + WORKLOADS[workload] + ["--timeout-s", str(timeout_s)]
    if workload != "ps":
        cmd += ["--nproc", "3"]
    job = Job(cmd)
    pids = set()
    deadline = time.time() + 60
    ranks = {}
    while time.time() < deadline and job.proc.poll() is None:
        for p in descendants(job.proc.pid):
            pids.add(p)
            r = rank_of(p)
            if r is not None and p not in ranks.values() and r not in ranks:
                ranks[r] = p
        if len(ranks) == 3:
            break
        time.sleep(0.05)
    # Past start-up (rendezvous, data, the first steps), then a random moment of training.
    if workload == "ps":
        time.sleep(4.0)
    elif not wait_for_training(job, 60):
        return False, f"training did not start within 60 s: {[l for _, l in job.lines[-3:]]}"
    time.sleep(rng.uniform(0.5, 3.0))
    pids.update(descendants(job.proc.pid))
    if job.proc.poll() is not None or not ranks:
        return False, f"the job ended before the fault ({job.proc.returncode}): {job.lines[-3:]}"
    candidates = sorted(ranks)
    victim = rng.choice(candidates)
    t0 = time.time()
    os.kill(ranks[victim], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    try:
        job.proc.wait(timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        os.killpg(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
        return False, "the launcher did not exit within timeout + 30 s"
    job.reader.join(timeout=5)
    survivors = [r for r in candidates if r != victim]
    if workload == "ps":
        survivors = [r for r in survivors if r < 2]  # bench: RANK 0, 1 are the trainers, 2 the server
    got = reports(job, t0, survivors, timeout_s)
    problems = []
    if job.proc.returncode == 0:
        problems.append("the launcher exited 0")
    problems += judge(got, survivors, timeout_s, pids, lambda r: f"last lines: {[l for _, l in job.lines[-3:]]}")
    if problems and any(p.startswith("left behind") for p in problems):
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    slowest = max((v[0] for v in got.values()), default=float("nan"))
    ops = sorted({v[1] for v in got.values()})
    text = f"rank {victim} {fault}: {len(got)}/{len(survivors)} survivors reported ({', '.join(ops)}) within {slowest:.2f} s, exit {job.proc.returncode}"
    return not problems, text + ("" if not problems else " -- " + "; ".join(problems))


def trial_link(build, workload, timeout_s, rng):
    tag = f"ddpkf{os.getpid() % 10000}"
    a, b = f"10.78.{os.getpid() % 200}.1", f"10.78.{os.getpid() % 200}.2"
    try:
        two_hosts.create(tag, a, b)
        jobs, port = [], 29700 + os.getpid() % 100
        for r in range(4):
            ns, ifname = (tag + "a", tag + "x") if r < 2 else (tag + "b", tag + "y")
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r % 2), LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR=a, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=ifname)
            cmd = ["ip", "netns", "exec", ns, os.path.join(build, "ddpkit")] + WORKLOADS[workload] + ["--timeout-s", str(timeout_s)]
            jobs.append(Job(cmd, env=env))
        if not wait_for_training(jobs[0], 60):
            return False, f"training did not start within 60 s: {[l for _, l in jobs[0].lines[-3:]]}"
        time.sleep(rng.uniform(0.5, 3.0))
        pids = set()
        for j in jobs:
            pids.add(j.proc.pid)
            pids.update(descendants(j.proc.pid))
        if any(j.proc.poll() is not None for j in jobs):
            return False, "a rank ended before the fault: " + str([j.lines[-2:] for j in jobs])
        t0 = time.time()
        subprocess.run(["ip", "-n", tag + "a", "link", "set", tag + "x", "down"], check=True)
        problems, got = [], {}
        for r, j in enumerate(jobs):
            try:
                j.proc.wait(timeout=timeout_s + 30)
            except subprocess.TimeoutExpired:
                j.proc.kill()
                problems.append(f"rank {r} did not exit")
            j.reader.join(timeout=5)
            # Each rank has its own stream here; its report may name its rank in a subgroup (the
            # hierarchical allreduce's across-hosts step), so any report in it counts.
            for t, line in j.lines:
                m = REPORT.search(line)
                if m and t >= t0:
                    got[r] = (t - t0, m.group(1))
                    break
            if j.proc.returncode == 0:
                problems.append(f"rank {r} exited 0")
        problems += judge(got, range(4), timeout_s, pids,
                          lambda r: f"exit {jobs[r].proc.returncode}, last line: "
                                    f"{jobs[r].lines[-1][1][:300] if jobs[r].lines else '(nothing)'}")
        slowest = max((v[0] for v in got.values()), default=float("nan"))
        ops = sorted({v[1] for v in got.values()})
        text = f"link down between 2 namespaces: {len(got)}/4 ranks reported ({', '.join(ops)}) within {slowest:.2f} s"
        return not problems, text + ("" if not problems else " -- " + "; ".join(problems))
    finally:
        if not two_hosts.remove(tag):
            print(f"LEFT BEHIND: namespace {tag}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--timeout-s", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", default="kill,stop,link")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    faults = a.faults.split(",")
    if "link" in faults and (os.geteuid() != 0 or not shutil.which("ip") or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode):
        print("link faults need root and ip netns: left out")
        faults.remove("link")
    counts = {}
    for t in range(a.trials):
        fault = faults[t % len(faults)]
        workload = rng.choice([w for w in WORKLOADS if not (fault == "link" and w == "ps")])
        if fault == "link":
            ok, text = trial_link(a.build, workload, a.timeout_s, rng)
        else:
            ok, text = trial_local(a.build, fault, workload, a.timeout_s, rng)
        key = (fault, workload)
        counts.setdefault(key, [0, 0])[0 if ok else 1] += 1
        print(f"trial {t + 1:3d} {fault:4s} {workload:9s} {'ok  ' if ok else 'FAIL'} {text}", flush=True)
    print("\nfault  workload   passed failed")
    for (fault, workload), (p, f) in sorted(counts.items()):
        print(f"{fault:6s} {workload:9s} {p:6d} {f:6d}")
    passed = sum(p for p, _ in counts.values())
    print(f"total: {passed}/{a.trials} trials passed")
    sys.exit(0 if passed == a.trials else 1)


if __name__ == "__main__":
    main()
