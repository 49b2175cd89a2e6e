#!/usr/bin/env bash
# Builds and tests ddpkit against the libtorch inside a pip-installed PyTorch, in build-pip/ beside
# build/. CI runs it against the pinned torch 2.15.0 venv that scripts/pip-torch-env.sh makes:
#
#   scripts/check-pip-torch.sh                 # the pinned venv (made on first use), default suite
#   PYTHON=~/venv/bin/python3 scripts/check-pip-torch.sh -- -R 'Nccl|Process'   # your torch; args to ctest
#   DDPKIT_TARGETS="ddpkit_nccl_tests ddpkit_tests" scripts/check-pip-torch.sh -- -R 'Nccl\.|FSDP\.'
#                                              # build only these (a GPU lease is short)
#
# What it checks: ddpkit configures and builds against that libtorch (C++20 from torch 2.13, the
# wheel's CUDA libraries and NCCL, Debian's gloo headers), the Python package builds against its
# Python, and the suite passes: ctest's default run (what scripts/test.sh runs), in which the NCCL
# tests skip where there is no GPU; on a GPU machine they run (tests/nccl_test.cpp and the
# transport conformance rows: every collective and a DDP step on CUDA tensors).
# pip's torch ships no gloo headers: Debian's libgloo-dev provides them (docs/compat.md says
# what was compared); DDPKIT_EXTRA_PREFIX may name a folder whose include/ holds other ones.
set -euo pipefail
cd "$(dirname "$0")/.."
ctest_args=()
[ "${1:-}" = "--" ] && { shift; ctest_args=("$@"); }
py=${PYTHON:-$(scripts/pip-torch-env.sh)}

# The CMake package's folder, found without importing torch (an import needs every nvidia library
# the wheel depends on; the C++ build does not).
torch_dir=$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("torch").origin))') || {
  echo "check-pip-torch: '$py' has no torch package" >&2
  exit 2
}
prefix="$torch_dir/share/cmake"
[ -f "$prefix/Torch/TorchConfig.cmake" ] || {
  echo "check-pip-torch: $prefix/Torch/TorchConfig.cmake is missing: this torch ships no libtorch CMake package" >&2
  exit 2
}
read -r version cuda gpus < <("$py" -c 'import torch; print(torch.__version__, int(torch.version.cuda is not None), torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null) || {
  echo "check-pip-torch: '$py' cannot import torch" >&2
  exit 2
}
echo "check-pip-torch: torch $version from $torch_dir (CUDA build: $cuda, GPUs: $gpus)"

args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_PREFIX_PATH=$prefix;${DDPKIT_EXTRA_PREFIX:-}" "-DDDPKIT_PYTHON=$py")
if [ -n "${DDPKIT_EXTRA_PREFIX:-}" ]; then
  args+=("-DCMAKE_CXX_FLAGS=-I$DDPKIT_EXTRA_PREFIX/include")
fi
# A CUDA torch's CMake package needs CUDA's compiler and toolkit (it probes nvcc).
if [ "$cuda" = 1 ] && ! command -v nvcc >/dev/null; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH=/usr/local/cuda/bin:$PATH
  else
    echo "check-pip-torch: torch $version is a CUDA build and its CMake package needs the CUDA toolkit (nvcc)" >&2
    exit 2
  fi
fi
mkdir -p build-pip
cmake -S . -B build-pip -G Ninja "${args[@]}" > build-pip/configure.log 2>&1 || {
  tail -30 build-pip/configure.log >&2
  exit 1
}
grep '^-- ddpkit' build-pip/configure.log
if [ "$cuda" = 1 ] && ! grep -q "NCCL backend: ON" build-pip/configure.log; then
  echo "check-pip-torch: CUDA torch, but ddpkit did not enable NCCL (build-pip/configure.log)" >&2
  exit 1
fi
# -k 0: every compile error of a new libtorch in one pass, not the first one.
# shellcheck disable=SC2086  # DDPKIT_TARGETS is a list of ninja targets
ninja -C build-pip -k 0 -j"${DDPKIT_JOBS:-$(nproc)}" ${DDPKIT_TARGETS:-}
if [ -x build-pip/ddpkit ]; then
  build-pip/ddpkit version
  # One NCCL in a process, the wheel's (libtorch_cuda's own), and no toolkit library besides the wheel's.
  if [ "$cuda" = 1 ]; then
    nccl=$(realpath "$(ldd build-pip/ddpkit | awk '/libnccl/ {print $3}')")
    wheel_nvidia=$(realpath "$torch_dir/../nvidia")
    echo "check-pip-torch: libnccl.so.2 resolves to $nccl"
    case "$nccl" in
      "$wheel_nvidia"/*) ;;
      *) echo "check-pip-torch: ddpkit's NCCL is not the wheel's (in $wheel_nvidia)" >&2; exit 1 ;;
    esac
  fi
fi
cd build-pip
if [ ${#ctest_args[@]} -eq 0 ]; then
  ctest_args=(-LE 'faults|soak|plan|convergence|torch-suite|cluster')
fi
ctest --output-on-failure --timeout 600 "${ctest_args[@]}"
