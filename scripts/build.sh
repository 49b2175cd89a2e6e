#!/usr/bin/env bash
# Installs what is missing, then configures and builds ddpkit into build/ (ccache, Ninja, -j2).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
ninja -C build -j"${DDPKIT_JOBS:-2}"
