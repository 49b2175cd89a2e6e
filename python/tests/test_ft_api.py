"""ddpkit.ft.Manager in a user's own loop: the commit protocol across two replica groups (each a
process of its own torch.distributed world) at a ddpkit.ft.Lighthouse in the test's process, the
state it carries, and its checkpoints."""
import os
import subprocess
import sys
import textwrap
import time

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
    lazy, seed_by_group = sys.argv[7] == "1", sys.argv[8] == "1"
    dist.init_process_group("gloo")
    torch.manual_seed(group if seed_by_group else 0)  # seeded apart: the first quorum makes them one
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    with ddpkit.ft.Manager(lighthouse=lighthouse, group_id=f"g{group}", cross_lazy_connections=lazy) as manager:
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


def run_groups(tmp_path, address, groups, steps, ckpt="", resume=False, lazy=False, seed_by_group=False):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = []
    for g in groups:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                   OMP_NUM_THREADS="1", USE_LIBUV="0")  # Debian 13's torch 2.6: no libuv
        if lazy:
            env["DDPKIT_SHM"] = "0"  # the groups as on hosts of their own: the cross group over Gloo
        procs.append(subprocess.Popen([sys.executable, str(script), address, str(g), str(steps),
                                       str(tmp_path / f"g{g}.pt"), ckpt, "1" if resume else "0", "1" if lazy else "0",
                                       "1" if seed_by_group else "0"],
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


def test_groups_seeded_differently_train_as_one_ddp_and_the_lighthouse_tells_its_events(tmp_path):
    import ddpkit.ft
    events = []
    with ddpkit.ft.Lighthouse("127.0.0.1:0", min_replicas=2, on_event=events.append) as lighthouse:
        results = run_groups(tmp_path, lighthouse.address, [0, 1], 6, seed_by_group=True)
    ref = reference(6)  # both groups' gradients averaged, from group 0's model (seed 0)
    for g, r in enumerate(results):
        assert r["stats"]["init_syncs"] == (1 if g == 1 else 0) and r["stats"]["heals"] == 0, r["stats"]
        for mine, want in zip(r["params"], ref):
            assert torch.allclose(mine, want, atol=1e-6), f"group {g} did not start from group 0's model"
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))
    assert events[0] == "quorum 0: groups [g0, g1]", events
    assert "group g0 left after step 6" in events and "group g1 left after step 6" in events, events
    assert any(e.startswith("job finished at step 6") for e in events), events


def test_an_unreachable_lighthouse_is_named_at_the_first_refusal():
    # A Manager given a port nothing listens on: it says so at once, and asks again until its
    # quorum timeout, then raises naming the lighthouse.
    script = textwrap.dedent("""
        import sys, torch.distributed as dist, ddpkit, ddpkit.ft
        dist.init_process_group("gloo")
        manager = ddpkit.ft.Manager(lighthouse=sys.argv[1], group_id="g0", quorum_timeout=3)
        try:
            manager.start_step()
        except ddpkit.CommError as e:
            print("raised:", e, file=sys.stderr, flush=True)
    """)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               OMP_NUM_THREADS="1", USE_LIBUV="0")
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-c", script, address], env=env, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append((time.monotonic(), line))
    proc.wait(timeout=60)
    told = [t for t, line in seen if f"the lighthouse at {address} cannot be reached" in line]
    raised = [t for t, line in seen if line.startswith("raised:") and address in line]
    assert len(told) == 1 and raised, seen
    print(f"told {told[0] - seen[0][0]:.2f} s after the first line, raised {raised[0] - told[0]:.2f} s after that")
    assert raised[0] - told[0] >= 2.5, seen  # told before the 3 s timeout ran out, not at its end


# A replica group that steps every 50 ms until STEPS, as group g0; a refusal exits 3, naming it.
PACED = textwrap.dedent("""
    import sys, time, torch.distributed as dist, ddpkit, ddpkit.ft
    dist.init_process_group("gloo")
    steps = int(sys.argv[2])
    try:
        with ddpkit.ft.Manager(lighthouse=sys.argv[1], group_id="g0", quorum_timeout=20) as manager:
            while manager.step < steps:
                manager.start_step()
                manager.should_commit()
                print("step", manager.step, flush=True)
                time.sleep(0.05)
    except ddpkit.CommError as e:
        print("refused:", e, flush=True)
        sys.exit(3)
""")


def test_a_second_process_with_a_running_groups_id_is_refused_and_never_displaces_it():
    import ddpkit.ft
    events = []

    def start():
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                   OMP_NUM_THREADS="1", USE_LIBUV="0")
        return subprocess.Popen([sys.executable, "-c", PACED, lighthouse.address, "80"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    with ddpkit.ft.Lighthouse("127.0.0.1:0", on_event=events.append) as lighthouse:
        running = start()
        seen = []
        for line in running.stdout:
            seen.append(line)
            if line == "step 10\n":
                break
        copy = start()  # the same group id, mid-run
        started = time.monotonic()
        copy_out, _ = copy.communicate(timeout=60)
        copy_took = time.monotonic() - started
        rest, _ = running.communicate(timeout=60)
    print(f"the second process was refused {copy_took:.2f} s after it started")
    assert copy.returncode == 3 and "duplicate group id 'g0'" in copy_out, copy_out
    assert copy_took < 10, f"refused after {copy_took:.1f} s"  # a heartbeat timeout, not the 20 s quorum timeout
    output = "".join(seen) + rest
    assert running.returncode == 0 and "step 80\n" in output and "refused" not in output, output
    assert any("refused a second process" in e and "a duplicate group id" in e for e in events), events
    assert not any("lost" in e for e in events), events
