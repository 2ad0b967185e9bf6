#!/usr/bin/env python3
"""Fails when a source includes a header of a layer above its own.

The layers (DESIGN.md), bottom up: lib/core; shard and offload (siblings,
each on core); lib/facade (on all three). Every `#include "shardema/..."`
is resolved against the include roots to the layer that owns the header,
and must belong to the including file's layer or one below it. The build
enforces the same through include roots (the probes in CMakeLists.txt);
this check names every offending line at once, tests and tools aside.

Usage: check_layering.py REPO_ROOT
"""
import pathlib
import re
import sys

LAYERS = {  # layer: (folder, layers it may include)
    "core": ("lib/core", {"core"}),
    "shard": ("shard", {"core", "shard"}),
    "offload": ("offload", {"core", "offload"}),
    "facade": ("lib/facade", {"core", "shard", "offload", "facade"}),
}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](shardema/[^">]+)[">]')


def owner(root, header):
    for layer, (folder, _) in LAYERS.items():
        if (root / folder / "include" / header).is_file():
            return layer
    return None


def main():
    root = pathlib.Path(sys.argv[1]).resolve()
    problems = []
    checked = 0
    for layer, (folder, allowed) in LAYERS.items():
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in (".h", ".cpp", ".cu") or not path.is_file():
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                match = INCLUDE.match(line)
                if not match:
                    continue
                checked += 1
                header = match.group(1)
                found = owner(root, header)
                where = f"{path.relative_to(root)}:{number}"
                if found is None:
                    problems.append(f"{where}: {header} is in no layer's include root")
                elif found not in allowed:
                    problems.append(f"{where}: {layer} includes {header} of {found} "
                                    f"(a layer above or beside it)")
    for p in problems:
        print(p)
    if checked == 0:
        print(f"no includes found under {root}: wrong root?")
        return 1
    print(f"{checked} includes checked, {len(problems)} point up")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
