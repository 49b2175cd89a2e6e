#!/usr/bin/python3
"""`ddpkit ps-server` as a user runs it: starts, names its address, refuses bad flags, and stops
cleanly on SIGTERM with a summary."""
import os
import signal
import subprocess
import sys
import tempfile

ddpkit = sys.argv[1]


def expect_usage_error(args, text):
    p = subprocess.run([ddpkit, "ps-server"] + args, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and text in p.stderr, (args, p.returncode, p.stderr)


expect_usage_error([], "name the trainers served")
expect_usage_error(["--trainers", "2", "--class", "median"], "--class must be average or average_batch")
expect_usage_error(["--trainers", "2", "--tls-cert", "x.pem"], "--tls-cert and --tls-key go together")
expect_usage_error(["--trainers", "2", "--token-file", "/nonexistent/token"], "cannot be read")

with tempfile.NamedTemporaryFile("w", suffix=".token") as token:
    token.write("s3cret\n")
    token.flush()
    p = subprocess.Popen([ddpkit, "ps-server", "--trainer-ids", "0,1", "--address", "127.0.0.1:0",
                          "--token-file", token.name], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.startswith("ddpkit ps-server: listening on 127.0.0.1:"), line
    port = int(line.split("127.0.0.1:")[1].split()[0])
    assert port > 0, line
    p.send_signal(signal.SIGTERM)
    rest = p.stdout.read()
    assert p.wait(timeout=20) == 0
    assert "stopped by signal 15 after averaging 0 buckets" in rest, rest
print("ok")
