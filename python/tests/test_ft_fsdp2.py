"""ddpkit.ft.Manager over torch FSDP2 (fully_shard) with the async quorum: two replica groups of two
ranks each (HSDP: FSDP2 inside a group, the Manager across), the model and AdamW registered with
register_state_dict as torch gives them (DTensors). One group is SIGKILLed mid-run and started
again: the survivors go on without waiting for its heal, and it copies their state while it
trains, from a snapshot its source took at a step boundary (torchft's async quorum exports the state
dict on its quorum thread while FSDP2 reshards inside forward: "mixed Tensor and DTensor"). Every
group ends with the same shards, rank by rank.

fully_shard runs on CPU from torch 2.7 on (test_fsdp2.py)."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from conftest import TORCH_MINOR, free_port

import ddpkit  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not hasattr(ddpkit._C, "ft"), reason="needs a build with fault tolerance (gRPC)"),
    pytest.mark.skipif(TORCH_MINOR < (2, 7), reason="fully_shard runs on CPU from torch 2.7"),
]

STEPS = 90

# One rank of replica group GROUP (a torch world of its own): prints "step N" as it commits; saves
# its local shards and the Manager's figures to OUT.
WORKER = textwrap.dedent("""
    import datetime, sys, time, torch, torch.distributed as dist, ddpkit.ft
    from torch.distributed.fsdp import fully_shard
    lighthouse, group, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    torch.manual_seed(100 + group)  # seeded apart: the first quorum makes them one
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(steps, 8, 16, generator=torch.Generator().manual_seed(1))
    with ddpkit.ft.Manager(lighthouse=lighthouse, group_id=f"g{group}", heartbeat_interval=0.05) as manager:
        manager.register_state_dict("model", model.state_dict, model.load_state_dict, scope="shared_per_rank")
        manager.register_state_dict("optimizer", opt.state_dict, opt.load_state_dict, scope="shared_per_rank")
        while True:
            manager.start_step()
            if manager.step >= steps:
                break
            x = data[manager.step][group * 4 + rank * 2:group * 4 + rank * 2 + 2]
            model(x).pow(2).mean().backward()
            manager.allreduce_gradients(model)
            if manager.should_commit():
                opt.step()
            opt.zero_grad()
            print(f"step {manager.step}", flush=True)
            time.sleep(0.05)  # paced: a kill lands mid-run
    shards = [p.to_local().detach().clone() for p in model.parameters()]
    torch.save({"shards": shards, "stats": manager.stats()}, out)
""")


def start_group(tmp_path, address, group, attempt):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   OMP_NUM_THREADS="1", USE_LIBUV="0")
        procs.append(subprocess.Popen([sys.executable, str(script), address, str(group), str(STEPS),
                                       str(tmp_path / f"g{group}r{rank}.pt")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    lines = [[] for _ in procs]
    for p, sink in zip(procs, lines):
        threading.Thread(target=lambda p=p, sink=sink: [sink.append(l) for l in p.stdout], daemon=True).start()
    return procs, lines


def last_step(lines):
    steps = [int(l.split()[1]) for l in list(lines) if l.startswith("step ")]
    return steps[-1] if steps else -1


def test_an_fsdp2_group_killed_under_the_async_quorum_heals_while_the_others_train(tmp_path):
    import ddpkit.ft
    with ddpkit.ft.Lighthouse("127.0.0.1:0", expected_groups=2, heartbeat_timeout=1.0) as lighthouse:
        g0, g0_lines = start_group(tmp_path, lighthouse.address, 0, 0)
        g1, g1_lines = start_group(tmp_path, lighthouse.address, 1, 0)
        try:
            deadline = time.monotonic() + 120
            while last_step(g1_lines[0]) < 10:
                assert time.monotonic() < deadline, "group 1 did not train:\n" + "".join(g1_lines[0])[-3000:]
                assert g0[0].poll() is None, "group 0 ended early:\n" + "".join(g0_lines[0])[-3000:]
                time.sleep(0.05)
            for p in reversed(g1):  # a rank dies, then the rest of its group, as torchrun's agent stops it
                p.send_signal(signal.SIGKILL)
                p.wait()
            killed_at = last_step(g0_lines[0])
            g1, g1_lines = start_group(tmp_path, lighthouse.address, 1, 1)
            for p, lines in zip(g0 + g1, g0_lines + g1_lines):
                p.wait(timeout=180)
                assert p.returncode == 0, "".join(lines)[-3000:]
        finally:
            for p in g0 + g1:
                if p.poll() is None:
                    p.kill()
    assert killed_at < STEPS - 10, f"group 0 was at step {killed_at} of {STEPS} when group 1 died: nothing left to heal into"
    ends = {(g, r): torch.load(tmp_path / f"g{g}r{r}.pt") for g in (0, 1) for r in (0, 1)}
    for r in (0, 1):
        for a, b in zip(ends[(0, r)]["shards"], ends[(1, r)]["shards"]):
            assert torch.equal(a, b), f"rank {r}: the groups' shards differ"
        survivor, healed = ends[(0, r)]["stats"], ends[(1, r)]["stats"]
        assert survivor["steps_not_committed"] <= 1 and survivor["steps_healing"] == 0, survivor
        assert survivor["snapshot_seconds"] > 0, f"group 0 served no snapshot: {survivor}"
        assert healed["heals"] + healed["init_syncs"] == 1 and healed["steps_healing"] >= 1, healed
