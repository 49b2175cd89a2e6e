#!/usr/bin/python3
"""Compute threads of launched ranks (docs/launching.md, "Compute threads per rank"): as torchrun
does, every path that starts several ranks on one host gives each OMP_NUM_THREADS=1 when it is
unset, says so once, and leaves a user's own value alone.

    launch-2              `ddpkit launch --nproc 2` of a libtorch program (PyTorch): each rank runs 1
                          intra-op thread, and the launcher said why, once
    launch-user-value     the same with OMP_NUM_THREADS=2 exported: 2 threads a rank, nothing said
    launch-1              one rank: the variable stays unset (the rank may use the whole host)
    kubeflow-node         a Trainer v2 pod (PET_NPROC_PER_NODE=2): the node's 2 ranks get 1
    train-2               `ddpkit train --nproc 2`: its ranks' environment
    fault-tolerant        `ddpkit train --fault-tolerant --replica-groups 2`: 2 groups of 1 rank
    openblas              `ddpkit train --nproc 2` with OPENBLAS_CORETYPE unset: on a CPU OpenBLAS does
                          not recognise, its ranks get the kernels the CPU has (procs.openblas_coretype)
                          and the command says so once; elsewhere, and with a user's own value, the
                          variable is left as it was

    tests/launch_threads.py build/ddpkit
"""
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ports import free_port  # noqa: E402
from procs import children, openblas_coretype  # noqa: E402

NOTICE = "OMP_NUM_THREADS is unset: setting it to 1"
PROBE = [sys.executable, "-c",
         "import os, torch; print(f\"rank {os.environ['RANK']}: OMP_NUM_THREADS="
         "{os.environ.get('OMP_NUM_THREADS', 'unset')} threads={torch.get_num_threads()}\")"]
TRAIN = ["train", "--dataset", "synthetic", "--mlp-dims", "32,64,8", "--synthetic-size", "2048", "--steps", "400",
         "--no-eval", "--quiet", "--timeout-s", "60"]
# What the test's own environment may carry from a launcher around it.
ENGINE_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PET_", "TORCHELASTIC_")
ENGINE_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "DDPKIT_LAUNCHED", "OMP_NUM_THREADS")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ENGINE_VARS and not k.startswith(ENGINE_PREFIXES)}
    env.update(extra)
    return env


def probe(ddpkit, nproc, env):
    out = subprocess.run([ddpkit, "launch", "--nproc", str(nproc)] + PROBE, env=env, capture_output=True, text=True,
                         timeout=120)
    # Found anywhere: the ranks share the launcher's stdout, and their lines may interleave.
    lines = sorted(re.findall(r"rank \d+: OMP_NUM_THREADS=\S+ threads=\d+", out.stdout))
    return out.returncode, lines, out.stderr.count(NOTICE), out.stderr


def check_probe(name, got, want_lines, want_notices):
    rc, lines, notices, err = got
    ok = rc == 0 and lines == want_lines and notices == want_notices
    print(f"{name}: {'ok' if ok else 'FAILED'}: {lines}, launcher notice {notices}x (want {want_lines}, {want_notices}x)")
    if not ok:
        print(err[-2000:])
    return ok


def ranks_environment(cmd, env, want_ranks, var="OMP_NUM_THREADS"):
    """Starts a job and reads its ranks' environments from /proc while they run."""
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = {}
    deadline = time.time() + 120
    while time.time() < deadline and len(seen) < want_ranks and job.poll() is None:
        for pid in children(job.pid):
            if pid in seen:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    entries = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            except OSError:
                continue
            if entries.get(b"DDPKIT_LAUNCHED") == b"1":
                seen[pid] = entries.get(var.encode(), b"unset").decode()
        time.sleep(0.02)
    _, err = job.communicate(timeout=300)
    return job.returncode, sorted(seen.values()), err.count(NOTICE), err


BLAS_NOTICE = "OpenBLAS did not recognise this CPU"


def check_openblas(ddpkit):
    cmd = [ddpkit] + TRAIN + ["--nproc", "2"]
    env = {k: v for k, v in clean_env().items() if k != "OPENBLAS_CORETYPE"}
    rc, values, _, err = ranks_environment(cmd, env, 2, var="OPENBLAS_CORETYPE")
    notices = err.count(BLAS_NOTICE)
    if notices:  # this CPU is one OpenBLAS misdetects: the ranks run with the kernels it has
        saved = os.environ.pop("OPENBLAS_CORETYPE", None)
        try:
            core = openblas_coretype()  # from the CPU's flags, as the command decides
        finally:
            if saved is not None:
                os.environ["OPENBLAS_CORETYPE"] = saved
        good = rc == 0 and notices == 1 and core is not None and values == [core] * 2 and \
            f"OPENBLAS_CORETYPE={core}" in err
    else:
        good = rc == 0 and values == ["unset"] * 2
    print(f"openblas: {'ok' if good else 'FAILED'}: ranks' OPENBLAS_CORETYPE {values}, notice {notices}x")
    if not good:
        print(err[-2000:])
    rc, values, _, err = ranks_environment(cmd, dict(env, OPENBLAS_CORETYPE="Haswell"), 2, var="OPENBLAS_CORETYPE")
    mine = rc == 0 and values == ["Haswell"] * 2 and BLAS_NOTICE not in err
    print(f"openblas-user-value: {'ok' if mine else 'FAILED'}: ranks' OPENBLAS_CORETYPE {values}")
    if not mine:
        print(err[-2000:])
    return good and mine


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    ddpkit = os.path.abspath(sys.argv[1])
    ok = True
    ones = ["rank 0: OMP_NUM_THREADS=1 threads=1", "rank 1: OMP_NUM_THREADS=1 threads=1"]
    ok &= check_probe("launch-2", probe(ddpkit, 2, clean_env()), ones, 1)
    twos = ["rank 0: OMP_NUM_THREADS=2 threads=2", "rank 1: OMP_NUM_THREADS=2 threads=2"]
    ok &= check_probe("launch-user-value", probe(ddpkit, 2, clean_env(OMP_NUM_THREADS="2")), twos, 0)
    rc, lines, notices, err = probe(ddpkit, 1, clean_env())
    one_ok = rc == 0 and len(lines) == 1 and "OMP_NUM_THREADS=unset" in lines[0] and notices == 0
    print(f"launch-1: {'ok' if one_ok else 'FAILED'}: {lines}, launcher notice {notices}x")
    ok &= one_ok
    port = str(free_port())
    node = clean_env(PET_NNODES="1", PET_NPROC_PER_NODE="2", PET_NODE_RANK="0", PET_MASTER_ADDR="127.0.0.1",
                     PET_MASTER_PORT=port)
    ok &= check_probe("kubeflow-node", probe(ddpkit, 2, node), ones, 1)
    for name, cmd, ranks in (
            ("train-2", [ddpkit] + TRAIN + ["--nproc", "2"], 2),
            ("fault-tolerant", [ddpkit] + TRAIN + ["--fault-tolerant", "--replica-groups", "2", "--nproc", "1"], 2)):
        rc, values, notices, err = ranks_environment(cmd, clean_env(), ranks)
        good = rc == 0 and values == ["1"] * ranks and notices == 1
        print(f"{name}: {'ok' if good else 'FAILED'}: ranks' OMP_NUM_THREADS {values}, launcher notice {notices}x")
        if not good:
            print(err[-2000:])
        ok &= good
    ok &= check_openblas(ddpkit)
    if not ok:
        sys.exit("FAILED")
    print("every launch path sets one compute thread per rank")


if __name__ == "__main__":
    main()
