#!/usr/bin/python3
"""A real Slurm cluster on one machine, and ddpkit jobs on it (docs/launching.md).

Debian's munged, slurmctld and one slurmd per "node": three network namespaces on one bridge (a
head with slurmctld, where srun/sbatch are typed, and node1, node2), each with its own address and
/etc/hosts. Then, as a user would:

    srun -N2 -n4 ddpkit train ...     trains, and ends with the parameters of `ddpkit train --nproc 4`
    srun -N2 -n4 python3 ...          torch.distributed.init_process_group("ddpkit") over env://
    sbatch --requeue --signal=USR1@T  a job with more steps than its time limit allows: the signal
                                      checkpoints, the script requeues, the requeued job resumes for
                                      REQUEUED_STEPS more and ends bit-identical to an undisturbed run
                                      of the same length
    scancel mid-run                   no process of the job and nothing in /dev/shm is left on any node

    tests/slurm_cluster.py build/ddpkit [srun|requeue|scancel|all]    (root; exit 77 without)
    tests/slurm_cluster.py build/ddpkit shell     # a cluster to try by hand, until Ctrl-C

Everything it makes (namespaces, a directory with the configuration, the hosts file each node sees,
the munge key, state and logs) is removed on exit; no system file is changed.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import two_hosts  # noqa: E402
from checkpoint_resume import ckpt, differences  # noqa: E402

NODES = ("node1", "node2")
# The job every scenario runs (and the reference runs on one host): two ranks per node. No shared
# memory, so the reduction is flat Gloo in rank order wherever the ranks are: the same sums as
# `ddpkit train --nproc 4`, bit for bit.
STEPS = 3600
# The requeue scenario's first run has more steps than any machine trains before its time limit,
# so the signal always lands mid-run however fast the machine (slurmctld checks time limits every
# 30 s: --signal=USR1@60 with --time=2 comes 60 to 90 s after the start); the requeued run trains
# REQUEUED_STEPS past the step it resumes from, and the reference is an undisturbed run that long.
UNBOUNDED_STEPS = 10_000_000
REQUEUED_STEPS = 300
TRAIN = ["train", "--dataset", "synthetic", "--mlp-dims", "64,512,512,10", "--synthetic-size", "4096",
         "--batch-size", "32", "--epochs", "1000", "--steps", str(STEPS), "--checkpoint-every", "1200", "--no-eval",
         "--quiet", "--timeout-s", "60"]


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(77)


class Cluster:
    def __init__(self, ddpkit):
        self.ddpkit = ddpkit
        self.tag = f"dks{os.getpid() % 100000}"
        net = f"10.79.{os.getpid() % 200}"
        self.addrs = {"head": f"{net}.1", "node1": f"{net}.11", "node2": f"{net}.12"}
        self.dir = tempfile.mkdtemp(prefix="ddpkit-slurm-")
        self.daemons = []
        self.ns = {}

    # -- set-up ------------------------------------------------------------------------------------
    def start(self):
        names = list(self.addrs)
        hosts = two_hosts.create_switched(self.tag, [self.addrs[n] for n in names])
        self.ns = {n: hosts[i][0] for i, n in enumerate(names)}
        os.chmod(self.dir, 0o755)
        self.hosts_file = os.path.join(self.dir, "hosts")
        with open(self.hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.addrs.items()))
        self._start_munge()
        self._write_conf()
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self._daemon("head", ["slurmctld", "-D", "-i"], "slurmctld")
        time.sleep(1)
        for node in NODES:
            self._daemon(node, ["slurmd", "-D", "-N", node], f"slurmd-{node}")
        deadline = time.time() + 60
        while time.time() < deadline:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
            if sum(1 for line in out.splitlines() if line.split()[-1:] == ["idle"]) == len(NODES):
                return
            time.sleep(0.5)
        raise RuntimeError("the nodes did not come up idle:\n" + out + self.logs())

    def _start_munge(self):
        key = os.path.join(self.dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = os.path.join(self.dir, "munge", "munge.socket")
        os.makedirs(os.path.dirname(self.munge_socket), mode=0o755)
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                        f"--pid-file={self.dir}/munged.pid", f"--log-file={self.dir}/munged.log",
                        f"--seed-file={self.dir}/munged.seed"], check=True)

    def _write_conf(self):
        d = self.dir
        for sub in ["state"] + [f"spool-{n}" for n in NODES]:
            os.makedirs(os.path.join(d, sub))
        lines = [
            "ClusterName=ddpkit", f"SlurmctldHost={socket.gethostname()}({self.addrs['head']})",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket}",
            "CredType=cred/munge", "SlurmctldPort=6817", "SlurmdPort=6818", f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool-%n", f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2", "SlurmdParameters=config_overrides",
            "JobRequeue=1", "KillWait=15", "MinJobAge=600", "SchedulerParameters=defer",
            f"PlugStackConfig={d}/plugstack.conf",
        ]
        lines += [f"NodeName={n} NodeAddr={self.addrs[n]} CPUs=2 State=UNKNOWN" for n in NODES]
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        self.conf = os.path.join(d, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        open(f"{d}/plugstack.conf", "w").close()

    def on(self, host, cmd):
        """`cmd` on `host`: in its network namespace, with a private mount namespace where
        /etc/hosts names the cluster's hosts. (Not `ip netns exec`: it mounts a fresh /sys,
        which hides the cgroup hierarchy slurmd reads.)"""
        return ["nsenter", f"--net=/run/netns/{self.ns[host]}", "unshare", "--mount", "--propagation", "private",
                "/bin/sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', self.hosts_file] + cmd

    def _daemon(self, host, cmd, name):
        log = open(os.path.join(self.dir, name + ".out"), "w")
        p = subprocess.Popen(self.on(host, cmd), env=self.env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.daemons.append(p)

    def logs(self):
        text = ""
        for name in ["slurmctld.log", "slurmd-node1.log", "slurmd-node2.log", "slurmctld.out"]:
            path = os.path.join(self.dir, name)
            if os.path.exists(path):
                text += f"\n--- {name} (last lines)\n" + "".join(open(path).readlines()[-15:])
        return text

    def stop(self):
        subprocess.run(["scancel", "--full", "-u", "root"], env=getattr(self, "env", None), capture_output=True)
        for p in self.daemons:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.daemons:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        if os.path.exists(f"{self.dir}/munged.pid"):
            subprocess.run(["munged", "--stop", f"--socket={self.munge_socket}"], capture_output=True)
        two_hosts.remove(self.tag)
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- use ---------------------------------------------------------------------------------------
    def run(self, cmd, check=True, timeout=300, host="head", env=None):
        out = subprocess.run(self.on(host, cmd), env=env or self.env, capture_output=True,
                             text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
                               + self.logs())
        return out

    def job_state(self, job):
        out = self.run(["scontrol", "-o", "show", "job", str(job)], check=False).stdout
        fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
        return fields

    def job_pids(self, node):
        """Processes in the node's namespace other than its slurmd (and what `ip netns exec` runs)."""
        pids = subprocess.run(["ip", "netns", "pids", self.ns[node]], capture_output=True, text=True).stdout.split()
        found = []
        for pid in pids:
            try:
                cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
            except OSError:
                continue
            if cmd and "slurmd" not in cmd.split()[0]:
                found.append(f"{pid} {cmd[:120]}")
        return found


