"""What the side-by-side benchmarks need to run PyTorch as a fair peer, and to read the runs
(imported by the bench scripts, which run from this folder)."""
import json
import os
import subprocess
import sys

# torch.set_num_threads does not reach OpenBLAS where libtorch links the generic libblas (Debian
# 13's 2.6), so limit it as ddpkit::set_compute_threads does; and Debian's 2.6 is built without
# libuv, which torch.distributed's TCPStore asks for unless USE_LIBUV=0.
PEER_ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", USE_LIBUV="0")


def last_json(text):
    """The last line of a run's output that is a JSON object (`ddpkit train`'s summary), or None."""
    for line in reversed(text.strip().splitlines()):
        if line.strip().startswith("{"):
            return json.loads(line)
    return None


def torch_version_or_exit():
    """The version of the torch this Python (sys.executable) imports; exits naming the problem if none."""
    p = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                       text=True)
    if p.returncode != 0:
        sys.exit("%s cannot import torch: run this with the Python that has PyTorch (Debian: /usr/bin/python3 "
                 "with python3-torch)" % sys.executable)
    return p.stdout.strip()


def fused_cpu_sgd_available():
    """Whether this Python's PyTorch has a one-pass SGD for CPU parameters (fused=True, 2.4+)."""
    code = "import torch; torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9, fused=True)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
