#!/usr/bin/python3
"""Every program the project builds answers bad input as the CLI does: a message that names the
program and what is wrong, exit status 2 for a usage error (1 for another failure), and never
std::terminate's "terminate called after throwing" or a stack trace.

    tests/program_errors.py BUILD_DIR
"""
import os
import subprocess
import sys

CRASH_SIGNS = ("terminate called", "Exception raised from", "frame #", "Aborted", "core dumped")
# What the test's own environment may carry from a launcher around it: the cases run without one.
ENGINE_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PET_", "TORCHELASTIC_")
ENGINE_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "DDPKIT_LAUNCHED")


def cases(build):
    # (program, arguments, status, what stderr must say[, environment added])
    out = [
        ("ddpkit", ["train", "--epochz", "3"], 2, "ddpkit: unknown flag --epochz"),
        ("collective_bench", ["--frobnicate"], 2, "collective_bench: unknown argument '--frobnicate'"),
        ("collective_bench", ["--reps", "0"], 2, "collective_bench: --ranks, --reps and --max-mb must be positive"),
        ("collective_bench", ["--processes"], 2, "collective_bench: --processes runs one rank per process and finds no "
                                                 "launcher's variables"),
        ("codec_bench", ["--elements"], 2, "usage: codec_bench"),
        ("codec_bench", ["--frobnicate", "1"], 2, "usage: codec_bench"),
        ("codec_bench", ["--reps", "0"], 2, "codec_bench: --elements and --reps must be positive"),
        ("ps_server_bench", ["--trainers", "0"], 2, "usage: ps_server_bench"),
        ("tests/train_mlp_example", ["--epochs"], 2, "usage: train_mlp"),
        # A partial launch environment: init_process_group's error, in one line, from the example's main.
        ("tests/train_mlp_example", [], 1, "WORLD_SIZE", {"RANK": "0"}),
    ]
    if os.path.exists(os.path.join(build, "fsdp_cuda_bench")):
        out.append(("fsdp_cuda_bench", ["--frobnicate"], 2, "usage: fsdp_cuda_bench"))
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build = os.path.abspath(sys.argv[1])
    env = {k: v for k, v in os.environ.items() if k not in ENGINE_VARS and not k.startswith(ENGINE_PREFIXES)}
    failed = 0
    for program, args, status, says, *extra in cases(build):
        path = os.path.join(build, program)
        if not os.path.exists(path):
            print(f"{program}: not built here, skipped")
            continue
        out = subprocess.run([path] + args, env=dict(env, **(extra[0] if extra else {})), capture_output=True, text=True, timeout=120)
        crashed = [s for s in CRASH_SIGNS if s in out.stderr]
        ok = out.returncode == status and says in out.stderr and not crashed
        print(f"{'ok' if ok else 'FAILED'}: {program} {' '.join(args)}: exit {out.returncode} (want {status}); "
              f"{out.stderr.strip().splitlines()[0] if out.stderr.strip() else '(nothing on stderr)'}")
        if not ok:
            failed += 1
            print(f"  want {says!r} on stderr{', got signs of a crash: ' + ', '.join(crashed) if crashed else ''}:\n"
                  + out.stderr[-1500:])
    if failed:
        sys.exit(f"FAILED: {failed} program(s) answered bad input badly")
    print("every program answers bad input with a named error")


if __name__ == "__main__":
    main()
