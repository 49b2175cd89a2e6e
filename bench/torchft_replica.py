#!/usr/bin/python3
"""One replica group of the fault-tolerance comparison (bench/ft_vs_torchft.py), as torchft's users
run it: torchft 0.2.0's Manager (quorum from the torchft_lighthouse at --lighthouse, live recovery
over its default HTTP transport, or --recovery pg: its PGTransport over the Manager's own group), its
DistributedDataParallel
and OptimizerWrapper, over torchft's ProcessGroupGloo or ddpkit's ProcessGroupDdpkit (--pg). With
--plain: no torchft, the same model under torch's DistributedDataParallel across --groups
processes (torchrun's variables), the failure-free baseline.

    torchft_replica.py --group G --groups 4 --lighthouse HOST:PORT --steps N [--pg gloo|ddpkit] [--step-log PATH]
    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. torchft_replica.py --plain --steps N

The model: ddpkit train's "--model transformer" (GptImpl in tools/ddpkit/training.h) written in
PyTorch: byte tokens (vocab 256), token and position embeddings, pre-norm blocks (qkv, causal
attention, proj, GELU MLP of 4 d), final norm, linear head; AdamW (lr 1e-3, PyTorch's defaults);
random byte batches (the timing and recovery do not depend on the text). Appends to PATH a line
per step, as ddpkit train's --step-log: step, end (Unix ms), length (ms), committed (1/0). Prints
a JSON line at the end.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads) + mask
        x = x + self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, d_model, heads, layers, length, vocab=256):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d_model), nn.Embedding(length, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)

    def forward(self, x):
        t = x.size(1)
        h = self.tokens(x) + self.positions(torch.arange(t))
        mask = torch.full((t, t), float("-inf")).triu(1)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.ln_f(h))


def batch(gen, args):
    x = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=gen)
    return x[:, :-1], x[:, 1:]


def loss_of(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


def plain(args, model):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        x, y = batch(gen, args)
        opt.zero_grad()
        loss_of(ddp, x, y).backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1000)
    print(json.dumps({"rank": dist.get_rank(), "median_step_ms": statistics.median(times[2:])}), flush=True)
    dist.destroy_process_group()


def fault_tolerant(args, model):
    from torchft import DistributedDataParallel, Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    if args.pg == "ddpkit":
        from ddpkit.torchft import ProcessGroupDdpkit
        pg = ProcessGroupDdpkit(timeout=timedelta(seconds=args.timeout_s))
    else:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=args.timeout_s))
    opt_inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    heals = []

    def state_dict():
        return {"model": model.state_dict(), "optim": opt_inner.state_dict()}

    def load_state_dict(sd):
        t0 = time.perf_counter()
        model.load_state_dict(sd["model"])
        opt_inner.load_state_dict(sd["optim"])
        heals[-1]["load_s"] = time.perf_counter() - t0 if heals else None

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the group's own
    timeout = timedelta(seconds=args.timeout_s)
    transport = None  # the Manager's default: HTTP
    if args.recovery == "pg":  # the state streamed over the Manager's own group, which it reconfigures per quorum
        from torchft.checkpointing.pg_transport import PGTransport
        transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu"), state_dict=state_dict)
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"group_{args.group}", store_addr="127.0.0.1", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=f"http://{args.lighthouse}", port=0, hostname="127.0.0.1",
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                      checkpoint_transport=transport)
    # How long each live recovery took to receive the state (the transport's recv).
    t = manager._checkpoint_transport
    recv = t.recv_checkpoint

    def timed_recv(*a, **k):
        t0 = time.perf_counter()
        out = recv(*a, **k)
        heals.append({"recv_s": time.perf_counter() - t0,
                      "bytes": sum(v.numel() * v.element_size() for v in _tensors(out))})
        return out
    t.recv_checkpoint = timed_recv
    ddp = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, opt_inner)  # its zero_grad starts the quorum; its step, written out below
    gen = torch.Generator().manual_seed(100 + args.group)
    log = open(f"{args.step_log}.replica-{args.group:03d}", "a") if args.step_log else None
    times, committed_steps = [], 0
    while manager.current_step() < args.steps:
        t0 = time.perf_counter()
        x, y = batch(gen, args)
        opt.zero_grad()  # starts the quorum (and a recovery, when this group is behind)
        loss_of(ddp, x, y).backward()
        step = manager.current_step()
        ok = manager.should_commit()  # every participant says the step succeeded (OptimizerWrapper.step's test)
        if ok:
            opt_inner.step()
        ms = (time.perf_counter() - t0) * 1000
        times.append(ms)
        committed_steps += bool(ok)
        if log:
            log.write(f"{step} {time.time() * 1000:.1f} {ms:.1f} {1 if ok else 0}\n")
            log.flush()
    print(json.dumps({"group": args.group, "incarnation": args.incarnation, "pg": args.pg,
                      "median_step_ms": statistics.median(times[2:]),
                      "committed": committed_steps, "heals": heals}), flush=True)
    manager.shutdown(wait=False)


def _tensors(d):
    for v in d.values():
        if torch.is_tensor(v):
            yield v
        elif isinstance(v, dict):
            yield from _tensors(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group", type=int, default=0)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--lighthouse", default="127.0.0.1:29510")
    ap.add_argument("--pg", choices=["gloo", "ddpkit"], default="gloo")
    ap.add_argument("--recovery", choices=["http", "pg"], default="http")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--step-log", default="")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--incarnation", type=int, default=0, help="how many times this group was started before")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every group starts from the same parameters (torchft also syncs them)
    model = Gpt(args.d_model, args.heads, args.layers, args.seq_len)
    if args.plain:
        plain(args, model)
    else:
        fault_tolerant(args, model)


if __name__ == "__main__":
    sys.exit(main())
