#!/usr/bin/python3
"""One replica group of the fault-tolerance comparison (bench/ft_vs_torchft.py), as torchft's users
run it: torchft 0.2.0's Manager (quorum from the torchft_lighthouse at --lighthouse, live recovery
over its default HTTP transport, or --recovery pg: its PGTransport over the Manager's own group), its
DistributedDataParallel
and OptimizerWrapper, over torchft's ProcessGroupGloo or ddpkit's ProcessGroupDdpkit, or (torchft-nightly)
a native group that torch reconfigures in place: c10d's Gloo or ddpkit's backend (--pg, make_group). With
--plain: no torchft, the same model under torch's DistributedDataParallel across --groups
processes (torchrun's variables), the failure-free baseline.

    torchft_replica.py --group G --groups 4 --lighthouse HOST:PORT --steps N [--step-log PATH]
        [--pg gloo|ddpkit|native-ddpkit|native-gloo --native-store HOST:PORT]
    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. torchft_replica.py --plain --steps N
    torchft_replica.py --diloco H --group G --groups 4 --lighthouse HOST:PORT --host ADDR --steps N [--lr LR]
        [--outer-lr 0.7 --outer-momentum 0.9] [--text-dir DIR]

--diloco H: one site of torchft's DiLoCo (torchft.local_sgd.DiLoCo: AdamW inner, SGD with Nesterov
momentum outer, fp32 on CPU: its quantization needs CUDA's Triton) on the text corpus as `ddpkit
train --dataset text` reads it (the sorted files of --text-dir, windows of --seq-len, the last 5 %
held out), this site's shard of the windows in a seeded order; prints the held-out loss of the
final (global) parameters (bench/diloco_sites.py runs it beside ddpkit's DiLoCo).

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

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the group's own
    timeout = timedelta(seconds=args.timeout_s)
    pg = make_group(args, store, timeout)
    opt_inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    heals = []

    def state_dict():
        return {"model": model.state_dict(), "optim": opt_inner.state_dict()}

    def load_state_dict(sd):
        t0 = time.perf_counter()
        model.load_state_dict(sd["model"])
        opt_inner.load_state_dict(sd["optim"])
        heals[-1]["load_s"] = time.perf_counter() - t0 if heals else None

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
    if args.pg.startswith("native"):  # torchft leaves a native group's shutdown to its owner
        pg.shutdown()


def make_group(args, store, timeout):
    """The group the Manager reconfigures per quorum (--pg): torchft's own wrappers (gloo: its
    ProcessGroupGloo; ddpkit: ddpkit.torchft.ProcessGroupDdpkit), both made anew per quorum, or a
    native torch group created with enable_reconfigure=True that changes members in place (torch >=
    2.14 and torchft-nightly only): native-gloo, c10d's ProcessGroupGloo as torchft's own
    manager_integ_test builds it, on a bootstrap store every group shares (--native-store: Gloo's
    handles rendezvous there, under distinct initial ranks); native-ddpkit, ddpkit.torchft.native_group,
    whose handles name each rank's own endpoint (no shared store)."""
    from torchft.process_group import ProcessGroupGloo
    import torch.distributed as dist
    if args.pg == "ddpkit":
        from ddpkit.torchft import ProcessGroupDdpkit
        return ProcessGroupDdpkit(timeout=timeout)
    if args.pg == "gloo":
        return ProcessGroupGloo(timeout=timeout)
    if args.pg == "native-ddpkit":
        from ddpkit.torchft import native_group
        return native_group(store, args.group, args.groups, timeout)
    host, port = args.native_store.rsplit(":", 1)
    shared = dist.PrefixStore("native/0", dist.TCPStore(host, int(port), is_master=False,
                                                                     wait_for_workers=False, timeout=timeout))
    pg = dist.ProcessGroup(shared, args.group, args.groups)
    backend = dist.ProcessGroupGloo(shared, args.group, args.groups, timeout=timeout, enable_reconfigure=True)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def text_split(text_dir, length, test_fraction=0.05):
    """ddpkit's load_text_corpus (tools/ddpkit/data.cpp): inputs and next-byte labels, train and test."""
    names = sorted(n for n in os.listdir(text_dir) if "." not in n and os.path.isfile(os.path.join(text_dir, n)))
    data = b"".join(open(os.path.join(text_dir, n), "rb").read() for n in names)
    windows = (len(data) - 1) // length
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    test = max(1, int(windows * test_fraction))

    def split(first, count):
        x = t[first * length:(first + count) * length].view(count, length)
        y = t[first * length + 1:(first + count) * length + 1].view(count, length)
        return x, y
    return split(0, windows - test), split(windows - test, test)


