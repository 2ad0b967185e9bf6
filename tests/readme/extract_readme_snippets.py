#!/usr/bin/env python3
"""Turns every ```cpp block of the given Markdown files into a GoogleTest
case (README.md and docs/cpp.md).

The README's API tour is a set of fragments that use a model, an optimizer,
a communicator and a few loop counters without declaring them. Each block
becomes the body of one TEST, inside a scope where readme_snippet_context.h
provides those names, so the test fails to build when the README drifts
from the API, and runs each block once in a fresh folder.

usage: extract_readme_snippets.py OUTPUT.cpp DOC.md [DOC.md ...]
"""
import re
import sys


def blocks(text):
    return re.findall(r"^```cpp\n(.*?)^```", text, flags=re.S | re.M)


def main():
    output, docs = sys.argv[1], sys.argv[2:]
    found = []
    for doc in docs:
        with open(doc, encoding="utf-8") as f:
            these = blocks(f.read())
        if not these:
            sys.exit(f"{doc}: no ```cpp blocks")
        found += these
    includes, bodies = [], []
    for block in found:
        lines = block.splitlines()
        includes += [l for l in lines if l.startswith("#include")]
        bodies.append("\n".join(l for l in lines if not l.startswith("#include")))
    out = ["// Generated from " + ", ".join(docs) + " by tests/readme/extract_readme_snippets.py.",
           "// Edit those documents, not this file."]
    out += sorted(set(includes))
    out.append('#include "readme/readme_snippet_context.h"')
    out.append("")
    out.append("namespace shardema::readme {")
    for number, body in enumerate(bodies, start=1):
        out.append(f"TEST(ReadmeSnippetsTest, Block{number}) {{")
        out.append("  SnippetContext context;")
        uses_comm = re.search(r"\bcomm\b", body) is not None
        makes_comm = "Communicator::fromEnvironment" in body
        macro = "NAMES_WITH_COMM" if uses_comm and not makes_comm else "NAMES"
        out.append(f"  SHARDEMA_README_SNIPPET_{macro}(context);")
        out.append("  {")
        out.append(body)
        out.append("  }")
        out.append("}")
        out.append("")
    out.append("}  // namespace shardema::readme")
    with open(output, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
