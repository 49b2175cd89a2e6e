"""ddpkit.ft and ddpkit.diloco on a user's own model: examples/python/diloco_sites.py run as its
users run it, one process per site rank, against `ddpkit lighthouse`.

- H=1, outer lr 1, momentum 0 is DDP across the sites: the parameters match a reference that
  averages both sites' gradients each step.
- A site SIGKILLed mid-round: the survivors run every inner step (none lost, none redone) and end
  bit-identical; the site started again heals from a live one and ends identical too.
- Streaming DiLoCo: fragments over the model's layers, int4 on the wire.
- Sites seeded differently start from the first site's model (init sync) and end bit-identical to
  sites seeded alike; a site whose global parameters are corrupted mid-run is named and healed.
- A site's Manager closes within 100 ms of its last step (everything of ddpkit freed), and its
  process exits within 300 ms more than the same loop without ddpkit takes to exit here.
- A site killed, and started again after the survivors have finished, is told the job is done."""
import importlib.util
import io
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "python", "diloco_sites.py")
SITE = os.path.join(ROOT, "python", "tests", "diloco_site.py")  # the example with the tests' hooks
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


def start_site(lighthouse, site, sites, out, *args, script=EXAMPLE):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1",
               USE_LIBUV="0")  # Debian 13's torch 2.6 has no libuv TCPStore
    return subprocess.Popen([sys.executable, script, "--lighthouse", lighthouse, "--site", str(site), "--sites",
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
        assert r["report"]["outer_steps"] == 4 and r["report"]["diloco"]["outer_syncs"] >= 12, r["report"]
        assert r["report"]["diloco"]["checksum_mismatches"] == 0
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


# ---- sites that start apart, a corrupted site, the end of a job ---------------------------------

RUN = ["--steps", 120, "--sync-every", 20]


class Site:
    """A site process of diloco_site.py whose output is read on a thread and whose exit time (on the
    monotonic clock the processes share) is taken as it happens."""

    def __init__(self, lighthouse, site, sites, out, *args):
        self.proc = start_site(lighthouse, site, sites, out, *args, script=SITE)
        self.lines, self.exited = [], None
        self.reader = threading.Thread(target=self._read)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
        self.proc.wait()
        self.exited = time.monotonic()

    def wait(self, timeout=240):
        self.reader.join(timeout)
        assert self.exited is not None, "".join(self.lines)[-3000:]
        assert self.proc.returncode == 0, "".join(self.lines)[-4000:]
        return "".join(self.lines)

    def clock(self, what):
        return float(next(line for line in self.lines if line.startswith(what)).split()[-1])


def run_sites_of(tmp_path, name, sites, *args, corrupt=None):
    lh = Lighthouse(sites)
    try:
        procs = [Site(lh.address, s, sites, tmp_path / f"{name}{s}.pt", *args,
                      *(["--corrupt-at", corrupt[1]] if corrupt and corrupt[0] == s else [])) for s in range(sites)]
        for p in procs:
            p.wait()
    finally:
        lh.close()
    return procs, [torch.load(tmp_path / f"{name}{s}.pt") for s in range(sites)]


def loss_of(params):
    ex = example()
    model = ex.make_model()
    with torch.no_grad():
        for p, q in zip(model.parameters(), params):
            p.copy_(q)
        x, y = ex.make_data()
        return torch.nn.functional.cross_entropy(model(x), y).item()


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """3 sites seeded alike, nothing done to them: the reference run."""
    return run_sites_of(tmp_path_factory.mktemp("undisturbed"), "site", 3, *RUN)


def test_sites_seeded_differently_end_bit_identical_to_sites_seeded_alike(undisturbed, tmp_path):
    _, reference = undisturbed
    _, results = run_sites_of(tmp_path, "seeded", 3, *RUN, "--seed", -1)  # each site seeds with its number
    for s, r in enumerate(results):
        assert r["report"]["manager"]["init_syncs"] == (0 if s == 0 else 1), r["report"]["manager"]
        assert r["report"]["diloco"]["checksum_mismatches"] == 0 and r["report"]["diloco"]["heals"] == 0, r["report"]
        for a, b in zip(r["params"], reference[0]["params"]):
            assert torch.equal(a, b), f"site {s} differs from the undisturbed run"


def test_a_site_whose_global_parameters_are_corrupted_is_named_and_healed(undisturbed, tmp_path):
    _, reference = undisturbed
    procs, results = run_sites_of(tmp_path, "corrupt", 3, *RUN, corrupt=(2, 50))
    for s, (p, r) in enumerate(zip(procs, results)):
        d = r["report"]["diloco"]
        assert d["checksum_mismatches"] == 1 and d["heals"] == (1 if s == 2 else 0), d
        assert "the global parameters of [site-2] differed from the other sites'" in d["last_checksum_mismatch"], d
        assert "ddpkit DiLoCo: site site-" in p.wait()  # said on stderr too, not only counted
        for a, b in zip(r["params"], results[0]["params"]):
            assert torch.equal(a, b), f"site {s} ended apart from site 0"
    # Site 2's pseudo-gradient of one round is left out: the loss is the undisturbed run's within 2 %.
    disturbed, clean = loss_of(results[0]["params"]), loss_of(reference[0]["params"])
    assert abs(disturbed - clean) <= 0.02 * clean, (disturbed, clean)


# The same program without ddpkit's Manager and DiLoCo: the example's model, data and inner steps,
# then exit. What a process like a site takes to exit when nothing of ddpkit is left in it: Python's
# and torch's own teardown (0.1-0.5 s a process on this 2-core VM, by torch version).
PLAIN_SITE = """
import importlib.util, sys, time, torch
spec = importlib.util.spec_from_file_location("diloco_sites", sys.argv[1])
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)
torch.set_num_threads(1)
model, data = ex.make_model(), ex.make_data()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(120):
    x, y = ex.batch(data, step, 32, 0, 3)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
print(time.monotonic(), flush=True)
"""


def plain_exit_seconds(processes):
    """How long `processes` such plain processes, exiting together as the sites do, take to exit
    after their last step: the median over three tries of each process."""
    took = []
    for _ in range(3):
        ps = [subprocess.Popen([sys.executable, "-c", PLAIN_SITE, EXAMPLE], stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1")) for _ in range(processes)]
        printed = [float(p.stdout.readline()) for p in ps]
        for p, t in zip(ps, printed):
            p.wait()
            took.append(time.monotonic() - t)
    return statistics.median(took)


def test_a_site_closes_within_100_ms_of_its_last_step(undisturbed):
    procs, _ = undisturbed
    floor = plain_exit_seconds(len(procs))
    after = [1000 * (p.clock("closed at") - p.clock("last step done at")) for p in procs]
    exits = [1000 * (p.exited - p.clock("last step done at")) for p in procs]
    print(f"last step -> closed: {[round(a) for a in after]} ms, -> exited: {[round(e) for e in exits]} ms; "
          f"{len(procs)} processes of the same loop without ddpkit exiting together: {1000 * floor:.0f} ms")
    for closed in after:
        # Everything after the last step: finish, the report and its file, Manager.close (the site
        # leaves, threads and sockets freed), destroy_process_group.
        assert closed < 100, f"closed {closed:.0f} ms after the last step"
    # Then the interpreter's and torch's teardown: 0.1-0.5 s a process here by torch version, so the
    # 100 ms target is ddpkit's part above. The whole exit is bounded against the same loop without
    # ddpkit (measured 0-170 ms more, by torch version: bench/results/ft-defects-2026-12-07.txt), so
    # a teardown held by ddpkit (the 1.1-3.2 s) fails here.
    assert statistics.median(exits) < 300 + 1000 * floor, \
        f"exited {exits} ms after the last step (without ddpkit: {1000 * floor:.0f} ms)"


def test_a_site_back_after_the_others_finished_is_told_the_job_is_done(tmp_path):
    lh = Lighthouse(2)
    try:
        args = ["--steps", 120, "--sync-every", 20, "--step-seconds", 0.01]
        survivor = Site(lh.address, 0, 2, tmp_path / "site0.pt", *args)
        victim = start_site(lh.address, 1, 2, tmp_path / "site1.pt", *args, script=SITE)
        for line in victim.stdout:
            if line.startswith("site 1 step 50 "):
                victim.kill()
                break
        victim.wait()
        survivor.wait()  # it finished alone and left: the job is over
        started = time.monotonic()
        back = Site(lh.address, 1, 2, tmp_path / "site1.pt", *args)
        output = back.wait()
        assert "nothing to do: ddpkit: lighthouse" in output and "the job has finished: groups [site-0] left after step" in output, output
        assert "site 1 step" not in output, "it trained on alone"
        print(f"the site back after the end exited {back.exited - started:.1f} s after it started")
        assert back.exited - started < 15, f"told after {back.exited - started:.1f} s"  # not a 60 s quorum timeout
    finally:
        lh.close()


def test_stats_keys_of_0_1_0_still_answer_naming_the_new_key():
    from ddpkit.diloco import _Stats
    stats = _Stats({"outer_syncs": 3, "sync_blocked_seconds": 0.25})
    with pytest.warns(DeprecationWarning, match=r"stats\(\)\['syncs'\] is deprecated: use \['outer_syncs'\]"):
        assert stats["syncs"] == 3
    with pytest.warns(DeprecationWarning, match="use \\['sync_blocked_seconds'\\]"):
        assert stats.get("blocked_seconds") == 0.25
    assert "syncs" not in stats
    saved = io.BytesIO()
    torch.save({"diloco": stats}, saved)  # a report holding it loads without ddpkit (weights_only, torch >= 2.6)
    saved.seek(0)
    back = torch.load(saved)["diloco"]
    assert type(back) is not _Stats and back == {"outer_syncs": 3, "sync_blocked_seconds": 0.25}
