#!/usr/bin/env python3
"""Every link and path the user docs name exists; measurement logs stay out of docs/.

Checks README.md, docs/*.md and bench/results/**/*.md:
- relative markdown links ([text](path#anchor)) resolve to a file, and the anchor to a heading;
- repository paths written in the text (bench/..., docs/..., include/..., tests/..., scripts/...)
  exist, globs (`*`) matching at least one file;
- bench/ holds no result files outside bench/results/ (results-*.txt, *.log).
"""
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w/.-])((?:bench|docs|include|src|tests|scripts|tools|python|examples)/[\w./*{},-]*[\w}])")


def anchors(path):
    out = set()
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                title = line.lstrip("#").strip().lower()
                out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def expand(p):
    """bench/results/online-tuning-2026-11-2{5,6,7}.txt -> three paths."""
    m = re.search(r"\{([^}]*)\}", p)
    if not m:
        return [p]
    return [x for alt in m.group(1).split(",") for x in expand(p[:m.start()] + alt + p[m.end():])]


def check(doc):
    problems = []
    text = open(doc).read()
    here = os.path.dirname(doc)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(here, path))
        if not os.path.exists(full):
            problems.append(f"link to {target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            problems.append(f"link to {target}: no heading '{anchor}' in {path}")
    for p in set(PATH.findall(text)):
        for one in expand(p.rstrip(".")):
            if "*" in one:
                if not glob.glob(os.path.join(ROOT, one)):
                    problems.append(f"path {one}: matches nothing")
            elif not os.path.exists(os.path.join(ROOT, one)) and not one.startswith(("build", "tools/ddpkit/ddpkit")):
                problems.append(f"path {one}: no such file or folder")
    return problems


def main():
    docs = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) \
        + sorted(glob.glob(os.path.join(ROOT, "bench", "results", "**", "*.md"), recursive=True))
    failed = 0
    for doc in docs:
        for problem in check(doc):
            print(f"{os.path.relpath(doc, ROOT)}: {problem}")
            failed += 1
    strays = [f for f in os.listdir(os.path.join(ROOT, "bench")) if re.match(r"results-.*\.txt$|.*\.log$", f)]
    for f in strays:
        print(f"bench/{f}: results belong in bench/results/ (and its README's index)")
        failed += 1
    print(f"docs_links: {len(docs)} pages, {failed} problems")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
