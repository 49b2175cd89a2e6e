"""ddpkit's hooks on PyTorch's DistributedDataParallel, 2 ranks as processes over Gloo, CPU tensors."""
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ddpkit
from conftest import run_ranks
from workloads import batch, ddp, flat_parameters, mlp, train

DIMS = [64, 256, 256, 10]
STEPS = 4

# (hook, options, lowest compression ratio against a ring allreduce of the same buckets)
HOOKS = [
    ("allreduce", {}, 0.99),
    ("fp16", {}, 1.9),
    ("bf16", {}, 1.9),
    ("fp16_wrapper", {}, 1.9),
    ("bf16_wrapper", {}, 1.9),
    ("int8", {}, 3.5),
    ("int8", {"error_feedback": True, "block": 128}, 3.5),
    ("quantize_per_tensor", {}, 1.5),   # gathers every rank's bucket, as PyTorch's does
    ("quantize_per_channel", {"bucket_size": 64}, 1.5),
    ("powersgd", {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}, 1.5),
    ("batched_powersgd", {"matrix_approximation_rank": 8, "start_powerSGD_iter": 2}, 1.5),
    ("powersgd", {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2, "wrapper": "bf16"}, 1.5),
]


def _every_hook(rank, world):
    out = []
    for name, options, _ in HOOKS:
        model = ddp(DIMS)
        state = ddpkit.register_comm_hook(model, name, **options)
        train(model, DIMS, STEPS, rank)
        stats = {"params": flat_parameters(model.module), "iter": state.iter,
                 "traffic": state.bucket_traffic(), "launch": state.launch_stats()}
        if "powersgd" in name:
            stats["compression_stats"] = state.compression_stats()
        out.append(stats)
    return out


def test_every_hook_keeps_ranks_identical_and_counts_its_traffic():
    ranks = run_ranks(_every_hook, 2)
    for i, (name, options, min_ratio) in enumerate(HOOKS):
        label = f"{name} {options}"
        r0, r1 = ranks[0][i], ranks[1][i]
        assert torch.equal(r0["params"], r1["params"]), f"{label}: ranks ended with different parameters"
        assert r0["iter"] == STEPS, f"{label}: iter {r0['iter']} after {STEPS} steps"
        sent = sum(b["bytes_sent"] + b["shm_bytes_sent"] for b in r0["traffic"])  # one host: shared memory
        plain = sum(b["allreduce_bytes"] for b in r0["traffic"])
        assert sent > 0 and plain > 0, f"{label}: no traffic counted: {r0['traffic']}"
        assert plain / sent >= min_ratio, f"{label}: compression ratio {plain / sent:.2f} < {min_ratio}"
        launch = r0["launch"]
        assert launch["python_calls_per_bucket"] == 0 and launch["launches"] >= STEPS
        assert 0 < launch["adapter_us_per_bucket"] <= launch["launch_us_per_bucket"]
        if "powersgd" in name:
            rate, before, after = r0["compression_stats"]
            assert before > after > 0 and rate == pytest.approx(before / after)


def _bounds(rank, world):
    """One step of each hook against the exact average of every rank's local gradients."""
    model = mlp(DIMS)
    x, y = batch(0, rank, 16, DIMS)
    torch.nn.functional.mse_loss(model(x), y).backward()
    local = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    out = {"local": torch.stack(gathered)}
    for name in ("bf16", "int8"):
        model = ddp(DIMS)
        ddpkit.register_comm_hook(model, name)
        out[name] = train(model, DIMS, 1, rank)[0]
    return out