def shm_entries():
    return set(os.listdir("/dev/shm"))


def shared_mappings(pids):
    """Shared-memory mappings (ddpkit's segments are memfds) the given processes hold."""
    count = 0
    for line in pids:
        try:
            count += sum(1 for m in open(f"/proc/{line.split()[0]}/maps") if "memfd:" in m)
        except OSError:
            pass
    return count


def reference(c, d, steps=STEPS):
    """The same job on one host under ddpkit's own launcher, `steps` long, into checkpoint dir d."""
    env = dict(c.env, DDPKIT_SHM="0")
    train = TRAIN[:TRAIN.index("--steps")] + ["--steps", str(steps)] + TRAIN[TRAIN.index("--steps") + 2:]
    subprocess.run([c.ddpkit] + train + ["--nproc", "4", "--checkpoint-dir", d], env=env, check=True,
                   capture_output=True, timeout=600)
    return d


def scenario_srun(c, work, ref):
    d = os.path.join(work, "srun")
    started = time.time()
    out = c.run(["srun", "-N2", "-n4", "--ntasks-per-node=2", "--export=ALL,DDPKIT_SHM=0", c.ddpkit] + TRAIN +
                ["--checkpoint-dir", d], timeout=600)
    diffs = differences(ckpt(ref, STEPS), ckpt(d, STEPS))
    detected = [line for line in out.stderr.splitlines() if "launched by slurm" in line]
    print(f"srun -N2 -n4 ddpkit train: {time.time() - started:.1f} s; {detected[0] if detected else 'NO DETECTION LINE'}; "
          f"step {STEPS} {'bit-identical to' if not diffs else 'DIFFERENT from'} ddpkit train --nproc 4"
          + ("" if not diffs else ": " + ", ".join(diffs[:5])))
    ok = not diffs and bool(detected)
    # The Python backend's env:// path: `import ddpkit` fills torchrun's variables from Slurm's.
    python_dir = os.path.join(os.path.dirname(c.ddpkit), "python")
    if os.path.isdir(os.path.join(python_dir, "ddpkit")):
        script = ("import ddpkit, socket, torch, torch.distributed as dist\n"
                  "dist.init_process_group('ddpkit')\n"
                  "t = torch.full((4,), float(dist.get_rank() + 1))\n"
                  "dist.all_reduce(t)\n"
                  "assert t.tolist() == [10.0] * 4, t\n"
                  "print(f'python rank {dist.get_rank()} of {dist.get_world_size()}: allreduce ok')\n"
                  "dist.destroy_process_group()\n")
        out = c.run(["srun", "-N2", "-n4", "--ntasks-per-node=2", f"--export=ALL,PYTHONPATH={python_dir}",
                     "/usr/bin/python3", "-c", script], timeout=300)
        good = out.stdout.count("allreduce ok")
        print(f"srun -N2 -n4 python3 (dist.init_process_group('ddpkit')): {good} of 4 ranks allreduced across nodes")
        ok &= good == 4
    return ok


