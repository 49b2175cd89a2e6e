"""Each ddpkit hook on PyTorch's DistributedDataParallel gives bit for bit the gradients the same
hook gives on ddpkit's C++ DistributedDataParallel: same model, data, buckets and steps (the C++
side is ddp_peer.cpp), over 4 hooked steps so error feedback and PowerSGD's warm start are
exercised.

The hook is registered after one step of DDP's built-in allreduce, on both sides. In that first
step PyTorch (>= 1.11, without find_unused_parameters) puts every parameter in one bucket in
registration order, while ddpkit's C++ DDP starts from buckets in reverse registration order;
both then rebuild them in gradient-ready order, identically. Hooks whose result depends on where
a bucket's blocks fall (int8, quantize_per_channel) would otherwise differ in that first step."""
import os
import subprocess
import tempfile

import torch

import ddpkit
from conftest import build_binary, free_port, run_ranks
from workloads import ddp, train

DIMS = [128, 1024, 512, 10]  # 2.6 MB of fp32 parameters: a 1 MiB first bucket, then 0.25 MB ones
STEPS = 5
BUCKET_CAP_MB = 0.25
HOOKS = [
    ("allreduce", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("fp16_wrapper", {}),
    ("bf16_wrapper", {}),
    ("noop", {}),
    ("int8", {"block": 256, "error_feedback": True}),
    ("quantize_per_tensor", {}),
    ("quantize_per_channel", {"bucket_size": 128}),
    ("powersgd", {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}),
    ("batched_powersgd", {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2, "use_error_feedback": False}),
]


def _spec(name, options):
    return name + (":" + ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in options.items())
                   if options else "")


def _python_ranks(rank, world):
    out = {}
    for name, options in HOOKS:
        model = ddp(DIMS, bucket_cap_mb=BUCKET_CAP_MB)

        def register(step, model=model, name=name, options=options):
            if step == 0:
                ddpkit.register_comm_hook(model, name, **options)

        out[name] = torch.stack(train(model, DIMS, STEPS, rank, after_step=register))
        out[name + ".buckets"] = len(model._ddpkit_hook_state.bucket_traffic())
    return out


def _cpp_ranks(world, out_dir):
    peer = build_binary("DDPKIT_DDP_PEER")
    port = free_port()
    cmd = [peer, "--dims", ",".join(map(str, DIMS)), "--steps", str(STEPS), "--batch", "16", "--lr", "0.1",
           "--bucket-cap-mb", str(BUCKET_CAP_MB), "--out", out_dir]
    for name, options in HOOKS:
        cmd += ["--hook", _spec(name, options)]
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for r, p in enumerate(procs):
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"ddp_peer rank {r} exited {p.returncode}:\n{output}"


def test_hooks_on_pytorch_ddp_match_ddpkit_cpp_ddp():
    world = 2
    python = run_ranks(_python_ranks, world)
    with tempfile.TemporaryDirectory() as d:
        _cpp_ranks(world, d)
        mismatched = []
        for name, _ in HOOKS:
            assert python[0][name + ".buckets"] >= 2, f"{name}: the model should span several buckets"
            for r in range(world):
                with open(os.path.join(d, f"{name}.rank{r}.bin"), "rb") as f:
                    cpp = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
                py = python[r][name].reshape(-1)
                assert cpp.numel() == py.numel(), f"{name}: C++ wrote {cpp.numel()} gradients, Python {py.numel()}"
                if not torch.equal(cpp, py):
                    diff = (cpp - py).abs().max().item()
                    mismatched.append(f"{name} rank {r}: max |C++ - Python| = {diff:.3g}")
    assert not mismatched, "gradients differ from ddpkit's C++ DDP:\n" + "\n".join(mismatched)
