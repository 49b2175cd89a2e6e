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
