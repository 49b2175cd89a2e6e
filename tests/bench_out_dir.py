#!/usr/bin/python3
"""`ddpkit bench --out-dir`: metrics.csv, metrics.json and summary.json exist, parse, and hold the
per-trainer, all-trainer, per-server and all-server tables with the seed's metric names."""
import csv
import json
import subprocess
import sys
import tempfile

ddpkit = sys.argv[1]
with tempfile.TemporaryDirectory() as out:
    p = subprocess.run([ddpkit, "bench", "--hook", "sparse_rpc", "--trainers", "2", "--servers", "1", "--dim", "64",
                        "--layers", "2", "--sample-length", "32", "--sample-count", "128", "--iterations", "3",
                        "--warmup", "1", "--quiet", "--out-dir", out], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(open(f"{out}/metrics.csv")))
    sources = {r["source"] for r in rows}
    assert sources == {"trainer0", "trainer1", "all_trainers", "server0", "all_servers"}, sources
    names = {(r["source"], r["metric"]) for r in rows}
    for need in [("all_trainers", "batch_all"), ("all_trainers", "forward_pass"), ("all_trainers", "backward"),
                 ("all_trainers", "rpc_sparse"), ("all_trainers", "gloo_dense_allreduce"),
                 ("server0", "param_index_straggler"), ("server0", "param_index_batch"),
                 ("server0", "average computation")]:
        assert need in names, (need, sorted(names))
    batch = next(r for r in rows if r["source"] == "all_trainers" and r["metric"] == "batch_all")
    assert int(batch["count"]) == 6 and float(batch["min_ms"]) <= float(batch["p50_ms"]) <= float(batch["max_ms"]), batch
    tables = json.load(open(f"{out}/metrics.json"))
    assert tables["server0"]["param_index_batch"]["count"] == 3, tables["server0"]  # one sparse bucket a step
    summary = json.load(open(f"{out}/summary.json"))
    assert summary["hook"] == "sparse_rpc" and summary["server_gradients_averaged"] == 6, summary
print("ok")
