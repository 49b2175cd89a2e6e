"""pip install --no-build-isolation .  (into a venv with torch: Debian's, made with
--system-site-packages, or pip's)

Builds ddpkit's Python package with CMake against the torch of the Python running pip (the
extension must match it): a pip torch's own libtorch (its share/cmake, found without importing
torch), else the system's (Debian 12's 1.13, Debian 13's 2.6). Then installs `ddpkit` with the
libraries it needs beside it. The CMake build (scripts/build.sh) builds the same package into
build/python. docs/python.md.
"""
import glob
import importlib.util
import os
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def torch_prefix():
    """-DCMAKE_PREFIX_PATH for a torch that carries its libtorch CMake package (pip's); none for
    Debian's, whose CMake package is the system's. Found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        sys.exit(f"ddpkit: {sys.executable} has no torch; install torch first (pip install torch, or Debian's python3-torch)")
    cmake_dir = os.path.join(os.path.dirname(spec.origin), "share", "cmake")
    return [f"-DCMAKE_PREFIX_PATH={cmake_dir}"] if os.path.isfile(os.path.join(cmake_dir, "Torch", "TorchConfig.cmake")) else []


class BuildWithCMake(build_py):
    def run(self):
        super().run()  # the pure-Python files
        build = os.environ.get("DDPKIT_PIP_BUILD_DIR", os.path.join(ROOT, "build-wheel"))
        # ccache hits from the main build: paths hashed relative to the checkout.
        env = dict(os.environ, CCACHE_BASEDIR=ROOT, CCACHE_NOHASHDIR="1")
        subprocess.check_call(["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                               "-DDDPKIT_BUILD_TESTS=OFF", "-DDDPKIT_BUILD_TOOLS=OFF", "-DDDPKIT_BUILD_PYTHON=ON",
                               f"-DDDPKIT_PYTHON={sys.executable}", "-DDDPKIT_PYTHON_BESIDE_LIBS=ON"] +
                              torch_prefix(), env=env)
        subprocess.check_call(["cmake", "--build", build, "--target", "ddpkit_python", "-j",
                               os.environ.get("DDPKIT_JOBS", "2")], env=env)
        built = os.path.join(build, "python", "ddpkit")
        extension = glob.glob(os.path.join(built, "_C*.so"))
        if not extension:
            sys.exit(f"ddpkit: the extension was not built in {built}: see CMake's messages above (is {sys.executable}'s "
                     "torch the libtorch CMake found?)")
        target = os.path.join(self.build_lib, "ddpkit")
        os.makedirs(target, exist_ok=True)
        for path in extension + [os.path.join(built, "_build_info.py")] + \
                glob.glob(os.path.join(build, "libddpkit*.so*")):
            shutil.copy2(path, target, follow_symlinks=True)


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(
    name="ddpkit",
    version="0.1.0",
    description="ddpkit: data-parallel training for libtorch; its collectives as a torch.distributed backend",
    packages=["ddpkit"],
    package_dir={"ddpkit": "python/ddpkit"},
    cmdclass={"build_py": BuildWithCMake},
    distclass=BinaryDistribution,
    python_requires=">=3.9",
)
