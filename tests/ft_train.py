#!/usr/bin/env python3
"""`ddpkit train --fault-tolerant` as a user runs it, with replica groups killed and stopped.

  tests/ft_train.py build/ddpkit MODE

MODE:
  kill        3 groups of 2 ranks; one rank of group 1 SIGKILLed mid-run: the job goes on, group 1
              is restarted and heals from a live group, every group ends with the same parameters
  stop        3 groups; group 2 SIGSTOPped: the others go on within 2 s (heartbeats, not the
              collective timeout) and finish; the stopped group is stopped by the launcher
  two-lost    4 groups; groups 1 and 3 killed at once
  lighthouse  the lighthouse (ddpkit lighthouse) killed and restarted on its port mid-run
  min-replicas  2 groups, --min-replicas 2, one group's restarts exhausted: the job stops with an
              error naming the live groups
  strategies  2 groups of 2 ranks under PowerSGD (hook state), ZeRO-1 and FSDP; a rank of group 1
              SIGKILLed in each: it heals (optimizer shards, FSDP shards, hook state) and every
              group ends alike
  every-strategy  the same for every DDP hook fault tolerance takes, ZeRO-1 and FSDP's strategies
  checkpoint  2 groups with --checkpoint-dir (a rank of group 1 killed: it restarts with --resume,
              loads the newest checkpoint and heals); then 3 groups --resume from it: they go on
              from its step, alike
  phases      3 groups; a rank dies (DDPKIT_FT_FAULT) exactly in forward, in backward, inside the
              cross-group allreduce, and mid-heal: the source dies as it serves the heal, and the
              joiner dies after copying, before loading (under DDP, PowerSGD, ZeRO-1, FSDP, int8);
              and a restarted group dies as the cross-group rendezvous with it begins (the
              others give it up within a heartbeat timeout); every time the job goes on, the lost
              groups heal, no survivor's step takes 10 s, and every group ends alike

  hosts       (root) 2 groups of 2 ranks, each group over two hosts (network namespaces); a rank of
              group 1 killed, the group restarted: it heals from group 0 across the link

Checks: exit status 0 (min-replicas: nonzero with the error), one JSON line per group, equal
parameter checksums, and that something was lost and healed where a group died.
"""
import glob
import json
import os
import shutil
import tempfile
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ports import free_port  # noqa: E402

BIN = None  # build/ddpkit, from the command line
# The step counts below were sized for a machine whose plain step of this model takes this long:
# a failure must land mid-run (wait_until_training waits for 1.8 s of a rank's CPU), so on a
# faster machine every count grows by its speed-up (steps()), or the job ends before the fault.
REFERENCE_STEP_MS = 3.0
_scale = []


def steps(n):
    """`n` steps, scaled up by this machine's speed over the reference's (measured once: a plain
    1-rank run of the same model), as a flag value."""
    if not _scale:
        out = subprocess.run([BIN, "train", "--dataset", "synthetic", "--mlp-dims", "64,512,512,10", "--epochs", "1000",
                              "--quiet", "--no-eval", "--nproc", "1", "--steps", "300"],
                             capture_output=True, text=True, timeout=120, check=True)
        step_ms = json.loads(out.stdout.strip().splitlines()[-1])["median_step_ms"]
        _scale.append(max(1.0, REFERENCE_STEP_MS / step_ms))
        print(f"plain step {step_ms:.2f} ms: step counts x{_scale[0]:.1f}", flush=True)
    return str(int(n * _scale[0]))
# Steps long enough that a failure lands mid-run, short enough for the default suite.
BASE = ["train", "--fault-tolerant", "--dataset", "synthetic", "--mlp-dims", "64,512,512,10",
        "--epochs", "1000", "--quiet", "--no-eval", "--timeout-s", "60"]


