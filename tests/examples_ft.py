#!/usr/bin/env python3
"""examples/fault_tolerance run as their users run them, each group or site one process, against
`ddpkit lighthouse`:

- ft_ddp: 2 replica groups; group 1 is SIGKILLed mid-run and started again: group 0 trains every
  step, group 1 heals from it and both end with the same parameters.
- diloco_sites: 3 sites, Streaming DiLoCo (3 fragments, int4); site 2 is SIGKILLed mid-round and
  started again: the survivors run every inner step (none lost), all three end with the same
  global parameters, and site 2 healed.

  examples_ft.py DDPKIT_CLI FT_DDP DILOCO_SITES
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ports import free_port  # noqa: E402


def lighthouse(cli, groups):
    proc = subprocess.Popen([cli, "lighthouse", "--address", "127.0.0.1:0", "--expected-groups", str(groups),
                             "--join-timeout-ms", "60000", "--quiet"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on " in line, line
    return proc, line.split("listening on ")[1].split()[0]


def start(program, *args):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen([program, *map(str, args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def kill_at(proc, prefix):
    """SIGKILLs `proc` once it prints a line starting with `prefix`."""
    for line in proc.stdout:
        if line.startswith(prefix):
            proc.kill()
            proc.wait()
            return
    raise AssertionError(f"the process ended before printing '{prefix}' (exit {proc.wait()})")


def report(proc):
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def main():
    cli, ft_ddp, diloco_sites = sys.argv[1:4]

    lh, address = lighthouse(cli, 2)
    common = ["--lighthouse", address, "--groups", 2, "--steps", 150, "--step-ms", 10]
    groups = [start(ft_ddp, "--group", g, *common) for g in range(2)]
    kill_at(groups[1], "group 1 step 40 ")
    back = start(ft_ddp, "--group", 1, *common)
    first, again = report(groups[0]), report(back)
    lh.terminate()
    print("ft_ddp:", first, again, sep="\n  ")
    assert first["steps"] == 150 and again["steps"] == 150, (first, again)
    assert again["heals"] >= 1 and again["steps_run"] < 150, again
    assert first["checksum"] == again["checksum"], (first, again)

    lh, address = lighthouse(cli, 3)
    common = ["--lighthouse", address, "--sites", 3, "--steps", 300, "--sync-every", 30, "--fragments", 3,
              "--codec", "int4", "--step-ms", 10]
    sites = [start(diloco_sites, "--site", s, *common) for s in range(3)]
    kill_at(sites[2], "site 2 step 45 ")  # syncs every 10 steps, a fragment each: between two of them
    back = start(diloco_sites, "--site", 2, *common)
    results = [report(sites[0]), report(sites[1]), report(back)]
    lh.terminate()
    print("diloco_sites:", *results, sep="\n  ")
    for r in results[:2]:
        assert r["steps"] == 300 and r["steps_run"] == 300, r  # no inner step lost or redone
    assert results[2]["heals"] >= 1 and results[2]["steps_run"] < 300, results[2]
    assert len({r["global_checksum"] for r in results}) == 1, results
    print("ok")


if __name__ == "__main__":
    main()
