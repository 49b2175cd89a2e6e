#!/usr/bin/python3
"""Side by side on this machine: `ddpkit bench` against PyTorch's RPC parameter server
(bench/pytorch_ps.py), same model, data, hooks and sizes, runs interleaved, median of --repeats.

  /usr/bin/python3 bench/ps_vs_pytorch.py build/ddpkit --hooks allreduce,rpc,sparse_rpc,hybrid

Ratios: server_gradients_per_s ddpkit / PyTorch (higher is better for ddpkit) and step time
ddpkit / PyTorch (lower is better).

  /usr/bin/python3 bench/ps_vs_pytorch.py build/ddpkit --sizes 1,4,16,25,64,100

--sizes measures the engines alone, all in separate processes on loopback: 2 trainers send one
bucket of each size per round to one server and wait for the average (`ddpkit ps-server` with
`ps_server_bench --connect`, against pytorch_ps.py --sizes on TensorPipe). Ratio: PyTorch's
round time / ddpkit's (throughput, higher is better for ddpkit). Both sides run --warmup-rounds
(10) unmeasured rounds before each size. On one host ddpkit's trainers pass their data through
shared memory (docs/parameter_server.md); DDPKIT_SHM=0 keeps it in gRPC messages.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from pytorch_peer import PEER_ENV, torch_version_or_exit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from ports import free_port  # noqa: E402

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


def ddpkit_sizes(ddpkit, sizes, rounds, trainers, warmup):
    """One run of `ddpkit ps-server` + `ps_server_bench --connect` trainers; {size_mb: round_ms_p50}."""
    bench = os.path.join(os.path.dirname(os.path.abspath(ddpkit)), "ps_server_bench")
    env = dict(PEER_ENV, GLOG_minloglevel="2")
    address = f"127.0.0.1:{free_port()}"
    server = subprocess.Popen([ddpkit, "ps-server", "--trainers", str(trainers), "--address", address],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        procs = [subprocess.Popen([bench, "--connect", address, "--trainer-id", str(t), "--sizes", sizes,
                                   "--batches", str(rounds), "--warmup", str(warmup)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for t in range(trainers)]
        outs = [p.communicate(timeout=900) for p in procs]
        for p, (out, err) in zip(procs, outs):
            if p.returncode != 0:
                raise RuntimeError(f"ps_server_bench failed ({p.returncode}):\n{out[-2000:]}\n{err[-2000:]}")
    finally:
        server.terminate()
        server.wait(timeout=30)
    rows = [json.loads(line) for line in outs[0][0].splitlines() if line.startswith("{")]
    return {r["size_mb"]: r["round_ms_p50"] for r in rows}


def pytorch_sizes(sizes, rounds, trainers, warmup):
    env = dict(PEER_ENV, GLOG_minloglevel="2")
    p = subprocess.run([sys.executable, os.path.join(HERE, "pytorch_ps.py"), "--sizes", sizes, "--iterations",
                        str(rounds), "--trainers", str(trainers), "--warmup-rounds", str(warmup)], capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"pytorch_ps.py --sizes failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return {r["size_mb"]: r["round_ms_p50"] for r in rows}


def compare_sizes(a, torch_version):
    print(f"# engines only: {a.trainers} trainers + 1 server, separate processes, loopback; one bucket per round; "
          f"median over {a.repeats} interleaved runs of each run's median of {a.iterations} rounds, "
          f"after {a.warmup_rounds} unmeasured rounds per size")
    print(f"# PyTorch {torch_version} RPC (TensorPipe, its default transports and channels) vs ddpkit ps "
          f"(gRPC with chunks; on one host data through shared memory and calls through its mailboxes{', off: DDPKIT_SHM=0' if os.environ.get('DDPKIT_SHM') == '0' else ''})")
    print(f"{'size_MB':>8} {'ddpkit ms':>10} {'torch ms':>10} {'ratio':>6} {'ddpkit GB/s':>12} {'torch GB/s':>11}")
    ours, theirs = [], []
    for _ in range(a.repeats):
        ours.append(ddpkit_sizes(a.ddpkit, a.sizes, a.iterations, a.trainers, a.warmup_rounds))
        theirs.append(pytorch_sizes(a.sizes, a.iterations, a.trainers, a.warmup_rounds))
    for mb in [float(x) for x in a.sizes.split(",")]:
        o = statistics.median(r[mb] for r in ours)
        t = statistics.median(r[mb] for r in theirs)
        # GB/s: payload per direction through the server (every trainer's bucket in, and out).
        gbs = lambda ms: a.trainers * mb * 1024 * 1024 / 1e9 / (ms / 1000)
        print(f"{mb:8.1f} {o:10.2f} {t:10.2f} {t / o:6.2f} {gbs(o):12.2f} {gbs(t):11.2f}", flush=True)


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
    ap.add_argument("--sizes", default="", help="engines only: bucket sizes in MB (see above)")
    ap.add_argument("--warmup-rounds", type=int, default=10, help="--sizes: unmeasured rounds before each size, both sides")
    a = ap.parse_args()
    torch_version = torch_version_or_exit()
    if a.sizes:
        return compare_sizes(a, torch_version)
    tmp = tempfile.mkdtemp(prefix="ps_vs_pytorch_")
    common = ["--trainers", str(a.trainers), "--servers", str(a.servers), "--batch-size", str(a.batch_size)]
    # The seed's data and trainer named explicitly: `ddpkit bench`'s default workload is another.
    ours_args = common + ["--data", "DummyData", "--trainer", "DdpTrainer",
                          "--model", {"dummy": "DummyModel", "dummy_sparse": "DummyModelSparse"}[a.model],
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
        rate = lambda g: f"{g:13.1f}" if g else f"{'-':>13}"  # hooks without a server
        print(f"{hook:<11} {rate(og)} {rate(tg)} {ratio} {os_:15.1f} {ts:14.1f} {os_ / ts:6.2f}", flush=True)


if __name__ == "__main__":
    main()
