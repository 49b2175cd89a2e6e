"""Ray Train on ddpkit, for test_ray_train.py (and by hand): a local Ray cluster, then

    python ray_train_job.py backend OUT.json     TorchTrainer, TorchConfig(backend="ddpkit"), 2 CPU workers:
                                                 DDP trains an MLP, each rank on its own data
    python ray_train_job.py cli DDPKIT DIR       TorchTrainer (Ray's own Gloo group) whose workers each run
                                                 `ddpkit train` (a subprocess: Ray's variables)

Each writes what the ranks saw; the test checks it.
"""
import json
import os
import subprocess
import sys

import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer


def train_on_backend(config):
    import torch.distributed as dist
    import ray.train
    import ray.train.torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model = ray.train.torch.prepare_model(model)  # DistributedDataParallel on CPU
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for _ in range(config["steps"]):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    group = dist.distributed_c10d._get_default_group()
    info = {"rank": rank, "world": world, "backend": dist.get_backend(),
            "ddp_backend": type(group._get_backend(torch.device("cpu"))).__module__,
            "ranks_agree": all(torch.equal(t, gathered[0]) for t in gathered),
            "moved": (flat - torch.cat([p.reshape(-1) for p in _initial()])).abs().max().item()}
    with open(config["out"] + f".{rank}", "w") as f:
        json.dump(info, f)


def _initial():
    torch.manual_seed(0)
    return list(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).parameters())


def run_ddpkit_train(config):
    import ray.train
    rank = ray.train.get_context().get_world_rank()
    env = {k: v for k, v in os.environ.items()}
    p = subprocess.run([config["ddpkit"]] + config["flags"] + ["--checkpoint-dir", config["dir"]], env=env,
                       capture_output=True, text=True, timeout=300)
    with open(os.path.join(config["dir"], f"rank{rank}.log"), "w") as f:
        json.dump({"rank": rank, "returncode": p.returncode, "stderr": p.stderr[-3000:],
                   "env": {k: env.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                                   "ACCELERATE_TORCH_DEVICE")}}, f)
    if p.returncode != 0:
        raise RuntimeError(f"ddpkit train on Ray worker {rank} exited {p.returncode}:\n{p.stderr[-2000:]}")


def main():
    mode = sys.argv[1]
    # Ray imports no plugin for a backend it does not know: each worker process registers ddpkit's as
    # it starts, before Ray calls init_process_group("ddpkit"). The hook is the job's (ray.init):
    # given in RunConfig(worker_runtime_env=...) it is not run (Ray 2.60: only ray.init uploads it).
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",  # Ray's services on loopback
             runtime_env={"worker_process_setup_hook": "ddpkit.register"})
    try:
        scaling = ScalingConfig(num_workers=2, use_gpu=False)
        storage = os.path.abspath(sys.argv[-1] if mode == "cli" else os.path.dirname(sys.argv[2]))
        if mode == "backend":
            trainer = TorchTrainer(
                train_on_backend, train_loop_config={"steps": 5, "out": os.path.abspath(sys.argv[2])},
                torch_config=TorchConfig(backend="ddpkit"), scaling_config=scaling,
                # Ray imports no plugin for a backend it does not know: each worker registers ddpkit's
                # as it starts, before Ray calls init_process_group("ddpkit").
                run_config=RunConfig(storage_path=os.path.join(storage, "ray"),
                                     worker_runtime_env={"worker_process_setup_hook": "ddpkit.register"}))
        else:
            flags = json.loads(os.environ["DDPKIT_RAY_TRAIN_FLAGS"])
            trainer = TorchTrainer(run_ddpkit_train,
                                   train_loop_config={"ddpkit": sys.argv[2], "flags": flags, "dir": storage},
                                   scaling_config=scaling, run_config=RunConfig(storage_path=os.path.join(storage, "ray")))
        trainer.fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
