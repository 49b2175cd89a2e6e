#!/usr/bin/env bash
# The sanitizer builds (clang 14, ASan + UBSan, in build-asan/):
#
#   scripts/sanitize.sh fuzz [SECONDS]   # each libFuzzer target for SECONDS (default 600) from
#                                        # tests/fuzz/corpus; new inputs are merged back into it
#   scripts/sanitize.sh tests [ARGS]     # the whole test suite built with ASan + UBSan, under ctest
#
# Crashes, leaks, UBSan reports and hangs (-timeout=10 per input) stop a fuzzer with a non-zero
# status and leave the input as build-asan/fuzz/crash-*. The regular build replays the corpus in
# ctest (fuzz.*), so what was found once stays fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
shift || true
command -v clang++-14 >/dev/null && ls /usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 ||
  { echo "sanitize.sh: needs clang 14 with libFuzzer (apt install clang-14 libclang-rt-14-dev)" >&2; exit 2; }
CXX=clang++-14 cmake -G Ninja -B build-asan -DDDPKIT_FUZZ=ON -DDDPKIT_BUILD_PYTHON=OFF >/dev/null
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:fast_unwind_on_malloc=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export LSAN_OPTIONS=suppressions=$(pwd)/tests/lsan.supp
case "$mode" in
  fuzz)
    seconds=${1:-600}
    ninja -C build-asan -j2 checkpoint_fuzzer ps_request_fuzzer
    mkdir -p build-asan/fuzz
    status=0
    for target in checkpoint ps_request; do
      work=build-asan/fuzz/$target
      rm -rf "$work" && mkdir -p "$work" && cp tests/fuzz/corpus/$target/* "$work"/
      echo "sanitize.sh: $target for ${seconds} s"
      if ! (cd build-asan/fuzz && "../tests/fuzz/${target}_fuzzer" -max_total_time="$seconds" -timeout=10 \
              -rss_limit_mb=4096 -print_final_stats=1 "$target" > "$target.log" 2>&1); then
        status=1
      fi
      grep -E "^#[0-9]+ +DONE|stat::|ERROR|SUMMARY|runtime error" "build-asan/fuzz/$target.log" || true
      "build-asan/tests/fuzz/${target}_fuzzer" -merge=1 "tests/fuzz/corpus/$target" "$work" 2>&1 | grep -E "MERGE-OUTER: [0-9]+ new files" || true
    done
    exit $status
    ;;
  tests)
    ninja -C build-asan -j2
    ctest --test-dir build-asan -j2 --output-on-failure "$@"
    ;;
  *)
    sed -n 2,11p "$0"
    exit 2
    ;;
esac