def test_bf16_and_int8_on_cpu_stay_within_their_documented_bounds():
    ranks = run_ranks(_bounds, 2)
    g = ranks[0]["local"]  # [world, numel]: every rank's own gradients
    n = g.shape[0]
    mean = g.sum(0) / n
    # docs/hooks.md: bf16 rounds each g_r/n once and the fp32 sum once more.
    bf16_bound = 2.0 ** -8 * mean.abs() + 2.0 ** -8 * g.abs().max(0).values + 1e-7
    # int8, per block of 512: (1/n) sum_r max|g_r| / 254 + max|mean| / 254; the whole-tensor maxima
    # bound every block's.
    int8_bound = g.abs().max(1).values.sum() / n / 254 + mean.abs().max() / 254 + 1e-6
    for r in range(n):
        bf16_err = (ranks[r]["bf16"] - mean).abs()
        assert (bf16_err <= bf16_bound).all(), f"bf16 exceeds its bound by {(bf16_err - bf16_bound).max():.3g}"
        int8_err = (ranks[r]["int8"] - mean).abs().max()
        assert int8_err <= int8_bound, f"int8 error {int8_err:.3g} > bound {int8_bound:.3g}"
        assert int8_err > 0, "int8 returned the exact average: did it quantize at all?"


def _powersgd_default_buckets(rank, world, gloo_threads, steps):
    group = ddpkit.new_group(gloo_threads=gloo_threads)
    dims = [256, 1024, 1024, 256]  # 8 MB: DDP's default 25 MB cap still makes several buckets
    model = ddp(dims)
    state = ddpkit.register_comm_hook(model, "powersgd", group=group, matrix_approximation_rank=2,
                                      start_powerSGD_iter=3)
    train(model, dims, steps, rank, lr=0.05)
    return {"params": flat_parameters(model.module), "iter": state.iter, "buckets": len(state.bucket_traffic()),
            "stats": state.compression_stats(), "gloo_threads": group.gloo_threads}


@pytest.mark.parametrize("gloo_threads", [2, 8])
def test_powersgd_with_default_buckets_runs_50_steps_bit_identical(gloo_threads):
    # PyTorch's own powerSGD_hook hangs or aborts here on Gloo (its collectives are issued from
    # future callbacks on Gloo's threads); ddpkit's are ordered by its process group.
    ranks = run_ranks(_powersgd_default_buckets, 2, gloo_threads, 50, timeout=300)
    assert ranks[0]["gloo_threads"] == gloo_threads
    assert ranks[0]["buckets"] >= 2
    assert ranks[0]["iter"] == 50
    assert ranks[0]["stats"][0] > 1
    assert torch.equal(ranks[0]["params"], ranks[1]["params"]), "ranks' parameters differ after 50 steps"


def _local_sgd(rank, world):
    model = ddp(DIMS)
    state = ddpkit.register_comm_hook(model, "post_local_sgd", start_localSGD_iter=3,
                                      post_local_gradient_allreduce=False)
    averager = ddpkit.PeriodicModelAverager(period=2, warmup_steps=3)
    snapshots, averaged = [], []

    def after(step):
        averaged.append(averager.average_parameters(model.parameters()))
        snapshots.append(flat_parameters(model.module))

    train(model, DIMS, 8, rank, after_step=after)
    # The averager releases the GIL while it waits: a Python thread runs meanwhile.
    ticks = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    if rank == 1:
        time.sleep(1.0)  # rank 0 waits for us inside average_parameters
    thread = threading.Thread(target=count)
    thread.start()
    before = ticks[0]
    ddpkit.average_parameters(model.parameters())
    during = ticks[0] - before
    stop.set()
    thread.join()
    return {"snapshots": snapshots, "averaged": averaged, "iter": state.iter, "ticks_while_waiting": during,
            "final": flat_parameters(model.module)}


def test_post_local_sgd_with_periodic_model_averager():
    ranks = run_ranks(_local_sgd, 2)
    # Steps 0-2: global gradient allreduce; from 3: local SGD, averaged on steps 3, 5, 7.
    assert ranks[0]["averaged"] == [False, False, False, True, False, True, False, True]
    same = [torch.equal(a, b) for a, b in zip(ranks[0]["snapshots"], ranks[1]["snapshots"])]
    assert same == [True, True, True, True, False, True, False, True], same
    assert ranks[0]["iter"] == 3  # as PyTorch's PostLocalSGDState.iter, it stops counting at the start
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])
    assert ranks[0]["ticks_while_waiting"] > 10, "a Python thread could not run while ddpkit waited: GIL held?"