BATCH = """#!/bin/bash
#SBATCH --nodes=2 --ntasks=4 --ntasks-per-node=2
#SBATCH --requeue --signal=USR1@{signal_at} --time={minutes}
#SBATCH --output={out} --open-mode=append
# The job as examples/slurm/train.sbatch runs it: --resume continues from the newest checkpoint
# (none: from the start); 143 means "preempted, checkpoint written", 138 a rank the signal ended
# while it was still starting: requeue either way. The first run trains until its time limit's
# signal; a requeued one trains {requeued_steps} steps past the checkpoint it resumes from.
export DDPKIT_SHM=0
steps={unbounded_steps}
if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then
  newest=$(ls {ckpt} 2>/dev/null | sed -n 's/^checkpoint-0*\\([0-9][0-9]*\\)\\.ddpk$/\\1/p' | sort -n | tail -1)
  steps=$(( ${{newest:-0}} + {requeued_steps} ))
fi
echo "restart ${{SLURM_RESTART_COUNT:-0}}: training to step $steps"
srun {ddpkit} {train} --steps $steps --checkpoint-dir {ckpt} --resume
rc=$?
echo "restart ${{SLURM_RESTART_COUNT:-0}}: srun exited $rc"
if [ $rc -eq 143 ] || [ $rc -eq 138 ]; then scontrol requeue $SLURM_JOB_ID; fi
exit $rc
"""


def scenario_requeue(c, work):
    d = os.path.join(work, "requeue")
    out = os.path.join(work, "requeue.out")
    # The time limit's warning: USR1 arrives T seconds before the limit (Slurm checks about every
    # 30 s, so it may come earlier); the training step loop checkpoints at the next step.
    train = TRAIN[:TRAIN.index("--steps")] + TRAIN[TRAIN.index("--steps") + 2:]
    train[train.index("--epochs") + 1] = str(UNBOUNDED_STEPS)  # the steps, not the epochs, bound it
    script = BATCH.format(signal_at=60, minutes=2, out=out, ddpkit=c.ddpkit, train=" ".join(train), ckpt=d,
                          unbounded_steps=UNBOUNDED_STEPS, requeued_steps=REQUEUED_STEPS)
    path = os.path.join(work, "requeue.sbatch")
    with open(path, "w") as f:
        f.write(script)
    job = c.run(["sbatch", "--parsable", path]).stdout.strip().split(";")[0]
    started = time.time()
    # Bounded: the first run ends by its 2-minute limit, the requeued one (REQUEUED_STEPS) well
    # within its own; a requeue that never comes leaves the job TIMEOUT after 2 minutes.
    deadline = started + 600
    fields = {}
    while time.time() < deadline:
        fields = c.job_state(job)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        if fields.get("JobState") == "PENDING" and fields.get("Restarts", "0") != "0":
            # A requeued job waits out a begin-time delay; start it now (the test's clock).
            c.run(["scontrol", "update", f"jobid={job}", "starttime=now"], check=False)
        time.sleep(1)
    log = open(out).read() if os.path.exists(out) else ""
    preempted_at = [int(s) for s in re.findall(r"preempted \(User defined signal 1\): checkpoint of step (\d+)", log)]
    targets = [int(s) for s in re.findall(r"restart [1-9][0-9]*: training to step (\d+)", log)]
    final = targets[-1] if targets else None
    ok = fields.get("JobState") == "COMPLETED" and fields.get("Restarts", "0") != "0" and bool(preempted_at) and \
        final == preempted_at[-1] + REQUEUED_STEPS and os.path.exists(ckpt(d, final)) and "resumed from" in log
    diffs = ["(not finished)"]
    if ok:
        ref = os.path.join(work, "requeue-reference")
        reference(c, ref, final)
        diffs = differences(ckpt(ref, final), ckpt(d, final))
    print(f"sbatch --requeue --signal=USR1@60 --time=2: {fields.get('JobState')} after {fields.get('Restarts')} requeue(s) "
          f"in {time.time() - started:.0f} s; preemption checkpoint at step {','.join(map(str, preempted_at))}; "
          f"step {final} {'bit-identical to an undisturbed run of that length' if not diffs else 'NOT equal: ' + ', '.join(diffs[:5])}")
    if not ok or diffs:
        print(log[-3000:] + c.logs())
    return ok and not diffs


