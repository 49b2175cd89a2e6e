#!/usr/bin/env python3
"""PowerSGD's local work, timed alone (issue 33, docs/plan.md "eleventh run"): what the plan's
PowerSGD terms are checked against.

  OMP_NUM_THREADS=1 bench/powersgd_passes.py [--side 4096] [--ranks 4,16,32,64] [--repeats 7]

1. powerSGD_hook's passes over one side x side gradient with error feedback, blocked as
   src/hooks/powersgd_hook.cpp blocks them (rows in 2 MB blocks): P = (M + E) Q with the error added
   block by block, Q = M^T P, then M ~ P Q^T with the new error E = M - P Q^T, block by block.
2. The same three products unblocked, as batched_powerSGD_hook runs them (bmm), on the square
   that holds mlp25's 25.2M gradients (5017^2) at rank 32.
Written in python3-torch (the same ATen kernels as libtorch 1.13 here), one thread, medians.
"""
import argparse
import time

import torch


def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def rows_per_block(cols):
    return max(1, 512 * 1024 // cols)


def project(m, e, q, p):  # P = (M + E) Q, the error added block by block
    step = rows_per_block(m.shape[1])
    for r0 in range(0, m.shape[0], step):
        mb = m[r0:r0 + step]
        mb.add_(e[r0:r0 + step])
        torch.mm(mb, q, out=p[r0:r0 + step])


def approximate(m, e, p, q):  # M ~ P Q^T, the new error E = M - P Q^T, block by block
    step = rows_per_block(m.shape[1])
    scratch = torch.empty(min(step, m.shape[0]), m.shape[1])
    for r0 in range(0, m.shape[0], step):
        rows = min(step, m.shape[0] - r0)
        a = scratch[:rows]
        torch.mm(p[r0:r0 + rows], q.t(), out=a)
        torch.sub(m[r0:r0 + rows], a, out=e[r0:r0 + rows])
        m[r0:r0 + rows].copy_(a)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", type=int, default=4096, help="the gradient's rows and columns (default 4096)")
    ap.add_argument("--ranks", default="4,16,32,64", help="comma-separated approximation ranks")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs of each (median; default 7)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    n = a.side
    m, e = torch.rand(n, n), torch.rand(n, n) * 0.01
    print(f"# powerSGD_hook's passes on a {n} x {n} fp32 gradient ({4 * n * n / 1e6:.0f} MB), one thread; ms")
    print(f"{'rank':>4} {'P=(M+E)Q':>9} {'Q=M^T P':>9} {'M~PQ^T,E':>9} {'total':>8}  {'copy':>6}")
    copy_ms = median_ms(lambda: m.copy_(e), a.repeats)
    for r in (int(x) for x in a.ranks.split(",")):
        q, p = torch.rand(n, r), torch.empty(n, r)
        first = median_ms(lambda: project(m, e, q, p), a.repeats)
        second = median_ms(lambda: torch.mm(m.t(), p, out=q), a.repeats)
        third = median_ms(lambda: approximate(m, e, p, q), a.repeats)
        print(f"{r:4d} {first:9.1f} {second:9.1f} {third:9.1f} {first + second + third:8.1f}  {copy_ms:6.1f}")
    side, r = 5017, 32
    big = torch.rand(1, side, side)
    q, p = torch.rand(1, side, r), torch.empty(1, side, r)
    products = [median_ms(lambda: torch.bmm(big, q, out=p), a.repeats),
                median_ms(lambda: torch.bmm(big.transpose(1, 2), p, out=q), a.repeats),
                median_ms(lambda: torch.bmm(p, q.transpose(1, 2), out=big), a.repeats)]
    print(f"# batched_powerSGD_hook's products on a {side}^2 square at rank {r}: "
          + " + ".join(f"{x:.1f}" for x in products) + f" = {sum(products):.1f} ms")


if __name__ == "__main__":
    main()
