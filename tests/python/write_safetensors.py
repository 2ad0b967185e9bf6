"""Writes interop_values.TABLE as a safetensors file, from the format
specification, with numpy only. Usage: write_safetensors.py FILE.

Deliberately unlike shardema's writer so the reader is tested on what other
writers do: JSON keys in table order but data in reverse order, metadata
last, non-ASCII metadata, no padding (the data area is not 8-byte aligned).
"""
import json
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interop_values import NUMPY_DTYPES, TABLE, expected_array, float32_to_bf16  # noqa: E402


def encode(seed, dtype, shape):
    values = expected_array(seed, dtype, shape)
    if dtype == "BF16":
        return float32_to_bf16(values).tobytes()
    return values.astype(NUMPY_DTYPES[dtype]).tobytes()


def main():
    data = b""
    spans = {}
    for seed, (name, dtype, shape) in reversed(list(enumerate(TABLE))):
        chunk = encode(seed, dtype, shape)
        spans[name] = [len(data), len(data) + len(chunk)]
        data += chunk
    header = {name: {"dtype": dtype, "shape": list(shape), "data_offsets": spans[name]}
              for name, dtype, shape in TABLE}
    header["__metadata__"] = {"shardema.format": "1", "written_by": "numpy",
                              "caf\u00e9": "\u00fcml\u00e4ut"}
    text = json.dumps(header, ensure_ascii=False).encode("utf-8")
    if (8 + len(text)) % 8 == 0:
        text += b" "  # keep the data area unaligned on purpose
    with open(sys.argv[1], "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
