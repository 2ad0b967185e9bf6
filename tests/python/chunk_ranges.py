"""Prints torch.chunk's row counts on dim 0 as JSON: one object per (d0, W),
{"d0": d0, "w": W, "rows": [rows of rank 0, ..., rank W-1]}, with 0 for the
ranks past the last chunk. The independent reference for FSDP2's split
(fully_shard shards with torch.chunk). Usage: chunk_ranges.py MAX_D0 MAX_W."""
import json
import sys

import torch


def rows(d0, world):
    chunks = torch.chunk(torch.arange(d0), world, dim=0)
    counts = [int(chunk.shape[0]) for chunk in chunks]
    return counts + [0] * (world - len(counts))


def main():
    max_d0, max_w = int(sys.argv[1]), int(sys.argv[2])
    out = [{"d0": d0, "w": w, "rows": rows(d0, w)}
           for d0 in range(max_d0 + 1) for w in range(1, max_w + 1)]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
