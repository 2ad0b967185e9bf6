#!/usr/bin/env python3
"""Fails when a document (README.md, DESIGN.md, docs/) names a repository
path that does not exist.

Checked: every `backticked` token and every markdown link target that looks
like a path of this repository (starts with one of its top-level folders or
files, or is an include spelling `shardema/...`, resolved against the
include roots). Paths a run creates (out/, build/) and patterns (with *, {,
<, ...) are not checked.

Usage: check_doc_paths.py REPO_ROOT [FILE.md ...]
"""
import pathlib
import re
import sys

INCLUDE_ROOTS = ["core/include", "lib/include", "shard/include", "offload/include"]
CREATED = ("out/", "build/", "build-fuzz/")
PATTERN_CHARS = set("*{}<>$|")


def candidates(text):
    for match in re.finditer(r"`([^`\n]+)`", text):
        yield match.group(1)
    for match in re.finditer(r"\]\(([^)\s]+)\)", text):
        yield match.group(1)


def check(root, doc, top_level):
    headers = [str(h) for r in INCLUDE_ROOTS for h in (root / r).rglob("*.h")]
    problems, checked = [], 0
    for token in candidates(doc.read_text()):
        token = token.strip().rstrip(".,:;")
        if " " in token or PATTERN_CHARS & set(token) or token.startswith(CREATED):
            continue
        if "://" in token or token.startswith("#"):
            continue
        path = token.split("#")[0]
        first = path.split("/")[0]
        if path.endswith(".h") and not (root / path).exists():
            # An include spelling or a header's name: some public or detail
            # header must end with it.
            checked += 1
            if not any(h.endswith("/" + path) for h in headers):
                problems.append(f"{doc.name}: header {path} is in no include root")
            continue
        if "/" not in path and first not in top_level:
            continue
        if first not in top_level:
            continue
        checked += 1
        if not (root / path).exists():
            problems.append(f"{doc.name}: {path} does not exist")
    return problems, checked


def main():
    root = pathlib.Path(sys.argv[1]).resolve()
    docs = [root / d for d in (sys.argv[2:] or ["README.md", "DESIGN.md"])]
    top_level = {p.name for p in root.iterdir() if not p.name.startswith(".")} | {".ci"}
    problems, checked = [], 0
    for doc in docs:
        if not doc.is_file():
            problems.append(f"{doc} is missing")
            continue
        p, c = check(root, doc, top_level)
        problems += p
        checked += c
    for p in problems:
        print(p)
    print(f"{checked} paths checked, {len(problems)} missing")
    return 1 if problems or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
