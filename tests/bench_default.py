#!/usr/bin/python3
"""`ddpkit bench` with no workload flags, as the README runs it: the default workload learns
(every hook's loss falls well below ln 10 = 2.30 and reaches the target), the table has a
time-to-target column, columns that do not apply show "-", and report.html has the loss against
wall-clock chart and no line a 1280-pixel window would have to scroll for."""
import json
import math
import re
import subprocess
import sys
import tempfile

ddpkit = sys.argv[1]
with tempfile.TemporaryDirectory() as out:
    p = subprocess.run([ddpkit, "bench", "--hooks", "allreduce,int8,rpc", "--no-tables",
                        "--out-dir", out], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    runs = json.load(open(f"{out}/comparison.json"))
    assert [r["hook"] for r in runs] == ["allreduce", "int8", "rpc"], runs
    for r in runs:
        assert r["model"] == "MLP" and r["data"] == "FashionMNIST", r
        first = sum(r["loss"][:10]) / 10
        last = sum(r["loss"][-20:]) / 20
        assert first > 1.5 and last < 0.9, (r["hook"], first, last)  # it learns
        assert r["target_loss"] == 0.6 and 0 < r["time_to_target_s"] <= sum(r["step_ms"]) / 1000, r["hook"]
        assert 50 * 2**20 < r["peak_rss_bytes"] < 8 * 2**30, r  # the largest trainer's memory, beside its time
        # Shared pages counted in proportion: never more than every page mapped, and most of it here.
        assert 0.3 * r["peak_rss_bytes"] < r["peak_pss_bytes"] < 2 * r["peak_rss_bytes"], r
        assert 0 < r["mean_peak_pss_bytes"] <= r["peak_pss_bytes"], r

    lines = p.stdout.splitlines()
    header = next(i for i, l in enumerate(lines) if l.startswith("hook"))
    assert "to_target_s" in lines[header] and lines[header].split()[5:7] == ["peak_MB", "pss_MB"], lines[header]
    rows = {l.split()[0]: l.split() for l in lines[header + 1:header + 4]}
    assert all(float(row[5]) > 50 and 0 < float(row[6]) < 2 * float(row[5]) for row in rows.values()), rows  # MB per hook
    assert rows["allreduce"][7] == "-" and rows["int8"][7] == "-", rows  # no server for these hooks
    assert float(rows["rpc"][7]) > 0, rows
    assert all(re.fullmatch(r"[0-9.]+", rows[h][8]) for h in rows), rows

    html = open(f"{out}/report.html").read()
    assert "Loss against wall-clock time" in html and "target loss 0.600" in html
    assert "<table>" in html and "<pre>" not in html
    for m in re.finditer(r"<svg[^>]*width='(\d+)'", html):
        assert int(m.group(1)) <= 600, m.group(0)  # two per row in 1280 pixels
    assert "max-width:1200px" in html
    seed = subprocess.run([ddpkit, "bench", "--seed-workload", "--hook", "allreduce", "--max-iterations", "3",
                           "--warmup", "1", "--quiet", "--out-dir", f"{out}/seed"], capture_output=True, text=True,
                          timeout=120)
    assert seed.returncode == 0, seed.stderr[-2000:]
    line = json.loads(next(l for l in seed.stdout.splitlines() if l.startswith("{")))
    assert line["model"] == "DummyModelSparse" and line["batch_size"] == 16 and "time_to_target_s" not in line, line
    assert abs(line["final_loss"] - math.log(1024)) < 0.01, line  # the seed's model does not learn at lr 1e-4
print("ok")
