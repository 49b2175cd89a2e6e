"""ddpkit.ft and ddpkit.diloco on a user's own model: examples/python/diloco_sites.py run as its
users run it, one process per site rank, against `ddpkit lighthouse`.

- H=1, outer lr 1, momentum 0 is DDP across the sites: the parameters match a reference that
  averages both sites' gradients each step.
- A site SIGKILLed mid-round: the survivors run every inner step (none lost, none redone) and end
  bit-identical; the site started again heals from a live one and ends identical too.
- Streaming DiLoCo: fragments over the model's layers, int4 on the wire."""
import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "python", "diloco_sites.py")
CLI = os.environ.get("DDPKIT_CLI")
pytestmark = pytest.mark.skipif(not CLI or not hasattr(__import__("ddpkit")._C, "ft"),
                                reason="needs the ddpkit CLI (DDPKIT_CLI) and a build with fault tolerance")


def example():
    spec = importlib.util.spec_from_file_location("diloco_sites", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Lighthouse:
    """`ddpkit lighthouse` for `sites` sites that start together (the first quorum waits for all)."""

    def __init__(self, sites):
        self.proc = subprocess.Popen([CLI, "lighthouse", "--address", "127.0.0.1:0", "--join-timeout-ms", "60000",
                                      "--expected-groups", str(sites), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()
        assert "listening on " in line, line
        self.address = line.split("listening on ")[1].split()[0]

    def close(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


@pytest.fixture
def lighthouse(request):
    lh = Lighthouse(request.param)
    yield lh.address
    lh.close()


def start_site(lighthouse, site, sites, out, *args):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1",
               USE_LIBUV="0")  # Debian 13's torch 2.6 has no libuv TCPStore
    return subprocess.Popen([sys.executable, EXAMPLE, "--lighthouse", lighthouse, "--site", str(site), "--sites",
                             str(sites), "--out", str(out), *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=240):
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, output[-4000:]
    return output


@pytest.mark.parametrize("lighthouse", [2], indirect=True)
def test_h1_outer_lr_1_momentum_0_is_ddp_across_sites(lighthouse, tmp_path):
    args = ["--steps", 12, "--sync-every", 1, "--outer-lr", 1, "--outer-momentum", 0, "--lr", 0.05]
    procs = [start_site(lighthouse, s, 2, tmp_path / f"site{s}.pt", *args) for s in range(2)]
    for p in procs:
        finish(p)
    ex = example()
    model, data = ex.make_model(), ex.make_data()
    for step in range(12):
        grads = []
        for share in range(2):
            model.zero_grad()
            x, y = ex.batch(data, step, 32, share, 2)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= 0.05 * (grads[0][i] + grads[1][i]) / 2
    for s in range(2):
        got = torch.load(tmp_path / f"site{s}.pt")["params"]
        for mine, ref in zip(got, model.parameters()):
            assert torch.allclose(mine, ref, atol=1e-6), (mine - ref).abs().max()


@pytest.mark.parametrize("lighthouse", [3], indirect=True)
def test_site_killed_mid_round_loses_no_survivor_steps_and_heals_when_back(lighthouse, tmp_path):
    steps, h = 400, 20
    args = ["--steps", steps, "--sync-every", h, "--step-seconds", 0.02]
    procs = [start_site(lighthouse, s, 3, tmp_path / f"site{s}.pt", *args) for s in range(3)]
    victim = procs[2]
    for line in victim.stdout:  # mid-round: between the syncs after steps 40 and 60
        if line.startswith("site 2 step 50 "):
            victim.kill()
            break
    victim.wait()
    restarted = start_site(lighthouse, 2, 3, tmp_path / "site2.pt", *args)
    for p in procs[:2] + [restarted]:
        finish(p)
    results = [torch.load(tmp_path / f"site{s}.pt") for s in range(3)]
    for r in results[:2]:
        assert r["report"]["steps_run"] == steps and r["report"]["inner_steps"] == steps, r["report"]
        assert r["report"]["diloco"]["checksum_mismatches"] == 0
    back = results[2]["report"]
    assert back["diloco"]["heals"] >= 1 and back["steps_run"] < steps and back["inner_steps"] == steps, back
    for r in results[1:]:
        for a, b in zip(results[0]["params"], r["params"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("lighthouse", [2], indirect=True)
def test_streaming_fragments_over_the_layers_with_int4(lighthouse, tmp_path):
    args = ["--steps", 24, "--sync-every", 6, "--fragments", 3, "--codec", "int4"]
    procs = [start_site(lighthouse, s, 2, tmp_path / f"site{s}.pt", *args) for s in range(2)]
    for p in procs:
        finish(p)
    results = [torch.load(tmp_path / f"site{s}.pt") for s in range(2)]
    for r in results:
        # Every 6 / 3 = 2 inner steps one of the 3 fragments (the model's 3 Linear layers) syncs.
        assert r["report"]["outer_steps"] == 4 and r["report"]["diloco"]["syncs"] >= 12, r["report"]
        assert r["report"]["diloco"]["checksum_mismatches"] == 0
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