def inner_steps(args, model, inner, train_x, train_y, shard):
    """--steps inner steps on this site's shard of the windows, in a seeded order (both DiLoCos)."""
    gen = torch.Generator().manual_seed(1000 + args.group)
    order, at = shard[torch.randperm(shard.numel(), generator=gen)], 0
    for _ in range(args.steps):
        if at + args.batch_size > order.numel():
            order, at = shard[torch.randperm(shard.numel(), generator=gen)], 0
        idx = order[at:at + args.batch_size]
        at += args.batch_size
        inner.zero_grad()
        loss_of(model, train_x[idx], train_y[idx]).backward()
        inner.step()


def test_loss(model, test_x, test_y):
    """The mean next-byte loss on the held-out windows."""
    with torch.no_grad():
        total = sum(F.cross_entropy(model(test_x[i:i + 256]).reshape(-1, 256), test_y[i:i + 256].reshape(-1),
                                    reduction="sum").item() for i in range(0, test_x.size(0), 256))
    return total / test_y.numel()


def diloco(args, model):
    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    (train_x, train_y), (test_x, test_y) = text_split(args.text_dir, args.seq_len)
    shard = torch.arange(args.group, train_x.size(0), args.groups)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                            nesterov=args.outer_momentum > 0)
    timeout = timedelta(seconds=args.timeout_s)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    # torchft names this machine by socket.gethostname() in what it advertises (0.2.0's checkpoint
    # address, the nightly's reconfigure handles' stores). Network namespaces share one hostname,
    # which resolves to none of the sites: each site answers with --host, as a real host's name
    # would resolve to its own address.
    import socket
    socket.gethostname = lambda: args.host

    store = torch.distributed.TCPStore(args.host, 0, is_master=True, wait_for_workers=False)  # the site's own
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, use_async_quorum=False,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"site_{args.group}",
                      store_addr=args.host, store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=f"http://{args.lighthouse}", port=0, hostname=args.host, timeout=timeout,
                      quorum_timeout=timeout, connect_timeout=timeout)
    with DiLoCo(manager, [model], inner, outer, sync_every=args.diloco):
        start = time.perf_counter()
        inner_steps(args, model, inner, train_x, train_y, shard)  # DiLoCo's hook counts them and syncs every H
        train_s = time.perf_counter() - start
    print(json.dumps({"replica_group": args.group, "steps_run": args.steps, "train_seconds": train_s,
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "outer_syncs": manager.current_step(), "test_loss": test_loss(model, test_x, test_y)}),
          flush=True)
    manager.shutdown(wait=False)


