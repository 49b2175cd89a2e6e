#!/usr/bin/python3
"""ddpkit compiles against gloo headers that need not be the ones libtorch was built with (pip's
torch ships none; Debian's libgloo-dev is older than the gloo inside torch 2.15), so it must not
depend on any gloo layout: no gloo code of its own (no gloo function, vtable or typeinfo defined in
a ddpkit library or program, which could stand in for libtorch's at run time), and every gloo
function it calls defined by the libtorch it links. Only pointers to gloo objects pass through
ddpkit (std templates over them are fine). docs/compat.md, "Gloo headers".

  tests/gloo_symbols.py BUILD_DIR"""
import glob
import os
import re
import subprocess
import sys

# A symbol of gloo's own: a gloo function or static, or gloo's vtable/typeinfo/guard.
OWN = re.compile(r"^((vtable|typeinfo|typeinfo name|VTT|guard variable) for )?(non-virtual thunk to )?gloo::")


def symbols(path, which):
    out = subprocess.run(["nm", "-DC", which, path], capture_output=True, text=True, check=True).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(None, 2) if which == "--defined-only" else line.split(None, 1)
        if len(parts) >= 2:
            names.append(parts[-1])
    return names


def linked_libtorch_cpu(path):
    out = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        m = re.search(r"libtorch_cpu\.so[.0-9]* => (\S+)", line)
        if m:
            return m.group(1)
    sys.exit(f"FAILED: {path} does not link libtorch_cpu.so")


def main():
    build = sys.argv[1]
    binaries = sorted(set(glob.glob(os.path.join(build, "libddpkit*.so")) +
                          glob.glob(os.path.join(build, "python", "ddpkit", "_C*.so")) +
                          [os.path.join(build, "ddpkit")]))
    binaries = [b for b in binaries if os.path.isfile(b)]
    if not binaries:
        sys.exit(f"FAILED: no ddpkit library under {build}")
    torch_cpu = linked_libtorch_cpu(binaries[0])
    provided = {s for s in symbols(torch_cpu, "--defined-only") if "gloo::" in s}
    failed = []
    for b in binaries:
        own = [s for s in symbols(b, "--defined-only") if OWN.match(s)]
        used = [s for s in symbols(b, "--undefined-only") if OWN.match(s)]
        missing = [s for s in used if s not in provided]
        print(f"{os.path.basename(b)}: {len(own)} gloo symbols defined, {len(used)} used, {len(missing)} not in "
              f"{torch_cpu}")
        failed += [f"{b} defines {s}" for s in own] + [f"{b} needs {s}, which libtorch_cpu lacks" for s in missing]
    if failed:
        sys.exit("FAILED:\n" + "\n".join(failed[:20]))
    print(f"no gloo layout in ddpkit: {len(binaries)} binaries, {len(provided)} gloo symbols in libtorch_cpu")


if __name__ == "__main__":
    main()
