#!/usr/bin/python3
"""ddpkit DDP vs PyTorch's own Python DDP, side by side, in one run.

    bench/ddp_vs_pytorch.py [--reps 3] [--steps 25] [--ddpkit build/ddpkit]

Model: MLP 1024-4096-4096-1024 (25M parameters), batch 32 per rank, 2 ranks x 1 thread, Gloo,
SGD momentum 0.9, zero_grad(set_to_none) on both sides. A third column runs PyTorch with its 1.13
default loop (zero_grad zeroing in place), the configuration of the issue's reference numbers. A
fourth runs PyTorch (same loop as ddpkit) under the glibc allocator settings that `ddpkit` applies
to itself (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_), to show how much of a difference is the
allocator rather than DDP. ddpkit's SGD updates each parameter in one pass (ddpkit::optim::SGD);
PyTorch's one-pass CPU SGD (fused=True) arrived in 2.4, so where this PyTorch has it a fifth
column (pt-fused) runs it under ddpkit's allocator settings, and the <= 0.6 target is read there;
with an older PyTorch it is read on pt-malloc. Every configuration runs --reps times,
interleaved (so drift on a shared machine hits all alike); each run reports the median step time
of its --steps steps, and the table shows the median over reps. Ratios are computed from these
medians, all measured in this one invocation. The local-pair row runs each side's training
without DDP, two processes side by side as the two ranks run: the floor a DDP step could reach on
this machine, which splits a ratio into what DDP costs and what the training loop costs.
"""
import argparse
import os
import statistics
import subprocess
import sys

from pytorch_peer import PEER_ENV, fused_cpu_sgd_available, last_json, torch_version_or_exit

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HOOKS = ["local", "local-pair", "none", "allreduce", "fp16", "bf16", "noop"]


def ddpkit_torch(binary):
    out = subprocess.run([binary, "version"], capture_output=True, text=True).stdout
    return out.split("libtorch ")[1].split(",")[0] if "libtorch " in out else "unknown"


