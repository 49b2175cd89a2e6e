"""Processes as /proc shows them, for tests and benchmarks that start, find and kill ranks."""
import os


def children(pid):
    """pids of the children of pid, forked by any of its threads (the replica groups of
    `ddpkit train --fault-tolerant` fork their ranks from supervisor threads)."""
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            continue  # the thread ended meanwhile
    return sorted(out)


def alive(pid):
    """pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def openblas_coretype():
    """OPENBLAS_CORETYPE for every side of a run: the environment's, else the kernels this CPU can
    run (OpenBLAS may not recognise it and fall back to slow generic ones; forcing kernels the CPU
    lacks, SkylakeX on a Zen 3, dies with SIGILL). The same rule as src/runtime's advice."""
    if os.environ.get("OPENBLAS_CORETYPE"):
        return os.environ["OPENBLAS_CORETYPE"]
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return "SkylakeX" if "avx512f" in flags else "Haswell" if "avx2" in flags else None


def with_openblas_coretype(env):
    """env with OPENBLAS_CORETYPE set by openblas_coretype(), where it names one."""
    core = openblas_coretype()
    return dict(env, OPENBLAS_CORETYPE=core) if core else dict(env)
