#!/usr/bin/python3
"""Checkpoint, resume and elastic restart of `ddpkit train`, as a user runs them (issue 16).

    tests/checkpoint_resume.py build/ddpkit bit-exact     # stop + resume == never stopped, per config
    tests/checkpoint_resume.py build/ddpkit restart       # ranks SIGKILLed at random moments
    tests/checkpoint_resume.py build/ddpkit torchrun      # under torchrun's elastic agent
    tests/checkpoint_resume.py build/ddpkit torchrun-hosts   # 2 agents in 2 network namespaces (root)
    tests/checkpoint_resume.py build/ddpkit world-size    # 2 ranks -> 3 ranks
    tests/checkpoint_resume.py build/ddpkit errors        # refusals name what is wrong
    tests/checkpoint_resume.py build/ddpkit preempt       # SIGUSR1/SIGTERM: checkpoint, exit 143, resume
    tests/checkpoint_resume.py build/ddpkit launcher-killed   # its ranks go with a SIGKILLed launcher

"Bit for bit" is checked on the checkpoints both runs write at the same step: every tensor
(model, hook state, buckets, RNG, position) byte-equal, and the optimizer's torch archive holding
the same tensor records (its pickled keys carry pointer addresses, so its bytes differ).
"""
import io
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zipfile

import two_hosts  # tests/two_hosts.py
from procs import alive, children  # tests/procs.py

# The Python whose torch goes with the build (torchrun, the Python package): tests/CMakeLists.txt sets it.
TORCH_PYTHON = os.environ.get("DDPKIT_TORCH_PYTHON", "/usr/bin/python3")

BIN = None
# Small and quick, several buckets (so bucket layouts and per-bucket hook state matter).
BASE = ["--dataset", "synthetic", "--mlp-dims", "64,128,128,10", "--synthetic-size", "4096", "--batch-size", "32",
        "--bucket-cap-mb", "0.05", "--quiet", "--no-eval"]

CONFIGS = {
    "allreduce+sgd": [],
    "adam": ["--optimizer", "adam"],
    "fp16": ["--hook", "fp16"],
    "int8+error-feedback": ["--hook", "int8", "--int8-error-feedback", "--int8-block", "64"],
    "powersgd": ["--hook", "powersgd", "--powersgd-start-iter", "5"],
    "batched_powersgd": ["--hook", "batched_powersgd", "--powersgd-start-iter", "5"],
    "post_local_sgd": ["--hook", "post_local_sgd", "--local-sgd-start-iter", "10", "--local-sgd-period", "3"],
    "zero1+adam": ["--zero", "1", "--optimizer", "adam"],
    "zero1+interleaved": ["--zero", "1", "--optimizer", "adam", "--zero-overlap", "interleaved"],
    "zero2+bf16": ["--zero", "2", "--optimizer", "adam", "--zero-precision", "bf16", "--zero-overlap", "step"],
    # Issue 31: FSDP's checkpoints hold the full model and optimizer state, gathered per unit.
    "fsdp_full_shard+adam": ["--fsdp", "full_shard", "--optimizer", "adam", "--fsdp-min-unit-params", "1000"],
    "fsdp_shard_grad_op+bf16": ["--fsdp", "shard_grad_op", "--fsdp-param-dtype", "bf16", "--fsdp-min-unit-params", "1000"],
    "fsdp_no_shard": ["--fsdp", "no_shard", "--fsdp-min-unit-params", "1000"],
}


def decode(path):
    """The tensors of a ddpkit checkpoint file: key -> (dtype code, sizes, raw bytes)."""
    b = open(path, "rb").read()
    assert b[:8] == b"DDPKTNS1", path
    (n,) = struct.unpack_from("<Q", b, 8)
    p, out = 16, {}
    for _ in range(n):
        (kl,) = struct.unpack_from("<I", b, p)
        p += 4
        key = b[p:p + kl].decode()
        p += kl
        dtype, ndim = struct.unpack_from("<bB", b, p)
        p += 2
        sizes = struct.unpack_from("<%dq" % ndim, b, p)
        p += 8 * ndim
        (nbytes,) = struct.unpack_from("<Q", b, p)
        p += 8
        out[key] = (dtype, sizes, b[p:p + nbytes])
        p += nbytes
    for key in [k for k in out if k.startswith("rank")]:  # each rank's own state, nested
        inner = tempfile.NamedTemporaryFile(delete=False)
        inner.write(out.pop(key)[2])
        inner.close()
        for k, v in decode(inner.name).items():
            out[key + "/" + k] = v
        os.unlink(inner.name)
    return out


