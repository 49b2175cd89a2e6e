#!/usr/bin/env python3
"""`ddpkit train --bucket-cap-mb auto [--piece-kb auto]` against the defaults (issue 33, docs/plan.md).

  bench/online_tuning_check.py DDPKIT [--steps N] [--repeats R] [--netns] [--only NAME,...]

Per configuration, the default run and the auto run alternate (default, auto, auto, default, ...)
R times each, on one host or on two network namespaces joined by a tc-limited veth (--netns, root).
Printed per configuration, medians over the repeats:
  default_ms   median step of the default run
  auto_ms      median step of the auto run over every step, its trials included
  tuned_ms     median step of the auto run after tuning ended (the steady state)
  tuned/def    tuned_ms / default_ms: what the choice gains or loses from then on
  run/def      the auto run's whole training time / the default's (trials' cost included)
  in-run       inside each auto run, the kept candidate's trial median / the default's (the same
               process, candidates taking turns: side by side, without the between-run spread)
  choice       the bucket cap (MiB) and piece size (KiB) the run kept, and its trial steps
Between runs of one configuration this 2-core VM moves by up to +-15 %; with the choice equal to the
default (same configuration), tuned/def is that spread alone.
The target: tuned/def <= 1.03 everywhere, <= 0.90 somewhere real (two hosts at 1 Gbit/s).
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_validation import MLP8, MLP25, MLP_FASHION, GPT, Hosts, train as local_train  # noqa: E402

# name: (world or ranks per host, rate (None: one host), flags, auto flags)
CAP = ["--bucket-cap-mb", "auto"]
CAP_PIECE = CAP + ["--piece-kb", "auto"]
CONFIGS = {
    "fashion-w2-ddp": (2, None, MLP_FASHION, CAP),
    "mlp25-w2-ddp": (2, None, MLP25, CAP),
    "mlp8-w2-fp16": (2, None, MLP8 + ["--hook", "fp16"], CAP_PIECE),
    "gpt-w2-ddp": (2, None, GPT, CAP),
}
NETNS_CONFIGS = {
    "mlp8-h2-1g-ddp": (1, "1gbit", MLP8, CAP),
    "mlp8-h2-1g-fp16": (1, "1gbit", MLP8 + ["--hook", "fp16"], CAP_PIECE),
    "mlp8-h2-1g-int8": (1, "1gbit", MLP8 + ["--hook", "int8"], CAP_PIECE),
    "mlp25-h2-1g-ddp": (1, "1gbit", MLP25, CAP),
    "mlp8-h2-10g-ddp": (1, "10gbit", MLP8, CAP),
    "mlp25-h2-10g-ddp": (1, "10gbit", MLP25, CAP),
    "gpt-h2-10g-ddp": (1, "10gbit", GPT, CAP),
    "gpt-h2-1g-ddp": (1, "1gbit", GPT, CAP),
    "fashion-h2-1g-ddp": (1, "1gbit", MLP_FASHION, CAP),
    "mlp8-h2-100m-fp16": (1, "100mbit", MLP8 + ["--hook", "fp16"], CAP_PIECE),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ddpkit")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--netns", action="store_true")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    configs = dict(CONFIGS, **(NETNS_CONFIGS if a.netns else {}))
    if a.only:
        configs = {k: v for k, v in {**CONFIGS, **NETNS_CONFIGS}.items() if k in a.only.split(",")}
    hosts = Hosts().__enter__() if any(v[1] for v in configs.values()) else None
    print(f"# {a.steps} steps per run, {a.repeats} runs each, alternating; medians over runs")
    print(f"{'config':22} {'default_ms':>10} {'auto_ms':>8} {'tuned_ms':>8} {'tuned/def':>9} {'run/def':>8} {'in-run':>12}  choice")
    try:
        for name, (n, rate, flags, auto) in configs.items():
            if rate:
                hosts.set_rate(rate)
                run = lambda fl: hosts.train(a.ddpkit, 2, n, fl, a.steps)  # noqa: E731
            else:
                run = lambda fl: local_train(a.ddpkit, n, fl, a.steps)  # noqa: E731
            runs = {"default": [], "auto": []}
            for i in range(a.repeats):
                for kind in (["default", "auto"] if i % 2 == 0 else ["auto", "default"]):
                    runs[kind].append(run(flags + (auto if kind == "auto" else [])))
            med = lambda kind, key: statistics.median(r[key] for r in runs[kind])  # noqa: E731
            # Whole training time: steps / samples per second (samples_per_s counts every step).
            run_time = lambda kind: statistics.median(1 / r["samples_per_s"] for r in runs[kind])  # noqa: E731
            d, au = med("default", "median_step_ms"), med("auto", "median_step_ms")
            tuned = statistics.median(r["tuned_median_step_ms"] or r["median_step_ms"] for r in runs["auto"])
            in_run = []
            for r in runs["auto"]:
                trials = r["tuning_trials"]
                kept = [t for t in trials if t["bucket_cap_mb"] == r["bucket_cap_mb"] and t["piece_kb"] == r["piece_kb"]]
                if trials and kept and trials[0]["median_step_ms"] > 0:
                    in_run.append(f"{kept[-1]['median_step_ms'] / trials[0]['median_step_ms']:.3f}")
            choices = sorted({f"{r['bucket_cap_mb']:g}MiB/{r['piece_kb']}KiB/{r['tuning_steps']}st" for r in runs["auto"]})
            print(f"{name:22} {d:10.1f} {au:8.1f} {tuned:8.1f} {tuned / d:9.3f} {run_time('auto') / run_time('default'):8.3f}"
                  f" {','.join(in_run) or '-':>12}  {' '.join(choices)}", flush=True)
    finally:
        if hosts:
            hosts.__exit__(None, None, None)


if __name__ == "__main__":
    main()
