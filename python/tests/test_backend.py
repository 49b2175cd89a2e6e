"""ddpkit as a torch.distributed backend: every collective, op and dtype against the reduction
computed locally from every rank's (deterministic) input and against Gloo's result where Gloo has
the operation; async work and futures; subgroups; init methods; errors. Ranks are processes."""
import os
import tempfile
from datetime import timedelta

import pytest
import torch

from conftest import TORCH_MINOR, free_port, run_ranks

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
          torch.bool]
SIZES = [1, 7, 1001, 300_001]  # the last spans several shared-memory slots


def data(rank, n, dtype, salt, op=None):
    """Rank `rank`'s input: every rank can make every other rank's."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if not dtype.is_floating_point:
        high = 4 if op == "PRODUCT" else 100
        return torch.randint(1, high, (n,), generator=g).to(dtype)
    if op == "PRODUCT":
        return (1 + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) / 8).to(dtype)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def reduce_local(tensors, op):
    x = torch.stack(tensors)
    dtype = x.dtype
    if dtype == torch.bool:
        y = x.to(torch.uint8)
        r = {"SUM": y.amax(0), "MAX": y.amax(0), "BOR": y.amax(0), "MIN": y.amin(0), "PRODUCT": y.amin(0),
             "BAND": y.amin(0), "BXOR": y.sum(0) % 2}[op]
        return r.bool()
    if op in ("BAND", "BOR", "BXOR"):
        r = x[0].clone()
        for t in x[1:]:
            r = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op](r, t)
        return r
    wide = x.double() if dtype.is_floating_point else x.long()
    r = {"SUM": wide.sum(0), "AVG": wide.mean(0) if dtype.is_floating_point else None, "MIN": wide.amin(0),
         "MAX": wide.amax(0), "PRODUCT": wide.prod(0)}[op]
    return r.to(dtype)


def ops_for(dtype):
    ops = ["SUM", "MIN", "MAX", "PRODUCT"]
    if dtype.is_floating_point:
        ops.append("AVG")
    else:
        ops += ["BAND", "BOR", "BXOR"]
    return ops


def close(actual, expected, what):
    if actual.dtype.is_floating_point:
        tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(actual.dtype, 1e-6)
        torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"


def gloo_agrees(fn, actual, what, log):
    """Runs fn on the Gloo default group; where Gloo has the operation, its result must match."""
    try:
        expected = fn()
    except (RuntimeError, ValueError) as e:
        log.append(f"gloo lacks {what}: {str(e).splitlines()[0][:80]}")
        return
    close(actual, expected, f"{what} against gloo")


def all_collectives(rank, world):
    import torch.distributed as dist
    import ddpkit  # noqa: F401
    dk = dist.new_group(backend="ddpkit")
    assert dist.get_backend(dk) == "ddpkit"
    R = dist.ReduceOp
    log = []
    salt = 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for n in SIZES if dtype == torch.float32 and op in ("SUM", "AVG") else SIZES[:3]:
                salt += 1
                mine = data(rank, n, dtype, salt, op)
                expected = reduce_local([data(r, n, dtype, salt, op) for r in range(world)], op)
                t = mine.clone()
                dist.all_reduce(t, op=getattr(R, op), group=dk)
                what = f"all_reduce {op} {dtype} n={n}"
                close(t, expected, what)

                def on_gloo():
                    g = mine.clone()
                    dist.all_reduce(g, op=getattr(R, op))
                    return g
                gloo_agrees(on_gloo, t, what, log)
                # reduce: the root gets the result
                root = salt % world
                t = mine.clone()
                dist.reduce(t, root, op=getattr(R, op), group=dk)
                if rank == root:
                    close(t, expected, f"reduce {op} {dtype} to {root}")
    for dtype in DTYPES:
        for n in SIZES[:3]:
            salt += 1
            inputs = [data(r, n, dtype, salt) for r in range(world)]
            # broadcast from every root
            for root in range(world):
                t = inputs[rank].clone()
                dist.broadcast(t, root, group=dk)
                close(t, inputs[root], f"broadcast {dtype} n={n} from {root}")
            # all_gather (list), all_gather_into_tensor
            outs = [torch.empty_like(inputs[0]) for _ in range(world)]
            dist.all_gather(outs, inputs[rank], group=dk)
            for r in range(world):
                close(outs[r], inputs[r], f"all_gather {dtype} n={n} block {r}")
            # the list as consecutive chunks of one tensor (FSDP's gather on CPU), and out of order
            whole = torch.full((world * n,), 7, dtype=dtype)
            chunks = list(whole.chunk(world))
            dist.all_gather(chunks, inputs[rank], group=dk)
            close(whole, torch.cat(inputs), f"all_gather into chunks {dtype} n={n}")
            whole = torch.full((world * n,), 7, dtype=dtype)
            reversed_chunks = list(whole.chunk(world))[::-1]
            dist.all_gather(reversed_chunks, inputs[rank], group=dk)
            close(whole, torch.cat(inputs[::-1]), f"all_gather into reversed chunks {dtype} n={n}")
            flat = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(flat, inputs[rank], group=dk) if hasattr(dist, "all_gather_into_tensor") \
                else dist._all_gather_base(flat, inputs[rank], group=dk)
            close(flat, torch.cat(inputs), f"all_gather_into_tensor {dtype} n={n}")
            # gather and scatter
            root = salt % world
            gl = [torch.empty_like(inputs[0]) for _ in range(world)] if rank == root else None
            dist.gather(inputs[rank], gl, dst=root, group=dk)
            if rank == root:
                for r in range(world):
                    close(gl[r], inputs[r], f"gather {dtype} to {root} block {r}")
            pieces = [data(root, n, dtype, salt * 100 + r) for r in range(world)]
            out = torch.empty_like(inputs[0])
            dist.scatter(out, pieces if rank == root else None, src=root, group=dk)
            close(out, pieces[rank], f"scatter {dtype} from {root}")
            # all_to_all_single (even) and all_to_all (uneven)
            src = [data(r, world * n, dtype, salt + 7) for r in range(world)]
            out = torch.empty(world * n, dtype=dtype)
            dist.all_to_all_single(out, src[rank], group=dk)
            close(out, torch.cat([src[r][rank * n:(rank + 1) * n] for r in range(world)]), f"all_to_all_single {dtype}")
            ins = [data(rank, (rank + 1) * (j + 1), dtype, salt + j) for j in range(world)]
            outs = [torch.empty((j + 1) * (rank + 1), dtype=dtype) for j in range(world)]
            dist.all_to_all(outs, ins, group=dk)
            for j in range(world):
                close(outs[j], data(j, (j + 1) * (rank + 1), dtype, salt + rank), f"all_to_all {dtype} from {j}")
    # reduce_scatter (list and tensor forms), every op
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for n in (1, 7, 1001):
                salt += 1
                ins = [data(r, world * n, dtype, salt, op) for r in range(world)]
                expected = reduce_local(ins, op)[rank * n:(rank + 1) * n]
                out = torch.empty(n, dtype=dtype)
                what = f"reduce_scatter_tensor {op} {dtype} n={n}"
                dist.reduce_scatter_tensor(out, ins[rank], op=getattr(R, op), group=dk) \
                    if hasattr(dist, "reduce_scatter_tensor") \
                    else dist._reduce_scatter_base(out, ins[rank], op=getattr(R, op), group=dk)
                close(out, expected, what)
                out2 = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(out2, list(ins[rank].chunk(world)), op=getattr(R, op), group=dk)
                close(out2, expected, f"reduce_scatter {op} {dtype} n={n}")

                def on_gloo():
                    g = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter(g, list(ins[rank].chunk(world)), op=getattr(R, op))
                    return g
                gloo_agrees(on_gloo, out2, f"reduce_scatter {op} {dtype}", log)
    # coalesced forms
    ts = [data(rank, k + 3, torch.float32, 900 + k) for k in range(3)]
    if hasattr(dist, "all_reduce_coalesced"):
        cs = [t.clone() for t in ts]
        dist.all_reduce_coalesced(cs, group=dk)
        for k in range(3):
            close(cs[k], reduce_local([data(r, k + 3, torch.float32, 900 + k) for r in range(world)], "SUM"),
                  "all_reduce_coalesced")
    if hasattr(dist, "all_gather_coalesced"):
        # One output list per rank, each as long as the inputs (PyTorch's and Gloo's layout), of
        # mixed shapes with an empty tensor; one dtype per call (2.x requires it).
        for dtype, shapes in ((torch.float32, [(2, 3), (0,), (5,), (1, 1, 4)]), (torch.int64, [(3,), (2, 2)])):
            mine = [data(rank, torch.Size(s).numel(), dtype, 950 + k).view(s) for k, s in enumerate(shapes)]
            outs = [[torch.full(s, -1, dtype=dtype) for s in shapes] for _ in range(world)]
            dist.all_gather_coalesced(outs, mine, group=dk)
            for r in range(world):
                for k, s in enumerate(shapes):
                    close(outs[r][k], data(r, torch.Size(s).numel(), dtype, 950 + k).view(s),
                          f"all_gather_coalesced {dtype} rank {r} tensor {k}")

            def on_gloo():
                g = [[torch.full(s, -1, dtype=dtype) for s in shapes] for _ in range(world)]
                dist.all_gather_coalesced(g, mine)
                return torch.cat([t.reshape(-1) for lst in g for t in lst])
            gloo_agrees(on_gloo, torch.cat([t.reshape(-1) for lst in outs for t in lst]), f"all_gather_coalesced {dtype}",
                        log)
    # non-contiguous tensors are written back
    base = data(rank, 40, torch.float32, 77).view(8, 5)
    view = base.t()
    dist.all_reduce(view, group=dk)
    close(base, reduce_local([data(r, 40, torch.float32, 77).view(8, 5) for r in range(world)], "SUM"),
          "all_reduce of a transposed view")
    dist.barrier(group=dk)
    return log


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_collective_op_and_dtype(world):
    logs = run_ranks(all_collectives, world, timeout=400)
    for line in sorted(set(logs[0]))[:5]:
        print(line)


def async_and_p2p(rank, world):
    import torch.distributed as dist
    import ddpkit  # noqa: F401
    assert dist.get_backend() == "ddpkit"
    works = []
    tensors = []
    for k in range(5):
        t = torch.full((1000,), float(rank + k))
        tensors.append(t)
        works.append(dist.all_reduce(t, async_op=True))
    futs = [w.get_future() for w in works]
    chained = futs[-1].then(lambda f: f.value()[0] * 2)
    for w in works:
        w.wait()
    total = sum(range(world))
    for k, t in enumerate(tensors):
        assert torch.all(t == total + world * k), (k, t[:3])
    assert torch.all(chained.wait() == 2 * (total + world * 4))
    assert all(w.is_completed() for w in works)
    # send / recv / isend / irecv around a ring
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if world > 1:
        out = torch.full((17,), float(rank))
        into = torch.empty(17)
        reqs = [dist.isend(out, nxt), dist.irecv(into, prv)]
        for r in reqs:
            r.wait()
        assert torch.all(into == prv)
        if rank == 0:
            dist.send(torch.arange(4.), 1)
        elif rank == 1:
            x = torch.empty(4)
            dist.recv(x, 0)
            assert torch.equal(x, torch.arange(4.))
    # subgroups: the even ranks, and a group of this rank alone
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    alone = [dist.new_group([r]) for r in range(world)][rank]
    if rank % 2 == 0:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=evens)
        assert t.item() == sum(r for r in range(world) if r % 2 == 0)
    t = torch.tensor([5.0])
    dist.all_reduce(t, group=alone)
    assert t.item() == 5.0
    # all_gather_object goes through the backend too
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)]
    return True


@pytest.mark.parametrize("world", [1, 3])
def test_async_work_futures_p2p_and_subgroups(world):
    run_ranks(async_and_p2p, world, backend="ddpkit")


def callbacks_that_issue(rank, world):
    """As PowerSGD does: each async all_reduce's callback issues another (and its callback a third)
    and waits for it, while the program goes on issuing. The ranks are made to run their callbacks
    at different moments; every pair must still meet its own partner (equal sizes, so a mismatch
    shows as a wrong sum, not an error)."""
    import time
    import torch.distributed as dist
    import ddpkit  # noqa: F401
    K = 12
    inner, innermost, futs = {}, {}, []

    def grandchild(k):
        def cb(fut):
            time.sleep(0.003 * ((rank + k + 1) % 2))
            t = torch.full((64,), float(1000 * rank + k))
            dist.all_reduce(t)
            innermost[k] = t
            return fut.value()
        return cb

    def child(k):
        def cb(fut):
            time.sleep(0.003 * ((rank + k) % 2))
            t = torch.full((64,), float(100 * rank + k))
            dist.all_reduce(t, async_op=True).get_future().then(grandchild(k)).wait()
            inner[k] = t
            return fut.value()[0]
        return cb

    for k in range(K):
        t = torch.full((64,), float(rank + k))
        futs.append(dist.all_reduce(t, async_op=True).get_future().then(child(k)))
        if (rank + k) % 3 == 0:
            time.sleep(0.002)
    for f in futs:
        f.wait()
    ranks = sum(range(world))
    for k in range(K):
        assert torch.all(futs[k].value() == ranks + world * k), k
        assert torch.all(inner[k] == 100 * ranks + world * k), (k, inner[k][0].item())
        assert torch.all(innermost[k] == 1000 * ranks + world * k), (k, innermost[k][0].item())
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_issued_by_callbacks_keep_one_order(world):
    for _ in range(3):
        run_ranks(callbacks_that_issue, world, backend="ddpkit")


def monitored_and_sparse(rank, world):
    """A group's own monitored_barrier (passing; then rank 2 stays away and is named) and a sparse
    COO all_reduce, as Gloo has them."""
    import torch.distributed as dist
    import ddpkit  # noqa: F401
    assert dist.get_backend() == "ddpkit"
    group = dist.new_group(list(range(world)))  # a ddpkit group too
    out = {}
    group.monitored_barrier(timedelta(seconds=20))
    # Sparse: rank r holds value r+1 at index r and at index 0; the sum coalesced.
    i = torch.tensor([[0, rank]])
    t = torch.sparse_coo_tensor(i, torch.tensor([1.0, float(rank + 1)]), (world,))
    dist.all_reduce(t)
    out["sparse"] = t.coalesce().to_dense()
    try:
        dist.all_reduce(torch.sparse_coo_tensor(i, torch.ones(2), (world,)), op=dist.ReduceOp.MAX)
    except RuntimeError as e:
        out["sparse_max"] = str(e)
    if rank != 2:  # rank 2 does not come
        try:
            group.monitored_barrier(timedelta(seconds=2), wait_all_ranks=rank == 0)
        except RuntimeError as e:
            out["missing"] = str(e)
    return out


def test_monitored_barrier_names_the_missing_rank_and_sparse_allreduce_sums():
    outs = run_ranks(monitored_and_sparse, 3, backend="ddpkit", timeout=120)
    expected = torch.tensor([3.0 + 1, 2.0, 3.0])  # index 0: 1 from each rank, plus rank 0's own 1
    for rank, out in enumerate(outs):
        assert torch.equal(out["sparse"], expected), (rank, out["sparse"])
        assert "sparse allreduce supports SUM only" in out["sparse_max"], out
    assert "Rank 2 failed to pass monitoredBarrier in 2000 ms" in outs[0]["missing"], outs[0]
    assert "Rank 1 successfully reached monitoredBarrier, but received errors" in outs[1]["missing"], outs[1]
    assert "missing" not in outs[2]


def init_with(rank, world, method, where):
    import torch.distributed as dist
    import ddpkit
    kwargs = dict(rank=rank, world_size=world, timeout=timedelta(seconds=30))
    if method == "env":
        dist.init_process_group(ddpkit.BACKEND, init_method="env://", **kwargs)
    elif method == "tcp":
        dist.init_process_group("ddpkit", init_method=f"tcp://127.0.0.1:{where}", **kwargs)
    elif method == "file":
        dist.init_process_group("ddpkit", init_method=f"file://{where}", **kwargs)
    else:
        try:  # Debian's 2.6 has no libuv, which 2.4+ TCPStore uses by default
            store = dist.TCPStore("127.0.0.1", int(where), world, rank == 0, timedelta(seconds=30), use_libuv=False)
        except TypeError:
            store = dist.TCPStore("127.0.0.1", int(where), world, rank == 0, timedelta(seconds=30))
        dist.init_process_group("ddpkit", store=store, **kwargs)
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.sum().item()


@pytest.mark.parametrize("method", ["env", "tcp", "file", "store"])
def test_init_methods(method):
    with tempfile.TemporaryDirectory() as d:
        where = os.path.join(d, "rendezvous") if method == "file" else str(free_port())
        assert run_ranks(init_with, 2, method, where, backend=None) == [6.0, 6.0]


def bad_input(rank, world):
    import torch.distributed as dist
    errors = {}
    try:
        dist.all_reduce(torch.ones(3, device="meta"))
    except Exception as e:  # noqa: BLE001
        errors["meta"] = str(e)
    # torch 2.15 returns for a meta tensor before any backend sees it (on Gloo as well).
    try:
        dist.all_reduce(torch.ones(3, device="meta"), group=dist.new_group(backend="gloo"))
        errors["meta_reaches_backend"] = False
    except Exception:  # noqa: BLE001
        errors["meta_reaches_backend"] = True
    if torch.cuda.is_available():  # a GPU machine: a real CUDA tensor on this CPU backend
        try:
            dist.all_reduce(torch.ones(3, device="cuda"))
        except Exception as e:  # noqa: BLE001
            errors["cuda"] = str(e)
    try:
        dist.all_reduce(torch.ones(3, dtype=torch.int64), op=dist.ReduceOp.AVG)
    except Exception as e:  # noqa: BLE001
        errors["avg_int"] = str(e)
    try:
        dist.send(torch.ones(3), 1 - rank, tag=0x5D000000)  # the backend's own tags
    except Exception as e:  # noqa: BLE001
        errors["tag"] = str(e)
    try:
        dist.all_reduce(torch.ones(3 + rank))  # sizes differ across ranks
    except Exception as e:  # noqa: BLE001
        errors["sizes"] = str(e)
    return errors


def test_bad_input_is_named_not_hung():
    errors = run_ranks(bad_input, 2, backend="ddpkit", timeout=120)
    for e in errors:
        if e["meta_reaches_backend"]:
            assert "meta" in e["meta"].lower(), e
        else:
            assert "meta" not in e, e
        if torch.cuda.is_available():
            assert "cuda" in e.get("cuda", "").lower() and "CPU tensors" in e["cuda"], e
        assert "AVG needs a floating-point tensor" in e["avg_int"], e
        assert "send tag 1560281088 is outside [0, 1560281088)" in e["tag"], e
        assert "sizes" in e and ("allreduce" in e["sizes"] or "all_reduce" in e["sizes"]), e


def test_mismatched_calls_over_gloo_are_named_with_the_check_on():
    """Between hosts Gloo aborts the process on mismatched sizes; DDPKIT_CHECK_COLLECTIVES=1 compares
    every call across the group first and names the difference on every rank."""
    errors = run_ranks(bad_input, 2, backend="ddpkit", timeout=120,
                       env={"DDPKIT_SHM": "0", "DDPKIT_CHECK_COLLECTIVES": "1"})
    for e in errors:
        assert "called different collectives" in e["sizes"], e
        assert "allreduce of 4 Float" in e["sizes"] and "allreduce of 3 Float" in e["sizes"], e


def test_every_collective_over_gloo_transport():
    """DDPKIT_SHM=0: the paths ranks on different hosts take (Gloo, ddpkit's alltoall-based forms), with
    the cross-rank call check on (it must pass every legitimate call, uneven all-to-all included)."""
    run_ranks(all_collectives, 3, timeout=400, env={"DDPKIT_SHM": "0", "DDPKIT_CHECK_COLLECTIVES": "1"})


def test_every_collective_across_two_network_namespaces():
    """Two "hosts" of two ranks each: shared memory within, Gloo between (hierarchical allreduce)."""
    from netns import run_on_two_hosts
    run_on_two_hosts("test_backend", "all_collectives", per_host=2, timeout=500)


def test_torchrun_elastic_restart(tmp_path):
    """torchrun (PyTorch's elastic agent) with --max-restarts: a rank dies, the agent restarts the
    group on the ddpkit backend, the second attempt runs.
    The flags are what each Debian's torchrun needs (docs/python.md, "torchrun on Debian")."""
    import subprocess
    import sys
    env = dict(os.environ, OMP_NUM_THREADS="1", USE_LIBUV="0", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max_restarts", "1",
           "--redirects", "1", "--tee", "1"]
    if int(torch.__version__.split(".")[0]) >= 2:
        # --local_addr: the workers' store at an address they reach whatever the hostname resolves to
        cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", str(tmp_path / "rdzv"), "--rdzv_conf", "store_type=file",
                "--local_addr", "127.0.0.1"]
    else:
        # 1.13 has no --local_addr, and --standalone gives the workers the host's name, which need
        # not resolve (no /etc/hosts line in many containers): its static rendezvous at 127.0.0.1.
        cmd += ["--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmd.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_worker.py"))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "rank 1 dies on attempt 0" in text, text[-4000:]
    # The agent stops the survivor as soon as it sees the failure, which may be before the survivor's
    # collective fails; if it got that far, its error names ddpkit's collective and the dead rank.
    for line in text.splitlines():
        if "attempt 0: survivor error" in line:
            assert "ddpkit: allreduce" in line and "rank 1" in line, line
    for rank in (0, 1):
        assert f"rank {rank}/2 attempt 1: ok" in text, text[-4000:]


