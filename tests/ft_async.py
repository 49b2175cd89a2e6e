#!/usr/bin/env python3
"""The async quorum (`ddpkit train --fault-tolerant`, --quorum-mode async, the default) as a user
runs it.

  tests/ft_async.py build/ddpkit MODE

MODE:
  parity          2 groups of 2 ranks under DDP, ZeRO-2 and FSDP (and DDP of a transformer, whose
                  buckets are rebuilt after the first step), nothing failing: --quorum-mode async
                  and sync end with the same parameters, bit for bit, every step committed
  kill            the same strategies, a rank of group 1 SIGKILLed: the survivors lose only the step
                  the failure broke (none to the heal), serve the restarted group a snapshot of a
                  step boundary without waiting for it, and the restarted group adds zeros while it
                  heals, then commits with them; every group ends alike
  slow-lighthouse 2 groups of one rank, a model whose step is ~0.4 s here (--mlp-dims 512,2048,2048,10, batch 2048), the lighthouse reached through
                  a proxy that holds every byte 100 ms each way (every round >= 200 ms slower):
                  async changes the survivors' median step by less than 2 %, sync pays the round
"""
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ft_train  # noqa: E402
from ports import free_port  # noqa: E402

STRATEGIES = {"DDP": [], "ZeRO-2": ["--zero", "2"], "FSDP": ["--fsdp", "full_shard"]}
# A model whose gradients come ready in another order than its parameters were made: DDP rebuilds
# its buckets after the first step, and a group that copied the first group's state at the job's
# first quorum must rebuild alike (it once kept the copied initial layout: every crossing mismatched).
TRANSFORMER = ["--model", "transformer", "--dataset", "text", "--layers", "2", "--d-model", "64", "--heads", "2",
               "--seq-len", "16", "--batch-size", "4"]


def parity_mode():
    mlp_base = ft_train.BASE
    # The transformer's runs take ft_train's flags but its model and data.
    transformer_base = [f for i, f in enumerate(mlp_base)
                        if f not in ("--dataset", "synthetic", "--mlp-dims") and mlp_base[i - 1] != "--mlp-dims"]
    for name, flags in dict(STRATEGIES, **{"DDP, transformer": TRANSFORMER}).items():
        sums = {}
        ft_train.BASE = transformer_base if flags is TRANSFORMER else mlp_base
        for mode in ("sync", "async"):
            rc, out, err = ft_train.run(["--replica-groups", "2", "--nproc", "2", "--steps", "60", "--quorum-mode", mode]
                                        + flags, lambda p: None)
            if rc != 0:
                sys.exit(f"FAILED ({name}, {mode}): exit {rc}\n{err[-3000:]}")
            reps = ft_train.reports(out)
            ft_train.check_same(reps, 2)
            if any(r["steps_not_committed"] or r["steps_healing"] or r["steps_committed"] != 60 for r in reps):
                sys.exit(f"FAILED ({name}, {mode}): a step did not commit with nothing failing: {reps}")
            sums[mode] = reps[0]["parameter_checksum"]
        if sums["sync"] != sums["async"]:
            sys.exit(f"FAILED ({name}): async ended with other parameters than sync: {sums}")
        print(f"{name}: async and sync end bit-identical (checksum {sums['async']})", flush=True)


def kill_mode():
    for name, flags in STRATEGIES.items():
        reps = ft_train.train_killing_group_1(2, 2, ["--steps", ft_train.steps(700)] + flags, name)
        survivor, healer = reps[0], reps[1]
        if survivor["steps_not_committed"] > 1 or survivor["steps_healing"]:
            sys.exit(f"FAILED ({name}): the survivor lost steps beyond the failure's: {survivor}")
        if survivor["snapshot_seconds"] <= 0 or survivor["serve_seconds"] <= 0:
            sys.exit(f"FAILED ({name}): the survivor did not serve a snapshot: {survivor}")
        if healer["steps_healing"] < 1:
            sys.exit(f"FAILED ({name}): the restarted group loaded its copy before forward (nothing overlapped): {healer}")
        print(f"{name}: a rank of group 1 killed; the survivor lost {survivor['steps_not_committed']} step, copied "
              f"{survivor['snapshot_seconds'] * 1e3:.1f} ms of snapshot and served it for {survivor['serve_seconds'] * 1e3:.1f} ms "
              f"beside its steps; group 1 healed {healer['heal_bytes']} B over {healer['steps_healing']} step(s) of zeros; "
              "parameters equal", flush=True)


