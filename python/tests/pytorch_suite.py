#!/usr/bin/env python3
"""PyTorch's own distributed test suite (torch/testing/_internal/distributed/distributed_test.py,
DistributedTest._DistTestBase, as PyTorch's test_distributed_spawn.py runs it) against the ddpkit
backend: the backend's conformance test.

The suite picks and gates its tests by the backend's name. Run with --backend ddpkit, it is told
"gloo" (so it runs what it runs for Gloo) while every process group it makes, default and
new_group alike, is made by the ddpkit backend: each group's backend is checked as it is made, and
the count of groups made and of groups that were not ddpkit's is part of the summary. With
--backend gloo it runs on Gloo itself, for the counts to compare against.

Tests that cannot pass on ddpkit for a reason of PyTorch's are listed in KNOWN below (and in
docs/python.md): they are run and expected to fail; one that passes is reported, so the list
stays true. The run fails on any other failure or error, on a group that was not ddpkit's, and
with --compare-gloo on a test that passes on Gloo but not on ddpkit (KNOWN ones aside).

  PYTHONPATH=build/python /usr/bin/python3 python/tests/pytorch_suite.py --backend ddpkit
  /usr/bin/python3 python/tests/pytorch_suite.py --backend gloo -k all_gather
"""
import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import unittest

# A test name (without the class) -> why it cannot pass on ddpkit. Every entry names PyTorch's
# reason; a difference between ddpkit and Gloo is a defect to fix, never an entry here.
_MONITORED = ("calls torch.distributed.monitored_barrier, which refuses every backend not named gloo before it "
              "reaches the group (distributed_c10d.py); the group's own monitored_barrier, which ddpkit has, passes "
              "test_monitored_barrier_gloo_rank_0_timeout")
KNOWN = {
    "test_get_backend": "asserts dist.get_backend() equals the suite's BACKEND ('gloo'); a ddpkit group says 'ddpkit'",
}
# Up to 2.6 at least (1.13 and 2.6 checked); 2.15's monitored_barrier takes any group with a CPU
# backend, and these pass there.
_MONITORED_TESTS = ("test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup",
                    "test_monitored_barrier_wait_all_ranks", "test_monitored_barrier_failure_order")


def _known_here():
    """KNOWN, plus the entries that hold only on this torch and Python (monitored_barrier's up to
    2.6, the Debian 13 root's 2.6 on Python 3.13). The Python 3.13 one fails on Gloo alike."""
    import torch
    known = dict(KNOWN)
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 15):
        known.update((name, _MONITORED) for name in _MONITORED_TESTS)
    if int(torch.__version__.split(".")[0]) >= 2:
        known["test_ddp_logging_data_cpu"] = (
            "asserts DDP's logged backend_name equals dist.get_backend(); from 2.x c10d logs a backend registered "
            "from Python as 'custom' (ProcessGroup.BackendType.CUSTOM), so 'custom' != 'ddpkit'")
    if sys.version_info >= (3, 13):
        for name in ("test_gather_object", "test_gather_object_subgroup"):
            known[name] = ("expects pickle's message \"Can't pickle local object\"; Python 3.13 says \"Can't get "
                           "local object\" (fails on Gloo too)")
    return known

_SUITE_BACKEND = "DDPKIT_SUITE_BACKEND"   # ddpkit | gloo: inherited by the spawned ranks
_SUITE_LOG = "DDPKIT_SUITE_GROUP_LOG"     # each rank appends one line per group made


