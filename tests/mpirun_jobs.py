#!/usr/bin/python3
"""ddpkit under Debian's Open MPI mpirun, as a user runs it (docs/launching.md):

    mpirun -n 4 ddpkit train ...           ends with the parameters of `ddpkit train --nproc 4`
    mpirun -n 2 train_mlp                  a C++ program calling ddpkit::init_process_group()
    mpirun -n 2 python3 ...                torch.distributed.init_process_group("ddpkit"), env://
    mpirun --host node1:2,node2:2 ...      both again across two network namespaces (root; mpirun's
                                           remote daemons started by `ip netns exec` in place of ssh)

The ranks meet through MPI's own environment (OMPI_COMM_WORLD_*, mpirun's address); libddpkit
does not link libmpi (checked).

    tests/mpirun_jobs.py BUILD_DIR [local|hosts|all]     (exit 77 without mpirun)
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import two_hosts  # noqa: E402
from checkpoint_resume import ckpt, differences  # noqa: E402
from procs import with_openblas_coretype  # noqa: E402

# The Python whose torch goes with the build (torchrun, the Python package): tests/CMakeLists.txt sets it.
TORCH_PYTHON = os.environ.get("DDPKIT_TORCH_PYTHON", "/usr/bin/python3")

STEPS = 300
TRAIN = ["train", "--dataset", "synthetic", "--mlp-dims", "64,512,512,10", "--synthetic-size", "4096",
         "--batch-size", "32", "--epochs", "100", "--steps", str(STEPS), "--checkpoint-every", "300", "--no-eval",
         "--quiet", "--timeout-s", "60"]
MPIRUN = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--mca", "btl", "self,tcp"]


def run(cmd, env, timeout=600):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    return out


def compare(name, ref, d, out):
    diffs = differences(ckpt(ref, STEPS), ckpt(d, STEPS))
    detected = [line for line in out.stderr.splitlines() if "launched by openmpi" in line]
    print(f"{name}: {detected[0] if detected else 'NO DETECTION LINE'}; step {STEPS} "
          f"{'bit-identical to' if not diffs else 'DIFFERENT from'} ddpkit train --nproc 4")
    if diffs or not detected:
        sys.exit(f"FAILED: {name}: {', '.join(diffs[:5])}")


def reference(build, work, env):
    """`ddpkit train --nproc 4`: what every mpirun run must end with (flat Gloo in rank order, as
    DDPKIT_SHM=0 makes every run here, on one host or two)."""
    ref = os.path.join(work, "ref")
    run([os.path.join(build, "ddpkit")] + TRAIN + ["--nproc", "4", "--checkpoint-dir", ref], env)
    return ref


def local(build, work, env, ref):
    ddpkit, example = os.path.join(build, "ddpkit"), os.path.join(build, "tests", "train_mlp_example")
    d = os.path.join(work, "mpirun-local")
    out = run(MPIRUN + ["-n", "4", ddpkit] + TRAIN + ["--checkpoint-dir", d], env)
    compare("mpirun -n 4 ddpkit train", ref, d, out)
    out = run(MPIRUN + ["-n", "2", example, "--epochs", "3"], env)
    line = [x for x in out.stdout.splitlines() if x.startswith("train_mlp:")]
    print(f"mpirun -n 2 train_mlp: {line[-1] if line else out.stdout[-500:]}")
    if not line or "ranks agree" not in line[-1]:
        sys.exit("FAILED: train_mlp under mpirun")
    # The Python backend's env:// path: `import ddpkit` fills torchrun's variables from MPI's.
    if os.path.isdir(os.path.join(build, "python", "ddpkit")):
        script = ("import ddpkit, torch, torch.distributed as dist\n"
                  "dist.init_process_group('ddpkit')\n"
                  "t = torch.full((4,), float(dist.get_rank() + 1))\n"
                  "dist.all_reduce(t)\n"
                  "assert t.tolist() == [3.0] * 4, t\n"
                  "print(f'python rank {dist.get_rank()} of {dist.get_world_size()}: allreduce ok')\n"
                  "dist.destroy_process_group()\n")
        # USE_LIBUV=0: Debian 13's torch is built without libuv, which its env:// store asks for.
        out = run(MPIRUN + ["-n", "2", "-x", "PYTHONPATH", "-x", "USE_LIBUV", TORCH_PYTHON, "-c", script],
                  dict(env, PYTHONPATH=os.path.join(build, "python"), USE_LIBUV="0"))
        print("mpirun -n 2 python3 (dist.init_process_group('ddpkit')): " +
              ", ".join(sorted(re.findall(r"python rank \d+ of \d+: allreduce ok", out.stdout))))
        if out.stdout.count("allreduce ok") != 2:
            sys.exit("FAILED: the Python backend under mpirun")


def hosts(build, work, env, ref):
    if os.geteuid() != 0 or not shutil.which("ip"):
        print("SKIP (hosts): network namespaces need root and ip")
        return 77
    ddpkit, example = os.path.join(build, "ddpkit"), os.path.join(build, "tests", "train_mlp_example")
    tag = f"dkm{os.getpid() % 100000}"
    net = f"10.80.{os.getpid() % 200}"
    addrs = {"node1": f"{net}.11", "node2": f"{net}.12", "login": f"{net}.1"}
    try:
        made = two_hosts.create_switched(tag, list(addrs.values()))
        ns = {name: made[i][0] for i, name in enumerate(addrs)}
        for n in ns.values():
            os.makedirs(f"/etc/netns/{n}", exist_ok=True)
            with open(f"/etc/netns/{n}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in addrs.items()))
        # mpirun's rsh launcher runs `AGENT HOST COMMAND...`: here, the command in HOST's namespace.
        agent = os.path.join(work, "netns-rsh")
        with open(agent, "w") as f:
            f.write("#!/bin/sh\nhost=$1; shift\ncase $host in\n" +
                    "".join(f"  {h}) exec ip netns exec {n} /bin/sh -c \"$*\" ;;\n" for h, n in ns.items()) +
                    "esac\necho \"netns-rsh: unknown host $host\" >&2; exit 1\n")
        os.chmod(agent, 0o755)
        across = MPIRUN + ["--host", "node1:2,node2:2", "--mca", "plm_rsh_agent", agent, "-x", "DDPKIT_SHM",
                           "-x", "PATH"] + (["-x", "OPENBLAS_CORETYPE"] if "OPENBLAS_CORETYPE" in env else [])
        # Open MPI 5's ranks do not see mpirun's address: the rendezvous is given, as docs/launching.md says.
        v5 = "(Open MPI) 5" in subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
        if v5:
            across += ["-x", "MASTER_ADDR=node1", "-x", f"MASTER_PORT={20000 + os.getpid() % 10000}"]
        d = os.path.join(work, "mpirun-hosts")
        started = time.time()
        out = run(["ip", "netns", "exec", ns["node1"]] + across + ["-n", "4", ddpkit] + TRAIN +
                  ["--checkpoint-dir", d], env)
        compare(f"mpirun --host node1:2,node2:2 ddpkit train ({time.time() - started:.1f} s)", ref, d, out)
        out = run(["ip", "netns", "exec", ns["node1"]] + across + ["-n", "4", example, "--epochs", "3"], env)
        line = [x for x in out.stdout.splitlines() if x.startswith("train_mlp:")]
        print(f"mpirun --host node1:2,node2:2 train_mlp: {line[-1] if line else out.stdout[-500:]}")
        if not line or "ranks agree" not in line[-1]:
            sys.exit("FAILED: train_mlp across hosts")
        if v5:
            return 0
        # mpirun on a login host that runs no rank: rank 0 (on node1) is not where the ranks would
        # meet; a named error at once, not a wait for the timeout.
        # Debian 12's Open MPI 4.1 orted now and then segfaults in its hwloc component before it
        # starts a rank when launched into a namespace this way (3 of 7 tries once, ddpkit not yet
        # loaded): that crash, and only it, is tried again.
        for attempt in range(3):
            started = time.time()
            bad = subprocess.run(["ip", "netns", "exec", ns["login"]] + across + ["-n", "4", example],
                                 env=env, capture_output=True, text=True, timeout=120)
            orted_crash = "mca_rtc_hwloc" in bad.stderr and "ORTE was unable to reliably start" in bad.stderr
            if not orted_crash:
                break
            print(f"mpirun from a login host: Open MPI's orted crashed in hwloc (try {attempt + 1}); again")
        named = "placed rank 0 on a host other than mpirun's" in bad.stdout + bad.stderr
        print(f"mpirun from a login host outside --host: exit {bad.returncode} in "
              f"{time.time() - started:.1f} s, {'the error names the fix' if named else 'NO NAMED ERROR'}")
        if bad.returncode == 0 or not named:
            sys.exit(f"FAILED: rank 0 away from mpirun's host:\n{bad.stderr[-2000:]}")
    finally:
        two_hosts.remove(tag)
    return 0


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build = os.path.abspath(sys.argv[1])
    which = sys.argv[2] if len(sys.argv) > 2 else "all"
    if not shutil.which("mpirun"):
        print("SKIP: mpirun is not installed (scripts/install-deps.sh installs openmpi-bin)")
        sys.exit(77)
    # What libddpkit itself links (NEEDED), not what libtorch brings: Debian 13's libtorch is built
    # with MPI and so loads libmpi into every process anyway.
    dynamic = subprocess.run(["readelf", "-d", os.path.join(build, "libddpkit.so")], capture_output=True,
                             text=True).stdout
    if any("NEEDED" in line and "libmpi" in line for line in dynamic.splitlines()):
        sys.exit("FAILED: libddpkit.so links libmpi")
    # The BLAS kernels this CPU runs (a fixed SkylakeX died with SIGILL on an AVX2-only Zen 3).
    env = with_openblas_coretype(dict(os.environ, OMP_NUM_THREADS="1", DDPKIT_SHM="0"))
    work = tempfile.mkdtemp(prefix="ddpkit-mpirun-")
    os.chmod(work, 0o755)
    code = 0
    try:
        ref = reference(build, work, env)
        if which in ("local", "all"):
            local(build, work, env, ref)
        if which in ("hosts", "all"):
            code = hosts(build, work, env, ref)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if code == 77 and which == "hosts":
        sys.exit(77)
    print("mpirun: every case passed")


if __name__ == "__main__":
    main()
