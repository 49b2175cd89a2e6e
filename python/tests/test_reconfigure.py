"""Native reconfigure on the ddpkit backend (c10d's fault-tolerance API, torch >= 2.14): a group
made with enable_reconfigure=True changes members in place (grow, shrink, the same peers again, a
rank that restarted), fails the old members' work, refuses bad handles by name, is bounded by the
options' timeout, and runs abort hooks when a collective fails."""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import free_port, run_ranks

pytestmark = pytest.mark.skipif(not hasattr(dist.ProcessGroup, "reconfigure"),
                                reason="torch < 2.14: c10d has no reconfigure API")

TIMEOUT = timedelta(seconds=20)


def start(rank, world, port):
    """The test's own store (rank 0 of the first world hosts it) and a reconfigurable group."""
    import ddpkit  # noqa: F401  registers the backend
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=TIMEOUT, use_libuv=False)
    dist.init_process_group("ddpkit", store=store, rank=rank, world_size=world, timeout=TIMEOUT,
                            enable_reconfigure=True)
    return store


def agree(store, key, place, size, uuid):
    """Every member's handle in member order, through the store (what torchft's lighthouse does)."""
    store.set(f"{key}/handle/{place}", dist._get_reconfigure_handle())
    store.wait([f"{key}/handle/{i}" for i in range(size)], TIMEOUT)
    return uuid, [store.get(f"{key}/handle/{i}").decode() for i in range(size)]


def meet(store, key, rank, world, timeout=TIMEOUT):
    """Every rank of the starting world has reached `key` (the test's barrier, outside the group)."""
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{r}" for r in range(world)], timeout)


def reconfigure(store, key, members, me, uuid, timeout=None):
    uuid, handles = agree(store, key, members.index(me), len(members), uuid)
    return dist._reconfigure(uuid=uuid, handles=handles, timeout=timeout).wait()


def resize(rank, world, port):
    store = start(rank, world, port)
    seen = {"supports": dist._supports_reconfigure()}
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:  # noqa: BLE001
        seen["before"] = str(e)
    sums = []
    for gen, members in enumerate(([0, 1, 2], [2, 0], [1, 2, 0], [1, 2, 0])):  # grow, shrink, reorder, same again
        if rank in members:
            reconfigure(store, f"gen{gen}", members, rank, 10 + gen)
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            ok = (dist.get_rank(), dist.get_world_size()) == (members.index(rank), len(members))
            sums.append((gen, t.item(), ok))
        meet(store, f"done{gen}", rank, world)
    # An abort leaves the group reconfigurable.
    dist.group.WORLD.abort()
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:  # noqa: BLE001
        seen["after_abort"] = str(e)
    reconfigure(store, "after", [0, 1, 2], rank, 99)
    t = torch.ones(1)
    dist.all_reduce(t)
    sums.append(("after", t.item(), True))
    meet(store, "end", rank, world)
    dist.destroy_process_group()
    return seen, sums


def test_grow_shrink_reorder_the_same_peers_and_after_an_abort():
    results = run_ranks(resize, 3, free_port(), backend=None)
    for rank, (seen, sums) in enumerate(results):
        assert seen["supports"]
        assert "call reconfigure() before issuing collectives" in seen["before"]
        assert "since it was aborted" in seen["after_abort"]
        expected = {0: 6.0, 1: 4.0, 2: 6.0, 3: 6.0, "after": 3.0}
        for gen, total, ok in sums:
            assert ok and total == expected[gen], (rank, gen, total)
    assert [len(s) for _, s in results] == [5, 4, 5]  # rank 1 sat out the shrink


def restarted(rank, world, port):
    """Rank 2 leaves after the first membership; a new process takes its place with a new handle."""
    store = start(rank, world, port)
    reconfigure(store, "first", [0, 1, 2], rank, 1)
    t = torch.ones(1)
    dist.all_reduce(t)
    first = t.item()
    if rank == 2:
        old = dist._get_reconfigure_handle()
        dist.destroy_process_group()  # this process's group goes; the "restarted" one is a new group
        store2 = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT, use_libuv=False)
        dist.init_process_group("ddpkit", store=dist.PrefixStore("restart", store2), rank=0, world_size=1,
                                timeout=TIMEOUT, enable_reconfigure=True)
        assert dist._get_reconfigure_handle() != old
        store = store2
    reconfigure(store, "second", [0, 1, 2], rank, 2)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return first, t.item()


