#!/usr/bin/python3
"""Side by side on this machine: `ddpkit bench` against PyTorch's RPC parameter server
(bench/pytorch_ps.py), same model, data, hooks and sizes, runs interleaved, median of --repeats.

  /usr/bin/python3 bench/ps_vs_pytorch.py build/ddpkit --hooks allreduce,rpc,sparse_rpc,hybrid

Ratios: server_gradients_per_s ddpkit / PyTorch (higher is better for ddpkit) and step time
ddpkit / PyTorch (lower is better).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from pytorch_peer import PEER_ENV, torch_version_or_exit

HERE = os.path.dirname(os.path.abspath(__file__))


def last_json(out):
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no JSON line in output:\n" + out[-2000:])


def run(cmd):
    env = dict(PEER_ENV, GLOG_minloglevel="2")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return last_json(p.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ddpkit")
    ap.add_argument("--hooks", default="allreduce,rpc,sparse_rpc,hybrid")
    ap.add_argument("--model", default="dummy_sparse", choices=["dummy", "dummy_sparse"])
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch_version = torch_version_or_exit()
    tmp = tempfile.mkdtemp(prefix="ps_vs_pytorch_")
    common = ["--trainers", str(a.trainers), "--servers", str(a.servers), "--batch-size", str(a.batch_size)]
    ours_args = common + ["--model", {"dummy": "DummyModel", "dummy_sparse": "DummyModelSparse"}[a.model],
                          "--max-iterations", str(a.iterations), "--out-dir", os.path.join(tmp, "runs")]
    theirs_args = common + ["--model", a.model, "--iterations", str(a.iterations)]
    print(f"# {a.trainers} trainers, {a.servers} server(s), model {a.model}, batch {a.batch_size}, "
          f"{a.iterations} iterations, median of {a.repeats} interleaved runs")
    ddpkit_version = subprocess.run([a.ddpkit, "version"], capture_output=True, text=True).stdout.strip()
    print(f"# PyTorch {torch_version} ({sys.executable}); {ddpkit_version}")
    print(f"{'hook':<11} {'ddpkit grad/s':>13} {'torch grad/s':>13} {'ratio':>6} {'ddpkit step ms':>15} "
          f"{'torch step ms':>14} {'ratio':>6}")
    for hook in a.hooks.split(","):
        ours, theirs = [], []
        for _ in range(a.repeats):
            ours.append(run([a.ddpkit, "bench", "--hook", hook, "--quiet"] + ours_args))
            theirs.append(run([sys.executable, os.path.join(HERE, "pytorch_ps.py"), "--hook", hook] + theirs_args))
        og = statistics.median(r["server_gradients_per_s"] for r in ours)
        tg = statistics.median(r["server_gradients_per_s"] for r in theirs)
        os_ = statistics.median(r["step_ms_p50"] for r in ours)
        ts = statistics.median(r["step_ms_p50"] for r in theirs)
        ratio = f"{og / tg:6.2f}" if tg else "     -"
        print(f"{hook:<11} {og:13.1f} {tg:13.1f} {ratio} {os_:15.1f} {ts:14.1f} {os_ / ts:6.2f}", flush=True)


if __name__ == "__main__":
    main()
