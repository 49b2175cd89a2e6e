#!/usr/bin/python3
"""The lighthouse's short form at scale (bench/lighthouse_scale.py): 100 groups of 8 ranks beating
through their groups, against the same lighthouse serving one group, in one run. Fails when

- the quorum p99 at 100 groups, as a multiple of the one-group p99 of the same run, passes twice
  the recorded multiple;
- detection of a silent group, as a multiple of the heartbeat timeout, passes twice the recorded
  multiple;
- any heartbeat names a live group lost, any quorum call fails, more than 5% of the step ticks are
  skipped, or most steady-state replies carry the participants (the delta protocol is off).

The recorded multiples are the median of three runs of this check on the 2-core machine
(9.6x, 13.0x, 13.6x and 0.98x, 0.99x, 0.99x; bench/results/lighthouse-scale-2026-12-06.txt); a
ratio within one run, not a timed unit test.

  tests/lighthouse_scale_check.py build/ddpkit build/lighthouse_load
"""
import argparse
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
import lighthouse_scale  # noqa: E402

# quorum p99 (100 x 8) / quorum p99 (1 x 8), and detection max / heartbeat timeout, as recorded.
RECORDED = {"quorum_p99_ratio": 13.0, "detect_ratio": 0.99}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ddpkit")
    ap.add_argument("lighthouse_load")
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=6.0)
    cli = ap.parse_args()
    args = types.SimpleNamespace(bin=cli.ddpkit, load=cli.lighthouse_load, python="", warmup=2.0, heartbeat_ms=100,
                                 heartbeat_timeout_ms=1000, join_timeout_ms=10000, restart_after_s=2.0, seed=7,
                                 lighthouse_cpus="", load_cpus="")
    base = lighthouse_scale.run_load(args, "ddpkit-group", 1, cli.ranks, 5.0, 0, cli.seconds)
    steady = lighthouse_scale.run_load(args, "ddpkit-group", cli.groups, cli.ranks, 5.0, 0, cli.seconds)
    churn = lighthouse_scale.run_load(args, "ddpkit-group", cli.groups, cli.ranks, 5.0, 2, cli.seconds)
    quorum_ratio = steady["quorum_p99_ms"] / max(base["quorum_p99_ms"], 0.1)
    detect_ratio = churn["detect_max_ms"] / args.heartbeat_timeout_ms
    print(f"1 group of {cli.ranks}: quorum p50 {base['quorum_p50_ms']:.2f} ms, p99 {base['quorum_p99_ms']:.2f} ms")
    print(f"{cli.groups} groups of {cli.ranks}: quorum p50 {steady['quorum_p50_ms']:.2f} ms, "
          f"p99 {steady['quorum_p99_ms']:.2f} ms ({quorum_ratio:.1f}x the one group's; recorded "
          f"{RECORDED['quorum_p99_ratio']:.1f}x), {100 * steady['ticks_skipped']:.1f}% ticks skipped, "
          f"{steady['compact_replies']} of {steady['quorums']} replies without participants, lighthouse "
          f"{steady['lighthouse_cores']:.2f} cores")
    print(f"churn: {churn['kills']} kills, detection max {churn['detect_max_ms']:.0f} ms ({detect_ratio:.2f}x the "
          f"{args.heartbeat_timeout_ms} ms timeout; recorded {RECORDED['detect_ratio']:.2f}x), survivors' quorum max "
          f"{churn['survivors_max_ms']:.0f} ms")
    failures = []
    if quorum_ratio > 2 * RECORDED["quorum_p99_ratio"]:
        failures.append(f"quorum p99 is {quorum_ratio:.1f}x the one-group run's, over twice the recorded "
                        f"{RECORDED['quorum_p99_ratio']:.1f}x")
    if churn["detected"] < churn["kills"]:
        failures.append(f"only {churn['detected']} of {churn['kills']} silent groups were detected")
    elif detect_ratio > 2 * RECORDED["detect_ratio"]:
        failures.append(f"detection took {detect_ratio:.2f}x the heartbeat timeout, over twice the recorded "
                        f"{RECORDED['detect_ratio']:.2f}x")
    for run in (base, steady, churn):
        if run["false_losses"]:
            failures.append(f"{run['false_losses']} heartbeat replies named a live group lost ({run['groups']} groups)")
        if run["quorum_errors"]:
            failures.append(f"{run['quorum_errors']} quorum calls failed ({run['groups']} groups): {run['driver_stderr']}")
    if steady["ticks_skipped"] > 0.05:
        failures.append(f"{100 * steady['ticks_skipped']:.1f}% of the step ticks were skipped at 5 steps/s")
    if steady["compact_replies"] < 0.9 * steady["quorums"]:
        failures.append(f"only {steady['compact_replies']} of {steady['quorums']} steady replies left the participants out")
    if failures:
        sys.exit("lighthouse_scale_check:\n  " + "\n  ".join(failures))
    print("ok")


if __name__ == "__main__":
    main()
