#!/usr/bin/python3
"""`ddpkit bench` report files: a two-hook comparison writes comparison.json and a self-contained
report.html; each hook's directory holds metrics.csv, metrics.json (per-trainer, all-trainer,
per-server and all-server tables with the seed's metric names), summary.json and a trace.json that
is valid Chrome-trace JSON with events from every rank."""
import csv
import json
import subprocess
import sys
import tempfile
import xml.dom.minidom

ddpkit = sys.argv[1]
with tempfile.TemporaryDirectory() as out:
    p = subprocess.run([ddpkit, "bench", "--seed-workload", "--hooks", "sparse_rpc,allreduce", "--data", "DummyDataSmall", "--model",
                        "DummyModelSmall", "--max-iterations", "3", "--warmup", "1", "--out-dir", out],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "sparse_rpc" in p.stdout and "allreduce" in p.stdout and "report: " in p.stdout, p.stdout
    assert "100%" in p.stderr, "progress bar missing: " + p.stderr[-500:]

    rows = list(csv.DictReader(open(f"{out}/sparse_rpc/metrics.csv")))
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
    tables = json.load(open(f"{out}/sparse_rpc/metrics.json"))
    assert tables["server0"]["param_index_batch"]["count"] == 3, tables["server0"]  # one sparse bucket a step

    summary = json.load(open(f"{out}/sparse_rpc/summary.json"))
    assert summary["hook"] == "sparse_rpc" and summary["server_gradients_averaged"] == 6, summary
    assert len(summary["loss"]) == 3 and len(summary["step_ms"]) == 3, summary

    trace = json.load(open(f"{out}/sparse_rpc/trace.json"))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["server 0", "trainer 0", "trainer 1"], processes
    for pid, name in processes.items():
        assert any(e["pid"] == pid for e in complete), f"no events from {name}"
    for e in complete:
        assert e["dur"] >= 0 and e["ts"] >= 0 and e["name"], e
    assert {"forward_pass", "backward", "rpc_sparse", "param_index_batch"} <= {e["name"] for e in complete}

    runs = json.load(open(f"{out}/comparison.json"))
    assert [r["hook"] for r in runs] == ["sparse_rpc", "allreduce"], runs
    html = open(f"{out}/report.html").read()
    assert html.startswith("<!DOCTYPE html>") and "http://" not in html.replace("http://www.w3.org/2000/svg", ""), \
        "the report must not load anything"
    svgs = html.split("<svg")[1:]
    assert len(svgs) == 4, len(svgs)
    for s in svgs:  # each chart is well-formed XML
        xml.dom.minidom.parseString("<svg" + s[:s.index("</svg>") + 6])
print("ok")
