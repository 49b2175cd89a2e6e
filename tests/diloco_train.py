#!/usr/bin/env python3
"""`ddpkit train --fault-tolerant --diloco H` as a user runs it (docs/diloco.md).

  tests/diloco_train.py build/ddpkit MODE

MODE:
  parity      DiLoCo with H=1, outer lr 1, no momentum, over SGD is DDP across the groups: the
              same test loss as plain --fault-tolerant (2 groups of 2 ranks)
  streaming   3 groups, 2 fragments synced in turn, each average behind 1 inner step, int4 outer
              codec: every group ends alike, and the bytes each sends are 2(n-1)/n of its syncs'
              encoded fragments (within 2 %)
  site-bytes  2 sites of 1, 2 and 4 ranks (DDP inside, int8): a site sends one copy of its
              pseudo-gradient whatever its ranks (each carries 1/W): cross_bytes_per_site_per_sync
              is 2(n-1)/n of the encoded model within 2 % at each size
  rounds      2 sites of 2 ranks with time-budgeted rounds (--round-seconds), one rank of site 1
              throttled (SIGSTOP/SIGCONT pulses), three times: each site's ranks end their rounds at
              the same inner step (one decision a site), every group ends alike
  kill-sync   3 groups, int2 outer codec with error feedback; group 1 dies just after issuing an
              outer average (its peers mid-transfer): the survivors redo that sync among themselves,
              lose no inner step, stay identical; group 1 restarts, heals at a later sync and ends alike
              (a run whose sync completed because group 1's part had all landed is run again, twice at most)
  kill-inner  the same with group 1 killed in its inner steps
  stop        3 groups; group 1 SIGSTOPped mid-run (silent: no RST, no FIN, its heartbeats stop): the
              others' sync with it ends within 2 s, and they finish every inner step, alike (5 s
              later the stopped rank is killed, its group restarted and healed)
  strategies  2 groups of 2 ranks with FSDP, ZeRO-1 and PowerSGD inside each site (int8 outer codec,
              2 fragments where the layers allow): every group ends alike
  lazy-cross  streaming and kill-sync again with --cross-lazy-connections and no shared memory
              (DDPKIT_SHM=0): the cross groups run on lazily connected Gloo pairs, and the bytes,
              the retried sync and the heal come out as on the full mesh
  checkpoint  2 groups write their checkpoints (outer state included) every 2 syncs; a run stopped
              half way and resumed ends bit for bit as the run straight through: one rank a site,
              and 2 ranks a site under FSDP with the int2 codec and error feedback (each rank's
              outer state and residuals its own)

Checks: exit status 0, one JSON line per group, equal parameter checksums, no checksum mismatch.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ft_train import ranks_of  # noqa: E402

BIN = None
MODEL = ["--dataset", "synthetic", "--epochs", "1000", "--quiet", "--timeout-s", "60",
         "--batch-size", "32", "--lr", "0.05"]


def run(flags, env=None, timeout=300, dims="64,256,256,10"):
    p = subprocess.run([BIN, "train", "--fault-tolerant", "--mlp-dims", dims] + MODEL + flags, capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ, **(env or {})))
    if p.returncode != 0:
        sys.exit(f"FAILED: {' '.join(flags)}: exit {p.returncode}\n{p.stderr[-4000:]}")
    reps = sorted((json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")), key=lambda r: r["replica_group"])
    return reps, p.stderr


def check_alike(reps, groups, what):
    if [r["replica_group"] for r in reps] != list(range(groups)):
        sys.exit(f"FAILED ({what}): expected a report from each of {groups} groups, got {reps}")
    if len({r["parameter_checksum"] for r in reps}) != 1:
        sys.exit(f"FAILED ({what}): the groups' parameters differ:\n" + "\n".join(json.dumps(r) for r in reps))
    for r in reps:
        if r.get("checksum_mismatches", 0):
            sys.exit(f"FAILED ({what}): sites' global parameters differed at a sync: {r}")


def parity_mode():
    common = ["--replica-groups", "2", "--nproc", "2", "--steps", "30", "--optimizer", "sgd"]
    ddp, _ = run(common)
    dl, _ = run(common + ["--diloco", "1", "--outer-lr", "1", "--outer-momentum", "0"])
    check_alike(dl, 2, "parity")
    a, b = ddp[0]["test_loss"], dl[0]["test_loss"]
    if abs(a - b) > 1e-4 * abs(a):
        sys.exit(f"FAILED: H=1 DiLoCo's test loss {b} differs from DDP across groups' {a}")
    if dl[0]["outer_syncs"] != 31:  # the first quorum's, then one per step
        sys.exit(f"FAILED: expected 31 syncs, got {dl[0]}")
    print(f"H=1 DiLoCo = DDP across groups: test loss {b:.6f} vs {a:.6f}")


def streaming_mode(extra=(), env=None):
    reps, _ = run(["--replica-groups", "3", "--nproc", "1", "--steps", "48", "--diloco", "8", "--fragments", "2",
                   "--fragment-delay", "1", "--outer-codec", "int4", "--optimizer", "adamw", "--lr", "0.001"] +
                  list(extra), env=env)
    check_alike(reps, 3, "streaming")
    r = reps[0]
    if r["outer_syncs"] != 1 + 48 // 4:
        sys.exit(f"FAILED: expected {1 + 48 // 4} syncs (one per 4 steps), got {r}")
    # Fragment 0 in the first quorum's sync, then the fragments in turn: 7 of fragment 0, 6 of 1.
    f0, f1 = r["fragment_parameters"]
    want = 2 * (3 - 1) / 3 * (7 * encoded_bytes("int4", f0) + 6 * encoded_bytes("int4", f1))
    for rep in reps:
        if abs(rep["cross_bytes_sent"] / want - 1) > 0.02:
            sys.exit(f"FAILED: group {rep['replica_group']} sent {rep['cross_bytes_sent']} B, the layout says "
                     f"{want:.0f} (2(n-1)/n x int4 of fragments {f0} and {f1}, 7 and 6 syncs)")
    print(f"streaming, 2 fragments, tau 1, int4: {r['outer_syncs']} syncs, {r['cross_bytes_per_step']:.0f} B/step, "
          f"test loss {r['test_loss']:.4f}, cross groups on {r['cross_transport']}")
    return reps


def encoded_bytes(codec, n):
    """include/ddpkit/codecs/codec.h's sizes, for the codecs these tests send."""
    if codec == "int8":  # blocks of 256 values, a float32 scale each
        blocks = -(-n // 256)
        return blocks * 256 + 4 * blocks
    if codec == "int4":  # 4-bit codes padded to 4 bytes, a float32 scale per 128 values
        return ((n + 1) // 2 + 3) // 4 * 4 + 4 * -(-n // 128)
    raise ValueError(codec)


def site_bytes_mode():
    sites, steps, h = 2, 16, 4
    share = 2 * (sites - 1) / sites
    per_site = {}
    for ranks in (1, 2, 4):
        reps, _ = run(["--replica-groups", str(sites), "--nproc", str(ranks), "--steps", str(steps), "--diloco", str(h),
                       "--outer-codec", "int8", "--no-eval"], dims="64,512,512,10")
        check_alike(reps, sites, f"{ranks} ranks a site")
        for r in reps:
            want = share * encoded_bytes("int8", r["parameters"])
            got = r["cross_bytes_per_site_per_sync"]
            if r["outer_syncs"] != 1 + steps // h or abs(got / want - 1) > 0.02:
                sys.exit(f"FAILED: {ranks} ranks a site: {got:.0f} B per site per sync, the formula says {want:.0f} "
                         f"(2(n-1)/n x int8 of {r['parameters']} values): {r}")
            per_site.setdefault(ranks, []).append(got)
        print(f"{ranks} rank(s) a site: {per_site[ranks][0]:.0f} B per site per sync (formula {want:.0f}), "
              f"{reps[0]['cross_bytes_per_rank_per_sync']:.0f} B per rank")
    if abs(per_site[4][0] / per_site[1][0] - 1) > 0.02:
        sys.exit(f"FAILED: a site of 4 ranks sends {per_site[4][0]:.0f} B per sync, a site of 1 {per_site[1][0]:.0f}")


def rounds_mode():
    import signal
    import threading
    import time
    for attempt in range(3):
        cmd = [BIN, "train", "--fault-tolerant", "--mlp-dims", "64,128,10"] + MODEL + \
            ["--replica-groups", "2", "--nproc", "2", "--steps", "6000", "--diloco", "1000", "--round-seconds", "0.25",
             "--no-eval"]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stop = threading.Event()

        def throttle():
            # One rank of site 1 runs 20 ms in every 50 ms: its clock reaches each deadline up to
            # 30 ms after its peer's.
            while not stop.is_set() and not ranks_of(1):
                time.sleep(0.05)
            pids = ranks_of(1)
            while not stop.is_set() and pids:
                try:
                    os.kill(pids[-1], signal.SIGSTOP)
                    time.sleep(0.03)
                    os.kill(pids[-1], signal.SIGCONT)
                except OSError:
                    return
                time.sleep(0.02)
        pulse = threading.Thread(target=throttle, daemon=True)
        pulse.start()
        try:
            out, err = p.communicate(timeout=200)
        finally:
            stop.set()
            pulse.join()
            for pid in ranks_of(1):
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    pass
            if p.poll() is None:
                p.kill()
        if p.returncode != 0:
            sys.exit(f"FAILED (run {attempt + 1}): exit {p.returncode}\n{err[-4000:]}")
        reps = sorted((json.loads(l) for l in out.splitlines() if l.startswith("{")), key=lambda r: r["replica_group"])
        check_alike(reps, 2, f"rounds, run {attempt + 1}")
        for r in reps:
            if r["outer_steps"] != 6 or r["sync_retries"]:
                sys.exit(f"FAILED (run {attempt + 1}): expected 6 rounds without retries: {r}")
        print(f"run {attempt + 1}: 6 time-budgeted rounds, inner steps by site {[r['steps_run'] for r in reps]} "
              "(site 1 throttled), every group alike")


def kill_mode(phase, step, extra=(), extra_env=None):
    # Long enough (~20 s here) that the killed group restarts and heals before the others end.
    steps = 3000
    # Group 1 dies just after issuing its part of the sync; when all of that part has already
    # reached the others (a small int2 message, written at once), their sync completes without it,
    # which is correct but does not show the retry: that run is done again (at most twice more).
    attempts = 3 if phase == "outer-issued" else 1
    for attempt in range(attempts):
        reps, err = run(["--replica-groups", "3", "--nproc", "1", "--steps", str(steps), "--diloco", "8",
                         "--max-restarts", "2", "--optimizer", "adamw", "--lr", "0.001", "--no-eval"] + list(extra),
                        env=dict({"DDPKIT_FT_FAULT": f"{phase}:{step}:1:0"}, **(extra_env or {})), dims="64,512,512,10")
        if "DDPKIT_FT_FAULT: dying" not in err:
            sys.exit(f"FAILED: group 1 did not die at {phase}:\n{err[-3000:]}")
        check_alike(reps, 3, phase)
        survivors = [reps[0], reps[2]]
        for r in survivors:
            if r["steps_run"] != steps:
                sys.exit(f"FAILED: a survivor lost inner steps ({r['steps_run']} of {steps} run): {r}")
        if reps[1]["heals"] < 1:
            sys.exit(f"FAILED: group 1 did not heal: {reps[1]}")
        if phase != "outer-issued" or any(r["sync_retries"] >= 1 for r in survivors):
            break
        if attempt + 1 == attempts:
            sys.exit(f"FAILED: in {attempts} runs no survivor redid the sync group 1 died in: {survivors}")
        print(f"run {attempt + 1}: the survivors' sync completed with group 1's part, which had landed before it "
              "died (no retry to show); running again")
    print(f"group 1 killed at {phase}: survivors ran {steps} of {steps} inner steps, retries "
          f"{[r['sync_retries'] for r in survivors]}, group 1 healed ({reps[1]['heal_bytes']} B) and ends alike")
    return reps


def lazy_cross_mode():
    lazy = ["--cross-lazy-connections"]
    no_shm = {"DDPKIT_SHM": "0"}
    for r in streaming_mode(lazy, no_shm):
        if not r["cross_transport"].startswith("gloo (pairs connected on demand)"):
            sys.exit(f"FAILED: the cross group ran on {r['cross_transport']!r}, not lazily connected pairs")
    for r in kill_mode("outer-issued", 4, ["--outer-codec", "int2", "--outer-error-feedback"] + lazy, no_shm):
        if not r["cross_transport"].startswith("gloo (pairs connected on demand)"):
            sys.exit(f"FAILED: the cross group ran on {r['cross_transport']!r}, not lazily connected pairs")


def stop_mode():
    import signal
    import time
    steps = 4000
    p = subprocess.Popen([BIN, "train", "--fault-tolerant", "--mlp-dims", "64,512,512,10"] + MODEL +
                         ["--replica-groups", "3", "--nproc", "1", "--steps", str(steps), "--diloco", "8",
                          "--optimizer", "adamw", "--lr", "0.001", "--no-eval"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        end = time.time() + 60
        while stopped is None and time.time() < end:
            stopped = (ranks_of(1) or [None])[0]
            time.sleep(0.1)
        if stopped is None:
            sys.exit("FAILED: group 1's rank did not start")
        time.sleep(4)  # into its steps and syncs
        os.kill(stopped, signal.SIGSTOP)
        # The survivors go on without it; then it is killed (a stopped process outlives the
        # launcher's SIGTERM) and its group restarted, so the job ends with every group.
        time.sleep(5)
        os.kill(stopped, signal.SIGKILL)
        out, err = p.communicate(timeout=300)
    finally:
        if stopped:
            try:
                os.kill(stopped, signal.SIGKILL)
            except OSError:
                pass
        if p.poll() is None:
            p.kill()
    reps = sorted((json.loads(l) for l in out.splitlines() if l.startswith("{")), key=lambda r: r["replica_group"])
    survivors = [r for r in reps if r["replica_group"] != 1]
    if p.returncode != 0 or len(survivors) != 2:
        sys.exit(f"FAILED: exit {p.returncode}, survivors' reports {survivors}\n{err[-3000:]}")
    if survivors[0]["parameter_checksum"] != survivors[1]["parameter_checksum"]:
        sys.exit(f"FAILED: the survivors differ: {survivors}")
    for r in survivors:
        if r["steps_run"] != steps or r["checksum_mismatches"]:
            sys.exit(f"FAILED: a survivor lost inner steps or diverged: {r}")
        if r["longest_sync_blocked_seconds"] > 2.0:
            sys.exit(f"FAILED: a survivor waited {r['longest_sync_blocked_seconds']:.2f} s in one sync: {r}")
    print(f"group 1 stopped: survivors ran {steps} of {steps} inner steps, longest sync "
          f"{max(r['longest_sync_blocked_seconds'] for r in survivors):.2f} s, alike")


def strategies_mode():
    for inside, extra in ((["--fsdp", "full_shard"], []), (["--zero", "1"], ["--fragments", "2"]),
                          (["--hook", "powersgd"], ["--fragments", "2"])):
        reps, _ = run(["--replica-groups", "2", "--nproc", "2", "--steps", "64", "--diloco", "8", "--outer-codec", "int8"]
                      + inside + extra)
        check_alike(reps, 2, " ".join(inside))
        print(f"{' '.join(inside)} inside each site: {reps[0]['outer_syncs']} syncs, alike, test loss {reps[0]['test_loss']:.4f}")


def checkpoint_mode():
    for name, inside in (("one rank a site", ["--nproc", "1"]),
                         ("FSDP over 2 ranks a site, int2 with error feedback",
                          ["--nproc", "2", "--fsdp", "full_shard", "--outer-codec", "int2", "--outer-error-feedback"])):
        d = tempfile.mkdtemp(prefix="ddpkit-diloco-ck-")
        try:
            common = ["--replica-groups", "2", "--diloco", "4", "--optimizer", "adamw", "--lr", "0.001",
                      "--checkpoint-every", "2", "--no-eval"] + inside
            straight, _ = run(common + ["--steps", "48", "--checkpoint-dir", os.path.join(d, "a")])
            run(common + ["--steps", "24", "--checkpoint-dir", os.path.join(d, "b")])
            resumed, err = run(common + ["--steps", "48", "--checkpoint-dir", os.path.join(d, "b"), "--resume"])
            if "resumed from" not in err:
                sys.exit(f"FAILED ({name}): the second run did not resume:\n{err[-3000:]}")
            check_alike(straight, 2, "straight")
            check_alike(resumed, 2, "resumed")
            if straight[0]["parameter_checksum"] != resumed[0]["parameter_checksum"]:
                sys.exit(f"FAILED ({name}): resumed run ends elsewhere:\n{straight}\n{resumed}")
            print(f"{name}: stopped at 24 of 48 inner steps and resumed: parameters bit-identical "
                  f"({resumed[0]['parameter_checksum']})")
        finally:
            shutil.rmtree(d, ignore_errors=True)


MODES = {"parity": parity_mode, "streaming": streaming_mode, "site-bytes": site_bytes_mode, "rounds": rounds_mode,
         "kill-sync": lambda: kill_mode("outer-issued", 4, ["--outer-codec", "int2", "--outer-error-feedback"]),
         "kill-inner": lambda: kill_mode("forward", 4), "stop": stop_mode, "strategies": strategies_mode,
         "checkpoint": checkpoint_mode, "lazy-cross": lazy_cross_mode}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in MODES:
        sys.exit(f"usage: {sys.argv[0]} build/ddpkit {{{'|'.join(MODES)}}}")
    BIN = sys.argv[1]
    MODES[sys.argv[2]]()
    print("ok")
