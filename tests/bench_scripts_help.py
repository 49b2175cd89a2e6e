#!/usr/bin/python3
"""Every benchmark script with a command line answers --help: it imports (its helpers from the
other scripts included) and parses its flags without running anything. bench/scaling.py imported
a name plan_validation.py no longer had, and nothing ran it until the figures were wanted."""
import glob
import os
import subprocess
import sys

bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")
failed = []
for script in sorted(glob.glob(os.path.join(bench, "*.py"))):
    if "argparse" not in open(script).read():
        continue  # a worker another script starts (pytorch_peer.py, exchange_bench.py)
    p = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    if p.returncode != 0 or "usage:" not in p.stdout:
        failed.append(f"{os.path.basename(script)} (exit {p.returncode}): {p.stderr.strip()[-800:]}")
if failed:
    sys.exit("bench scripts that do not answer --help:\n" + "\n".join(failed))
print("ok")
