#!/usr/bin/python3
"""Fashion-MNIST on PyTorch's own DistributedDataParallel with one of ddpkit's hooks.

    torchrun --nproc-per-node 2 examples/train_fashion_mnist.py --hook int8
    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 examples/train_fashion_mnist.py &
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 examples/train_fashion_mnist.py

(From a build tree: PYTHONPATH=build/python; Debian 13's PyTorch needs USE_LIBUV=0.) The model,
data and optimizer are ddpkit train's default job: MLP 784-512-256-10, batch 64 per rank, SGD
with momentum 0.9, lr 0.05, each rank its own shard of the shuffled training set. Rank 0 prints
each epoch's loss and test accuracy and a last line that is one JSON object.
"""
import argparse
import gzip
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ddpkit


def read_idx(path):
    with gzip.open(path) if path.endswith(".gz") else open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape).copy())


def load(data_dir, split):
    stem = "train" if split == "train" else "t10k"

    def path(kind):
        for suffix in ("-ubyte.gz", "-ubyte"):
            p = os.path.join(data_dir, f"{stem}-{kind}{suffix}")
            if os.path.exists(p):
                return p
        raise SystemExit(f"train_fashion_mnist: no {stem}-{kind} file in {data_dir} "
                         "(Debian: apt install dataset-fashion-mnist)")

    images = read_idx(path("images-idx3")).reshape(-1, 784).float().div_(255).sub_(0.2860).div_(0.3530)
    labels = read_idx(path("labels-idx1")).long()
    return images, labels


def hook_options(args):
    if args.hook in ("powersgd", "batched_powersgd"):
        return {"matrix_approximation_rank": args.powersgd_rank, "start_powerSGD_iter": args.powersgd_start_iter}
    if args.hook == "int8":
        return {"error_feedback": args.int8_error_feedback}
    if args.hook == "post_local_sgd":
        return {"start_localSGD_iter": args.local_sgd_start_iter, "post_local_gradient_allreduce": False}
    return {}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hook", default="none", help="none (DDP's built-in allreduce) or a ddpkit hook: " +
                   ", ".join(ddpkit.hook_names()))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--powersgd-start-iter", type=int, default=10)
    p.add_argument("--int8-error-feedback", action="store_true")
    p.add_argument("--local-sgd-start-iter", type=int, default=100)
    p.add_argument("--local-sgd-period", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    args = p.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("train_fashion_mnist: run under torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT")

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_x, train_y = load(args.data_dir, "train")
    test_x, test_y = load(args.data_dir, "test")

    torch.manual_seed(1)  # the same initial model everywhere (DDP broadcasts rank 0's anyway)
    net = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 10))
    model = DistributedDataParallel(net)
    state = None
    if args.hook != "none":
        state = ddpkit.register_comm_hook(model, args.hook, **hook_options(args))
    averager = (ddpkit.PeriodicModelAverager(args.local_sgd_period, args.local_sgd_start_iter)
                if args.hook == "post_local_sgd" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    steps_per_epoch = len(train_x) // (args.batch_size * world)
    step_ms, accuracy = [], 0.0
    for epoch in range(args.epochs):
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(epoch))
        mine = order[rank::world]
        model.train()
        losses = []
        for i in range(steps_per_epoch):
            idx = mine[i * args.batch_size:(i + 1) * args.batch_size]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
            loss.backward()
            opt.step()
            if averager:
                averager.average_parameters(model.parameters())
            step_ms.append((time.perf_counter() - t0) * 1e3)
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            accuracy = (net(test_x).argmax(1) == test_y).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {statistics.mean(losses):.4f}, test accuracy "
                  f"{accuracy:.4f}", flush=True)
    result = {"hook": args.hook, "world_size": world, "steps": len(step_ms), "epochs": args.epochs,
              "median_step_ms": statistics.median(step_ms), "test_accuracy": accuracy}
    if state is not None:
        traffic = state.bucket_traffic()
        sent = sum(b["bytes_sent"] for b in traffic)
        result["bytes_sent_per_step"] = sent / len(step_ms)
        result["compression_ratio"] = sum(b["allreduce_bytes"] for b in traffic) / sent if sent else None
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
