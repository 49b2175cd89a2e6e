#!/usr/bin/env bash
# The main job: build, then ddpkit's default run (2 processes, MLP on Fashion-MNIST, 3 epochs).
# Extra arguments go to `ddpkit train` (e.g. --hook fp16, --model cnn).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh >&2
exec ./build/ddpkit train "$@"