def test_a_restarted_rank_joins_with_its_new_handle():
    assert run_ranks(restarted, 3, free_port(), backend=None) == [(3.0, 6.0)] * 3


def in_flight_and_bad_input(rank, world, port):
    store = start(rank, world, port)
    reconfigure(store, "first", [0, 1], rank, 1)
    errors = {}
    if rank == 0:
        # A collective rank 1 never joins: the reconfigure fails it (not its timeout, 20 s).
        work = dist.all_reduce(torch.ones(1), async_op=True)
        time.sleep(0.2)
        began = time.monotonic()
        dist._reconfigure(uuid=2, handles=[dist._get_reconfigure_handle()]).wait()
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001
            errors["in_flight"] = (str(e), time.monotonic() - began)
        mine = dist._get_reconfigure_handle()
        for name, handles, uuid in (("foreign", ["tcp://x:1/y", mine], 3), ("missing", ["ddpkit://127.0.0.1:9/ab"], 4),
                                    ("reused", [mine], 2), ("port", ["ddpkit://h:x/1", mine], 5)):
            try:
                dist._reconfigure(uuid=uuid, handles=handles).wait()
            except Exception as e:  # noqa: BLE001
                errors[name] = str(e)
        # A member that never comes: bounded by the options' timeout.
        began = time.monotonic()
        try:
            dist._reconfigure(uuid=6, handles=[mine, store.get("first/handle/1").decode()],
                              timeout=timedelta(seconds=2)).wait()
        except Exception as e:  # noqa: BLE001
            errors["absent"] = (str(e), time.monotonic() - began)
    meet(store, "end", rank, world, timedelta(seconds=60))
    dist.destroy_process_group()
    return errors


def test_in_flight_work_fails_and_bad_handles_are_named():
    errors = run_ranks(in_flight_and_bad_input, 2, free_port(), backend=None)[0]
    message, seconds = errors["in_flight"]
    assert "reconfigured (uuid 2)" in message and seconds < 10, errors["in_flight"]
    assert "is not a ddpkit handle: it does not start with ddpkit://" in errors["foreign"]
    assert "this rank's handle" in errors["missing"] and "is not among the 1 handles" in errors["missing"]
    assert "uuid 2 was this group's last one" in errors["reused"]
    assert "its port is not a number" in errors["port"]
    message, seconds = errors["absent"]
    assert seconds < 10, errors["absent"]


def plain_group(rank, world):
    pg = dist.group.WORLD
    said = {"supports": pg.supports_reconfigure, "supports_window": pg.supports_window}
    for name, call in (("handle", pg.get_reconfigure_handle), ("window", lambda: pg.new_window(torch.zeros(4)))):
        try:
            call()
        except Exception as e:  # noqa: BLE001
            said[name] = str(e)
    return said


def test_a_group_made_without_enable_reconfigure_says_so_and_windows_are_refused_by_name():
    said = run_ranks(plain_group, 1, backend="ddpkit")[0]
    assert said["supports"] is False and "enable_reconfigure=True" in said["handle"], said
    # One-sided windows: not served (docs/python.md); PyTorch's refusal names the backend.
    assert said["supports_window"] is False and "ddpkit does not support new_window" in said["window"], said


def hooks_on_failure(rank, world, port):
    store = start(rank, world, port)
    reconfigure(store, "first", [0, 1], rank, 1, timeout=timedelta(seconds=3))
    calls = []
    pg = dist.group.WORLD
    ran = {"supports": pg.supports_abort_hooks}
    pg.register_abort_hook(7, lambda: calls.append("hook"))
    t = torch.ones(1)
    dist.all_reduce(t)  # succeeds: no hook
    ran["after_success"] = len(calls)
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins: fails by the 3 s timeout
        except Exception as e:  # noqa: BLE001
            ran["error"] = str(e)[:200]
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.05)
        ran["after_failure"] = len(calls)
        pg.unregister_abort_hook(7)
        try:
            pg.unregister_abort_hook(7)
        except Exception as e:  # noqa: BLE001
            ran["unregister_twice"] = str(e)
    meet(store, "end", rank, world, timedelta(seconds=60))
    dist.destroy_process_group()
    return ran


def test_abort_hooks_run_when_a_collective_fails():
    ran = run_ranks(hooks_on_failure, 2, free_port(), backend=None)[0]
    assert ran["supports"] and ran["after_success"] == 0
    assert ran["after_failure"] >= 1, ran
    assert "no abort hook 7 is registered" in ran["unregister_twice"]