def archive_records(raw):
    z = zipfile.ZipFile(io.BytesIO(raw))
    return sorted(z.read(n) for n in z.namelist() if "/data/" in n)


def differences(a, b):
    ta, tb = decode(a), decode(b)
    diffs = sorted(set(ta) ^ set(tb))
    for k in sorted(set(ta) & set(tb)):
        if k.endswith("optimizer"):
            if archive_records(ta[k][2]) != archive_records(tb[k][2]):
                diffs.append(k)
        elif ta[k] != tb[k]:
            diffs.append(k)
    return diffs


def train(flags, check=True, timeout=300, evaluate=False):
    cmd = [BIN, "train"] + [f for f in BASE if not (evaluate and f == "--no-eval")] + flags
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return out


def last_json(out):
    return json.loads(out.stdout.strip().splitlines()[-1])


def ckpt(d, step):
    return os.path.join(d, "checkpoint-%010d.ddpk" % step)


def bit_exact(tmp):
    failed = []
    for name, flags in CONFIGS.items():
        a, b = os.path.join(tmp, name, "a"), os.path.join(tmp, name, "b")
        common = flags + ["--checkpoint-every", "15"]
        whole = last_json(train(common + ["--steps", "45", "--checkpoint-dir", a]))
        train(common + ["--steps", "15", "--checkpoint-dir", b])
        resumed = last_json(train(common + ["--steps", "45", "--checkpoint-dir", b, "--resume"]))
        diffs = differences(ckpt(a, 45), ckpt(b, 45))
        ok = not diffs and resumed["resumed_from_step"] == 15 and whole["final_loss"] == resumed["final_loss"]
        print(f"{name:22s} stopped at 15, resumed to 45: {'bit-identical' if ok else 'DIFFERENT: ' + ', '.join(diffs[:6])}")
        if not ok:
            failed.append(name)
    if failed:
        sys.exit(f"FAILED: resumed runs differ for {', '.join(failed)}")
    print(f"all {len(CONFIGS)} configurations resume bit for bit")


