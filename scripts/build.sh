#!/usr/bin/env bash
# Installs what is missing, then configures and builds ddpkit into build/ (ccache, Ninja, -j2).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
# ccache hits from any checkout path (CI builds a fresh clone): paths under the checkout are
# hashed relative to it.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
ninja -C build -j"${DDPKIT_JOBS:-2}"
