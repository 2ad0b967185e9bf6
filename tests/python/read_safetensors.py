"""Reads a safetensors file written by shardema with numpy only and checks
every tensor against interop_values.TABLE. Usage: read_safetensors.py FILE.
Exit code 0 = every check passed; 1 = a mismatch (printed)."""
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interop_values import (ITEM_SIZES, NUMPY_DTYPES, TABLE, bf16_to_float32,  # noqa: E402
                            expected_array)


def check(path):
    problems = []
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        return ["header length %d past file end %d" % (n, len(blob))]
    if (8 + n) % 8:
        problems.append("data area not 8-byte aligned (N=%d)" % n)
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    metadata = header.pop("__metadata__", {})
    if metadata.get("shardema.format") != "1":
        problems.append("shardema.format is %r" % metadata.get("shardema.format"))
    if set(header) != {name for name, _, _ in TABLE}:
        problems.append("names differ: %s" % sorted(header))
        return problems

    spans = sorted((entry["data_offsets"][0], entry["data_offsets"][1], name)
                   for name, entry in header.items())
    covered = 0
    for begin, end, name in spans:
        if begin != covered:
            problems.append("%s begins at %d, expected %d" % (name, begin, covered))
        covered = end
    if covered != len(data):
        problems.append("tensors cover %d of %d data bytes" % (covered, len(data)))

    for seed, (name, dtype, shape) in enumerate(TABLE):
        entry = header[name]
        if entry["dtype"] != dtype or tuple(entry["shape"]) != shape:
            problems.append("%s: dtype %s shape %s, expected %s %s"
                            % (name, entry["dtype"], entry["shape"], dtype, shape))
            continue
        begin, end = entry["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * ITEM_SIZES[dtype]:
            problems.append("%s: span %d for %d elements" % (name, end - begin, count))
            continue
        raw = np.frombuffer(data[begin:end], dtype=NUMPY_DTYPES[dtype]).reshape(shape)
        actual = bf16_to_float32(raw) if dtype == "BF16" else raw
        want = expected_array(seed, dtype, shape)
        if not np.array_equal(actual.astype(want.dtype), want):
            bad = np.argwhere(actual.astype(want.dtype) != want)[:3].tolist()
            problems.append("%s: values differ at %s" % (name, bad))
    problems += check_tensor_checksums(header, metadata, data)
    return problems


def check_tensor_checksums(header, metadata, data):
    """shardema.xxh64 recomputed with the xxhash package (docs/files.md): per
    tensor, XXH64 of "<DTYPE>[<shape>]" followed by the tensor's bytes."""
    import xxhash  # xxhash from requirements.lock
    text = metadata.get("shardema.xxh64")
    if text is None:
        return ["no shardema.xxh64 in the metadata"]
    table = json.loads(text)
    if set(table) != set(header):
        return ["shardema.xxh64 lists %s, the file has %s" % (sorted(table), sorted(header))]
    problems = []
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        prefix = "%s[%s]" % (entry["dtype"], ",".join(str(d) for d in entry["shape"]))
        digest = xxhash.xxh64(prefix.encode("ascii") + data[begin:end]).hexdigest()
        if digest != table[name]:
            problems.append("%s: shardema.xxh64 says %s, xxhash computes %s"
                            % (name, table[name], digest))
    return problems


def main():
    problems = check(sys.argv[1])
    for problem in problems:
        print("read_safetensors.py: " + problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
