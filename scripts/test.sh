#!/usr/bin/env bash
# Builds and runs every test (GoogleTest under ctest: ranks as threads, real processes, the CLI),
# except the long fault-injection and soak runs (labels faults, soak: `ctest -L faults|soak`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
cd build
ctest --output-on-failure --timeout 600 -LE 'faults|soak' "$@"