def groups_and_options(rank, world):
    import ddpkit
    import torch.distributed as dist
    out = {}
    # ddpkit.new_group(ranks): members get a group ranked by their place in sorted(ranks), the others None.
    odd = ddpkit.new_group([r for r in range(world) if r % 2 == 1][::-1])
    out["odd_member"] = odd is not None
    if odd is not None:
        t = torch.tensor([float(rank)])
        odd.allreduce(t)
        out["odd_rank"], out["odd_size"], out["odd_sum"] = odd.rank(), odd.size(), t.item()
    whole = ddpkit.new_group(timeout=30, gloo_threads=1, shared_memory=False)
    t = torch.ones(1)
    whole.allreduce(t)
    out["whole"] = (whole.rank(), whole.size(), t.item())
    errors = {}
    for what, call in {"empty": lambda: ddpkit.new_group([]), "twice": lambda: ddpkit.new_group([0, 0]),
                       "outside": lambda: ddpkit.new_group([0, world]), "threads": lambda: ddpkit.new_group(gloo_threads=0),
                       "pg_options": lambda: dist.new_group(backend="ddpkit", pg_options={"gloo_threads": 2})}.items():
        try:
            call()
            errors[what] = "no error"
        except Exception as e:  # noqa: BLE001
            errors[what] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    # Options through torch.distributed: a group made with pg_options works like any other.
    sub = dist.new_group(list(range(world)), backend="ddpkit", pg_options=ddpkit.Options(gloo_threads=1, shared_memory=False))
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, group=sub)
    out["pg_options_sum"] = t[0].item()
    return out


