#!/usr/bin/python3
"""Each lossy hook reaches Fashion-MNIST test accuracy within 1.5 points of fp32 allreduce after
the same epochs (2 ranks, ddpkit train's default run otherwise).

    tests/hook_convergence.py build/ddpkit [--epochs 3]
    tests/hook_convergence.py build/ddpkit --defaults --epochs 1   # every --hook with no other flag

With --defaults every hook the CLI offers runs at its defaults (and under the divergence guard,
which would stop a run that lost what it learned).
"""
import json
import subprocess
import sys

LOSSY = [
    ["--hook", "fp16"],
    ["--hook", "bf16"],
    ["--hook", "int8"],
    ["--hook", "int8", "--int8-error-feedback"],
    ["--hook", "quantize_per_tensor"],
    ["--hook", "quantize_per_channel"],
    ["--hook", "powersgd", "--powersgd-rank", "4"],
    ["--hook", "batched_powersgd", "--powersgd-rank", "32"],
    ["--hook", "post_local_sgd", "--local-sgd-start-iter", "200", "--local-sgd-period", "4"],
    ["--optimizer-in-hook"],
]
DEFAULTS = [["--hook", h] for h in ("fp16", "bf16", "noop", "fp16_wrapper", "bf16_wrapper", "int8",
                                    "quantize_per_tensor", "quantize_per_channel", "powersgd", "batched_powersgd",
                                    "post_local_sgd")]


def run(binary, flags, epochs):
    cmd = [binary, "train", "--quiet", "--epochs", str(epochs)] + flags
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["test_accuracy"]


def main():
    binary = sys.argv[1]
    epochs = int(sys.argv[sys.argv.index("--epochs") + 1]) if "--epochs" in sys.argv else 3
    base = run(binary, ["--hook", "allreduce"], epochs)
    print(f"allreduce: {base:.4f}")
    failed = []
    for flags in DEFAULTS if "--defaults" in sys.argv else LOSSY:
        acc = run(binary, flags, epochs)
        ok = acc >= base - 0.015
        print(f"{' '.join(flags)}: {acc:.4f} ({(acc - base) * 100:+.2f} points){'' if ok else '  <- more than 1.5 below'}")
        if not ok:
            failed.append(flags)
    if failed:
        sys.exit(f"{len(failed)} hook(s) more than 1.5 points below allreduce")
    print("all hooks within 1.5 points of allreduce")


if __name__ == "__main__":
    main()