def scenario_scancel(c, work):
    d = os.path.join(work, "scancel")
    before = shm_entries()
    path = os.path.join(work, "scancel.sbatch")
    with open(path, "w") as f:
        f.write(f"#!/bin/bash\n#SBATCH --nodes=2 --ntasks=4 --ntasks-per-node=2 --output={work}/scancel.out\n"
                f"srun {c.ddpkit} {' '.join(TRAIN[:TRAIN.index('--steps')])} --steps 100000 --checkpoint-dir {d}\n")
    job = c.run(["sbatch", "--parsable", path]).stdout.strip().split(";")[0]
    deadline = time.time() + 120
    ranks = lambda n: [p for p in c.job_pids(n) if p.split()[1] == c.ddpkit]  # noqa: E731
    while time.time() < deadline and not all(len(ranks(n)) >= 2 and shared_mappings(ranks(n)) for n in NODES):
        time.sleep(0.2)
    time.sleep(2)  # well into training
    running = {n: len(ranks(n)) for n in NODES}
    during = sum(shared_mappings(ranks(n)) for n in NODES)
    c.run(["scancel", job])
    deadline = time.time() + 60
    while time.time() < deadline and (any(c.job_pids(n) for n in NODES) or shm_entries() != before):
        time.sleep(0.2)
    left = {n: c.job_pids(n) for n in NODES}
    shm_left = sorted(shm_entries() - before)
    ok = all(running[n] >= 2 for n in NODES) and during > 0 and not any(left.values()) and not shm_left
    print(f"scancel mid-run: ranks running per node {running}, holding {during} shared-memory mappings; after "
          f"scancel: {sum(len(v) for v in left.values())} processes of the job on the nodes, {len(shm_left)} new "
          f"entries in /dev/shm")
    if not ok:
        print(left, shm_left, c.logs())
    return ok


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    ddpkit = os.path.abspath(sys.argv[1])
    which = sys.argv[2] if len(sys.argv) > 2 else "all"
    if os.geteuid() != 0 or not shutil.which("ip"):
        skip("the Slurm cluster needs root and ip (network namespaces)")
    for tool in ("slurmctld", "slurmd", "munged", "srun"):
        if not shutil.which(tool):
            skip(f"{tool} is not installed (scripts/install-deps.sh installs slurm-wlm and munge)")
    c = Cluster(ddpkit)
    work = tempfile.mkdtemp(prefix="ddpkit-slurm-jobs-")
    os.chmod(work, 0o755)
    ok = True
    try:
        c.start()
        print(f"cluster up: slurmctld on head ({c.addrs['head']}), slurmd on node1 ({c.addrs['node1']}) and "
              f"node2 ({c.addrs['node2']})")
        if which == "shell":
            print(f"try: SLURM_CONF={c.conf} {' '.join(c.on('head', ['srun', '-N2', 'hostname']))}")
            signal.pause()
        if which in ("srun", "all"):
            ok &= scenario_srun(c, work, reference(c, os.path.join(work, "reference")))
        if which in ("requeue", "all"):
            ok &= scenario_requeue(c, work)
        if which in ("scancel", "all"):
            ok &= scenario_scancel(c, work)
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
        shutil.rmtree(work, ignore_errors=True)
    if not ok:
        sys.exit("FAILED")
    print("every Slurm scenario passed")


if __name__ == "__main__":
    main()
