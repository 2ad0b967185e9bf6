#!/usr/bin/env python3
"""Hostile-file corpus: generates damaged copies of a good tensor file and a
good per-rank checkpoint folder, runs the `shardema` CLI on each under a
timeout, and checks that every case ends in exit status 2 with one line on
stderr naming the damaged file or folder: no crash, no hang, no damaged
input taken as valid.

  hostile_files.py --cli BUILD/tools/shardema --file GOOD.safetensors \
                   --checkpoint GOOD_FOLDER --work SCRATCH

By default a CI-sized sample (72 runs of the CLI, 4 at a time); --full
runs every case (170; several minutes: run it after changing a reader).
Cases where a random flip may leave a valid file (a byte of a tensor name
or of a metadata value) may also exit 0; they must still not crash or hang.
Exit status: 0 when every case behaved, 1 otherwise (each failure listed).
"""
import argparse
import concurrent.futures
import json
import os
import random
import shutil
import struct
import subprocess
import sys

TIMEOUT_S = 20


class Corpus:
    def __init__(self, cli, work, full):
        self.cli = cli
        self.work = work
        self.full = full
        self.jobs = []
        self.failures = []

    def n(self, quick, full):
        """How many random cases of a kind: a few in CI, more with --full."""
        return full if self.full else quick

    def run(self, case, args, named, allow_ok=False):
        """Queues one CLI run; `named` must appear in its one-line error."""
        self.jobs.append((case, args, named, allow_ok))

    def check(self, job):
        case, args, named, allow_ok = job
        try:
            done = subprocess.run([self.cli] + args, capture_output=True, text=True,
                                  timeout=TIMEOUT_S, errors="replace")
        except subprocess.TimeoutExpired:
            return f"{case}: hung (no answer in {TIMEOUT_S} s)"
        err = done.stderr.strip()
        if done.returncode == 0 and allow_ok:
            return None
        if done.returncode != 2:
            return f"{case}: exit {done.returncode} (expected 2): {err[-300:]}"
        if len(err.splitlines()) != 1:
            return f"{case}: {len(err.splitlines())} lines on stderr: {err[:300]}"
        if named not in err:
            return f"{case}: error does not name {named}: {err}"
        return None

    def run_all(self):
        # The CLI's start (loading LibTorch) dominates: run a few at once.
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            self.failures = [f for f in pool.map(self.check, self.jobs) if f]

    def inspect(self, case, path, allow_ok=False):
        self.run(case + " (inspect)", ["inspect", path], path, allow_ok)

    def folder(self, case, path, allow_ok=False, export=False):
        """inspect, and with export=True (or --full) export as well."""
        self.inspect(case, path, allow_ok)
        if export or self.full:
            out = os.path.join(self.work, "export_" + os.path.basename(path) + ".safetensors")
            self.run(case + " (export)", ["export", "--checkpoint", path, "--out", out], path,
                     allow_ok)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def header_of(raw):
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n])