def ranks_of(group):
    """pids of the ranks of replica group `group` of a `ddpkit train --fault-tolerant` job (their
    command line says --replica-group G; ranks, unlike the launcher, have RANK set)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"train" in args and b"--replica-group" in args \
                and args[args.index(b"--replica-group") + 1] == str(group).encode() \
                and any(e.startswith(b"RANK=") for e in env):
            out.append(int(pid))
    return sorted(out)


def wait_for_ranks(groups, per_group, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        if all(len(ranks_of(g)) == per_group for g in groups):
            return
        time.sleep(0.1)
    sys.exit(f"FAILED: the ranks of groups {groups} did not start within {timeout} s")


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until_training(group, cpu=1.8, timeout=120):
    """Until a rank of `group` has used `cpu` seconds of CPU: past start-up, in the steps."""
    end = time.time() + timeout
    while time.time() < end:
        pids = ranks_of(group)
        try:
            if pids and cpu_seconds(pids[0]) >= cpu:
                return
        except OSError:
            pass
        time.sleep(0.1)
    sys.exit(f"FAILED: group {group} did not get into its steps within {timeout} s")


def reports(out):
    lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    return sorted(lines, key=lambda r: r["replica_group"])


def check_same(reps, groups):
    got = [r["replica_group"] for r in reps]
    if got != list(range(groups)):
        sys.exit(f"FAILED: expected a report from each of {groups} groups, got {got}")
    sums = {r["parameter_checksum"] for r in reps}
    if len(sums) != 1:
        sys.exit("FAILED: the groups' parameters differ:\n" + "\n".join(json.dumps(r) for r in reps))


def run(flags, act, timeout=300, env=None):
    p = subprocess.Popen([BIN] + BASE + flags, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, **(env or {})))
    try:
        act(p)
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, err


def train_killing_group_1(groups, nproc, flags, name):
    """Runs the job and, once group 1 trains, SIGKILLs its last rank. Checks exit 0, a report per
    group, equal parameters and that group 1 healed; returns the reports."""
    def act(p):
        wait_for_ranks(list(range(groups)), nproc)
        wait_until_training(1)
        os.kill(ranks_of(1)[-1], signal.SIGKILL)
    rc, out, err = run(["--replica-groups", str(groups), "--nproc", str(nproc)] + flags, act)
    if rc != 0:
        sys.exit(f"FAILED ({name}): exit {rc}\n{err[-3000:]}")
    reps = reports(out)
    check_same(reps, groups)
    if reps[1]["heals"] < 1:
        sys.exit(f"FAILED ({name}): group 1 did not heal: {reps[1]}")
    return reps


def kill_mode():
    reps = train_killing_group_1(3, 2, ["--steps", steps(1000)], "kill")
    lost = [r["steps_not_committed"] for r in (reps[0], reps[2])]
    if max(lost) > 1:
        sys.exit(f"FAILED: survivors lost more than one step to the failure: {lost}")
    print(f"killed a rank of group 1: restarted, healed {reps[1]['heal_bytes']} B in {reps[1]['heal_seconds']:.3f} s "
          f"(heal: {reps[1]['heal_route']}); survivors lost {lost} steps; parameters equal")


def stop_mode():
    stopped = []

    def act(p):
        wait_for_ranks([0, 1, 2], 1)
        wait_until_training(2)
        for pid in ranks_of(2):
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
    # --timeout-s 10: the survivors' aborted Gloo collective with the stopped group ends by the
    # cross-group timeout (min(--timeout-s, 30 s)), and their exit waits for it.
    rc, out, err = run(["--replica-groups", "3", "--nproc", "1", "--steps", steps(800), "--timeout-s", "10"], act)
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if rc != 0:
        sys.exit(f"FAILED: exit {rc}\n{err[-3000:]}")
    reps = [r for r in reports(out) if r["replica_group"] != 2]
    if [r["replica_group"] for r in reps] != [0, 1] or len({r["parameter_checksum"] for r in reps}) != 1:
        sys.exit(f"FAILED: the survivors did not finish alike: {reps}")
    longest = max(r["longest_step_ms"] for r in reps)
    if longest > 2500:
        sys.exit(f"FAILED: a survivor's step took {longest:.0f} ms across the stopped group (target: within 2 s)")
    print(f"stopped group 2: survivors finished alike; their longest step {longest:.0f} ms")


def two_lost_mode():
    def act(p):
        wait_for_ranks([0, 1, 2, 3], 1)
        wait_until_training(1)
        victims = ranks_of(1) + ranks_of(3)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
    rc, out, err = run(["--replica-groups", "4", "--nproc", "1", "--steps", steps(1000)], act)
    if rc != 0:
        sys.exit(f"FAILED: exit {rc}\n{err[-3000:]}")
    reps = reports(out)
    check_same(reps, 4)
    if reps[1]["heals"] < 1 or reps[3]["heals"] < 1:
        sys.exit(f"FAILED: groups 1 and 3 did not both heal: {reps}")
    print("killed groups 1 and 3 at once: both restarted and healed; parameters equal")


def lighthouse_mode():
    port = free_port()
    address = f"127.0.0.1:{port}"

    def start_lighthouse():
        lh = subprocess.Popen([BIN, "lighthouse", "--address", address, "--expected-groups", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = lh.stdout.readline()
        if "listening on" not in line:
            sys.exit(f"FAILED: the lighthouse did not start: {line}")
        # Its event lines follow: drained, so that a full pipe never blocks the lighthouse.
        threading.Thread(target=lambda out=lh.stdout: [None for _ in out], daemon=True).start()
        return lh

    lh = [start_lighthouse()]

    def act(p):
        wait_for_ranks([0, 1], 1)
        wait_until_training(1)
        lh[0].kill()
        lh[0].wait()
        time.sleep(1)
        lh[0] = start_lighthouse()
    try:
        rc, out, err = run(["--replica-groups", "2", "--nproc", "1", "--steps", steps(800), "--lighthouse", address], act)
    finally:
        lh[0].kill()
    if rc != 0:
        sys.exit(f"FAILED: exit {rc}\n{err[-3000:]}")
    reps = reports(out)
    check_same(reps, 2)
    print(f"lighthouse killed and restarted: the groups went on (reconfigurations {[r['reconfigurations'] for r in reps]}); "
          "parameters equal")


def min_replicas_mode():
    def act(p):
        wait_for_ranks([0, 1], 1)
        wait_until_training(1)
        os.kill(ranks_of(1)[0], signal.SIGKILL)
    rc, out, err = run(["--replica-groups", "2", "--nproc", "1", "--steps", "100000", "--min-replicas", "2",
                        "--max-restarts", "0", "--timeout-s", "8"], act, timeout=120)
    if rc == 0:
        sys.exit("FAILED: the job went on below --min-replicas")
    if "has no quorum" not in err or "min_replicas 2" not in err or "replica-000" not in err:
        sys.exit(f"FAILED: the error does not name the quorum's shortfall:\n{err[-2000:]}")
    print("below --min-replicas: the job stopped with an error naming the live groups")


# Inside a group: what a heal must copy rank by rank besides parameters and optimizer state.
STRATEGIES = {
    "powersgd": ["--hook", "powersgd", "--powersgd-start-iter", "2"],
    "zero1": ["--zero", "1"],
    "zero2": ["--zero", "2", "--optimizer", "adam"],
    "fsdp": ["--fsdp", "full_shard"],
}
EVERY_STRATEGY = dict(STRATEGIES, **{
    "allreduce": ["--hook", "allreduce"], "fp16": ["--hook", "fp16"], "bf16": ["--hook", "bf16"],
    "zero2_bf16": ["--zero", "2", "--zero-precision", "bf16"],
    "fp16_wrapper": ["--hook", "fp16_wrapper"], "bf16_wrapper": ["--hook", "bf16_wrapper"],
    "int8": ["--hook", "int8", "--int8-error-feedback"], "quantize_per_tensor": ["--hook", "quantize_per_tensor"],
    "quantize_per_channel": ["--hook", "quantize_per_channel"],
    "batched_powersgd": ["--hook", "batched_powersgd", "--powersgd-start-iter", "2"],
    "fsdp_shard_grad_op": ["--fsdp", "shard_grad_op"], "fsdp_no_shard": ["--fsdp", "no_shard"],
    "fsdp_fp16": ["--fsdp", "full_shard", "--hook", "fp16"],
})


def strategies_mode(table=STRATEGIES):
    for name, flags in table.items():
        reps = train_killing_group_1(2, 2, ["--steps", steps(700)] + flags, name)
        if not all(r["final_loss"] == r["final_loss"] for r in reps):  # NaN
            sys.exit(f"FAILED ({name}): the loss is not a number: {reps}")
        print(f"{name}: a rank of group 1 killed; healed {reps[1]['heal_bytes']} B; parameters equal; "
              f"final loss {reps[0]['final_loss']:.4f}", flush=True)


def checkpoint_mode():
    work = tempfile.mkdtemp(prefix="ddpkit-ft-ckpt-")
    try:
        ckpt = os.path.join(work, "ckpt")
        # Group 1 dies at step 350, half way between checkpoints, so that restarted from the newest
        # one it is behind group 0 and heals. (A kill timed from outside once landed as group 0
        # wrote step 300's checkpoint: group 0 waited out the restart at step 300, group 1
        # resumed there, and nothing was behind to heal.)
        steps, every, dies_at = 4000, 100, 350
        rc, out, err = run(["--replica-groups", "2", "--nproc", "1", "--steps", str(steps), "--checkpoint-dir", ckpt,
                            "--checkpoint-every", str(every)], lambda p: None,
                           env={"DDPKIT_FT_FAULT": f"forward:{dies_at}:1:0"})
        if rc != 0 or "DDPKIT_FT_FAULT: dying" not in err:
            sys.exit(f"FAILED (checkpointing): exit {rc}\n{err[-3000:]}")
        reps = reports(out)
        check_same(reps, 2)
        # Unless group 0 went on alone, wrote a newer checkpoint and was at exactly that step when
        # group 1 came back (then group 1 resumed at the quorum's step and committed every step on).
        back = reps[1]["resumed_from"]
        level = back > dies_at and back + reps[1]["steps_committed"] == steps
        if back < dies_at // every * every or back % every or (reps[1]["heals"] < 1 and not level):
            sys.exit(f"FAILED (checkpointing): group 1 did not resume from a checkpoint and heal: {reps[1]}")
        files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(ckpt, "checkpoint-*.ddpk")))
        if "checkpoint-0000004000.ddpk" not in files or sum(r["checkpoints_written"] for r in reps) < 1:
            sys.exit(f"FAILED (checkpointing): checkpoints {files}; reports {reps}")
        rc, out, err = run(["--replica-groups", "3", "--nproc", "1", "--steps", "4100", "--checkpoint-dir", ckpt,
                            "--checkpoint-every", "100", "--resume"], lambda p: None)
        if rc != 0:
            sys.exit(f"FAILED (resuming under 3 groups): exit {rc}\n{err[-3000:]}")
        reps3 = reports(out)
        check_same(reps3, 3)
        if {r["resumed_from"] for r in reps3} != {4000} or any(r["steps"] != 4100 for r in reps3):
            sys.exit(f"FAILED (resuming under 3 groups): {reps3}")
        print(f"checkpoints under --fault-tolerant ({', '.join(files)}); group 1, killed at step {dies_at}, resumed from "
              f"step {back} and healed {reps[1]['heal_bytes']} B; 3 groups resumed the 2 groups' step 4000 and trained on alike")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# DDPKIT_FT_FAULT points (PHASE:STEP:GROUP:RANK[:ATTEMPT]), one run each; what must have healed.
# One run each: DDPKIT_FT_FAULT points (PHASE:STEP:GROUP:RANK[:ATTEMPT]), what inside the groups (so
# the heals copy hook state, ZeRO partitions and FSDP shards too), and the groups that must heal.
PHASES = {
    "forward": (["forward:40:1:0"], ["--zero", "2"], {1}),
    "backward": (["backward:40:1:0"], ["--hook", "powersgd", "--powersgd-start-iter", "2"], {1}),
    "cross-group allreduce": (["crossing:40:1:0"], ["--zero", "1"], {1}),
    # Group 1 dies at step 40; its heal source (the lighthouse names the first up-to-date group,
    # 0) dies as it publishes: group 1 heals from group 2, and so does group 0. FSDP's shards cross
    # after backward (Manager::allreduce). (Step 1: group 0 also publishes at step 0, as the source
    # the others copy at their first quorum.)
    "heal source dies": (["forward:40:1:0", "heal-publish:1:0:0"], ["--fsdp", "full_shard"], {0, 1}),
    # Group 1 dies at step 40, and again, restarted, after copying its state, before loading it.
    "healing group dies": (["forward:40:1:0", "heal-fetched:0:1:0:1"], ["--hook", "int8", "--int8-error-feedback"], {1}),
    # Group 1 dies at step 40, and again, restarted, as the cross-group rendezvous with it begins:
    # the others give that rendezvous up when its heartbeats stop, not at the rendezvous's 30 s.
    "rendezvous": (["forward:40:1:0", "rendezvous:0:1:0:1"], [], {1}),
}


def phases_mode():
    for name, (faults, flags, healed) in PHASES.items():
        env = {"DDPKIT_FT_FAULT": ",".join(faults)}
        rc, out, err = run(["--replica-groups", "3", "--nproc", "1", "--steps", "400"] + flags, lambda p: None, env=env)
        if rc != 0:
            sys.exit(f"FAILED ({name}): exit {rc}\n{err[-3000:]}")
        died = err.count("DDPKIT_FT_FAULT: dying")
        if died != len(faults):
            sys.exit(f"FAILED ({name}): {died} of {len(faults)} fault points fired\n{err[-3000:]}")
        reps = reports(out)
        check_same(reps, 3)
        heals = {r["replica_group"] for r in reps if r["heals"] > 0}
        if not healed <= heals:
            sys.exit(f"FAILED ({name}): groups {sorted(healed)} should have healed, healed: {sorted(heals)}")
        lost = max(r["steps_not_committed"] for r in reps if r["replica_group"] not in heals)
        if lost > len(faults):
            sys.exit(f"FAILED ({name}): survivors lost {lost} steps to {len(faults)} failures: {reps}")
        held = max(r["longest_step_ms"] for r in reps if r["replica_group"] not in heals) / 1000
        if held > 10:  # a failure costs a heartbeat timeout (1 s) and a step, not a collective's 30 s
            sys.exit(f"FAILED ({name}): a survivor's step took {held:.1f} s: {reps}")
        print(f"{name} ({' '.join(flags) or 'DDP allreduce'}): died there, healed groups {sorted(heals)}, survivors lost at most {lost} step(s); "
              "parameters equal", flush=True)


def hosts_mode():
    """2 groups of 2 ranks on two hosts (network namespaces, each with its own host name), every
    group spanning both, crossed: group 0's rank 0 on host a, group 1's on host b, so each cross-group
    process group and each heal goes over the link. A rank of group 1 is killed and its other rank
    stopped as a launcher's agent would; both restarted (fresh rendezvous port), group 1 heals from
    group 0 across the link, and both groups end alike."""
    import two_hosts
    if os.geteuid() != 0:
        sys.exit("FAILED: mode hosts needs root (network namespaces)")
    if not shutil.which("ip"):
        sys.exit("FAILED: mode hosts needs ip (network namespaces): scripts/install-deps.sh installs iproute2")
    tag = f"dft{os.getpid() % 10000}"
    a, b = "10.214.0.1", "10.214.0.2"
    lighthouse, ranks = None, {}
    try:
        (ns_a, _), (ns_b, _) = two_hosts.create(tag, a, b)
        lighthouse = subprocess.Popen(["ip", "netns", "exec", ns_a, BIN, "lighthouse", "--address", f"{a}:29620",
                                       "--expected-groups", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def start(group, rank, attempt):
            ns = (ns_a, ns_b)[(group + rank) % 2]
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR=(a, b)[group], MASTER_PORT=str(29630 + 10 * group + attempt))
            cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", f'hostname {ns} && exec "$0" "$@"', BIN] + \
                BASE + ["--steps", steps(600), "--replica-groups", "2",
                        "--replica-group", str(group), "--lighthouse", f"{a}:29620"]
            ranks[(group, rank)] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                    env=env)
        for g in (0, 1):
            for r in (0, 1):
                start(g, r, 0)
        wait_for_ranks([0, 1], 2)
        wait_until_training(1)
        for r in (1, 0):  # the rank that dies, then the rest of its group, as torchrun's agent does
            ranks[(1, r)].kill()
            ranks[(1, r)].communicate()
        if ranks[(0, 0)].poll() is not None:
            sys.exit("FAILED (hosts): group 0 ended before group 1 was restarted")
        for r in (0, 1):
            start(1, r, 1)
        outs = {k: p.communicate(timeout=300) for k, p in ranks.items()}
        for k, p in ranks.items():
            if p.returncode != 0:
                sys.exit(f"FAILED (hosts): group {k[0]} rank {k[1]} exit {p.returncode}\n{outs[k][1][-3000:]}")
        reps = sorted((json.loads(l) for o, _ in outs.values() for l in o.splitlines() if l.startswith("{")),
                      key=lambda r: r["replica_group"])
        check_same(reps, 2)
        healed = reps[1]
        if healed["heals"] < 1 or healed["heals_single_copy"] or "gloo" not in healed["cross_transport"] or \
                "gloo" not in healed["heal_route"]:
            sys.exit(f"FAILED (hosts): group 1 should have healed over the link (Gloo across groups): {healed}")
        print(f"groups spanning two hosts: group 1 restarted, healed {healed['heal_bytes']} B across the link in "
              f"{healed['heal_seconds']:.3f} s over '{healed['heal_route']}', cross-group transport "
              f"'{healed['cross_transport']}'; parameters equal")
    finally:
        for p in ranks.values():
            if p.poll() is None:
                p.kill()
        if lighthouse:
            lighthouse.kill()
            lighthouse.wait()
        two_hosts.remove(tag)


MODES = {"checkpoint": checkpoint_mode, "phases": phases_mode, "strategies": strategies_mode, "every-strategy": lambda: strategies_mode(EVERY_STRATEGY),
         "kill": kill_mode, "stop": stop_mode, "two-lost": two_lost_mode, "lighthouse": lighthouse_mode,
         "min-replicas": min_replicas_mode, "hosts": hosts_mode}

if __name__ == "__main__":
    BIN = os.path.abspath(sys.argv[1])
    if sys.argv[2] not in MODES:
        sys.exit(f"unknown mode {sys.argv[2]}: {', '.join(MODES)}")
    MODES[sys.argv[2]]()
    print("ok")