def _route_gloo_to_ddpkit():
    """Every group asked for as "gloo" is made by the ddpkit backend. Patched where torch.distributed
    makes a group, so init_process_group and new_group (with or without a backend) both pass here."""
    import torch.distributed.distributed_c10d as c10d
    import ddpkit

    helper = c10d._new_process_group_helper
    if getattr(helper, "_ddpkit_routes", False):
        return
    import inspect
    params = list(inspect.signature(helper).parameters)
    at = params.index("backend")

    def swap(backend):
        # 1.13: "gloo"; 2.x: "gloo", "cpu:gloo,cuda:nccl" or a Backend (a str subclass).
        text = str(backend)
        if ":" in text:
            return ",".join(p.replace(":gloo", ":ddpkit") for p in text.split(","))
        return "ddpkit" if text.lower() == "gloo" else backend

    def is_ddpkit(pg):
        if pg is None or pg == c10d.GroupMember.NON_GROUP_MEMBER:
            return None
        try:
            return ddpkit._ddpkit_group_of(pg) is not None
        except Exception:
            return False

    def made_by_ddpkit(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = swap(kwargs["backend"])
        elif len(args) > at:
            args = args[:at] + (swap(args[at]),) + args[at + 1:]
        result = helper(*args, **kwargs)
        pg = result[0] if isinstance(result, tuple) else result  # 2.x returns (pg, prefix_store)
        verdict = is_ddpkit(pg)
        if verdict is not None:
            with open(os.environ[_SUITE_LOG], "a") as log:
                log.write(("ddpkit" if verdict else f"other:{type(pg).__name__}") + "\n")
        return result

    made_by_ddpkit._ddpkit_routes = True
    c10d._new_process_group_helper = made_by_ddpkit
    # 2.x: a group asked for with no backend gets each device's default; the CPU's is ddpkit here.
    defaults = getattr(c10d.Backend, "default_device_backend_map", None)
    if defaults is not None and defaults.get("cpu") == "gloo":
        defaults["cpu"] = "ddpkit"


def _use_shims_where_missing():
    """PyTorch's test utilities import expecttest, which Debian does not package: suite_shims/ has
    one (see its doc). On PYTHONPATH as well, for the spawned ranks."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        shims = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suite_shims")
        sys.path.insert(0, shims)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (shims, os.environ.get("PYTHONPATH")) if p)


def _replicated_tensor_ddp_where_it_imports():
    """PyTorch 1.13's suite turns on DDP's experimental ReplicatedTensor mode in every rank
    (TestDistBackend._run). On Python 3.11 that mode's module does not import (a dataclass field
    with a mutable default, torch/distributed/_shard/sharded_tensor/metadata.py), so every DDP test
    then fails on any backend, Gloo's too. Where the import fails the switch is left off, for both
    backends alike, and DDP runs as in PyTorch 2.x, which dropped the mode. Returns why, or None."""
    try:
        import torch.nn.parallel._replicated_tensor_ddp_utils as utils
    except ImportError:
        return None  # 2.x: no such mode
    try:
        import torch.distributed._shard.replicated_tensor  # noqa: F401
        return None
    except ValueError as e:
        utils._set_ddp_with_replicated_tensor = lambda value: None
        return f"ReplicatedTensor DDP left off: its module does not import here ({e})"


def _setup_environment(args):
    os.environ["BACKEND"] = "gloo"  # what the suite gates on (see the module's doc)
    os.environ["WORLD_SIZE"] = str(args.world)
    os.environ[_SUITE_BACKEND] = args.backend
    made = None
    if "TEMP_DIR" not in os.environ:
        made = os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="ddpkit-suite-")
    os.environ.setdefault(_SUITE_LOG, os.path.join(os.environ["TEMP_DIR"], "groups.log"))
    os.environ["USE_LIBUV"] = "0"  # Debian's 2.6 has no libuv TCPStore
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return made


def _suite_classes():
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()

    # Pickled by reference into the spawned ranks, which define it again on import.
    TestDistBackendWithSpawn.__module__ = __name__
    TestDistBackendWithSpawn.__qualname__ = "TestDistBackendWithSpawn"
    return TestDistBackendWithSpawn


# The spawned ranks import this module (as __mp_main__ or by name) before they unpickle the test
# class: the routing and the class must exist at import, in the ranks as in the parent.
if _SUITE_BACKEND in os.environ:
    _use_shims_where_missing()
    _replicated_tensor_ddp_where_it_imports()
    if os.environ[_SUITE_BACKEND] == "ddpkit":
        import ddpkit  # noqa: F401  registers the backend
        _route_gloo_to_ddpkit()
    TestDistBackendWithSpawn = _suite_classes()


class _Recorder(unittest.TextTestResult):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.outcomes = {}
        self.durations = {}
        self._start = 0.0

    def startTest(self, test):
        self._start = time.monotonic()
        super().startTest(test)

    def _note(self, test, outcome, detail=""):
        name = test.id().rsplit(".", 1)[-1]
        self.outcomes[name] = (outcome, detail)
        self.durations[name] = time.monotonic() - self._start

    def addSuccess(self, test):
        super().addSuccess(test)
        self._note(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._note(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._note(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._note(test, "skip", reason)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--backend", choices=["ddpkit", "gloo"], default="ddpkit")
    p.add_argument("--world", type=int, default=3, help="ranks per test (PyTorch's CI runs Gloo at 3 on CPU)")
    p.add_argument("-k", action="append", default=[], help="run the tests whose name contains this (repeatable)")
    p.add_argument("--json", help="write every test's outcome, reason and seconds here")
    p.add_argument("--compare-gloo", action="store_true",
                   help="with --backend ddpkit: run the same tests on Gloo first (results beside --json's, as "
                        "X.gloo.json); fail if a test Gloo passes does not pass on ddpkit (unless KNOWN)")
    p.add_argument("--list", action="store_true", help="print the tests that would run and exit")
    args = p.parse_args()
    if args.world < 2:
        p.error(f"--world must be at least 2, got {args.world}")
    made = _setup_environment(args)
    # A run stopped by SIGTERM (ctest's timeout, a killed job) stops as on Ctrl-C, which unittest
    # passes on (it would record SystemExit as a test's error and go on), and removes its files below.
    def stop(*_):
        raise KeyboardInterrupt("SIGTERM")
    signal.signal(signal.SIGTERM, stop)
    try:
        return _run(args)
    finally:
        if made:  # the suite's files and the group log are this run's; nothing is left in /tmp
            shutil.rmtree(made, ignore_errors=True)


def _run(args):
    _use_shims_where_missing()
    open(os.environ[_SUITE_LOG], "w").close()
    global TestDistBackendWithSpawn
    if args.backend == "ddpkit":
        import ddpkit  # noqa: F401
        _route_gloo_to_ddpkit()
    TestDistBackendWithSpawn = _suite_classes()
    sys.modules[__name__].TestDistBackendWithSpawn = TestDistBackendWithSpawn

    names = sorted(n for n in unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn))
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    if args.list:
        print("\n".join(names))
        return 0
    args.gloo_passed = gloo_passes(args) if args.compare_gloo and args.backend == "ddpkit" else None
    import torch
    print(f"pytorch_suite: torch {torch.__version__}, backend {args.backend} (gated as gloo), world {args.world}, "
          f"{len(names)} tests", flush=True)
    why = _replicated_tensor_ddp_where_it_imports()
    if why:
        print(f"pytorch_suite: {why}", flush=True)
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=2, stream=sys.stdout)
    started = time.monotonic()
    result = runner.run(suite)
    seconds = time.monotonic() - started
    return report(args, result, seconds)


def gloo_passes(args):
    """The same tests on Gloo, in a process of their own: the names of those that pass."""
    # Kept beside --json's file when one is named (X.json -> X.gloo.json), else in this run's TEMP_DIR.
    out = (os.path.splitext(args.json)[0] + ".gloo.json") if args.json else os.path.join(os.environ["TEMP_DIR"], "gloo.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--backend", "gloo", "--world", str(args.world), "--json", out]
    for k in args.k:
        cmd += ["-k", k]
    env = {k: v for k, v in os.environ.items() if k not in ("TEMP_DIR", _SUITE_LOG, _SUITE_BACKEND)}
    print("pytorch_suite: the same tests on Gloo first:", " ".join(cmd[1:]), flush=True)
    import subprocess
    log = os.path.join(os.environ["TEMP_DIR"], "gloo-run.log")
    with open(log, "w") as f:
        subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if not os.path.exists(out):
        with open(log) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"pytorch_suite: the Gloo run wrote no results; the end of its output:\n{tail}")
    with open(out) as f:
        gloo = json.load(f)
    counts = gloo["counts"]
    print(f"pytorch_suite: gloo: {counts['pass']} passed, {counts['fail']} failed, {counts['error']} errors, "
          f"{counts['skip']} skipped", flush=True)
    return {n for n, t in gloo["tests"].items() if t["outcome"] == "pass"}


def report(args, result, seconds):
    known = _known_here()
    counts = {"pass": 0, "fail": 0, "error": 0, "skip": 0, "known": 0}
    unexpected, known_passed, skips = [], [], {}
    for name, (outcome, detail) in sorted(result.outcomes.items()):
        listed = args.backend == "ddpkit" and name in known
        if listed and outcome in ("fail", "error"):
            counts["known"] += 1
            continue
        counts[outcome] += 1
        if outcome in ("fail", "error"):
            unexpected.append((name, outcome, detail))
        elif listed and outcome == "pass":
            known_passed.append(name)
        elif outcome == "skip":
            skips[detail] = skips.get(detail, 0) + 1
    with open(os.environ[_SUITE_LOG]) as f:
        groups = [line.strip() for line in f if line.strip()]
    others = [g for g in groups if g != "ddpkit"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "world": args.world, "counts": counts, "seconds": round(seconds, 1),
                       "groups_made": len(groups), "groups_not_ddpkit": len(others),
                       "tests": {n: {"outcome": o, "detail": next((l for l in reversed(d.splitlines()) if l.strip()), "") if d else "",
                                     "seconds": round(result.durations.get(n, 0), 2)}
                                 for n, (o, d) in result.outcomes.items()}}, f, indent=1)
    print()
    for name, outcome, detail in unexpected:
        print(f"UNEXPECTED {outcome.upper()}: {name}\n{detail}")
    for reason, n in sorted(skips.items(), key=lambda kv: -kv[1]):
        print(f"skipped {n:4d}: {reason}")
    print(f"pytorch_suite: {args.backend}: {counts['pass']} passed, {counts['fail']} failed, {counts['error']} errors, "
          f"{counts['skip']} skipped, {counts['known']} failed as listed (KNOWN), in {seconds:.0f} s")
    if args.backend == "ddpkit":
        print(f"pytorch_suite: {len(groups)} process groups made, {len(others)} not by ddpkit"
              + (f" ({', '.join(sorted(set(others)))})" if others else ""))
    ok = not unexpected and not others
    for name in known_passed:
        print(f"pytorch_suite: {name} passed but is listed in KNOWN: take it off the list")
        ok = False
    if args.gloo_passed is not None:
        passed = {n for n, (o, _) in result.outcomes.items() if o == "pass"}
        behind = sorted(args.gloo_passed - passed - set(known))
        print(f"pytorch_suite: Gloo passed {len(args.gloo_passed)}, ddpkit {len(passed)}; of Gloo's passes, "
              f"{len(args.gloo_passed & set(known))} are KNOWN here and {len(behind)} others did not pass on ddpkit"
              + (f": {', '.join(behind)}" if behind else ""))
        ok = ok and not behind
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
