#!/usr/bin/env bash
# ddpkit as a dependency, the two ways a libtorch project takes it:
#  1. cmake --install to a temporary prefix, then examples/train_mlp built with find_package(ddpkit)
#     against that prefix alone, and run on 2 ranks by the installed `ddpkit launch`;
#  2. add_subdirectory(ddpkit) from a project that never calls find_package(Torch): configure,
#     generate, and check the example's link line names libtorch (--build adds a full build).
#   install_consumer.sh SOURCE_DIR BUILD_DIR [--build]
set -euo pipefail
src=$1
build=$2
full=${3:-}
work=$(mktemp -d /tmp/ddpkit-consumer.XXXXXX)
trap 'rm -rf "$work"' EXIT

echo "== install to $work/prefix"
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
for f in include/ddpkit/ddpkit.h bin/ddpkit lib/cmake/ddpkit/ddpkitConfig.cmake lib/cmake/ddpkit/ddpkitTargets.cmake; do
  [ -e "$work/prefix/$f" ] || { echo "missing after install: $f"; exit 1; }
done
ls "$work/prefix/lib"/libddpkit*.so >/dev/null

echo "== examples/train_mlp against the installed package"
cmake -S "$src/examples/train_mlp" -B "$work/example" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" >"$work/example.cfg.log" \
  || { cat "$work/example.cfg.log"; exit 1; }
cmake --build "$work/example" -j2 >"$work/example.build.log" || { tail -40 "$work/example.build.log"; exit 1; }
# The build tree's libraries must not be what the program loads. (Captured first: `ldd | grep -q`
# under pipefail fails whenever grep exits before ldd has written everything.)
libs=$(ldd "$work/example/train_mlp")
if [[ "$libs" == *"$build/"* ]]; then
  echo "train_mlp loads libraries from the build tree:"; echo "$libs"; exit 1
fi
[[ "$libs" == *"$work/prefix/lib/libddpkit.so"* ]] || { echo "train_mlp does not load the installed libddpkit:"; echo "$libs"; exit 1; }
"$work/prefix/bin/ddpkit" launch --nproc 2 "$work/example/train_mlp" --epochs 4 | tee "$work/run.log"
grep -q "train_mlp: world 2, hook allreduce, .* ranks agree" "$work/run.log"
"$work/prefix/bin/ddpkit" launch --nproc 2 "$work/example/train_mlp" --epochs 2 --hook fp16 | tee "$work/run16.log"
grep -q "hook fp16, .* ranks agree" "$work/run16.log"

if [ -e "$work/prefix/lib/cmake/ddpkit/ddpkitFtTargets.cmake" ]; then
  echo "== examples/fault_tolerance against the installed package (tests/examples_ft.py runs the in-tree build)"
  cmake -S "$src/examples/fault_tolerance" -B "$work/ft_examples" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" \
    >"$work/ft_examples.cfg.log" || { cat "$work/ft_examples.cfg.log"; exit 1; }
  # One of the two is enough to prove ddpkit::ft's export (both use only it); the in-tree build has both.
  cmake --build "$work/ft_examples" --target diloco_sites -j2 >"$work/ft_examples.build.log" || { tail -40 "$work/ft_examples.build.log"; exit 1; }
  libs=$(ldd "$work/ft_examples/diloco_sites")
  [[ "$libs" == *"$work/prefix/lib/libddpkit_ft.so"* ]] || { echo "diloco_sites does not load the installed libddpkit_ft:"; echo "$libs"; exit 1; }
fi

if [ -e "$work/prefix/lib/cmake/ddpkit/ddpkitFtTargets.cmake" ]; then
  echo "== a program using ft::Manager, linked with the README's own CMake lines"
  # The block under "Using ddpkit from your project", as a user would copy it.
  readme_lines=$(awk '/^## Using ddpkit from your project/ {in_section = 1}
                      in_section && /^```cmake/ {in_block = 1; next}
                      in_block && /^```/ {exit}
                      in_block {print}' "$src/README.md")
  [[ "$readme_lines" == *find_package* ]] || { echo "no cmake block in the README's 'Using ddpkit from your project'"; exit 1; }
  mkdir -p "$work/readme_app"
  cp "$src/tests/readme_consumer/app.cpp" "$work/readme_app/"
  printf 'cmake_minimum_required(VERSION 3.21)\nproject(app LANGUAGES CXX)\nset(CMAKE_CXX_STANDARD 17)\nadd_executable(app app.cpp)\n%s\n' \
    "$readme_lines" >"$work/readme_app/CMakeLists.txt"
  cmake -S "$work/readme_app" -B "$work/readme_app/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" \
    >"$work/readme_app.cfg.log" || { cat "$work/readme_app/CMakeLists.txt" "$work/readme_app.cfg.log"; exit 1; }
  cmake --build "$work/readme_app/build" -j2 >"$work/readme_app.build.log" \
    || { cat "$work/readme_app/CMakeLists.txt"; tail -40 "$work/readme_app.build.log"; exit 1; }
  "$work/prefix/bin/ddpkit" launch --nproc 1 "$work/readme_app/build/app" | tee "$work/readme_app.log"
  grep -q "readme app: 3 steps committed" "$work/readme_app.log"
fi

echo "== the Python package from the prefix"
pydirs=("$work"/prefix/lib/python3*/*-packages)
if [ -d "${pydirs[0]}/ddpkit" ]; then
  # Loads the installed extension and, through its RPATH, the installed libddpkit.
  PYTHONPATH="${pydirs[0]}" "${DDPKIT_TORCH_PYTHON:-/usr/bin/python3}" -c "
import ddpkit, os
so = ddpkit._C.__file__
assert so.startswith('$work/prefix/'), so
maps = open('/proc/self/maps').read()
lib = [l.split()[-1] for l in maps.splitlines() if 'libddpkit.so' in l][0]
assert lib.startswith('$work/prefix/lib/'), lib
print('python: ddpkit', ddpkit.__version__, 'from', os.path.dirname(so), 'hooks:', len(ddpkit.hook_names()))
"
elif grep -q "ddpkit_python" "$build/build.ninja"; then
  echo "the Python package was built but not installed under $work/prefix/lib/python3*"; exit 1
fi

echo "== add_subdirectory(ddpkit) without find_package(Torch)"
# The libtorch the build used (a pip torch's, say), as such a project would name it.
torch_dir=$(sed -n 's/^Torch_DIR:PATH=//p' "$build/CMakeCache.txt")
cmake -S "$src/tests/consumer_subdir" -B "$work/subdir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DDDPKIT_SOURCE_DIR="$src" -DTorch_DIR="$torch_dir" >"$work/subdir.cfg.log" 2>&1 || { cat "$work/subdir.cfg.log"; exit 1; }
grep -q "CMake Error" "$work/subdir.cfg.log" && { cat "$work/subdir.cfg.log"; exit 1; }
# ddpkit's own tests and tools are off when it is a subproject.
if grep -q "ddpkit_tests" "$work/subdir/build.ninja"; then echo "subproject builds ddpkit's tests"; exit 1; fi
link=$(ninja -C "$work/subdir" -t commands train_mlp | tail -1)
[[ "$link" == *libtorch* ]] || { echo "train_mlp's link line does not name libtorch: $link"; exit 1; }
if [ "$full" = --build ]; then
  cmake --build "$work/subdir" -j2 --target train_mlp >"$work/subdir.build.log" || { tail -40 "$work/subdir.build.log"; exit 1; }
  "$build/ddpkit" launch --nproc 2 "$work/subdir/train_mlp" --epochs 2 | grep "ranks agree"
fi
echo "install_consumer: OK"