def with_header(raw, header):
    """The file with a new JSON header (data bytes unchanged)."""
    n, _ = header_of(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


def flip(data, position, rng):
    out = bytearray(data)
    out[position] ^= 1 << rng.randrange(8)
    return bytes(out)


def tensor_file_cases(corpus, good, rng):
    raw = read(good)
    n, header = header_of(raw)
    names = [k for k in header if k != "__metadata__"]
    d = os.path.join(corpus.work, "files")
    os.makedirs(d, exist_ok=True)

    def case(name, data, allow_ok=False):
        path = os.path.join(d, name + ".safetensors")
        write(path, data)
        corpus.inspect(name, path, allow_ok)

    cuts = [0, 7, 8 + n // 2, 8 + n, len(raw) - 1]
    if corpus.full:
        cuts += [1, 8, 9, 8 + n - 1]
    for cut in sorted(set(cuts)):
        case(f"truncated_{cut}", raw[:cut])
    for i in range(corpus.n(4, 24)):
        case(f"header_flip_{i}", flip(raw, 8 + rng.randrange(n), rng), allow_ok=True)
    for i in range(corpus.n(4, 24)):
        case(f"data_flip_{i}", flip(raw, 8 + n + rng.randrange(len(raw) - 8 - n), rng))
    for length in (n + 1, len(raw), 100 << 20, (1 << 63) + 5, (1 << 64) - 1):
        case(f"header_length_{length}", struct.pack("<Q", length) + raw[8:])
    case("header_not_json", struct.pack("<Q", n) + b"{" * n + raw[8 + n:])
    case("header_deep", struct.pack("<Q", 200000) + b"[" * 200000)
    big = dict(header)
    big["__metadata__"] = dict(header.get("__metadata__", {}), pad="x" * (101 << 20))
    case("header_over_limit", with_header(raw, big))
    first = names[0]
    second = names[1]  # its offsets can be moved onto the first tensor's
    for label, offsets in [("shifted", lambda b, e: [b + 4, e + 4]),
                           ("overlapping", lambda b, e: [0, e]),
                           ("reversed", lambda b, e: [e, b]),
                           ("past_end", lambda b, e: [b, e + 1024]),
                           ("huge", lambda b, e: [b, (1 << 64) - 1])]:
        edited = json.loads(json.dumps(header))
        b, e = edited[second]["data_offsets"]
        edited[second]["data_offsets"] = offsets(b, e)
        case(f"offsets_{label}", with_header(raw, edited))
    for dtype in ("I32", "F16", "BF16", "U8", "C64", ""):
        edited = json.loads(json.dumps(header))
        edited[first]["dtype"] = dtype
        case(f"dtype_{dtype or 'empty'}", with_header(raw, edited))
    edited = json.loads(json.dumps(header))
    edited[first]["shape"] = [-1]
    case("shape_negative", with_header(raw, edited))
    edited = json.loads(json.dumps(header))
    edited["__metadata__"]["shardema.xxh64"] = "not json"
    case("checksum_text", with_header(raw, edited))
    fifo = os.path.join(d, "fifo.safetensors")
    os.mkfifo(fifo)
    corpus.inspect("fifo", fifo)
    loop = os.path.join(d, "loop.safetensors")
    os.symlink(loop, loop)
    corpus.inspect("symlink_loop", loop)


def folder_cases(corpus, good, rng):
    base = os.path.join(corpus.work, "folders")
    os.makedirs(base, exist_ok=True)
    manifest_text = read(os.path.join(good, "manifest.json"))
    manifest = json.loads(manifest_text)
    counter = [0]

    def fresh(name):
        counter[0] += 1
        path = os.path.join(base, f"{counter[0]:03d}_{name}")
        shutil.copytree(good, path)
        return path

    def edited(name, edit, allow_ok=False):
        path = fresh(name)
        m = json.loads(json.dumps(manifest))
        edit(m)
        write(os.path.join(path, "manifest.json"), json.dumps(m).encode())
        corpus.folder(name, path, allow_ok)

    def rank_file(path, r):
        return os.path.join(path, manifest["files"][r]["name"])

    for cut in (0, 1, len(manifest_text) // 2, len(manifest_text) - 2):
        path = fresh(f"manifest_truncated_{cut}")
        write(os.path.join(path, "manifest.json"), manifest_text[:cut])
        corpus.folder(f"manifest_truncated_{cut}", path, export=cut == 0)
    for i in range(corpus.n(3, 16)):
        path = fresh(f"manifest_flip_{i}")
        write(os.path.join(path, "manifest.json"),
              flip(manifest_text, rng.randrange(len(manifest_text)), rng))
        corpus.folder(f"manifest_flip_{i}", path, allow_ok=True)
    edited("step_negative", lambda m: m.update(step=-3))
    edited("step_text", lambda m: m.update(step="3"))
    edited("world_size_huge", lambda m: m.update(world_size=100000))
    edited("world_size_zero", lambda m: m.update(world_size=0))
    edited("format_2", lambda m: m.update(format=2))
    edited("fingerprint", lambda m: m.update(layout_fingerprint="0" * 16))
    edited("size_wrong", lambda m: m["files"][1].update(size=m["files"][1]["size"] + 1))
    edited("size_negative", lambda m: m["files"][1].update(size=-1))
    edited("checksum_wrong", lambda m: m["files"][0].update(xxh64="0" * 16))
    edited("rank_swapped", lambda m: m["files"].reverse())
    edited("name_outside", lambda m: m["files"][1].update(name="../outside.safetensors"))
    edited("name_absolute", lambda m: m["files"][1].update(name="/etc/passwd"))
    edited("name_missing_file",
           lambda m: m["files"][1].update(name="rank_00001.step_1.00000000000000ff.safetensors"))
    edited("layout_range", lambda m: m["layout"]["tensors"][0]["ranges"][0].__setitem__(1, 1 << 62))
    path = fresh("manifest_over_limit")
    write(os.path.join(path, "manifest.json"), manifest_text[:-1] + b" " * (65 << 20) + b"}")
    corpus.folder("manifest_over_limit", path)
    for r in (0, 1):
        path = fresh(f"rank{r}_truncated")
        data = read(rank_file(path, r))
        write(rank_file(path, r), data[:len(data) // 2])
        corpus.folder(f"rank{r}_truncated", path)
        path = fresh(f"rank{r}_data_flip")
        n, _ = header_of(data)
        write(rank_file(path, r), flip(data, 8 + n + rng.randrange(len(data) - 8 - n), rng))
        corpus.folder(f"rank{r}_data_flip", path, export=True)
    # A rank file that claims another rank (or world size), with the
    # manifest's size and checksum made to match, so only the rank-metadata
    # check can catch it.
    import xxhash
    for key, value in (("shardema.rank", "0"), ("shardema.world_size", "3")):
        name = f"rank_metadata_{key.split('.')[1]}"
        path = fresh(name)
        data = read(rank_file(path, 1))
        _, header = header_of(data)
        header["__metadata__"][key] = value
        data = with_header(data, header)
        write(rank_file(path, 1), data)
        m = json.loads(json.dumps(manifest))
        m["files"][1].update(size=len(data), xxh64=xxhash.xxh64(data).hexdigest())
        write(os.path.join(path, "manifest.json"), json.dumps(m).encode())
        out = os.path.join(corpus.work, f"export_{name}.safetensors")
        corpus.run(name + " (inspect)", ["inspect", path], key)
        corpus.run(name + " (export)", ["export", "--checkpoint", path, "--out", out], key)
    path = fresh("rank_fifo")
    os.remove(rank_file(path, 1))
    os.mkfifo(rank_file(path, 1))
    corpus.folder("rank_fifo", path, export=True)
    path = fresh("rank_symlink_outside")
    outside = os.path.join(corpus.work, "outside.safetensors")
    shutil.copy(rank_file(path, 1), outside)
    write(outside, read(outside) + b"\0")
    os.remove(rank_file(path, 1))
    os.symlink(outside, rank_file(path, 1))
    corpus.folder("rank_symlink_outside", path)
    path = fresh("rank_folder")
    os.remove(rank_file(path, 0))
    os.mkdir(rank_file(path, 0))
    corpus.folder("rank_folder", path)
    path = fresh("manifest_fifo")
    os.remove(os.path.join(path, "manifest.json"))
    os.mkfifo(os.path.join(path, "manifest.json"))
    corpus.folder("manifest_fifo", path)
    path = fresh("manifest_loop")
    loop = os.path.join(path, "manifest.json")
    os.remove(loop)
    os.symlink(loop, loop)
    corpus.folder("manifest_loop", path)
    loop = os.path.join(base, "folder_loop")
    os.symlink(loop, loop)
    corpus.folder("folder_loop", loop)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli", required=True)
    parser.add_argument("--file", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--full", action="store_true",
                        help="more random cases, and export on every folder (170 runs)")
    args = parser.parse_args()
    corpus = Corpus(args.cli, args.work, args.full)
    rng = random.Random(args.seed)
    tensor_file_cases(corpus, args.file, rng)
    folder_cases(corpus, args.checkpoint, rng)
    corpus.run_all()
    for failure in corpus.failures:
        print("FAIL", failure)
    print(f"{len(corpus.jobs)} cases, {len(corpus.failures)} failed")
    return 1 if corpus.failures else 0


if __name__ == "__main__":
    sys.exit(main())
