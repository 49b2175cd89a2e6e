#!/usr/bin/env bash
# Installs every Debian package ddpkit needs, only those missing. Idempotent; CI calls it.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libgloo-dev         # libtorch 1.13 (CPU) and the Gloo headers c10d includes
  libopenblas0-pthread             # optimized BLAS: Debian's reference BLAS is ~20x slower
  googletest libgtest-dev libgmock-dev
  dataset-fashion-mnist            # IDX files under /usr/share/datasets/fashion-mnist
  fortunes                         # English text (/usr/share/games/fortunes): the transformer LM's corpus
  python3-torch                    # PyTorch's own Python DDP: side-by-side benchmarks, the Python package
  python3-dev pybind11-dev python3-pytest   # the Python package's extension and its tests
  python3-venv python3-setuptools  # `pip install .` into a venv (the README's Python section)
  zlib1g-dev                       # the CLI gunzips the dataset itself
  libgrpc++-dev protobuf-compiler-grpc protobuf-compiler libprotobuf-dev  # the parameter server's RPC
  openssl                          # the TLS test makes a throwaway certificate
  nlohmann-json3-dev               # metrics and benchmark configuration files
  openmpi-bin                      # mpirun: tests/mpirun_jobs.py (ddpkit never links libmpi)
  slurm-wlm munge                  # a real Slurm cluster in network namespaces: tests/slurm_cluster.py
  iproute2                         # ip netns, tc: the multi-host tests' network namespaces and shaped links
)

# --pip-torch: also the pinned pip torch 2.15.0 venv (scripts/pip-torch-env.sh; CI's second suite).
if [ "${1:-}" = "--pip-torch" ]; then
  "$(dirname "$0")/install-deps.sh"
  "$(dirname "$0")/pip-torch-env.sh" >/dev/null
  exit 0
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
