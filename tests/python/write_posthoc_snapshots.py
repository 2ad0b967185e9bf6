"""Writes post-hoc EMA snapshots in shardema's documented format (docs/files.md)
from Python, with numpy, struct and json only, so that a training
job that never links shardema can still hand its snapshots to
`shardema synthesize`.

Usage: write_posthoc_snapshots.py GOLDEN_JSON OUT_DIR [--corrupt-gamma]

Writes the snapshots of the lucid_fp32 run (runs[0]) of GOLDEN_JSON
(tests/data/posthoc_ema_run.json) as OUT_DIR/{i}.{step}.safetensors.
--corrupt-gamma then gives 1.50.safetensors a gamma that disagrees with its
sigma_rel, which shardema must refuse.

From a PyTorch job, per profile i at step n (bf16 has no numpy dtype, hence
the .float()):
    tensors = {k: v.detach().float().cpu().numpy() for k, v in ema.state_dict().items()}
    write_snapshot(f"{folder}/{i}.{n}.safetensors", tensors, i, n, sigma_rels[i])
"""
import json
import os
import struct
import sys

import numpy as np


def sigma_rel_to_gamma(sigma_rel):
    # Karras et al. 2024, eq. 3: sigma_rel^2 = (g + 1) / ((g + 2)^2 (g + 3)).
    # With q = 1 / sigma_rel^2 that is the cubic g^3 + 7g^2 + (16 - q)g + (12 - q)
    # = 0, which has three real roots for every valid sigma_rel (q > 12);
    # gamma is the largest (the only positive) one, as in shardema and ema-pytorch.
    assert 0 < sigma_rel < 12 ** -0.5, f"sigma_rel {sigma_rel} has no power profile"
    q = 1.0 / sigma_rel**2
    return float(np.roots([1.0, 7.0, 16.0 - q, 12.0 - q]).real.max())


# numpy dtype (little-endian) -> safetensors dtype name.
DTYPES = {"<f4": "F32", "<i8": "I64", "<i4": "I32", "|b1": "BOOL"}


def write_snapshot(path, tensors, profile_index, step, sigma_rel):
    """Writes one profile's EMA at one step; tensors: dict[str, np.ndarray]."""
    # shardema checks that the name matches the metadata (a renamed file is refused).
    assert os.path.basename(path) == f"{profile_index}.{step}.safetensors", path
    header, chunks, offset = {}, [], 0
    for name, array in tensors.items():
        # Snapshots are float32 by contract whatever the training dtype;
        # integer buffers (counters) are not averaged and keep their dtype.
        if np.issubdtype(array.dtype, np.floating):
            array = array.astype(np.float32)
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        data = array.tobytes()
        header[name] = {"dtype": DTYPES[array.dtype.str], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    # All values are strings. repr() round-trips a float exactly, and shardema
    # refuses a file whose sigma_rel and gamma disagree (relative 1e-9).
    header["__metadata__"] = {
        "shardema.format": "1",
        "shardema.kind": "posthoc_snapshot",
        "shardema.sigma_rel": repr(float(sigma_rel)),
        "shardema.gamma": repr(sigma_rel_to_gamma(sigma_rel)),
        "shardema.step": str(step),
        "shardema.profile_index": str(profile_index),
    }
    text = json.dumps(header).encode("utf-8")
    text += b" " * (-len(text) % 8)  # spaces align the data area to 8 bytes
    # Write aside, then rename: a crash leaves only a .tmp, which synthesize
    # ignores, never a half-written snapshot under the real name.
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


# ---- the rest drives the test (tests/tools/python_snapshots_test.cpp) ----

# The golden run's PostHocEMA(sigma_rels=(0.05, 0.1)), see its "description".
SIGMA_RELS = (0.05, 0.1)


def corrupt_gamma(path):
    """Rewrites path with gamma 1% off its sigma_rel, data unchanged."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["__metadata__"]["shardema.gamma"] = repr(
        float(header["__metadata__"]["shardema.gamma"]) * 1.01)
    text = json.dumps(header).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def main(argv):
    if len(argv) not in (3, 4) or (len(argv) == 4 and argv[3] != "--corrupt-gamma"):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        run = json.load(f)["runs"][0]
    assert run["run"] == "lucid_fp32", run["run"]
    os.makedirs(argv[2], exist_ok=True)
    for snapshot in run["snapshots"]:
        index, step = (int(part) for part in snapshot["file"].split(".")[:2])  # "0.10.pt"
        theta = np.array(snapshot["contents"]["ema_model.theta"]["values"], dtype=np.float32)
        path = os.path.join(argv[2], f"{index}.{step}.safetensors")
        write_snapshot(path, {"theta": theta}, index, step, SIGMA_RELS[index])
    if len(argv) == 4:
        corrupt_gamma(os.path.join(argv[2], "1.50.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
