#!/usr/bin/env python3
"""The library's folders are layers, and every include points down.

A folder of include/ddpkit/ and src/ may include its own headers and those of folders in lower
layers, never a folder in its own layer or above. The order is LAYERS below, as docs/design.md
draws it. Prints the folder dependency graph (who includes whom, how many times) and fails on
every include that points sideways or up, naming the file and line.

The library's clients (tools/: the CLIs; python/src: the bindings) sit above every layer: they
include only public headers (no private header of src/), and hold no training policy the library
owns (CLIENT_POLICY: which samples a rank reads, how gradients cross replica groups, the
lighthouse's DiLoCo invariant), so a user of the library gets every behaviour the CLI has.

  python3 tests/layers.py            # check
  python3 tests/layers.py --graph    # the graph only
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first. Folders in one entry are peers and must not include each other.
LAYERS = [
    ["runtime", "codecs", "metrics"],   # allocator, block cache, threads; kernels; counters
    ["comm", "optim"],                  # process groups and transports; one-pass optimizers
    ["reducer"],                        # buckets and the Reducer
    ["hooks"],                          # comm hooks
    ["ddp"],                            # DistributedDataParallel
    ["zero", "fsdp"],                   # ZeRO, FullyShardedDataParallel
    ["training"],                       # checkpoints, divergence guard: above every wrapper
    ["plan", "ps"],                     # cost model and tuning; parameter server
    ["ft"],                             # fault tolerance across replica groups (gRPC, like ps)
    ["diloco"],                         # DiLoCo over ft's Manager; its outer all-reduce
]
RANK = {folder: i for i, layer in enumerate(LAYERS) for folder in layer}
# <ddpkit/comm/x.h> (public) and "../comm/x.h" (another folder's private header in src/).
INCLUDE = re.compile(r'^\s*#\s*include\s*(?:<ddpkit/|"\.\./)([a-z_]+)/[^>"]+[>"]')


def folder_of(path):
    for base in ("include/ddpkit/", "src/"):
        if path.startswith(base):
            rest = path[len(base):]
            return rest.split("/")[0] if "/" in rest else None
    return None


def source_lines(bases):
    """(path, line number, line) of every C++ source and header under `bases`, relative to ROOT."""
    for base in bases:
        for root, _, files in os.walk(os.path.join(ROOT, base)):
            for name in sorted(files):
                if name.endswith((".h", ".cpp")):
                    path = os.path.relpath(os.path.join(root, name), ROOT)
                    with open(os.path.join(ROOT, path)) as f:
                        for lineno, line in enumerate(f, 1):
                            yield path, lineno, line


def scan():
    edges, bad, unknown = {}, [], set()
    for path, lineno, line in source_lines(("include/ddpkit", "src")):
        here = folder_of(path)
        if here is None:
            continue
        if here not in RANK:
            unknown.add(here)
            continue
        m = INCLUDE.match(line)
        if not m or m.group(1) == here:
            continue
        there = m.group(1)
        edges.setdefault(here, {}).setdefault(there, 0)
        edges[here][there] += 1
        if there not in RANK:
            unknown.add(there)
        elif RANK[there] >= RANK[here]:
            bad.append(f"{path}:{lineno}: {here} (layer {RANK[here]}) includes {there} "
                       f"(layer {RANK[there]}): {line.strip()}")
    return edges, bad, unknown


# (pattern, what the library owns it as, files allowed to use it): a client that needs one calls the library.
CLIENT_POLICY = [
    (re.compile(r"\brandperm\b"), "which samples each rank reads: ddpkit::ReplicaGroupSampler", ()),
    (re.compile(r"set_cross_replica_reduction|gradient_shards\(\)"),
     "the route of gradients across replica groups: ddpkit::ft::CrossGroupGradients", ()),
    (re.compile(r"\.join_timeout\("), "the lighthouse's DiLoCo invariant: ft::LighthouseOptions::for_diloco",
     # `ddpkit lighthouse --join-timeout-ms` and ddpkit.ft.Lighthouse(join_timeout=): the option as it is
     ("tools/ddpkit/lighthouse.cpp", "python/src/ft_bindings.cpp")),
]
PRIVATE_INCLUDE = re.compile(r'^\s*#\s*include\s*["<](?:\.\./)*src/')


def scan_clients():
    bad = []
    for path, lineno, line in source_lines(("tools", "python/src")):
        if PRIVATE_INCLUDE.match(line):
            bad.append(f"{path}:{lineno}: a client includes a private header of src/: {line.strip()}")
        code = line.split("//", 1)[0]
        for pattern, owner, allowed in CLIENT_POLICY:
            if pattern.search(code) and path not in allowed:
                bad.append(f"{path}:{lineno}: the library owns {owner}: {line.strip()}")
    return bad


def main():
    edges, bad, unknown = scan()
    client_bad = scan_clients()
    print("folder dependencies (includes), lowest layer first:")
    for layer in LAYERS:
        for folder in layer:
            out = edges.get(folder, {})
            print(f"  {folder:9s} -> " + (", ".join(f"{t} ({n})" for t, n in sorted(out.items())) or "-"))
    if "--graph" in sys.argv:
        return 0
    for u in sorted(unknown):
        print(f"folder '{u}' is in no layer: add it to LAYERS in tests/layers.py and to docs/design.md")
    for b in bad + client_bad:
        print(b)
    print(f"layers: {len(bad)} includes point sideways or up, {len(unknown)} folders without a layer; "
          f"clients (tools/, python/src): {len(client_bad)} private includes or library policy")
    return 1 if bad or unknown or client_bad else 0


if __name__ == "__main__":
    sys.exit(main())
