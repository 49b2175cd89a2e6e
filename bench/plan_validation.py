#!/usr/bin/env python3
"""`ddpkit plan`'s predictions against measured `ddpkit train` steps (issue 33, docs/plan.md).

  bench/plan_validation.py DDPKIT [--only NAME,...] [--steps N] [--min-timed-s S] [--out FILE] [--max-step-error X]
                           [--max-memory-error X] [--constants FILE] [--describe PREFIX=FILE]

For each configuration: `ddpkit plan --json` predicts the step time and peak memory per rank of
exactly that job (same model, world size, strategy, hook, bucket cap, batch, optimizer), then
`ddpkit train` runs it for --steps steps (more where the predicted step is short, so that they
span --min-timed-s) and reports its median step and the largest rank's peak
resident memory. Prints one row per configuration with both and the relative errors, and exits 1
when any error is beyond the limits (default 20 % step, 10 % memory): the test that fails when the
model drifts (ctest plan.validation runs a fixed subset).

With --describe (e.g. mlp25=bench/described/mlp25.json), configurations named PREFIX-... are
predicted from that description of their model (`ddpkit plan --describe`: shapes and GFLOP, no
profile) and measured as usual: the check of a described model against the real one.

Measured steps on this 2-core VM vary by up to +-40 % between runs of the same job, and so does the
profile a prediction rests on. So every configuration is predicted and measured --repeats times
(default 3), in rounds over all of them, after one warm-up job that is not scored; the row scored
takes the median of each figure over its runs. Each run's row is printed as it comes.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

MLP25 = ["--dataset", "synthetic"]                                     # 1024,4096,4096,1024: 25.2M
MLP8 = ["--dataset", "synthetic", "--mlp-dims", "1024,2048,2048,1024"]  # 8.4M
MLP_FASHION = ["--model", "mlp"]                                         # 784,512,256,10: 0.5M
CNN = ["--model", "cnn"]
GPT = ["--model", "transformer", "--batch-size", "16"]
FSDP_UNITS = ["--fsdp-min-unit-params", "1000"]

# name: (world, train flags). Names say model, world, strategy/hook.
CONFIGS = {
    "mlp25-w1-ddp": (1, MLP25),
    "mlp25-w2-ddp": (2, MLP25),
    "mlp25-w4-ddp": (4, MLP25),
    "mlp25-w2-fp16": (2, MLP25 + ["--hook", "fp16"]),
    "mlp25-w2-int8": (2, MLP25 + ["--hook", "int8"]),
    "mlp25-w2-powersgd": (2, MLP25 + ["--hook", "powersgd", "--powersgd-start-iter", "2"]),
    "mlp25-w2-allreduce": (2, MLP25 + ["--hook", "allreduce"]),
    "mlp25-w2-zero1": (2, MLP25 + ["--zero", "1"]),
    "mlp25-w2-zero2": (2, MLP25 + ["--zero", "2"]),
    "mlp25-w2-full_shard": (2, MLP25 + ["--fsdp", "full_shard"] + FSDP_UNITS),
    "mlp25-w4-full_shard": (4, MLP25 + ["--fsdp", "full_shard"] + FSDP_UNITS),
    "mlp25-w2-shard_grad_op": (2, MLP25 + ["--fsdp", "shard_grad_op"] + FSDP_UNITS),
    "mlp25-w2-no_shard": (2, MLP25 + ["--fsdp", "no_shard"] + FSDP_UNITS),
    "mlp25-w2-adam": (2, MLP25 + ["--optimizer", "adam"]),
    "mlp8-w2-ddp": (2, MLP8),
    "mlp8-w4-fp16": (4, MLP8 + ["--hook", "fp16"]),
    "mlp8-w8-ddp": (8, MLP8),
    "mlp8-w4-zero1": (4, MLP8 + ["--zero", "1"]),
    "mlp8-w4-full_shard": (4, MLP8 + ["--fsdp", "full_shard"] + FSDP_UNITS),
    "mlp8-w2-bf16": (2, MLP8 + ["--hook", "bf16"]),
    "mlp8-w1-ddp": (1, MLP8),
    "gpt-w2-ddp": (2, GPT),
    "gpt-w2-full_shard": (2, GPT + ["--fsdp", "full_shard"]),
    "gpt-w4-fp16": (4, GPT + ["--hook", "fp16"]),
    "mlp25-w2-fp16_wrapper": (2, MLP25 + ["--hook", "fp16_wrapper"]),
    "mlp25-w2-quantize_per_tensor": (2, MLP25 + ["--hook", "quantize_per_tensor"]),
    "mlp25-w2-quantize_per_channel": (2, MLP25 + ["--hook", "quantize_per_channel"]),
    "mlp25-w2-batched_powersgd": (2, MLP25 + ["--hook", "batched_powersgd", "--powersgd-start-iter", "2"]),
    # A rank between the two the products are calibrated at (4 and 32).
    "mlp25-w2-powersgd-r16": (2, MLP25 + ["--hook", "powersgd", "--powersgd-rank", "16", "--powersgd-start-iter", "2"]),
    # Averaging every step: a median step is then the mean step the plan predicts.
    "mlp25-w2-post_local_sgd": (2, MLP25 + ["--hook", "post_local_sgd", "--local-sgd-start-iter", "2",
                                            "--local-sgd-period", "1"]),
    # The optimizer in the hook (--optimizer-in-hook), and local SGD's gradients within groups.
    "mlp25-w2-allreduce+optimizer": (2, MLP25 + ["--hook", "allreduce", "--optimizer-in-hook"]),
    "mlp8-w2-adam+optimizer": (2, MLP8 + ["--optimizer", "adam", "--optimizer-in-hook"]),
    "mlp8-w4-post_local_sgd-g2": (4, MLP8 + ["--hook", "post_local_sgd", "--local-sgd-start-iter", "2",
                                            "--local-sgd-period", "1", "--local-sgd-group-size", "2"]),
    # FSDP's mixed precision: units gathered and computed in bf16 (3x slower than fp32 on this CPU).
    "mlp8-w2-full_shard-mp_bf16": (2, MLP8 + ["--fsdp", "full_shard", "--fsdp-param-dtype", "bf16"] + FSDP_UNITS),
    "mlp25-w2-shard_grad_op-mp_bf16": (2, MLP25 + ["--fsdp", "shard_grad_op", "--fsdp-param-dtype", "bf16"] + FSDP_UNITS),
    "mlp8-w2-no_shard-mp_bf16_reduce_fp32": (2, MLP8 + ["--fsdp", "no_shard", "--fsdp-param-dtype", "bf16",
                                                      "--fsdp-reduce-dtype", "fp32"] + FSDP_UNITS),
    "gpt-w2-full_shard-mp_bf16": (2, GPT + ["--fsdp", "full_shard", "--fsdp-param-dtype", "bf16"]),
    "gpt-w4-shard_grad_op-mp_bf16": (4, GPT + ["--fsdp", "shard_grad_op", "--fsdp-param-dtype", "bf16"]),
    "cnn-w2-full_shard-mp_bf16": (2, CNN + ["--fsdp", "full_shard", "--fsdp-param-dtype", "bf16"] + FSDP_UNITS),
    "cnn-w2-ddp": (2, CNN),
    "fashion-w2-ddp": (2, MLP_FASHION),
}
# Several hosts: network namespaces on one bridge, each host's link limited by tc tbf to the rate.
# name: (hosts, ranks per host, rate, Gbit/s, train flags). The "hosts" share this machine's 2
# cores, so the plan is told one core per host; with 3 and 4 hosts that overstates their cores,
# so those run at 100 Mbit/s, where the links dominate the step.
NETNS_CONFIGS = {
    "mlp8-h2-1g-ddp": (2, 1, "1gbit", 1, MLP8),
    "mlp8-h2-1g-fp16": (2, 1, "1gbit", 1, MLP8 + ["--hook", "fp16"]),
    "mlp8-h2-1g-int8": (2, 1, "1gbit", 1, MLP8 + ["--hook", "int8"]),
    "mlp8-h2-1g-powersgd": (2, 1, "1gbit", 1, MLP8 + ["--hook", "powersgd", "--powersgd-start-iter", "2"]),
    "mlp8-h2-1g-full_shard": (2, 1, "1gbit", 1, MLP8 + ["--fsdp", "full_shard"] + FSDP_UNITS),
    "mlp8-h2-1g-quantize_per_channel": (2, 1, "1gbit", 1, MLP8 + ["--hook", "quantize_per_channel"]),
    "mlp8-h2-1g-batched_powersgd": (2, 1, "1gbit", 1, MLP8 + ["--hook", "batched_powersgd", "--powersgd-start-iter", "2"]),
    "mlp8-h2-1g-post_local_sgd": (2, 1, "1gbit", 1, MLP8 + ["--hook", "post_local_sgd", "--local-sgd-start-iter", "2",
                                                            "--local-sgd-period", "1"]),
    "mlp8-h2-1g-fp16+optimizer": (2, 1, "1gbit", 1, MLP8 + ["--hook", "fp16", "--optimizer-in-hook"]),
    "mlp8-h2x2-1g-post_local_sgd-g2": (2, 2, "1gbit", 1, MLP8 + ["--hook", "post_local_sgd", "--local-sgd-start-iter", "2",
                                                                "--local-sgd-period", "1", "--local-sgd-group-size", "2"]),
    "mlp8-h2-1g-full_shard-mp_bf16": (2, 1, "1gbit", 1, MLP8 + ["--fsdp", "full_shard", "--fsdp-param-dtype", "bf16"]
                                      + FSDP_UNITS),
    "mlp8-h2-100m-fp16": (2, 1, "100mbit", 0.1, MLP8 + ["--hook", "fp16"]),
    "mlp8-h2-10g-ddp": (2, 1, "10gbit", 10, MLP8),
    "mlp8-h2x2-1g-ddp": (2, 2, "1gbit", 1, MLP8),
    "mlp8-h3-100m-ddp": (3, 1, "100mbit", 0.1, MLP8),
    "mlp8-h4-100m-ddp": (4, 1, "100mbit", 0.1, MLP8),
    "mlp8-h4-100m-fp16": (4, 1, "100mbit", 0.1, MLP8 + ["--hook", "fp16"]),
    # The transformer at 1 Gbit/s, where the link takes about as long as backward: at the default
    # cap and at the one `plan --bucket-cap-mb auto` chooses (1 MiB), for fp32 and int8.
    "gpt-h2-1g-ddp": (2, 1, "1gbit", 1, GPT),
    "gpt-h2-1g-ddp-1mb": (2, 1, "1gbit", 1, GPT + ["--bucket-cap-mb", "1"]),
    "gpt-h2-1g-int8": (2, 1, "1gbit", 1, GPT + ["--hook", "int8"]),
    "gpt-h2-1g-int8-1mb": (2, 1, "1gbit", 1, GPT + ["--hook", "int8", "--bucket-cap-mb", "1"]),
}
SUBSET = ["mlp8-w2-ddp", "mlp8-w2-bf16", "mlp8-w4-full_shard", "mlp8-w4-zero1"]


def train(ddpkit, world, flags, steps):
    cmd = [ddpkit, "train", "--quiet", "--no-eval", "--nproc", str(world), "--steps", str(steps)] + flags
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plan_flags(flags):
    """`ddpkit train` flags as `ddpkit plan` takes them: one strategy and hook."""
    out, strategy, hook, i = [], "ddp", "none", 0
    while i < len(flags):
        name, value = flags[i], flags[i + 1] if i + 1 < len(flags) else None
        if name == "--zero":
            strategy = "zero" + value
        elif name == "--fsdp":
            strategy = value
        elif name == "--hook":
            hook = value
        elif name in ("--powersgd-start-iter", "--local-sgd-start-iter"):
            pass  # the steps measured are PowerSGD's (local SGD's); the plan predicts those
        else:
            out.append(name)
            if value is not None and not value.startswith("--"):
                out.append(value)
            else:
                i -= 1
        i += 2
    return out + ["--strategy", strategy, "--hook", hook]


class Hosts:
    """Namespaces TAGh0..TAGh3 at 10.78.0.1-4 on one bridge, made once; each configuration uses the
    first `hosts` of them, its rate set on each."""
    TAG, COUNT = "ddpkplan", 4
    ADDRS = [f"10.78.0.{i + 1}" for i in range(COUNT)]

    def __enter__(self):
        import two_hosts
        self.mod = two_hosts
        two_hosts.remove(self.TAG)
        self.hosts = two_hosts.create_switched(self.TAG, self.ADDRS)
        self.port = 29700
        return self

    def __exit__(self, *exc):
        self.mod.remove(self.TAG)

    @staticmethod
    def burst(rate):
        """2 ms at the rate (at least 64 KB). tbf lets the bucket fill while a rank computes, and a
        step then sends that much at the wire's own speed: a 2 MB burst gave a "1 Gbit/s" link 2 MB
        a step for free, a quarter of int8's bytes (steps 20-30 % faster than the rate allows)."""
        units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
        for unit, scale in units.items():
            if rate.endswith(unit):
                return f"{max(64, int(float(rate[:-len(unit)]) * scale / 8 * 0.002 / 1024))}kb"
        raise ValueError(f"rate {rate!r}: expected <number>kbit|mbit|gbit")

    def set_rate(self, rate):
        for ns, dev in self.hosts:
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
                            self.burst(rate), "latency", os.environ.get("DDPKIT_TBF_LATENCY", "50ms")], check=True)

    def train(self, ddpkit, hosts, per_host, flags, steps):
        self.port += 1
        world = hosts * per_host
        procs = []
        for h, (ns, dev) in enumerate(self.hosts[:hosts]):
            for local in range(per_host):
                rank = h * per_host + local
                env = ["env", f"RANK={rank}", f"WORLD_SIZE={world}", f"LOCAL_RANK={local}",
                       f"MASTER_ADDR={self.ADDRS[0]}", f"MASTER_PORT={self.port}", f"GLOO_SOCKET_IFNAME={dev}",
                       "OMP_NUM_THREADS=1"]
                cmd = ["ip", "netns", "exec", ns] + env + ["timeout", "900", ddpkit, "train", "--quiet", "--no-eval",
                                                           "--steps", str(steps), "--timeout-s", "300"] + flags
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate() for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{hosts}-host train {flags} failed: {[o[1][-1500:] for o in outs]}")
        return json.loads(outs[0][0].strip().splitlines()[-1])


