"""The tests' model and data, seeded exactly as python/tests/ddp_peer.cpp seeds its C++ twin."""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


def mlp(dims):
    layers = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i + 2 < len(dims):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        torch.manual_seed(0)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    return model


def batch(step, rank, size, dims):
    torch.manual_seed(1000 + 100 * step + rank)
    x = torch.randn(size, dims[0])
    y = torch.randn(size, dims[-1])
    return x, y


def train(ddp, dims, steps, rank, size=16, lr=0.1, after_step=None):
    """SGD by hand; returns every step's averaged gradients, flattened, one tensor per step."""
    grads = []
    for s in range(steps):
        x, y = batch(s, rank, size, dims)
        F.mse_loss(ddp(x), y).backward()
        with torch.no_grad():
            grads.append(torch.cat([p.grad.reshape(-1).clone() for p in ddp.module.parameters()]))
            for p in ddp.module.parameters():
                p.sub_(p.grad, alpha=lr)
                p.grad.zero_()
        if after_step:
            after_step(s)
    return grads


def flat_parameters(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ddp(dims, **kwargs):
    return DistributedDataParallel(mlp(dims), **kwargs)


DIMS_SMALL = [16, 32, 4]


def deepspeed_zero_engine(dims, batch, stage, lr):
    """DeepSpeed's engine for ZeRO stage `stage` over an MLP of `dims` (ReLU between, torch's default
    init after manual_seed(1)) with torch.optim.Adam(lr) as its client optimizer, fp32, `batch` per
    rank: what python/tests/test_deepspeed.py and bench/deepspeed_zero.py train. Returns (engine,
    optimizer)."""
    import deepspeed
    torch.manual_seed(1)
    layers = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers)
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    engine, optimizer, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.Adam(net.parameters(), lr=lr),
                                                   config=config)
    return engine, optimizer