def restart(tmp, trials=3):
    """A job whose ranks are SIGKILLed at random moments finishes, restarted by the launcher, with
    the parameters of an undisturbed run (resume is bit-exact, so the accuracy is the same too).
    DDP with int8 and error feedback (`trials` times), and FSDP FULL_SHARD with Adam (once)."""
    rng = random.Random(int(os.environ.get("DDPKIT_TEST_SEED", "16")))
    variants = [("int8", ["--hook", "int8", "--int8-error-feedback"], trials),
                ("fsdp_full_shard+adam", ["--fsdp", "full_shard", "--optimizer", "adam", "--fsdp-min-unit-params", "1000"], 1)]
    for name, extra, count in variants:
        # About 8 s of training, a checkpoint every ~0.25 s.
        flags = extra + ["--checkpoint-every", "50", "--epochs", "50", "--steps", "1500", "--nproc", "3"]
        ref = os.path.join(tmp, "undisturbed-" + name)
        started = time.time()
        undisturbed = last_json(train(flags + ["--checkpoint-dir", ref]))
        # Kill moments are drawn within the undisturbed run's length, so a fast machine or a fast
        # libtorch cannot finish the job before the first kill.
        duration = time.time() - started
        for t in range(count):
            d = os.path.join(tmp, f"killed-{name}-{t}")
            cmd = [BIN, "train"] + BASE + flags + ["--checkpoint-dir", d, "--max-restarts", "3"]
            job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            kills = 0
            killed_generation = set()
            deadline = time.time() + 240
            while kills < 2 and job.poll() is None and time.time() < deadline:
                time.sleep(rng.uniform(0.3, 0.6) * duration)
                # (Re)starting: wait for three ranks, none of them from the generation killed last
                # (a second kill among ranks the launcher is already stopping is no second restart).
                ranks = children(job.pid)
                while (len(ranks) != 3 or killed_generation & set(ranks)) and job.poll() is None and time.time() < deadline:
                    time.sleep(0.05)
                    ranks = children(job.pid)
                if len(ranks) == 3 and not killed_generation & set(ranks):
                    victim = rng.choice(ranks)
                    os.kill(victim, signal.SIGKILL)
                    kills += 1
                    killed_generation = set(ranks)
            out, err = job.communicate(timeout=300)
            if job.returncode != 0:
                sys.exit(f"FAILED: {name} trial {t}: the job exited {job.returncode} after {kills} kills:\n{err[-3000:]}")
            result = json.loads(out.strip().splitlines()[-1])
            diffs = differences(ckpt(ref, 1500), ckpt(d, 1500))
            restarts = err.count("restarting every rank")
            print(f"{name} trial {t}: {kills} ranks SIGKILLed, {restarts} restarts, resumed from step "
                  f"{result['resumed_from_step']}, final loss {result['final_loss']} (undisturbed "
                  f"{undisturbed['final_loss']}): {'bit-identical' if not diffs else 'DIFFERENT ' + ', '.join(diffs[:5])}")
            if diffs or kills == 0 or restarts < kills:
                sys.exit(f"FAILED: {name} trial {t}")
    print("every killed job finished, bit-identical to the undisturbed run")


def checkpoint_steps(d):
    return sorted(int(n[len("checkpoint-"):-len(".ddpk")]) for n in os.listdir(d) if n.endswith(".ddpk"))


