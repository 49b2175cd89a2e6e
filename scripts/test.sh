#!/usr/bin/env bash
# Builds and runs every test (GoogleTest under ctest: ranks as threads, real processes, the CLI),
# except the long fault-injection, soak and cost-model validation runs (labels faults, soak, plan:
# `ctest -L faults|soak|plan`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
cd build
ctest --output-on-failure --timeout 600 -LE 'faults|soak|plan' "$@"
