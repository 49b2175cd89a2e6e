"""rpc, sparse_rpc and hybrid hooks on PyTorch's DDP, against a running `ddpkit ps-server`."""
import signal
import subprocess

import pytest
import torch
import torch.nn.functional as F

import ddpkit
from conftest import build_binary, run_ranks
from workloads import DIMS_SMALL, ddp, flat_parameters, train

STEPS = 3


@pytest.fixture
def ps_servers():
    """Two servers for trainers 0 and 1: one per job (a server numbers its batches per job)."""
    cli = build_binary("DDPKIT_CLI")
    procs, addresses = [], []
    try:
        for _ in range(2):
            p = subprocess.Popen([cli, "ps-server", "--trainer-ids", "0,1", "--address", "127.0.0.1:0"],
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
            line = p.stdout.readline()
            assert line.startswith("ddpkit ps-server: listening on "), line
            addresses.append(line.split("listening on ")[1].split()[0])
        yield addresses
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            assert p.wait(timeout=20) == 0


class SparseNet(torch.nn.Module):
    """The seed's DummyModelSparse in small: a sparse EmbeddingBag, then a dense layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bag = torch.nn.EmbeddingBag(100, 16, mode="mean", sparse=True)
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.bag(x))


def _train_sparse(model, rank):
    for s in range(STEPS):
        torch.manual_seed(100 * s + rank)
        x = torch.randint(0, 100, (8, 5))
        y = torch.randn(8, 4)
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.module.parameters():
                p.add_(p.grad, alpha=-0.1)
                p.grad = None


def _hooks(rank, world, servers):
    from torch.nn.parallel import DistributedDataParallel
    out = {}
    reference = ddp(DIMS_SMALL)
    ddpkit.register_comm_hook(reference, "allreduce")
    train(reference, DIMS_SMALL, STEPS, rank)
    out["allreduce"] = flat_parameters(reference.module)

    dense = ddp(DIMS_SMALL)
    state = ddpkit.register_comm_hook(dense, "rpc", server=servers[0])
    train(dense, DIMS_SMALL, STEPS, rank)
    out["rpc"] = flat_parameters(dense.module)
    out["rpc traffic"] = state.ps_traffic()

    for hook, options in (("sparse_rpc", {"server": servers[1]}), ("hybrid", {})):
        model = DistributedDataParallel(SparseNet())
        ddpkit.register_comm_hook(model, hook, **options)
        _train_sparse(model, rank)
        out[hook] = flat_parameters(model.module)
    return out


def test_rpc_sparse_rpc_and_hybrid_average_like_allreduce(ps_servers):
    ranks = run_ranks(_hooks, 2, ps_servers)
    for hook in ("rpc", "sparse_rpc", "hybrid"):
        assert torch.equal(ranks[0][hook], ranks[1][hook]), f"{hook}: ranks' parameters differ"
    # The server returns (g0 + g1) / 2, the allreduce hook g0/2 + g1/2: equal up to rounding.
    torch.testing.assert_close(ranks[0]["rpc"], ranks[0]["allreduce"], rtol=1e-5, atol=1e-6)
    traffic = ranks[0]["rpc traffic"]
    assert traffic["calls"] == STEPS and traffic["bytes_sent"] > 0, traffic
    # The servers run on this host: the gradients go through shared memory, the messages carry the rest.
    assert traffic["shared_memory"] and traffic["shm_bytes_sent"] > traffic["bytes_sent"], traffic
    assert traffic["doorbell_calls"] == traffic["calls"], traffic  # and the calls through its mailboxes
    # sparse_rpc averages the embedding on the server and allreduces the rest; hybrid allreduces
    # both over Gloo: the same average.
    torch.testing.assert_close(ranks[0]["sparse_rpc"], ranks[0]["hybrid"], rtol=1e-5, atol=1e-6)