def launcher_killed(tmp):
    """A launcher SIGKILLed (kill -9, the OOM killer: nothing it can catch) takes its ranks with it
    instead of leaving them training on, orphaned: `ddpkit train --nproc 2` and the replica groups
    of `ddpkit train --fault-tolerant`."""
    cases = [("ddpkit train --nproc 2", ["--nproc", "2"]),
             ("ddpkit train --fault-tolerant --replica-groups 2",
              ["--fault-tolerant", "--replica-groups", "2", "--nproc", "1"])]
    for what, extra in cases:
        job = subprocess.Popen([BIN, "train"] + BASE + ["--epochs", "1000", "--steps", "1000000"] + extra,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while len(children(job.pid)) != 2 and job.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        ranks = children(job.pid)
        if job.poll() is not None or len(ranks) != 2:
            sys.exit(f"FAILED: {what}: the job was not running two ranks:\n{job.communicate()[1][-3000:]}")
        time.sleep(1)  # in their steps
        job.kill()
        job.wait()
        deadline = time.time() + 10
        while any(alive(r) for r in ranks) and time.time() < deadline:
            time.sleep(0.05)
        left = [r for r in ranks if alive(r)]
        for r in left:
            os.killpg(r, signal.SIGKILL)
        if left:
            sys.exit(f"FAILED: {what}: ranks {left} outlived their SIGKILLed launcher by 10 s")
        print(f"{what}: launcher SIGKILLed, its 2 ranks gone with it")


def preempt(tmp):
    """Preemption (docs/launching.md): SIGUSR1 to one rank (Slurm's --signal), SIGTERM to the
    launcher (Kubernetes, scancel) and SIGUSR1 to a rank under --max-restarts. Every rank
    checkpoints the same step and the job exits 143 (under --max-restarts the launcher starts it
    again); the resumed job ends bit-identical to an undisturbed run."""
    flags = ["--mlp-dims", "64,512,512,10", "--checkpoint-every", "500", "--epochs", "50", "--steps", "1500",
             "--nproc", "2"]
    ref = os.path.join(tmp, "preempt-ref")
    started = time.time()
    train(flags + ["--checkpoint-dir", ref])
    duration = time.time() - started
    cases = [("SIGUSR1 to rank 1", signal.SIGUSR1, "rank", []),
             ("SIGTERM to the launcher", signal.SIGTERM, "launcher", []),
             ("SIGUSR1 to rank 0 under --max-restarts 1", signal.SIGUSR1, "rank0", ["--max-restarts", "1"])]
    for i, (what, sig, target, extra) in enumerate(cases):
        d = os.path.join(tmp, f"preempt-{i}")
        job = subprocess.Popen([BIN, "train"] + BASE + flags + extra + ["--checkpoint-dir", d], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while len(children(job.pid)) != 2 and job.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.4 * duration)
        ranks = children(job.pid)
        if job.poll() is not None or len(ranks) != 2:
            sys.exit(f"FAILED: {what}: the job was not running two ranks:\n{job.communicate()[1][-3000:]}")
        os.kill({"rank": ranks[-1], "rank0": ranks[0], "launcher": job.pid}[target], sig)
        out, err = job.communicate(timeout=300)
        if extra:
            if job.returncode != 0 or "restarting every rank" not in err:
                sys.exit(f"FAILED: {what}: exit {job.returncode}, no restart:\n{err[-3000:]}")
            resumed_from = last_json(subprocess.CompletedProcess([], 0, out, err))["resumed_from_step"]
        else:
            steps = checkpoint_steps(d)
            if job.returncode != 143 or "preempted" not in err or not steps or steps[-1] >= 1500:
                sys.exit(f"FAILED: {what}: exit {job.returncode} (expected 143), checkpoints {steps}:\n{err[-3000:]}")
            resumed_from = last_json(train(flags + ["--checkpoint-dir", d, "--resume"]))["resumed_from_step"]
        diffs = differences(ckpt(ref, 1500), ckpt(d, 1500))
        print(f"{what}: checkpoint at step {resumed_from}, exit {job.returncode}; resumed to 1500: "
              f"{'bit-identical' if not diffs else 'DIFFERENT ' + ', '.join(diffs[:5])}")
        if diffs or not resumed_from:
            sys.exit(f"FAILED: {what}")
    print("every preempted job checkpointed together and resumed bit for bit")


def skip_without_torchrun():
    if subprocess.run([TORCH_PYTHON, "-c", "import torch.distributed.run"], capture_output=True).returncode != 0:
        print(f"SKIP: {TORCH_PYTHON} has no torch.distributed.run (apt install python3-torch)")
        sys.exit(77)
    # Debian 13's torch 2.6 is built without libuv, yet torchrun's rendezvous creates its TCPStore with
    # the default use_libuv=True (no environment override on that path): torchrun cannot start there.
    probe = subprocess.run([TORCH_PYTHON, "-c", "from torch.distributed import TCPStore\n"
                            "TCPStore('127.0.0.1', 0, 1, True, multi_tenant=True)"], capture_output=True, text=True)
    if "without libuv" in probe.stderr:
        print("SKIP: this torch's torchrun cannot create its store (built without libuv, which its TCPStore requests)")
        sys.exit(77)


def torchrun(tmp):
    """ddpkit train under torchrun's own elastic agent (--no-python, the torch of DDPKIT_TORCH_PYTHON): a
    SIGKILLed rank makes the agent restart the workers, which resume from the newest checkpoint."""
    skip_without_torchrun()
    flags = ["--mlp-dims", "64,512,512,10", "--checkpoint-every", "50", "--epochs", "50", "--steps", "1500"]
    ref = os.path.join(tmp, "torchrun-ref")
    train(flags + ["--checkpoint-dir", ref])
    d = os.path.join(tmp, "torchrun")
    # --redirects/--tee 2: torch 1.13's default of 0 fails under Python 3.11 (Std.from_str("0") is None).
    cmd = [TORCH_PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max_restarts", "2",
           "--redirects", "2", "--tee", "2", "--no_python", BIN, "train"] + BASE + flags + ["--checkpoint-dir", d, "--resume"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and job.poll() is None and not (os.path.isdir(d) and os.listdir(d)):
        time.sleep(0.1)
    workers = [c for c in children(job.pid) if "ddpkit" in open(f"/proc/{c}/cmdline").read()]
    if not workers:
        job.kill()
        sys.exit(f"FAILED: no worker under torchrun:\n{job.communicate()[1][-3000:]}")
    os.kill(workers[-1], signal.SIGKILL)
    out, err = job.communicate(timeout=300)
    if job.returncode != 0:
        sys.exit(f"FAILED: torchrun exited {job.returncode}:\n{err[-3000:]}")
    r = json.loads(out.strip().splitlines()[-1])
    diffs = differences(ckpt(ref, 1500), ckpt(d, 1500))
    print(f"torchrun --max_restarts 2 --no_python: a worker SIGKILLed, the agent restarted both, resumed from step "
          f"{r['resumed_from_step']}: {'bit-identical' if not diffs else 'DIFFERENT ' + ', '.join(diffs[:5])}")
    if diffs or r["resumed_from_step"] is None:
        sys.exit("FAILED: torchrun restart")


def torchrun_hosts(tmp):
    """Two "hosts" (network namespaces joined by a veth pair), one torchrun agent each, c10d
    rendezvous: a worker SIGKILLed on host b makes both agents restart their workers, which resume
    from the newest checkpoint. Needs root (exit 77 without)."""
    if os.geteuid() != 0 or not shutil.which("ip") or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        print("SKIP: needs root and ip netns")
        sys.exit(77)
    skip_without_torchrun()
    flags = ["--mlp-dims", "64,512,512,10", "--checkpoint-every", "50", "--epochs", "50", "--steps", "1500",
             "--timeout-s", "20"]
    ref = os.path.join(tmp, "hosts-ref")
    train(flags + ["--checkpoint-dir", ref])
    tag, n = f"ddpkr{os.getpid() % 10000}", os.getpid() % 200
    a, b, port = f"10.77.{n}.1", f"10.77.{n}.2", 29300 + os.getpid() % 100
    d = os.path.join(tmp, "hosts")
    agents = []
    try:
        # torchrun hands workers its rank-0 agent's hostname as MASTER_ADDR; both "hosts" share
        # this machine's name, so each namespace gets an /etc/hosts that sends it to host a.
        two_hosts.create(tag, a, b, f"{a} {socket.gethostname()} {socket.getfqdn()}")
        # is_host: in a namespace torchrun cannot tell from the hostname which agent serves the store.
        for ns, ifname, host in ((tag + "a", tag + "x", "true"), (tag + "b", tag + "y", "false")):
            cmd = ["ip", "netns", "exec", ns, TORCH_PYTHON, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{a}:{port}",
                   "--rdzv_conf", f"is_host={host}", "--rdzv_id", tag, "--max_restarts", "2", "--redirects", "2",
                   "--tee", "2", "--no_python", BIN, "train"] + BASE + flags + ["--checkpoint-dir", d, "--resume"]
            agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           env=dict(os.environ, GLOO_SOCKET_IFNAME=ifname)))
        deadline = time.time() + 90
        while time.time() < deadline and not (os.path.isdir(d) and os.listdir(d)):
            time.sleep(0.1)
        workers = [c for c in children(agents[1].pid) if "ddpkit" in open(f"/proc/{c}/cmdline").read()]
        if not workers:
            sys.exit("FAILED: no worker running on host b after 90 s")
        os.kill(workers[0], signal.SIGKILL)
        outs = [ag.communicate(timeout=180) for ag in agents]
        codes = [ag.returncode for ag in agents]
        if any(codes):
            sys.exit(f"FAILED: agents exited {codes}:\n{outs[0][1][-2000:]}\n{outs[1][1][-2000:]}")
        out = outs[0][0] if outs[0][0].strip() else outs[1][0]
        r = json.loads(out.strip().splitlines()[-1])
        diffs = differences(ckpt(ref, 1500), ckpt(d, 1500))
        print(f"torchrun on 2 hosts (namespaces), c10d rendezvous: a worker SIGKILLed on host b, both agents "
              f"restarted, resumed from step {r['resumed_from_step']}: "
              f"{'bit-identical' if not diffs else 'DIFFERENT ' + ', '.join(diffs[:5])}")
        if diffs or r["resumed_from_step"] is None:
            sys.exit("FAILED: torchrun restart across hosts")
    finally:
        for ag in agents:
            if ag.poll() is None:
                ag.kill()
        two_hosts.remove(tag)


