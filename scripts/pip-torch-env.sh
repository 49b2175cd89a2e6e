#!/usr/bin/env bash
# Makes (once, then reuses) the pinned pip PyTorch environment ddpkit is built and tested against
# beside Debian's libtorch, and prints its interpreter's path on the last line of stdout:
#
#   py=$(scripts/pip-torch-env.sh)          # /var/cache/ddpkit/pip-torch-2.15.0/bin/python3
#   DDPKIT_PIP_VENV=~/venvs/t215 scripts/pip-torch-env.sh
#   py=$(scripts/pip-torch-env.sh --torchft-nightly)   # the same, with torchft-nightly in place of 0.2.0
#
# --torchft-nightly: a second, small venv (<venv>-torchft-nightly) layered over the first (a .pth
# file puts the first's site-packages after its own): torchft-nightly (pinned below, the newest on
# PyPI; its module is torchft too, so it cannot sit beside 0.2.0) and its OpenTelemetry packages in
# its own site-packages, torch and the rest shared. The fault-tolerance benchmark runs both.
#
# The venv lives outside the checkout (a fresh clone reuses it; its ~6 GB never lands in git) and
# holds torch 2.15.0 from PyPI, which on Linux is the CUDA 13 build with its nvidia-* wheels (PyPI
# has no CPU-only Linux torch), and the peers the tests and benchmarks run beside ddpkit, each
# pinned. A venv whose pins all match is reused as it is; one that lacks a pin is topped up.
# Debian's python3 (3.11) is the interpreter: torchft's wheels stop at 3.13.
set -euo pipefail

venv=${DDPKIT_PIP_VENV:-/var/cache/ddpkit/pip-torch-2.15.0}
base_python=${DDPKIT_PIP_BASE_PYTHON:-/usr/bin/python3}
pins=(
  torch==2.15.0
  torchft==0.2.0        # fault-tolerant replica groups, the peer of ddpkit's FT (issue 71)
  "ray[train]==2.60.0"  # Ray Train (issue 71); quoted: [train] would glob
  deepspeed==0.19.8     # ZeRO on CPU/Gloo (issue 71)
  numpy==2.4.6          # the newest numpy for Python 3.11
  pytest==9.2.0
  expecttest==0.3.0     # torch.testing._internal imports it (PyTorch's own suite)
  parameterized==0.9.0  # torchft's own integration tests import it (issue 71)
  pybind11==3.1.0       # the Python package's build
  pip==26.3
  setuptools==84.2.1
  wheel==0.48.0
)

nightly_pin=torchft-nightly==2026.10.26
nightly=false
[ "${1:-}" = "--torchft-nightly" ] && nightly=true

log() { echo "pip-torch-env: $*" >&2; }

[ -x "$base_python" ] || { log "no interpreter at $base_python (install python3 and python3-venv)"; exit 2; }

if [ ! -x "$venv/bin/python3" ]; then
  log "creating $venv from $base_python"
  mkdir -p "$(dirname "$venv")"
  "$base_python" -m venv "$venv" || { log "python3 -m venv failed: is python3-venv installed?"; exit 2; }
fi
py="$venv/bin/python3"

# Which pins the venv lacks, asked of pip's own metadata (no import: importing torch takes seconds).
missing=$("$py" - "${pins[@]}" <<'EOF'
import sys
from importlib import metadata
out = []
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    name = name.split("[")[0]
    try:
        if metadata.version(name) != version:
            out.append(pin)
    except metadata.PackageNotFoundError:
        out.append(pin)
print(" ".join(out))
EOF
)

if [ -n "$missing" ]; then
  log "installing ${missing} into $venv (the first time downloads ~3.5 GB: torch's CUDA wheels)"
  # Build tools first: deepspeed ships an sdist, built with them.
  "$py" -m pip install --quiet --no-input --progress-bar off pip==26.3 setuptools==84.2.1 wheel==0.48.0 >&2
  "$py" -m pip install --quiet --no-input --progress-bar off "${pins[@]}" >&2
  log "done: $(du -sh "$venv" | cut -f1) in $venv"
else
  log "all ${#pins[@]} pins present in $venv"
fi
if ! $nightly; then
  echo "$py"
  exit 0
fi

layer="$venv-torchft-nightly"
if [ ! -x "$layer/bin/python3" ]; then
  log "creating $layer over $venv"
  "$base_python" -m venv "$layer"
  shared=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  own=$("$layer/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$shared" > "$own/zz-ddpkit-pip-torch.pth"  # after its own packages: its torchft wins
fi
lpy="$layer/bin/python3"
if [ "$("$lpy" -c 'from importlib import metadata; print(metadata.version("torchft-nightly"))' 2>/dev/null)" != "${nightly_pin#*==}" ]; then
  log "installing $nightly_pin into $layer"
  "$lpy" -m pip install --quiet --no-input --progress-bar off "$nightly_pin" >&2
fi
echo "$lpy"