def described_flags(flags, description):
    """plan_flags for a described model: the description stands for the model and data flags."""
    keep = {"--optimizer", "--bucket-cap-mb", "--powersgd-rank", "--strategy", "--hook"}
    planned = plan_flags(flags)
    out = ["--describe", description]
    for i, name in enumerate(planned):
        if name in keep:
            out += [name, planned[i + 1]]
    return out


def predict(ddpkit, world, flags, constants, extra=(), description=None):
    model = described_flags(flags, description) if description else plan_flags(flags)
    cmd = [ddpkit, "plan", "--json", "--world-size", str(world)] + list(extra) + model
    if constants:
        cmd += ["--constants", constants]
    # The environment the jobs train in: the plan's one-rank run measures memory that OpenMP's and
    # OpenBLAS's thread pools change (mlp8: 380 MB without OMP_NUM_THREADS=1, 355 with).
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    rows = json.loads(out.stdout)
    if len(rows) != 1:
        raise RuntimeError(f"{' '.join(cmd)} gave {len(rows)} rows, expected the one configuration")
    return rows[0]


def run_once(a, n, net):
    """One prediction and one measured job of configuration n: (world, flags, pred, meas, seconds)."""
    t0 = time.time()
    if n in NETNS_CONFIGS:
        hosts, per_host, rate, gbit, flags = NETNS_CONFIGS[n]
        world = hosts * per_host
        extra = ["--hosts", str(hosts), "--link-gbit", str(gbit), "--cores-per-host", "1", "--hosts-on-this-machine"]
        pred = None if a.measure_only else predict(a.ddpkit, world, flags, a.constants, extra)
        net.set_rate(rate)
        meas = net.train(a.ddpkit, hosts, per_host, flags, steps_for(a, pred))
    else:
        world, flags = CONFIGS[n]
        described = [d.split("=", 1)[1] for d in a.describe if n.startswith(d.split("=", 1)[0] + "-")]
        pred = None if a.measure_only else predict(a.ddpkit, world, flags, a.constants,
                                                   description=described[0] if described else None)
        meas = train(a.ddpkit, world, flags, steps_for(a, pred))
    return world, flags, pred, meas, time.time() - t0