def world_size(tmp):
    """Written by 2 ranks, resumed by 3: per-rank hook state starts over, the run continues from the
    same global sample position; the loss stays within tolerance of the undisturbed run. DDP with
    PowerSGD, and FSDP (whose full checkpoint is resharded over 3 ranks)."""
    cases = {"powersgd": ["--hook", "powersgd", "--powersgd-start-iter", "10"],
             "fsdp_full_shard+adam": ["--fsdp", "full_shard", "--optimizer", "adam", "--fsdp-min-unit-params", "1000"]}
    for name, extra in cases.items():
        d, ref = os.path.join(tmp, "ws-" + name), os.path.join(tmp, "ws-ref-" + name)
        flags = ["--checkpoint-every", "100", "--epochs", "4", "--synthetic-size", "8192"] + extra
        undisturbed = last_json(train(flags + ["--checkpoint-dir", ref, "--nproc", "2"], evaluate=True))
        train(flags + ["--checkpoint-dir", d, "--nproc", "2", "--steps", "200"], evaluate=True)
        r = last_json(train(flags + ["--checkpoint-dir", d, "--nproc", "3", "--resume"], evaluate=True))
        print(f"{name}: 2 ranks to step 200 of 512, then 3 ranks: resumed from {r['resumed_from_step']}, test accuracy "
              f"{r['test_accuracy']} (undisturbed 2-rank run {undisturbed['test_accuracy']}, tolerance 0.03)")
        if r["resumed_from_step"] != 200 or r["world_size"] != 3 or abs(r["test_accuracy"] - undisturbed["test_accuracy"]) > 0.03:
            sys.exit("FAILED: world-size change with " + name)


