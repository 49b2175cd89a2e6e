#!/usr/bin/env python3
"""`ddpkit tune --json`: one row per configuration tried, the fastest marked, and arguments that
`ddpkit train` runs as they are.

  tests/tune_json.py DDPKIT CONSTANTS
"""
import json
import subprocess
import sys

ddpkit, constants = sys.argv[1], sys.argv[2]
model = ["--dataset", "synthetic", "--mlp-dims", "64,256,10", "--synthetic-size", "2048"]
out = subprocess.run([ddpkit, "tune", "--json", "--constants", constants, "--world-size", "2", "--top", "2",
                      "--trial-steps", "10", "--trial-rounds", "2", "--profile-steps", "2"] + model,
                     capture_output=True, text=True, timeout=240)
assert out.returncode == 0, out.stderr[-2000:]
rows = json.loads(out.stdout)  # stdout is the JSON alone
assert len(rows) == 2, rows
assert "# round 2 of 2" in out.stderr, out.stderr[-2000:]
ok = [r for r in rows if r["trial"] == "ok"]
assert ok, rows
for r in rows:
    for key in ("strategy", "hook", "bucket_cap_mb", "predicted_step_ms", "measured_step_ms", "trial_step_ms",
                "peak_rss_bytes", "trial", "fastest", "train_args"):
        assert key in r, (key, r)
for r in ok:
    assert len(r["trial_step_ms"]) == 2, r
    trials = sorted(r["trial_step_ms"])
    assert abs(r["measured_step_ms"] - (trials[0] + trials[1]) / 2) < 1e-6, r  # the median of two
    assert r["peak_rss_bytes"] > 0, r
fastest = [r for r in rows if r["fastest"]]
assert len(fastest) == 1 and fastest[0]["measured_step_ms"] == min(r["measured_step_ms"] for r in ok), rows
args = fastest[0]["train_args"]
assert args[:2] == ["--nproc", "2"] and "--json" not in args and "--constants" not in args, args
run = subprocess.run([ddpkit, "train", "--quiet", "--no-eval", "--steps", "3"] + args, capture_output=True, text=True,
                     timeout=120)
assert run.returncode == 0, run.stderr[-2000:]
assert json.loads(run.stdout.strip().splitlines()[-1])["world_size"] == 2, run.stdout[-500:]
print("ok")
