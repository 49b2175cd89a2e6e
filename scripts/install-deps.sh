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

# c10d names every TCPStore connection's peer with a reverse lookup (getnameinfo without
# NI_NUMERICHOST). A loopback peer is ::ffff:127.0.0.1, which /etc/hosts does not name as written
# (127.0.0.1), so the lookup goes to DNS; where the resolver does not answer it (these VMs), that
# connect stalls 5 s, about one in ten (torchft's test_quorum_timeout, ddpkit.torchft's quorums).
# Naming the address here answers it locally. Only as root; docs/python.md says so for users.
if [ "$(id -u)" -eq 0 ] && [ -w /etc/hosts ] && ! grep -qE '^::ffff:127\.0\.0\.1[[:space:]]' /etc/hosts; then
  echo "::ffff:127.0.0.1 localhost" >> /etc/hosts
  echo "install-deps: /etc/hosts now names ::ffff:127.0.0.1 (c10d's reverse lookups of loopback peers)"
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