def errors(tmp):
    d = os.path.join(tmp, "err")
    train(["--steps", "10", "--checkpoint-every", "5", "--checkpoint-dir", d])
    cases = [
        (["--steps", "10", "--checkpoint-dir", d], "already holds checkpoints"),
        (["--steps", "20", "--checkpoint-dir", d, "--resume", "--hook", "fp16"], "different training flags (--hook=none)"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--checkpoint-dir", d, "--optimizer-in-hook"], "does not save the per-parameter optimizer state"),
    ]
    for flags, expect in cases:
        out = train(flags, check=False)
        text = out.stdout + out.stderr
        if out.returncode == 0 or expect not in text:
            sys.exit(f"FAILED: {flags} exited {out.returncode} without '{expect}':\n{text[-2000:]}")
        print(f"refused as expected: {expect}")
    # A damaged newest checkpoint is skipped with a warning; the one before it is used.
    newest = ckpt(d, 10)
    with open(newest, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff\xff\xff")
    out = train(["--steps", "20", "--checkpoint-dir", d, "--resume"], check=False)
    r = last_json(out) if out.returncode == 0 else {}
    if r.get("resumed_from_step") != 5 or "checksum mismatch" not in out.stderr:
        sys.exit(f"FAILED: a corrupt newest checkpoint:\n{out.stderr[-2000:]}")
    print("a corrupt newest checkpoint is skipped (checksum mismatch): resumed from step 5")


def main():
    global BIN
    modes = {"bit-exact": bit_exact, "restart": restart, "torchrun": torchrun, "torchrun-hosts": torchrun_hosts,
             "world-size": world_size, "errors": errors, "preempt": preempt,
             "launcher-killed": launcher_killed}
    if len(sys.argv) != 3 or sys.argv[2] not in modes:
        sys.exit(__doc__)
    BIN = os.path.abspath(sys.argv[1])
    tmp = tempfile.mkdtemp(prefix="ddpkit-ckpt-")
    try:
        modes[sys.argv[2]](tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