def run_ddpkit(binary, hook, args):
    cmd = [binary, "train", "--model", "mlp", "--dataset", "synthetic", "--batch-size", "32",
           "--steps", str(args.steps), "--threads", "1", "--no-eval", "--quiet"]
    cmd += ["--no-ddp"] if hook in ("local", "local-pair") else ["--nproc", "2", "--hook", hook]
    cmd += args.ddpkit_args
    # local-pair: two trainings without DDP side by side, as the two ranks run: the step's floor.
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2 if hook == "local-pair" else 1)]
    medians, error = [], None
    for p in procs:
        if error:  # the pair failed: its other half must not run on into the next measurement
            p.kill()
            p.communicate()
            continue
        stdout, stderr = p.communicate(timeout=900)
        out = last_json(stdout)
        if p.returncode != 0 or out is None:
            error = (stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]
        else:
            medians.append(out["median_step_ms"])
    return (None, error) if error else (statistics.mean(medians), None)


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def run_pytorch(hook, args, env=None):
    cmd = [sys.executable, os.path.join(HERE, "pytorch_ddp.py"), "--hook", hook, "--steps", str(args.steps)]
    cmd += args.pytorch_args
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(PEER_ENV, **(env or {})))
    except subprocess.TimeoutExpired:
        return None, "timed out"
    out = last_json(p.stdout)
    if out is None:
        return None, "no result"
    if out.get("error") or out.get("median_step_ms") is None:
        return None, out.get("error") or "failed"
    return out["median_step_ms"], None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--ddpkit", default=os.path.join(ROOT, "build", "ddpkit"))
    ap.add_argument("--hooks", default=",".join(HOOKS))
    ap.add_argument("--ddpkit-args", default="", help="extra flags for ddpkit train")
    ap.add_argument("--pytorch-args", default="", help="extra flags for bench/pytorch_ddp.py")
    ap.add_argument("--gradient-as-bucket-view", action="store_true",
                    help="both sides: gradients are views into DDP's buckets (no copy back into .grad)")
    args = ap.parse_args()
    peer_torch = torch_version_or_exit()
    args.ddpkit_args = args.ddpkit_args.split()
    args.pytorch_args = args.pytorch_args.split()
    if args.gradient_as_bucket_view:
        args.ddpkit_args.append("--gradient-as-bucket-view")
        args.pytorch_args.append("--gradient-as-bucket-view")
    hooks = args.hooks.split(",")
    ours = {h: [] for h in hooks}
    theirs = {h: [] for h in hooks}
    theirs_default = {h: [] for h in hooks}
    theirs_malloc = {h: [] for h in hooks}
    theirs_fused = {h: [] for h in hooks}
    default_args = argparse.Namespace(**vars(args))
    default_args.pytorch_args = args.pytorch_args + ["--zero-grad", "zero"]
    fused = fused_cpu_sgd_available()
    fused_args = argparse.Namespace(**vars(args))
    fused_args.pytorch_args = args.pytorch_args + ["--fused-sgd"]
    configs = [("ddpkit", ours, lambda h: run_ddpkit(args.ddpkit, h, args)),
               ("pytorch", theirs, lambda h: run_pytorch(h, args)),
               ("pytorch-zeroing", theirs_default, lambda h: run_pytorch(h, default_args)),
               ("pytorch-malloc", theirs_malloc, lambda h: run_pytorch(h, args, MALLOC_ENV))]
    if fused:
        configs.append(("pytorch-fused", theirs_fused, lambda h: run_pytorch(h, fused_args, MALLOC_ENV)))
    errors = {}
    for rep in range(args.reps):
        for h in hooks:
            for impl, store, fn in configs:
                if (impl, h) in errors:
                    continue  # refused once: do not wait for it again
                if h == "local-pair" and impl in ("pytorch", "pytorch-zeroing"):
                    continue  # the floor is read against the malloc-matched columns
                ms, err = fn(h)
                print("rep %d %-8s %-9s %s" % (rep + 1, impl, h, "%.1f ms" % ms if ms else "error: " + err),
                      file=sys.stderr, flush=True)
                if err:
                    errors[(impl, h)] = err
                else:
                    store[h].append(ms)

    med = lambda xs: statistics.median(xs) if xs else None
    fmt = lambda x: "%9.1f" % x if x is not None else "%9s" % "-"
    print("\nMLP 1024-4096-4096-1024, batch 32/rank, 2 ranks x 1 thread, gloo; median step ms over %d reps x %d steps"
          % (args.reps, args.steps))
    print("PyTorch %s (%s), ddpkit on libtorch %s%s" % (peer_torch, sys.executable, ddpkit_torch(args.ddpkit),
                                                        "; gradient_as_bucket_view on both sides" if args.gradient_as_bucket_view else ""))
    columns = [("pytorch", theirs), ("pt-zero", theirs_default), ("pt-malloc", theirs_malloc)]
    if fused:
        columns.append(("pt-fused", theirs_fused))
    print("%-10s %9s" % ("hook", "ddpkit") + "".join(" %9s %8s" % (name, "ratio") for name, _ in columns))
    results = {}
    for h in hooks:
        a = med(ours[h])
        row = [med(store[h]) for _, store in columns] + [None] * (4 - len(columns))
        results[h] = [a] + row
        r = lambda x: "%8.2f" % (a / x) if a and x else "%8s" % "-"
        print("%-10s %s" % (h, fmt(a)) + "".join(" %s %s" % (fmt(x), r(x)) for x in row[:len(columns)]))
    print("ratio = ddpkit / that column. pytorch: same loop as ddpkit (zero_grad set_to_none); pt-zero: PyTorch 1.13's")
    print("default loop (zero_grad zeroes in place); pt-malloc: same loop, glibc settings of the ddpkit program.")
    if fused:
        print("pt-fused: as pt-malloc, with SGD(fused=True): one pass per parameter, like ddpkit's SGD.")
    else:
        print("PyTorch %s has no one-pass CPU SGD (fused=True arrived in 2.4); ddpkit's SGD is one pass." % peer_torch)
    for (impl, h), err in sorted(errors.items()):
        print("  %s %s: %s" % (impl, h, err))
    print()
    def show(label, num, den, target=None):
        if num and den:
            r = num / den
            verdict = "" if target is None else ("  (target <= %.2f: %s)" % (target, "met" if r <= target else "NOT met"))
            print("%-60s %.2f%s" % (label, r, verdict))
    a_none, p_none, z_none, m_none, f_none = results.get("none", (None,) * 5)
    a_ar, p_ar, z_ar, m_ar, f_ar = results.get("allreduce", (None,) * 5)
    a_fp16 = results.get("fp16", (None,) * 5)[0]
    show("ddpkit built-in allreduce / PyTorch built-in", a_none, p_none, 0.8)
    show("ddpkit allreduce hook / PyTorch allreduce hook", a_ar, p_ar, 0.8)
    show("ddpkit built-in / PyTorch built-in (zeroing loop)", a_none, z_none, 0.8)
    show("ddpkit allreduce hook / PyTorch hook (zeroing loop)", a_ar, z_ar, 0.8)
    show("ddpkit built-in / PyTorch built-in (ddpkit's malloc env)", a_none, m_none, None if fused else 0.6)
    show("ddpkit allreduce hook / PyTorch hook (ddpkit's malloc env)", a_ar, m_ar)
    show("ddpkit built-in / PyTorch built-in (malloc env, fused SGD)", a_none, f_none, 0.6)
    show("ddpkit allreduce hook / PyTorch hook (malloc env, fused SGD)", a_ar, f_ar)
    show("ddpkit fp16 hook / ddpkit built-in allreduce", a_fp16, a_none, 1.0)
    show("ddpkit fp16 hook / ddpkit allreduce hook", a_fp16, a_ar, 1.0)
    show("ddpkit fp16 hook / PyTorch fp16 hook", a_fp16, results.get("fp16", (None,) * 5)[1])
    show("ddpkit noop / ddpkit local", results.get("noop", (None,))[0], results.get("local", (None,))[0])
    pair = results.get("local-pair", (None,) * 5)
    if pair[0] and a_none:
        print()
        print("The floor: two trainings without DDP side by side (local-pair), each side's own, malloc-matched:")
        for name, ddp, floor in [("ddpkit", a_none, pair[0]), ("PyTorch (pt-malloc)", m_none, pair[3]),
                                 ("PyTorch (pt-fused)", f_none, pair[4])]:
            if ddp and floor:
                print("  %-20s DDP step %6.1f ms, floor %6.1f ms: DDP adds %5.1f ms (%+.0f%%)"
                      % (name, ddp, floor, ddp - floor, 100 * (ddp / floor - 1)))
        show("ddpkit's floor / PyTorch's floor (malloc env)", pair[0], pair[3])
        show("ddpkit's floor / PyTorch's floor (malloc env, fused SGD)", pair[0], pair[4])
    return 0


if __name__ == "__main__":
    sys.exit(main())
