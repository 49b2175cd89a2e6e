"""One site rank of examples/python/diloco_sites.py, with the test's hooks (test_diloco_api.py).

--corrupt-at STEP: after inner step STEP this site's global parameters are changed in place, as a
bit flip in memory would (the DiLoCo's own tensors, through its binding). Every run prints, on the
monotonic clock every process shares, when its last inner step ended ("last step done at T") and
when its Manager had closed ("closed at T"), for the test's exit-time check. A site that finds the
job finished prints so and exits 0, as a user's program would."""
import argparse
import importlib.util
import os
import sys
import time

import torch

import ddpkit.ft

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                       "python", "diloco_sites.py")


def example():
    spec = importlib.util.spec_from_file_location("diloco_sites", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--corrupt-at", type=int, default=-1)
    hooks, rest = own.parse_known_args()
    ex = example()
    args = ex.parse_args(rest)

    def after_step(diloco, model):
        if diloco.inner_steps == hooks.corrupt_at:
            with torch.no_grad():
                for i in range(len(diloco.fragments)):
                    diloco._diloco.global_parameters(i).add_(0.01)
        if diloco.inner_steps == args.steps:
            print(f"last step done at {time.monotonic():.6f}", flush=True)

    try:
        ex.train(args, after_step)
    except ddpkit.ft.JobFinished as e:
        print(f"site {args.site}: nothing to do: {e}", flush=True)
        return
    print(f"closed at {time.monotonic():.6f}", flush=True)


if __name__ == "__main__":
    main()
