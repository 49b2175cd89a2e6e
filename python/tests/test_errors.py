"""Wrong use gets a Python exception that names what is wrong; a lost peer an error, not a hang."""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ddpkit
from conftest import run_ranks
from workloads import DIMS_SMALL as DIMS, batch, ddp


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects the type
        return type(e).__name__, str(e)
    return None, "no exception"


def _misuse(rank, world):
    out = {}
    out["unknown hook"] = _raises(lambda: ddpkit.register_comm_hook(ddp(DIMS), "int9"))
    out["not ddp"] = _raises(lambda: ddpkit.register_comm_hook(torch.nn.Linear(2, 2), "int8"))
    out["hook not a name"] = _raises(lambda: ddpkit.register_comm_hook(ddp(DIMS), print))
    out["block=0"] = _raises(lambda: ddpkit.register_comm_hook(ddp(DIMS), "int8", block=0))
    out["block str"] = _raises(lambda: ddpkit.register_comm_hook(ddp(DIMS), "int8", block="big"))
    out["rank=0"] = _raises(lambda: ddpkit.register_comm_hook(ddp(DIMS), "powersgd", matrix_approximation_rank=0))
    out["start=1"] = _raises(lambda: ddpkit.register_comm_hook(ddp(DIMS), "powersgd", start_powerSGD_iter=1))
    out["unknown option"] = _raises(lambda: ddpkit.register_comm_hook(ddp(DIMS), "powersgd", rank=4))
    out["option of no-option hook"] = _raises(lambda: ddpkit.register_comm_hook(ddp(DIMS), "fp16", block=4))
    out["wrapper"] = _raises(lambda: ddpkit.register_comm_hook(ddp(DIMS), "allreduce", wrapper="fp8"))
    out["local sgd start"] = _raises(lambda: ddpkit.register_comm_hook(ddp(DIMS), "post_local_sgd"))
    out["rpc server"] = _raises(lambda: ddpkit.register_comm_hook(ddp(DIMS), "rpc"))
    out["bad group"] = _raises(lambda: ddpkit.register_comm_hook(ddp(DIMS), "fp16", group=dist.group.WORLD))
    out["averager period"] = _raises(lambda: ddpkit.PeriodicModelAverager(period=0))

    twice = ddp(DIMS)
    ddpkit.register_comm_hook(twice, "int8")
    out["second ddpkit hook"] = _raises(lambda: ddpkit.register_comm_hook(twice, "fp16"))
    torch_first = ddp(DIMS)
    torch_first.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
    out["after pytorch's hook"] = _raises(lambda: ddpkit.register_comm_hook(torch_first, "fp16"))

    model = ddp(DIMS)
    dist.destroy_process_group()
    out["no process group"] = _raises(lambda: ddpkit.register_comm_hook(model, "int8"))
    out["new_group without init"] = _raises(lambda: ddpkit.new_group())
    return out


EXPECTED = {
    "unknown hook": ("ValueError", "unknown hook 'int9' (known: allreduce, fp16, bf16"),
    "not ddp": ("TypeError", "expected a torch.nn.parallel.DistributedDataParallel, got Linear"),
    "hook not a name": ("TypeError", "hook must be a name"),
    "block=0": ("ValueError", "hook 'int8': option block must be >= 1, got 0"),
    "block str": ("TypeError", "hook 'int8': option block must be an int, got str 'big'"),
    "rank=0": ("ValueError", "matrix_approximation_rank must be >= 1, got 0"),
    "start=1": ("ValueError", "start_powerSGD_iter must be > 1 when use_error_feedback or warm_start is on"),
    "unknown option": ("TypeError", "hook 'powersgd' has no option 'rank' (its options: "),
    "option of no-option hook": ("TypeError", "hook 'fp16' has no option 'block'"),
    "wrapper": ("ValueError", "option wrapper must be 'fp16' or 'bf16', got 'fp8'"),
    "local sgd start": ("ValueError", "option start_localSGD_iter is required"),
    "rpc server": ("ValueError", "option server is required: the HOST:PORT a `ddpkit ps-server` listens on"),
    "bad group": ("TypeError", "group must be a ddpkit.ProcessGroup"),
    "averager period": ("ValueError", "PeriodicModelAverager: period must be >= 1, got 0"),
    "second ddpkit hook": ("RuntimeError", "this model already has ddpkit's 'int8' hook"),
    "after pytorch's hook": ("RuntimeError", "PyTorch's DDP refused the hook: register_comm_hook or "
                                             "register_builtin_comm_hook can only be called once"),
    "no process group": ("RuntimeError", "torch.distributed is not initialized; call "
                                         "torch.distributed.init_process_group('gloo') first"),
    "new_group without init": ("RuntimeError", "ddpkit.new_group: torch.distributed is not initialized"),
}


def test_misuse_raises_exceptions_that_name_the_problem():
    got = run_ranks(_misuse, 1)[0]
    wrong = []
    for case, (kind, text) in EXPECTED.items():
        if got[case][0] != kind or text not in got[case][1]:
            wrong.append(f"{case}: expected {kind} containing {text!r}, got {got[case][0]}: {got[case][1]}")
    assert not wrong, "\n".join(wrong)
    assert "matrix_approximation_rank" in got["unknown option"][1]


def _peer_leaves(rank, world):
    group = ddpkit.new_group(timeout=timedelta(seconds=5))
    model = ddp(DIMS)
    ddpkit.register_comm_hook(model, "int8", group=group)
    if rank == 1:
        return "left"  # this process ends: its sockets close under rank 0's collective
    x, y = batch(0, rank, 16, DIMS)
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return "backward succeeded without the peer"


def test_a_lost_peer_fails_backward_with_the_operation_named():
    rank0, rank1 = run_ranks(_peer_leaves, 2, timeout=60)
    assert rank1 == "left"
    assert "ddpkit:" in rank0 and "failed on rank 0 of 2" in rank0, rank0