def test_new_group_takes_ranks_and_options_take_arguments():
    world = 3
    results = run_ranks(groups_and_options, world, backend="ddpkit", timeout=180)
    for rank, r in enumerate(results):
        assert r["odd_member"] == (rank % 2 == 1), r
        if r["odd_member"]:
            assert (r["odd_rank"], r["odd_size"], r["odd_sum"]) == (0, 1, 1.0), r  # ranks [1] of world 3
        assert r["whole"] == (rank, world, float(world)), r
        e = r["errors"]
        assert "ValueError" in e["empty"] and "empty" in e["empty"], e
        assert "ValueError" in e["twice"] and "more than once" in e["twice"], e
        assert "ValueError" in e["outside"] and "[0, 3)" in e["outside"], e
        assert "ValueError" in e["threads"] and "gloo_threads" in e["threads"], e
        assert "TypeError" in e["pg_options"] and "ddpkit.Options" in e["pg_options"], e
        assert r["pg_options_sum"] == 6.0, r


def current_contract(rank, world):
    """What torch 2.7-2.15 call on a backend beyond the collectives: the `_single` collectives
    (2.13+), split_group, new_subgroups, shrink_group, abort, and shutdown through
    destroy_process_group."""
    import warnings
    import torch.distributed as dist
    out = {}
    t = torch.arange(3.0) + rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if hasattr(dist, "all_gather_single"):  # 2.13+: the torchcomms names
            gathered = torch.empty(3 * world)
            dist.all_gather_single(gathered, t)
            scattered = torch.empty(2)
            dist.reduce_scatter_single(scattered, torch.arange(2.0 * world) * (rank + 1))
            out["single"] = (gathered.tolist(), scattered.tolist())
        gathered = torch.empty(3 * world)
        dist.all_gather_into_tensor(gathered, t)
        out["into_tensor"] = gathered.tolist()
    out["warnings"] = [str(w.message) for w in caught if "ddpkit" in str(w.message) or "deprecated" in str(w.message)]
    # split_group: each rank alone, then the even ranks together (the odd ones are not members).
    try:
        alone = dist.split_group(split_ranks=[[r] for r in range(world)])
        x = torch.ones(1)
        dist.all_reduce(x, group=alone)
        evens = dist.split_group(split_ranks=[[r for r in range(world) if r % 2 == 0]])
        y = torch.full((2,), float(rank))
        if evens != dist.GroupMember.NON_GROUP_MEMBER:
            dist.all_reduce(y, group=evens)
        out["split"] = (x.item(), dist.get_world_size(alone), evens == dist.GroupMember.NON_GROUP_MEMBER, y.tolist())
    except Exception as e:  # noqa: BLE001
        out["split"] = f"{type(e).__name__}: {e}"
    sub, _ = dist.new_subgroups(group_size=1)
    z = torch.ones(1)
    dist.all_reduce(z, group=sub)
    out["subgroups"] = (z.item(), dist.get_world_size(sub))
    if hasattr(dist, "shrink_group"):
        try:
            dist.shrink_group([world - 1])
            out["shrink"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["shrink"] = f"{type(e).__name__}: {e}"
    # abort: a group's own abort fails what is in flight and leaves it unusable, naming why.
    doomed = dist.new_group(backend="ddpkit")
    backend = doomed._get_backend(torch.device("cpu"))
    backend.abort()
    try:
        dist.all_reduce(torch.ones(1), group=doomed)
        out["after_abort"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["after_abort"] = str(e)
    dist.destroy_process_group()  # shutdown() on every group's backend
    out["destroyed"] = not dist.is_initialized()
    return out


@pytest.mark.skipif(TORCH_MINOR < (2, 7), reason="Backend.shutdown/abort and split_group arrive in torch 2.7+")
def test_current_torch_contract_single_collectives_split_abort_shutdown():
    world = 3
    results = run_ranks(current_contract, world, backend="ddpkit", timeout=180)
    for rank, r in enumerate(results):
        expected_gather = [float(i + k) for k in range(world) for i in range(3)]
        assert r["into_tensor"] == expected_gather, r
        if "single" in r:
            assert r["single"] == (expected_gather, [float(2 * rank + j) * sum(range(1, world + 1)) for j in range(2)]), r
        assert not r["warnings"], r["warnings"]
        if TORCH_MINOR >= (2, 15):
            assert isinstance(r["split"], tuple), r
            ones, alone_size, not_member, evens_sum = r["split"]
            assert (ones, alone_size, not_member) == (1.0, 1, rank % 2 == 1), r
            if rank % 2 == 0:
                assert evens_sum == [float(sum(range(0, world, 2)))] * 2, r
        else:
            assert "does not support splitting" in r["split"], r
        assert r["subgroups"] == (1.0, 1), r
        if "shrink" in r:
            assert "does not support shrinking" in r["shrink"], r
        assert "shut down or aborted" in r["after_abort"], r
        assert r["destroyed"], r
