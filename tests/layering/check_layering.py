#!/usr/bin/env python3
"""Fails when an include crosses the floors the wrong way (DESIGN.md section 1).

The floors, bottom up: core; shard and offload (siblings, each on core);
lib, the public API (on all three). Each publishes shardema/<floor>/*.h
(lib: shardema/*.h) to what sits above it, and keeps shardema/<floor>/detail/
(lib: shardema/detail/) to itself. Every `#include "shardema/..."` is
resolved against the include roots to the floor that owns it, and:
  - a floor includes its own headers and the public ones of the floors
    below it, never a floor above or beside it, nor another floor's detail/;
  - a public header (not under detail/) includes no detail/ header, its
    own floor's included;
  - the users of the API (python/src, tools, examples) include public
    headers of any floor, never a detail/ one;
  - bench/ measures internals and may include any header, but each must
    exist. tests/ are not checked: they test details.
The build enforces the floor order through include roots (the probes in
tests/CMakeLists.txt); this check names the offending line, covers the
detail/ rules the include roots cannot, and the users of the API.
Usage: check_layering.py <repository root>"""
import pathlib
import re
import sys

FLOORS = {  # floor: floors it may include
    "core": {"core"},
    "shard": {"core", "shard"},
    "offload": {"core", "offload"},
    "lib": {"core", "shard", "offload", "lib"},
}
USERS = ("python/src", "tools", "examples")
MEASURERS = ("bench",)
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](shardema/[^">]+)[">]')


def owner(root, header):
    """(floor, is_detail) of an include path, or None when no root has it."""
    for floor in FLOORS:
        if (root / floor / "include" / header).is_file():
            parts = header.split("/")
            return floor, "detail" in parts[1:-1]
    return None


def sources(root, folder):
    for path in sorted((root / folder).rglob("*")):
        if path.suffix in (".h", ".cpp", ".cu") and path.is_file():
            yield path


def includes(path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = INCLUDE.match(line)
        if match:
            yield number, match.group(1)


def problem(root, path, floor, header, found):
    """What is wrong with `path` (of `floor`, or a user/measurer folder)
    including `header`, owned by `found`; None when nothing is."""
    if found is None:
        return f"{header} is in no floor's include root"
    owner_floor, is_detail = found
    if floor in FLOORS:
        if owner_floor not in FLOORS[floor]:
            return f"{floor} includes {header} of {owner_floor} (a floor above or beside it)"
        if is_detail and owner_floor != floor:
            return f"{floor} includes {header}, a detail of {owner_floor}"
        public = "detail" not in path.relative_to(root / floor / "include").parts \
            if (root / floor / "include") in path.parents else False
        if public and is_detail:
            return f"public header includes {header}, a detail header"
        return None
    if floor in USERS and is_detail:
        return f"{floor} is a user of the API but includes {header}, a detail of {owner_floor}"
    return None


def main():
    root = pathlib.Path(sys.argv[1]).resolve()
    problems = []
    checked = 0
    for floor in list(FLOORS) + list(USERS) + list(MEASURERS):
        for path in sources(root, floor):
            for number, header in includes(path):
                checked += 1
                wrong = problem(root, path, floor, header, owner(root, header))
                if wrong:
                    problems.append(f"{path.relative_to(root)}:{number}: {wrong}")
    for p in problems:
        print(p)
    if checked == 0:
        print(f"no includes found under {root}: wrong root?")
        return 1
    print(f"{checked} includes checked, {len(problems)} cross the floors the wrong way")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
