#!/usr/bin/env bash
# Builds and runs every test (GoogleTest under ctest: ranks as threads, real processes, the CLI),
# except the long fault-injection, soak and cost-model validation runs (labels faults, soak, plan:
# `ctest -L faults|soak|plan`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
cd build
# A caller's own -LE replaces the default exclusion (CI's Debian 13 run also leaves out the
# convergence trials, which the host run keeps).
exclude='faults|soak|plan'
for arg in "$@"; do [ "$arg" = -LE ] && exclude=""; done
ctest --output-on-failure --timeout 600 ${exclude:+-LE "$exclude"} "$@"
