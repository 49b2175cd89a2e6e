"""DeepSpeed's ZeRO on the ddpkit backend (docs/integrations.md): ZeRO-1 and ZeRO-2 on CPU
(DS_ACCELERATOR=cpu) with deepspeed.init_distributed(dist_backend="ddpkit"), 2 ranks, 20 steps of
Adam: every step's loss equal to the same run on Gloo within 1e-5, and DeepSpeed's collectives
carried by ddpkit's group (its byte count grows). DeepSpeed is pinned in the pip venv
(scripts/pip-torch-env.sh); elsewhere the test is skipped."""
import importlib.util

import pytest
import torch

from conftest import run_ranks
from workloads import deepspeed_zero_engine

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (scripts/pip-torch-env.sh pins 0.19.8)")

STEPS = 20
DIMS = [32, 64, 64, 10]
BATCH = 16


def zero_losses(rank, world, backend, stage):
    import deepspeed
    import torch.distributed as dist
    if backend == "ddpkit":
        import ddpkit  # noqa: F401  registers the backend
    deepspeed.init_distributed(dist_backend=backend)
    assert dist.get_backend() == backend
    engine, optimizer = deepspeed_zero_engine(DIMS, BATCH, stage, lr=1e-2)
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(BATCH, DIMS[0], generator=gen)  # one batch a rank, fitted over the steps
    y = torch.randint(0, DIMS[-1], (BATCH,), generator=gen)
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    sent = 0
    if backend == "ddpkit":  # ZeRO's data-parallel group is a ddpkit group: its traffic went through ddpkit
        import ddpkit
        group = getattr(optimizer, "dp_process_group", None) or dist.group.WORLD
        stats = ddpkit._ddpkit_group_of(group).stats()
        sent = stats["bytes_sent"] + stats["shm_bytes_sent"]
    dist.barrier()
    dist.destroy_process_group()
    return {"losses": losses, "sent": sent}


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_zero_on_ddpkit_matches_gloo(stage):
    env = {"DS_ACCELERATOR": "cpu"}
    gloo = run_ranks(zero_losses, 2, "gloo", stage, backend=None, env=env, timeout=300)
    ours = run_ranks(zero_losses, 2, "ddpkit", stage, backend=None, env=env, timeout=300)
    for rank in range(2):
        a, b = gloo[rank]["losses"], ours[rank]["losses"]
        assert len(a) == len(b) == STEPS
        worst = max(abs(x - y) for x, y in zip(a, b))
        assert worst <= 1e-5, f"ZeRO-{stage}, rank {rank}: losses differ by {worst} (Gloo {a}, ddpkit {b})"
        assert ours[rank]["sent"] > 0, f"ZeRO-{stage}, rank {rank}: nothing went through ddpkit's group"
    # Training happened: each rank fits its batch.
    assert gloo[0]["losses"][-1] < 0.5 * gloo[0]["losses"][0], gloo[0]["losses"]