class DelayProxy:
    """A TCP proxy on 127.0.0.1 that holds every byte `delay` seconds in each direction (bytes stay
    in order), on a thread of its own: a far lighthouse."""

    def __init__(self, target_port, delay):
        self.port = free_port()
        self.target_port, self.delay = target_port, delay
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait(10)

    def _run(self, started):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        started.set()
        self.loop.run_forever()

    async def _pump(self, reader, writer):
        queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await queue.get()
                if data is None:
                    writer.close()
                    return
                await asyncio.sleep(max(0.0, due - self.loop.time()))
                writer.write(data)
                await writer.drain()
        task = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(65536)
                await queue.put((self.loop.time() + self.delay, data or None))
                if not data:
                    break
        except (ConnectionError, OSError):
            await queue.put((0, None))
        await task

    async def _serve(self, reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)


def slow_lighthouse_mode():
    port = free_port()
    lh = subprocess.Popen([ft_train.BIN, "lighthouse", "--address", f"127.0.0.1:{port}", "--expected-groups", "2",
                           "--heartbeat-timeout-ms", "5000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if "listening on" not in lh.stdout.readline():
            sys.exit("FAILED: the lighthouse did not start")
        threading.Thread(target=lambda: [None for _ in lh.stdout], daemon=True).start()
        proxy = DelayProxy(port, 0.1)
        model = ["--mlp-dims", "512,2048,2048,10", "--batch-size", "2048", "--steps", "30"]
        medians = {}
        # Twice each, interleaved: the machine's drift between runs is not the lighthouse's.
        for attempt in range(2):
            for mode in ("async", "sync"):
                for where, lighthouse_port in (("direct", port), ("slow", proxy.port)):
                    rc, out, err = ft_train.run(["--replica-groups", "2", "--nproc", "1", "--quorum-mode", mode,
                                                 "--lighthouse", f"127.0.0.1:{lighthouse_port}"] + model, lambda p: None)
                    if rc != 0:
                        sys.exit(f"FAILED ({mode}, {where}): exit {rc}\n{err[-3000:]}")
                    reps = ft_train.reports(out)
                    ft_train.check_same(reps, 2)
                    ms = statistics.median(r["median_step_ms"] for r in reps)
                    medians.setdefault((mode, where), []).append(ms)
                    print(f"{mode:5} {where:6} median step {ms:8.1f} ms (quorum waits {sum(r['quorum_wait_seconds'] for r in reps):.2f} s)",
                          flush=True)
        best = {k: min(v) for k, v in medians.items()}
        async_change = best[("async", "slow")] / best[("async", "direct")] - 1
        sync_paid = best[("sync", "slow")] - best[("sync", "direct")]
        print(f"a lighthouse 200 ms slower on every round: async step {async_change * 100:+.2f} %, "
              f"sync step +{sync_paid:.0f} ms", flush=True)
        if sync_paid < 150:
            sys.exit("FAILED: the proxy did not slow the lighthouse (sync paid nothing): the check measures nothing")
        if async_change >= 0.02:
            sys.exit(f"FAILED: async's step changed by {async_change * 100:.2f} % (>= 2 %)")
    finally:
        lh.kill()
        lh.wait()


MODES = {"parity": parity_mode, "kill": kill_mode, "slow-lighthouse": slow_lighthouse_mode}

if __name__ == "__main__":
    ft_train.BIN = os.path.abspath(sys.argv[1])
    if sys.argv[2] not in MODES:
        sys.exit(f"unknown mode {sys.argv[2]}: {', '.join(MODES)}")
    MODES[sys.argv[2]]()
    print("ok")