def steps_for(a, pred):
    """--steps, or more where the predicted steps are short: the median then spans at least
    --min-timed-s of training, longer than this VM's slow spells (fashion's 4 ms steps measured
    2.9-5.8 ms over 25 steps, 3.9-4.3 over 200)."""
    if not pred or pred["predicted_step_ms"] <= 0:
        return a.steps
    return max(a.steps, math.ceil(a.min_timed_s * 1000 / pred["predicted_step_ms"]))


def median(values):
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def score(n, world, flags, runs, a, failed, flag=True):
    """The row of configuration n over its runs [(pred, meas, seconds)]: each figure the median of
    its runs, the measured step's spread beside it."""
    preds = [p for p, _, _ in runs if p]
    meas = [m for _, m, _ in runs]
    steps = [m["median_step_ms"] for m in meas]
    row = {"name": n, "world": world, "flags": flags, "runs": len(runs),
           "measured_step_ms": median(steps), "measured_step_ms_runs": steps,
           "measured_peak_rss_bytes": median([m["peak_rss_bytes"] for m in meas]),
           "seconds": round(sum(s for _, _, s in runs), 1)}
    for key in ("forward", "backward", "optimizer"):
        row[f"measured_{key}_ms"] = median([m[f"median_{key}_ms"] for m in meas])
    row["measured_bytes_sent_per_step"] = median([m["bytes_sent_per_step"] for m in meas])
    spread = f"{min(steps):7.1f}-{max(steps):<7.1f}" if len(steps) > 1 else ""
    line = f"{n:24} "
    if preds:
        pred_steps = [p["predicted_step_ms"] for p in preds]
        row.update(predicted_step_ms=median(pred_steps), predicted_step_ms_runs=pred_steps,
                   predicted_memory_bytes=median([p["memory_per_rank_bytes"] for p in preds]),
                   predicted_wire_bytes=median([p["wire_bytes_per_step"] for p in preds]))
        step_err = row["predicted_step_ms"] / row["measured_step_ms"] - 1
        mem_err = row["predicted_memory_bytes"] / row["measured_peak_rss_bytes"] - 1
        row.update(step_error=step_err, memory_error=mem_err)
        line += f"{row['predicted_step_ms']:8.1f} {row['measured_step_ms']:8.1f} {step_err:+6.1%}  "
        line += f"{row['predicted_memory_bytes'] / 2**20:8.0f} {row['measured_peak_rss_bytes'] / 2**20:8.0f} {mem_err:+6.1%}"
        line += f"  {spread}"
        if abs(step_err) > a.max_step_error or abs(mem_err) > a.max_memory_error:
            failed.append(n)
            line += "  <- beyond the limits" if flag else ""
    else:
        line += f"{'':8} {row['measured_step_ms']:8.1f} {'':6}  {'':8} {row['measured_peak_rss_bytes'] / 2**20:8.0f}"
        line += f"{'':7}  {spread}"
    return row, line


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ddpkit")
    ap.add_argument("--only", default="", help="comma-separated names, or 'subset'")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of every configuration, in rounds; each figure scored is the median of its runs")
    ap.add_argument("--min-timed-s", type=float, default=1.0,
                    help="more steps than --steps where the predicted ones are short, so that a job's timed steps span this long")
    ap.add_argument("--out", default="")
    ap.add_argument("--constants", default="")
    ap.add_argument("--measure-only", action="store_true")
    ap.add_argument("--netns", action="store_true", help="also the configurations of 2-4 hosts in network namespaces (root, ip, tc)")
    ap.add_argument("--max-step-error", type=float, default=0.20)
    ap.add_argument("--max-memory-error", type=float, default=0.10)
    ap.add_argument("--describe", action="append", default=[], metavar="PREFIX=FILE",
                    help="predict configurations PREFIX-... from this model description")
    a = ap.parse_args()
    known = dict(CONFIGS, **NETNS_CONFIGS)
    names = (list(CONFIGS) + (list(NETNS_CONFIGS) if a.netns else [])) if not a.only else \
        SUBSET if a.only == "subset" else a.only.split(",")
    for n in names:
        if n not in known:
            sys.exit(f"unknown configuration {n!r}; known: {', '.join(known)}")
    train(a.ddpkit, 2, MLP8, 10)  # warm-up: page cache, first-run costs; not scored
    header = f"{'configuration':24} {'pred_ms':>8} {'meas_ms':>8} {'err':>6}  {'pred_MB':>8} {'meas_MB':>8} {'err':>6}"
    runs = {n: [] for n in names}
    shapes, rows, failed = {}, [], []
    net = Hosts().__enter__() if any(n in NETNS_CONFIGS for n in names) else None
    try:
        # Round after round over every configuration: a slow spell of this shared VM lands on one
        # run of several configurations rather than on every run of one.
        for rnd in range(a.repeats):
            if a.repeats > 1:
                print(f"# round {rnd + 1} of {a.repeats}", flush=True)
            print(header, flush=True)
            for n in names:
                world, flags, pred, meas, seconds = run_once(a, n, net)
                shapes[n] = (world, flags)
                runs[n].append((pred, meas, seconds))
                _, line = score(n, world, flags, runs[n][-1:], a, [], flag=a.repeats == 1)
                print(line, flush=True)
                if a.out:  # after every run: a run cut short keeps what it measured
                    with open(a.out, "w") as f:
                        json.dump([score(m, *shapes[m], runs[m], a, [])[0] for m in names if runs[m]], f, indent=1)
    finally:
        if net:
            net.__exit__(None, None, None)
    if a.repeats > 1:
        print(f"# medians of {a.repeats} runs (predicted and measured), the measured steps' range last", flush=True)
        print(header + f"  {'meas_ms range':>15}", flush=True)
        for n in names:
            row, line = score(n, *shapes[n], runs[n], a, failed)
            rows.append(row)
            print(line, flush=True)
    else:
        for n in names:
            rows.append(score(n, *shapes[n], runs[n], a, failed)[0])
    if failed:
        print(f"beyond {a.max_step_error:.0%} step / {a.max_memory_error:.0%} memory: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
