"""Ray Train for real (ray 2.60 pinned): a local Ray cluster of 2 CPU workers.

1. TorchTrainer with TorchConfig(backend="ddpkit"): each worker registers the backend as it starts
   (worker_process_setup_hook "ddpkit.register"), Ray initializes the group on it, DDP trains; the
   ranks' parameters must agree bit for bit and have moved.
2. TorchTrainer whose workers run `ddpkit train` as a subprocess (Ray's variables): it must end
   with the parameters `ddpkit train --nproc 2` ends with, bit for bit.
"""
import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import TESTS, build_binary

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(TESTS)), "tests"))
from checkpoint_resume import ckpt, differences  # noqa: E402

# A skip mark, not importorskip: a module skipped whole collects nothing, which ctest counts as a failure.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="Ray Train is not installed (scripts/pip-torch-env.sh pins ray[train] 2.60.0)")

STEPS = 40
FLAGS = ["train", "--dataset", "synthetic", "--mlp-dims", "64,256,10", "--synthetic-size", "1024", "--batch-size", "32",
         "--epochs", "100", "--steps", str(STEPS), "--checkpoint-every", str(STEPS), "--no-eval", "--quiet",
         "--timeout-s", "60"]


def _run(args, tmp_path, env=None):
    p = subprocess.run([sys.executable, os.path.join(TESTS, "ray_train_job.py")] + args, cwd=tmp_path,
                       env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **(env or {})), capture_output=True,
                       text=True, timeout=400)
    assert p.returncode == 0, f"the Ray job failed ({p.returncode}):\n{(p.stdout + p.stderr)[-5000:]}"


def test_torch_trainer_on_the_ddpkit_backend(tmp_path):
    out = tmp_path / "ranks.json"
    _run(["backend", str(out)], tmp_path)
    ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
    print(ranks)
    for r, info in enumerate(ranks):
        assert info["rank"] == r and info["world"] == 2 and info["backend"] == "ddpkit", info
        assert info["ddp_backend"] == "ddpkit._C", info  # the group's CPU backend is ddpkit's
        assert info["ranks_agree"] and info["moved"] > 1e-4, info


def test_ray_launches_ddpkit_train(tmp_path):
    ddpkit = build_binary("DDPKIT_CLI")
    ref = tmp_path / "ref"
    subprocess.run([ddpkit] + FLAGS + ["--nproc", "2", "--checkpoint-dir", str(ref)], check=True,
                   capture_output=True, timeout=300)
    d = tmp_path / "ray"
    d.mkdir()
    _run(["cli", ddpkit, str(d)], tmp_path, env={"DDPKIT_RAY_TRAIN_FLAGS": json.dumps(FLAGS)})
    logs = [json.load(open(f)) for f in sorted(glob.glob(str(d / "rank*.log")))]
    print([(log["rank"], log["env"]) for log in logs])
    assert len(logs) == 2 and all(log["returncode"] == 0 for log in logs), logs
    assert any("launched by ray-train" in log["stderr"] for log in logs), [log["stderr"][-500:] for log in logs]
    assert not differences(ckpt(str(ref), STEPS), ckpt(str(d), STEPS)), "Ray's ddpkit train differs from --nproc 2"
