"""ddpkit.ft.Manager in a user's own loop: the commit protocol across two replica groups (each a
process of its own torch.distributed world) at a ddpkit.ft.Lighthouse in the test's process, the
state it carries, and its checkpoints."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import free_port

import ddpkit  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(ddpkit._C, "ft"), reason="needs a build with fault tolerance (gRPC)")

# One rank of replica group GROUP: the model and data are seeded alike everywhere; group g reads
# rows g, g + 2, ... of each batch of 8. Prints nothing; saves its parameters and figures to OUT.
WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, ddpkit.ft
    lighthouse, group, steps, out, ckpt, resume = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \\
        sys.argv[5], sys.argv[6] == "1"
    lazy = sys.argv[7] == "1"
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    manager = ddpkit.ft.Manager(lighthouse=lighthouse, group_id=f"g{group}", cross_lazy_connections=lazy)
    manager.register_state_dict("model", model.state_dict, model.load_state_dict)
    manager.register_state_dict("optimizer", opt.state_dict, opt.load_state_dict)
    if resume:
        assert manager.restore_checkpoint(ckpt) == 3, "no checkpoint of step 3"
    while True:
        manager.start_step()
        if manager.step >= steps:
            break
        x = data[manager.step * 8:(manager.step + 1) * 8][group::2]
        model(x).pow(2).mean().backward()
        manager.allreduce_gradients(model)
        if manager.should_commit():
            opt.step()
            if ckpt and not resume and manager.step == 3 and manager.replica_rank == 0:
                manager.save_checkpoint(ckpt)
        opt.zero_grad()
    torch.save({"params": [p.detach() for p in model.parameters()], "stats": manager.stats(),
                "replica_count": manager.replica_count}, out)
""")


def reference(steps):
    """The same steps with both groups' gradients averaged in one process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        grads = []
        for g in range(2):
            opt.zero_grad()
            model(data[step * 8:(step + 1) * 8][g::2]).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, a, b in zip(model.parameters(), *grads):
            p.grad = (a + b) / 2
        opt.step()
    return [p.detach() for p in model.parameters()]


def run_groups(tmp_path, address, groups, steps, ckpt="", resume=False, lazy=False):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = []
    for g in groups:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                   OMP_NUM_THREADS="1", USE_LIBUV="0")  # Debian 13's torch 2.6: no libuv
        if lazy:
            env["DDPKIT_SHM"] = "0"  # the groups as on hosts of their own: the cross group over Gloo
        procs.append(subprocess.Popen([sys.executable, str(script), address, str(g), str(steps),
                                       str(tmp_path / f"g{g}.pt"), ckpt, "1" if resume else "0", "1" if lazy else "0"],
                                      env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out[-3000:]
    return [torch.load(tmp_path / f"g{g}.pt") for g in groups]


def test_two_groups_train_as_one_ddp_and_a_checkpoint_resumes_them(tmp_path):
    import ddpkit.ft
    # In this process: every quorum holds both groups (each run's groups train as one).
    with ddpkit.ft.Lighthouse("127.0.0.1:0", min_replicas=2) as lighthouse:
        address = lighthouse.address
        ckpt = str(tmp_path / "ckpt")
        results = run_groups(tmp_path, address, [0, 1], 6, ckpt)
        ref = reference(6)
        for r in results:
            assert r["replica_count"] == 2 and r["stats"]["steps_committed"] == 6, r["stats"]
            for mine, want in zip(r["params"], ref):
                assert torch.allclose(mine, want, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))
        # Both groups start again from the step-3 checkpoint (group 0 wrote it; each reads it).
        again = run_groups(tmp_path, address, [0, 1], 6, ckpt, resume=True)
        for r in again:
            assert r["replica_count"] == 2 and r["stats"]["steps_committed"] == 3, r["stats"]
            assert all(torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"]))
        assert lighthouse.quorums_formed >= 2
        rounds = lighthouse.round_times  # every quorum formed is one round, steady or whole
        assert rounds["rounds"] + rounds["whole_rounds"] == lighthouse.quorums_formed, rounds
        assert 0 <= rounds["replies_p50_ms"] <= rounds["replies_max_ms"], rounds


def test_cross_groups_that_connect_lazily_train_the_same(tmp_path):
    import ddpkit.ft
    with ddpkit.ft.Lighthouse("127.0.0.1:0", min_replicas=2) as lighthouse:
        results = run_groups(tmp_path, lighthouse.address, [0, 1], 4, lazy=True)
    ref = reference(4)
    for r in results:
        assert r["stats"]["cross_transport"].startswith("gloo (pairs connected on demand)"), r["stats"]
        assert r["stats"]["steps_committed"] == 4, r["stats"]
        for mine, want in zip(r["params"], ref):
            assert torch.allclose(mine, want, atol=1e-6)
