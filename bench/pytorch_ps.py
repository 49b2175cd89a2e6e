#!/usr/bin/python3
"""PyTorch's own RPC parameter-server benchmark, same model, data and hooks as `ddpkit bench`.

A compact port of pytorch/benchmarks/distributed/rpc/parameter_server (trainer hooks, the
AverageParameterServer, DummyData/DummyModel[Sparse]) on torch.distributed.rpc (TensorPipe) and
Gloo DDP, with one fix so both sides do the same work: the server returns the average (PyTorch's
discards its division and returns the sum). Prints one JSON line with the same fields as
`ddpkit bench`: step_ms_mean/p50 (trainer batch time) and server_gradients_per_s.

  /usr/bin/python3 bench/pytorch_ps.py --hook rpc --trainers 2 --servers 1 --iterations 20
"""
import argparse
import json
import os
import random
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from ports import free_port  # noqa: E402

SERVER = None


def sparse_to_rpc(t):
    t = t.coalesce()
    return [t.indices(), t.values(), list(t.size())]


def rpc_to_sparse(l):
    return torch.sparse_coo_tensor(l[0], l[1], l[2])


class AverageParameterServer:
    def __init__(self, trainer_count):
        self.lock = threading.Lock()
        self.trainer_count = trainer_count
        self.reset()

    def reset(self):
        self.batch_number = 0
        self.futures = {}
        self.gradient_dict = {}
        self.gradients = 0
        self.bytes_in = 0
        self.t0 = time.perf_counter()


@rpc.functions.async_execution
def average_gradient(batch_number, param_loc, gradient):
    self = SERVER
    if type(gradient) is list:
        gradient = rpc_to_sparse(gradient)
    fut = torch.futures.Future()
    with self.lock:
        self.gradients += 1
        if gradient.is_sparse:
            self.bytes_in += gradient._values().numel() * 4 + gradient._indices().numel() * 8
        else:
            self.bytes_in += gradient.numel() * gradient.element_size()
        if self.batch_number < batch_number:
            self.batch_number = batch_number
            self.futures.clear()
            self.gradient_dict.clear()
        if param_loc not in self.gradient_dict:
            self.gradient_dict[param_loc] = gradient
        else:
            self.gradient_dict[param_loc] = self.gradient_dict[param_loc] + gradient
        self.futures.setdefault(param_loc, []).append(fut)
        if len(self.futures[param_loc]) == self.trainer_count:
            avg = self.gradient_dict[param_loc] / self.trainer_count  # the fix: keep the division
            if avg.is_sparse:
                avg = sparse_to_rpc(avg)
            for f in self.futures[param_loc]:
                f.set_result(avg)
    return fut


def reset_server():
    SERVER.reset()


def server_counters():
    return {"gradients": SERVER.gradients, "bytes_in": SERVER.bytes_in, "seconds": time.perf_counter() - SERVER.t0}


class DummyData:
    def __init__(self, max_val, sample_count, sample_length, sparsity, seed):
        rng = random.Random(seed)
        values = list(range(max_val))
        rng.shuffle(values)
        used = max(1, max_val * (100 - sparsity) // 100)
        values = np.array(values[:used])
        nrng = np.random.default_rng(seed)
        self.input = torch.from_numpy(values[nrng.integers(0, used, size=(sample_count, sample_length))])
        self.target = torch.from_numpy(nrng.integers(0, max_val, size=(sample_count,)))


class DummyModel(nn.Module):
    def __init__(self, num_embeddings, dim, layers, sparse):
        super().__init__()
        self.embedding = nn.EmbeddingBag(num_embeddings, dim, mode="mean", sparse=sparse)
        self.dense_seq = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])

    def forward(self, x):
        return F.softmax(self.dense_seq(self.embedding(x)), dim=1)


class HookState:
    def __init__(self, server_name, pg):
        self.server_name = server_name
        self.process_group = pg
        self.batch_number = 0


def remote_average(state, bucket):
    tensor = bucket.buffer()
    payload = sparse_to_rpc(tensor) if tensor.is_sparse else tensor
    fut = rpc.rpc_async(state.server_name, average_gradient, args=(state.batch_number, bucket.index(), payload))

    def unpack(f):
        r = f.wait()
        return rpc_to_sparse(r) if type(r) is list else r

    return fut.then(unpack)


def allreduce(state, bucket):
    tensor = bucket.buffer()
    if tensor.is_sparse:
        tensor = tensor.coalesce()
    tensor = tensor / state.process_group.size()
    return state.process_group.allreduce([tensor]).get_future().then(lambda f: f.value()[0])


def rpc_hook(state, bucket):
    return remote_average(state, bucket)


def sparse_rpc_hook(state, bucket):
    return remote_average(state, bucket) if bucket.buffer().is_sparse else allreduce(state, bucket)


def hybrid_hook(state, bucket):
    if bucket.buffer().is_sparse:
        tensor = bucket.buffer().coalesce() / state.process_group.size()
        dist.all_reduce(tensor, group=state.sparse_group)
        fut = torch.futures.Future()
        fut.set_result(tensor)
        return fut
    return allreduce(state, bucket)


