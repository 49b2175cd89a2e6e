#!/usr/bin/env bash
# Builds and tests ddpkit against the libtorch inside a pip-installed PyTorch (pytorch.org 2.x,
# with CUDA on a GPU machine), in build-pip/ beside build/:
#
#   scripts/check-pip-torch.sh                 # PYTHON=python3 by default
#   PYTHON=/opt/venv/bin/python3 scripts/check-pip-torch.sh -- -R 'Nccl|Process'   # args to ctest
#   DDPKIT_TARGETS="ddpkit_nccl_tests ddpkit_tests" scripts/check-pip-torch.sh -- -R 'Nccl\.|FSDP\.'
#                                              # build only these (a GPU lease is short)
#
# What it checks: ddpkit configures and builds against that libtorch (its ABI flag, Gloo headers,
# NCCL when torch_cuda carries USE_C10D_NCCL), the whole CPU suite passes, and with CUDA the NCCL
# tests (tests/nccl_test.cpp: every collective and a DDP step on CUDA tensors) pass. It installs
# nothing: cmake, ninja and a C++17 compiler must be there. Missing optional pieces are reported
# and skipped: GoogleTest (else /usr/src/googletest is built in), gRPC (no parameter server),
# nlohmann-json (DDPKIT_EXTRA_PREFIX may name a folder holding include/nlohmann/json.hpp). pip's torch
# ships no gloo headers: DDPKIT_EXTRA_PREFIX/include/gloo must hold them (docs/compat.md says which).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
ctest_args=()
[ "${1:-}" = "--" ] && { shift; ctest_args=("$@"); }

prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)') || {
  echo "check-pip-torch: '$py' cannot import torch" >&2
  exit 2
}
read -r version cuda gpus < <("$py" -c 'import torch; print(torch.__version__, int(torch.version.cuda is not None), torch.cuda.device_count() if torch.cuda.is_available() else 0)')
echo "check-pip-torch: torch $version from $prefix (CUDA build: $cuda, GPUs: $gpus)"
[ -f "$prefix/Torch/TorchConfig.cmake" ] || {
  echo "check-pip-torch: $prefix/Torch/TorchConfig.cmake is missing: this torch ships no libtorch CMake package" >&2
  exit 2
}

args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_PREFIX_PATH=$prefix;${DDPKIT_EXTRA_PREFIX:-}")
if [ -n "${DDPKIT_EXTRA_PREFIX:-}" ]; then
  args+=("-DCMAKE_CXX_FLAGS=-I$DDPKIT_EXTRA_PREFIX/include")
fi
# CUDA's compiler for torch_cuda's CMake (it probes nvcc when CUDA is present).
if [ "$cuda" = 1 ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
mkdir -p build-pip
cmake -S . -B build-pip -G Ninja "${args[@]}" 2>&1 | tee build-pip/configure.log
if [ "$cuda" = 1 ] && [ "$gpus" -gt 0 ] && ! grep -q "NCCL backend: ON" build-pip/configure.log; then
  echo "check-pip-torch: CUDA torch, but ddpkit did not enable NCCL (build-pip/configure.log)" >&2
  exit 1
fi
# -k 0: every compile error of a new libtorch in one pass, not the first one.
# shellcheck disable=SC2086  # DDPKIT_TARGETS is a list of ninja targets
ninja -C build-pip -k 0 -j"${DDPKIT_JOBS:-$(nproc)}" ${DDPKIT_TARGETS:-}
[ -x build-pip/ddpkit ] && build-pip/ddpkit version
cd build-pip
ctest --output-on-failure --timeout 600 "${ctest_args[@]}"
