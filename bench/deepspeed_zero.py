#!/usr/bin/python3
"""DeepSpeed ZeRO-1/2 on CPU (DS_ACCELERATOR=cpu) over dist_backend "ddpkit" and over Gloo, against
ddpkit's own ZeRO (`ddpkit train --zero 1|2`), on the same model, side by side in one run (issue 71).

    bench/deepspeed_zero.py --python "$(scripts/pip-torch-env.sh)" --bin build-pip/ddpkit [--steps 20] [--reps 3]
    bench/deepspeed_zero.py --worker --backend ddpkit --stage 2 --steps 20     (one DeepSpeed run; prints JSON)

Model: bench/zero_bench.py's MLP 1024-2048-2048-2048-2048-1024 (14.7M parameters, ReLU between),
synthetic data, cross entropy, Adam (lr 1e-3; DeepSpeed: torch.optim.Adam as its client optimizer,
zero_allow_untested_optimizer), batch 32 a rank, 2 ranks on this host, one compute thread each,
fp32, glibc's malloc thresholds pinned the same for every side. Per run: the median step after two
warm-up steps; the largest optimizer state any rank holds (Adam's exp_avg and exp_avg_sq: under
ZeRO, of the rank's partition); each rank's peak RSS (VmHWM). Rows are interleaved over --reps
rounds; the table shows medians over rounds and ratios to DeepSpeed on Gloo of the same stage.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from fsdp_bench import MALLOC as FSDP_MALLOC  # noqa: E402  glibc's thresholds pinned, as the other benchmarks
from ports import free_port  # noqa: E402

# The engine python/tests/test_deepspeed.py trains (imported by the workers: it imports torch).
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python", "tests"))

DIMS = [1024, 2048, 2048, 2048, 2048, 1024]
BATCH = 32
MALLOC = dict(FSDP_MALLOC, MALLOC_TOP_PAD_=str(1 << 26))


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(rank, world, port, backend, stage, steps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), USE_LIBUV="0")
    import torch
    torch.set_num_threads(1)
    if backend == "ddpkit":
        import ddpkit  # noqa: F401  registers the backend
    import deepspeed
    deepspeed.init_distributed(dist_backend=backend)
    import torch.distributed as dist
    from workloads import deepspeed_zero_engine
    engine, optimizer = deepspeed_zero_engine(DIMS, BATCH, stage, lr=1e-3)
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(BATCH, DIMS[0], generator=gen)
    y = torch.randint(0, DIMS[-1], (BATCH,), generator=gen)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        times.append((time.perf_counter() - t0) * 1000)
        losses.append(loss.item())
    inner = getattr(optimizer, "optimizer", optimizer)
    state_bytes = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
    sent = 0.0
    if backend == "ddpkit":  # what crossed through ddpkit's group: DeepSpeed's collectives ran on it
        import ddpkit
        # ZeRO's data-parallel group (DeepSpeed makes its own with new_group: ddpkit's too)
        st = ddpkit._ddpkit_group_of(getattr(optimizer, "dp_process_group", None) or dist.group.WORLD).stats()
        sent = float(st["bytes_sent"] + st["shm_bytes_sent"])
    stats = torch.tensor([state_bytes, peak_rss_bytes(), sent], dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    if rank == 0:
        out.put({"median_step_ms": statistics.median(times[2:]), "final_loss": losses[-1],
                 "optimizer_state_bytes": max(int(g[0]) for g in gathered),
                 "peak_rss_bytes": [int(g[1]) for g in gathered], "torch": torch.__version__,
                 "ddpkit_bytes_sent_per_step": [g[2].item() / steps for g in gathered],
                 "deepspeed": deepspeed.__version__, "backend": dist.get_backend()})
    dist.barrier()
    dist.destroy_process_group()


def run_worker(a):
    import multiprocessing as mp
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, a.backend, a.stage, a.steps, q)) for r in range(2)]
    for p in procs:
        p.start()
    import queue
    deadline = time.monotonic() + 1200
    result = None
    while result is None:
        try:
            result = q.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                sys.exit(f"deepspeed_zero: a rank failed or timed out ({[p.exitcode for p in procs]})")
    for p in procs:
        p.join(timeout=120)
    if any(p.exitcode for p in procs):
        sys.exit(f"deepspeed_zero: a rank failed ({[p.exitcode for p in procs]})")
    print(json.dumps(result))


def deepspeed_run(python, build, backend, stage, steps):
    env = dict(os.environ, **MALLOC, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.path.join(build, "python"))
    p = subprocess.run([python, os.path.abspath(__file__), "--worker", "--backend", backend, "--stage", str(stage),
                        "--steps", str(steps)], env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"FAILED: DeepSpeed ZeRO-{stage} on {backend}\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def ddpkit_run(binary, stage, steps):
    flags = ["train", "--dataset", "synthetic", "--mlp-dims", ",".join(map(str, DIMS)), "--batch-size", str(BATCH),
             "--threads", "1", "--no-eval", "--quiet", "--optimizer", "adam", "--lr", "0.001", "--zero", str(stage),
             "--nproc", "2", "--steps", str(steps)]
    p = subprocess.run([binary] + flags, env=dict(os.environ, **MALLOC), capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"FAILED: ddpkit train --zero {stage}\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    # peak_rss_bytes: the largest rank's VmHWM, as the DeepSpeed rows report theirs.
    return {"median_step_ms": r["median_step_ms"], "optimizer_state_bytes": r["optimizer_state_bytes"],
            "peak_rss_bytes": [r["peak_rss_bytes"]]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", choices=["gloo", "ddpkit"], default="ddpkit")
    ap.add_argument("--stage", type=int, choices=[1, 2], default=2)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build-pip", "ddpkit"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if a.worker:
        return run_worker(a)
    build = os.path.dirname(os.path.abspath(a.bin))
    rows = {}
    versions = ""
    for _ in range(a.reps):
        for stage in (1, 2):
            runs = {f"DeepSpeed ZeRO-{stage} on Gloo": lambda: deepspeed_run(a.python, build, "gloo", stage, a.steps),
                    f"DeepSpeed ZeRO-{stage} on ddpkit": lambda: deepspeed_run(a.python, build, "ddpkit", stage, a.steps),
                    f"ddpkit ZeRO-{stage}": lambda: ddpkit_run(a.bin, stage, a.steps)}
            for name, run in runs.items():
                r = run()
                if "deepspeed" in r:
                    versions = f"DeepSpeed {r['deepspeed']}, torch {r['torch']}"
                rows.setdefault(name, []).append(r)
    print(f"ZeRO on CPU: {versions}; MLP {'-'.join(map(str, DIMS))} (14.7M parameters), Adam, batch {BATCH}/rank, "
          f"W=2, 1 thread/rank, fp32, malloc pinned; median of {a.reps} interleaved rounds")
    print(f"{'':<26} {'step ms':>8} {'rounds':>22} {'opt state MB/rank':>18} {'peak RSS MB/rank':>17} "
          f"{'step vs DS Gloo':>16} {'RSS vs DS Gloo':>15}")
    med = {}
    for name, runs in rows.items():
        med[name] = (statistics.median(r["median_step_ms"] for r in runs),
                     statistics.median(r["optimizer_state_bytes"] for r in runs) / 2 ** 20,
                     statistics.median(max(r["peak_rss_bytes"]) for r in runs) / 2 ** 20)
    for name, (ms, state, rss) in med.items():
        ref = med[f"DeepSpeed ZeRO-{name.split('ZeRO-')[1][0]} on Gloo"]
        rounds = " ".join(f"{r['median_step_ms']:.1f}" for r in rows[name])
        print(f"{name:<26} {ms:>8.1f} {rounds:>22} {state:>18.1f} {rss:>17.0f} {ms / ref[0]:>16.2f} {rss / ref[2]:>15.2f}")
    for name, runs in rows.items():
        if "on ddpkit" in name:  # DeepSpeed's collectives went through ddpkit's group
            sent = statistics.median(max(r["ddpkit_bytes_sent_per_step"]) for r in runs)
            print(f"{name}: {sent / 2 ** 20:.1f} MB a step sent through ddpkit's group by each rank; final loss "
                  f"{runs[-1]['final_loss']:.4f} (on Gloo: {rows[name.replace('ddpkit', 'Gloo')][-1]['final_loss']:.4f})")


if __name__ == "__main__":
    main()