def run(rank, a, rpc_port, pg_port):
    torch.set_num_threads(a.threads)
    world = a.trainers + a.servers
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rpc_port}", num_worker_threads=16,
                                           rpc_timeout=300)
    global SERVER
    if rank >= a.trainers:
        SERVER = AverageParameterServer(a.trainers // a.servers)
        rpc.init_rpc(f"server{rank - a.trainers}", rank=rank, world_size=world, rpc_backend_options=opts)
        rpc.shutdown()
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=a.trainers)
    rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if a.sizes:
        engine_sweep(rank, a)
        return
    torch.manual_seed(a.seed)
    model = DummyModel(a.dim, a.dim, a.layers, a.model == "dummy_sparse")
    data = DummyData(a.dim, a.sample_count, a.sample_length, a.sparsity, a.seed)
    ddp = DDP(model, bucket_cap_mb=a.bucket_cap_mb)
    per = a.trainers // a.servers if a.servers else 1
    state = HookState(f"server{rank // per}", dist.group.WORLD)
    if a.hook == "hybrid":
        state.sparse_group = dist.new_group(backend="gloo")
    ddp.register_comm_hook(state, {"allreduce": allreduce, "rpc": rpc_hook, "sparse_rpc": sparse_rpc_hook,
                                   "hybrid": hybrid_hook}[a.hook])
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr)
    rows = data.input.size(0)
    times = []
    for it in range(a.warmup + a.iterations):
        if it == a.warmup:
            dist.barrier()
            if rank == 0:
                for s in range(a.servers):
                    rpc.rpc_sync(f"server{s}", reset_server)
            dist.barrier()
        start = ((it * a.trainers + rank) * a.batch_size) % (rows - a.batch_size + 1)
        x, y = data.input[start:start + a.batch_size], data.target[start:start + a.batch_size]
        t0 = time.perf_counter()
        state.batch_number = it
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if it >= a.warmup:
            times.append((time.perf_counter() - t0) * 1000)
    gathered = [None] * a.trainers
    dist.all_gather_object(gathered, times)
    if rank == 0:
        all_times = [t for g in gathered for t in g]
        grads = bytes_in = seconds = 0
        for s in range(a.servers):
            c = rpc.rpc_sync(f"server{s}", server_counters)
            grads += c["gradients"]
            bytes_in += c["bytes_in"]
            seconds = max(seconds, c["seconds"])
        print(json.dumps({"impl": "pytorch", "torch": torch.__version__, "hook": a.hook, "model": a.model,
                          "trainers": a.trainers, "servers": a.servers, "iterations": a.iterations,
                          "batch_size": a.batch_size, "step_ms_mean": float(np.mean(all_times)),
                          "step_ms_p50": float(np.median(all_times)), "server_gradients_averaged": grads,
                          "server_gradients_per_s": grads / seconds if seconds and a.servers else 0.0,
                          "server_MB_in_per_s": bytes_in / seconds / 1e6 if seconds and a.servers else 0.0}),
              flush=True)
    rpc.shutdown()
    dist.destroy_process_group()


def engine_sweep(rank, a):
    """No model: per size, `iterations` rounds in which every trainer sends one bucket of that
    many MB to its server and waits for the average (as ps_server_bench --connect does)."""
    per = a.trainers // a.servers
    server = f"server{rank // per}"
    batch = 0
    for mb in [float(x) for x in a.sizes.split(",")]:
        grad = torch.full((int(mb * 1024 * 1024 / 4),), float(rank))
        rounds = []
        for it in range(a.warmup_rounds + a.iterations):
            t0 = time.perf_counter()
            avg = rpc.rpc_sync(server, average_gradient, args=(batch, 0, grad))
            batch += 1
            if it >= a.warmup_rounds:  # connections, allocator, threads
                rounds.append((time.perf_counter() - t0) * 1000)
        assert avg.numel() == grad.numel()
        if rank == 0:  # a round ends for every trainer when the server answers the last one
            print(json.dumps({"impl": "pytorch", "size_mb": mb, "round_ms_p50": float(np.median(rounds)),
                              "round_ms_min": float(np.min(rounds))}), flush=True)
    rpc.shutdown()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--hook", default="rpc", choices=["allreduce", "rpc", "sparse_rpc", "hybrid"])
    p.add_argument("--model", default="dummy_sparse", choices=["dummy", "dummy_sparse"])
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--warmup-rounds", type=int, default=10, help="--sizes: unmeasured rounds before each size")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sample-length", type=int, default=1024)
    p.add_argument("--sample-count", type=int, default=1024)
    p.add_argument("--sparsity", type=int, default=20)
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sizes", default="", help="engine only: bucket sizes in MB, e.g. 1,4,16 (no model, no DDP)")
    a = p.parse_args()
    if a.trainers % max(a.servers, 1):
        p.error("--trainers must be a multiple of --servers")
    mp.spawn(run, args=(a, free_port(), free_port()), nprocs=a.trainers + a.servers, join=True)


if __name__ == "__main__":
    main()
