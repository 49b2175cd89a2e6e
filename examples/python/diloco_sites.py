"""Streaming DiLoCo across sites with ddpkit's Python API, over a model of your own.

One torchrun job per site; the sites meet at a lighthouse:

    ddpkit lighthouse --address 0.0.0.0:29510 --min-replicas 1 --join-timeout-ms 60000 &
    torchrun --nproc-per-node 2 --master-port 29400 examples/python/diloco_sites.py --site 0 --sites 2 \
        --lighthouse 127.0.0.1:29510
    torchrun --nproc-per-node 2 --master-port 29401 examples/python/diloco_sites.py --site 1 --sites 2 \
        --lighthouse 127.0.0.1:29510

Kill a site and the others go on; start it again and it heals from a live one at the next sync.
(Debian's own PyTorch is built without libuv, which torchrun's store asks for: set USE_LIBUV=0 there.)
"""
import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

import ddpkit.diloco
import ddpkit.ft


def make_model(seed=0):
    torch.manual_seed(seed)  # sites seeded differently still start alike: the first quorum copies one site's
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 10))  # each Linear a layer: DiLoCo's fragments are layers


def make_data(samples=8192):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 32, generator=g)
    teacher = torch.randn(32, 10, generator=g)
    return x, (x @ teacher).argmax(1)


def batch(data, step, batch_size, share, shares):
    """This rank's batch at job step `step`: share `share` of `shares` of each epoch's permutation."""
    x, y = data
    epoch, i = divmod(step, x.shape[0] // shares // batch_size)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(epoch))[share::shares]
    idx = perm[i * batch_size:(i + 1) * batch_size]
    return x[idx], y[idx]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--site", type=int, required=True)
    p.add_argument("--sites", type=int, required=True, help="sites the data is shared among")
    p.add_argument("--steps", type=int, default=200, help="inner steps")
    p.add_argument("--sync-every", type=int, default=20, help="H: a multiple of --fragments")
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--codec", default="fp32", choices=ddpkit.diloco.codec_names())
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0,
                   help="the model's seed; -1: the site's number (as separate jobs seeding themselves would)")
    p.add_argument("--step-seconds", type=float, default=0, help="pace each inner step (to kill a site by hand)")
    p.add_argument("--out", help="rank 0 saves the final parameters and figures here")
    return p.parse_args(argv)


def train(args, after_step=None):
    """One site rank's run; after_step(diloco, model), if given, is called after each inner step."""
    dist.init_process_group("gloo")  # this site's ranks (torchrun's environment)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = make_model(args.site if args.seed < 0 else args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = make_data()
    # Leaving the block closes the Manager: the site leaves the job and everything is freed at once.
    with ddpkit.ft.Manager(lighthouse=args.lighthouse, group_id=f"site-{args.site}") as manager:
        diloco = ddpkit.diloco.DiLoCo(manager, model, optimizer, sync_every=args.sync_every, fragments=args.fragments,
                                      codec=args.codec, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
        steps_run, start = 0, time.perf_counter()
        with diloco:  # start(): the first quorum (a late site heals here); finish() on the way out
            while diloco.inner_steps < args.steps:
                # The site's ranks hold the same model: the site averages their gradients (its DDP).
                x, y = batch(data, diloco.inner_steps, args.batch_size, args.site * world + rank, args.sites * world)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                for param in model.parameters():
                    dist.all_reduce(param.grad)
                    param.grad /= world
                optimizer.step()  # DiLoCo syncs in the step's hook, on its schedule
                optimizer.zero_grad()
                time.sleep(args.step_seconds)
                steps_run += 1
                if rank == 0:
                    print(f"site {args.site} step {diloco.inner_steps} loss {loss.item():.4f}", flush=True)
                if after_step:
                    after_step(diloco, model)
        train_seconds = time.perf_counter() - start
        diloco.load_global_parameters()  # the model the sites agree on
        if rank == 0:
            report = {"site": args.site, "inner_steps": diloco.inner_steps, "steps_run": steps_run,
                      "outer_steps": diloco.outer_steps, "train_seconds": train_seconds, "diloco": diloco.stats(),
                      "manager": manager.stats()}
            print(json.dumps(report), flush=True)
            if args.out:
                torch.save({"params": [p.detach().clone() for p in model.parameters()], "report": report}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        train(parse_args())
    except ddpkit.ft.JobFinished as e:  # started again after every site finished: nothing left to do
        print(f"diloco_sites.py: {e}", file=sys.stderr)