def ddpkit_diloco(args, model):
    """The same site under ddpkit's Python DiLoCo (ddpkit.diloco over ddpkit.ft.Manager): the same
    model, data order, inner AdamW and outer SGD(Nesterov) settings; --codec and --fragments choose
    its wire format and Streaming fragments (the model's blocks, strided). The timed span covers
    start() (the first quorum) to finish() (the last fragment applied)."""
    import torch.distributed as dist
    import ddpkit.diloco
    import ddpkit.ft

    (train_x, train_y), (test_x, test_y) = text_split(args.text_dir, args.seq_len)
    shard = torch.arange(args.group, train_x.size(0), args.groups)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    store = dist.TCPStore(args.host, 0, 1, True, wait_for_workers=False)  # the site's own world of one rank
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    manager = ddpkit.ft.Manager(lighthouse=args.lighthouse, group_id=f"site_{args.group}",
                                quorum_timeout=args.timeout_s, cross_group_timeout=args.timeout_s,
                                cross_gloo_threads=4)
    fragments = 1 if args.fragments == 1 else _gpt_fragments(model, args.fragments)
    diloco = ddpkit.diloco.DiLoCo(manager, model, inner, args.diloco, fragments=fragments, outer_lr=args.outer_lr,
                                  outer_momentum=args.outer_momentum, codec=args.codec,
                                  fragment_delay=args.fragment_delay)
    start = time.perf_counter()
    with diloco:
        inner_steps(args, model, inner, train_x, train_y, shard)  # DiLoCo's post hook syncs on its schedule
    train_s = time.perf_counter() - start
    diloco.load_global_parameters()
    d, m = diloco.stats(), manager.stats()
    print(json.dumps({"replica_group": args.group, "steps_run": args.steps, "train_seconds": train_s,
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "fragment_parameters": [sum(p.numel() for p in f) for f in diloco.fragments],
                      "outer_codec": args.codec, "outer_syncs": d["outer_syncs"], "sync_retries": d["sync_retries"],
                      "sync_wait_seconds": d["sync_wait_seconds"], "sync_transfer_seconds": d["sync_transfer_seconds"],
                      "cross_bytes_sent": m["cross_bytes_sent"],
                      "cross_bytes_per_step": m["cross_bytes_sent"] / args.steps,
                      "test_loss": test_loss(model, test_x, test_y)}), flush=True)
    diloco.close()


def _gpt_fragments(model, count):
    """Streaming DiLoCo's fragments of the Gpt: each block a layer, the embeddings and the head layers
    of their own, strided over `count` fragments (ddpkit train --fragments does the same)."""
    import ddpkit.diloco
    layers = [list(model.tokens.parameters()) + list(model.positions.parameters())]
    layers += [list(b.parameters()) for b in model.blocks]
    layers.append(list(model.ln_f.parameters()) + list(model.head.parameters()))
    return ddpkit.diloco.fragments_of(layers, count, "strided")


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
    ap.add_argument("--pg", choices=["gloo", "ddpkit", "native-gloo", "native-ddpkit"], default="gloo")
    ap.add_argument("--native-store", default="", help="--pg native-gloo: HOST:PORT of the TCPStore every group shares")
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
    ap.add_argument("--timeout-s", type=float, default=60, help="the Manager's and the group's timeouts (torchft's default)")
    ap.add_argument("--diloco", type=int, default=0, help="H: one site of torchft's DiLoCo (0: off)")
    ap.add_argument("--host", default="127.0.0.1", help="--diloco: the address other sites reach this one at")
    ap.add_argument("--lr", type=float, default=1e-3, help="--diloco: the inner AdamW's")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--text-dir", default="/usr/share/games/fortunes")
    ap.add_argument("--impl", choices=["torchft", "ddpkit"], default="torchft",
                    help="--diloco: whose DiLoCo (ddpkit: ddpkit's Python API, its lighthouse at --lighthouse)")
    ap.add_argument("--codec", default="fp32", help="--impl ddpkit: the pseudo-gradients' wire format")
    ap.add_argument("--fragments", type=int, default=1, help="--impl ddpkit: Streaming DiLoCo's fragments")
    ap.add_argument("--fragment-delay", type=int, default=0, help="--impl ddpkit: Streaming DiLoCo's tau")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every group starts from the same parameters (torchft also syncs them)
    model = Gpt(args.d_model, args.heads, args.layers, args.seq_len)
    if args.plain:
        plain(args, model)
    elif args.diloco:
        (ddpkit_diloco if args.impl == "ddpkit" else diloco)(args, model)
    else:
        fault_tolerant(args, model)


if __name__ == "__main__":
    sys.exit(main())
