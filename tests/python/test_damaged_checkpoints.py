"""A corpus of damaged checkpoint folders (issue 23): each is refused by
EMA.load_checkpoint, `shardema inspect` and `shardema export` with one line
that names what is wrong, no C++ backtrace, nothing written by the export,
and the in-memory EMA unchanged. The damage is made here with the file
formats' own tools (json, xxhash), the way an outside writer would."""
import json
import os
import re
import shutil
import subprocess

import pytest
import torch
import xxhash

import shardema

HALF = shardema.DecaySchedule.constant(0.5)
BACKTRACE = re.compile(r"Exception raised from|frame #\d")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A checkpoint folder saved at step 2."""
    folder = tmp_path_factory.mktemp("good") / "ckpt"
    m = model()
    ema = shardema.EMA(m, HALF)
    for step in (1, 2):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.5 * step)
        ema.update()
        ema.fence()
    ema.save_checkpoint(str(folder))
    return folder


def manifest_of(folder):
    with open(folder / "manifest.json") as f:
        return json.load(f)


def write_manifest(folder, manifest):
    with open(folder / "manifest.json", "w") as f:
        json.dump(manifest, f)


def rank_file(folder):
    return folder / manifest_of(folder)["files"][0]["name"]


def resign(folder):
    """Writes the rank file's current size and XXH64 into the manifest, so
    the damage gets past the file-level check to the contents."""
    manifest = manifest_of(folder)
    data = rank_file(folder).read_bytes()
    manifest["files"][0]["size"] = len(data)
    manifest["files"][0]["xxh64"] = xxhash.xxh64(data).hexdigest()
    write_manifest(folder, manifest)


def header_length(data):
    return int.from_bytes(data[:8], "little")


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_data_byte(folder):
    path = rank_file(folder)
    flip(path, 8 + header_length(path.read_bytes()) + 3)


def edit_header(folder, edit):
    path = rank_file(folder)
    data = path.read_bytes()
    n = header_length(data)
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    resign(folder)


def set_metadata(key, value):
    return lambda header: header["__metadata__"].__setitem__(key, value)


# name -> (damage, what the one-line error must say)
DAMAGES = {
    "manifest missing": (lambda f: os.remove(f / "manifest.json"), r"manifest\.json missing"),
    "manifest not JSON": (lambda f: (f / "manifest.json").write_text("{\"files\": ["),
                          r"manifest\.json"),
    "manifest truncated to nothing": (lambda f: (f / "manifest.json").write_text(""),
                                      r"manifest\.json"),
    "rank file missing": (lambda f: os.remove(rank_file(f)), r"rank_00000"),
    "rank file truncated": (lambda f: rank_file(f).write_bytes(rank_file(f).read_bytes()[:40]),
                            r"rank_00000.*(size|bytes)"),
    "data byte flipped": (flip_data_byte, r"rank_00000.*(XXH64|corrupted)"),
    "data byte flipped, manifest re-signed": (lambda f: (flip_data_byte(f), resign(f)),
                                              r"rank_00000.*tensor '.*' fails its checksum"),
    "header byte flipped, manifest re-signed": (
        lambda f: (flip(rank_file(f), 12), resign(f)), r"rank_00000"),
    "step edited in the rank file, re-signed": (
        lambda f: edit_header(f, set_metadata("shardema.step", "7")), r"shardema\.step"),
    "decay NaN in the rank file, re-signed": (
        lambda f: edit_header(f, set_metadata("shardema.last_decay", "nan")),
        r"shardema\.last_decay"),
    # Valid values the load refuses only against the EMA it loads into (a
    # role, a schedule): inspect and export once passed them.
    "roles edited in the rank file, re-signed": (
        lambda f: edit_header(f, set_metadata("shardema.roles", json.dumps(
            {"0.weight": "copy", "0.bias": "average_if_trainable", "1.weight":
             "average_if_trainable", "1.bias": "average_if_trainable"}))),
        r"shardema\.state_xxh64.*shardema\.roles"),
    "schedule edited in the rank file, re-signed": (
        lambda f: edit_header(f, set_metadata("shardema.schedule",
                                              shardema.DecaySchedule.constant(0.25).to_json())),
        r"shardema\.state_xxh64.*shardema\.schedule"),
    "manifest world size edited": (
        lambda f: write_manifest(f, dict(manifest_of(f), world_size=2)), r"world_size|ranks"),
    "manifest layout edited": (
        lambda f: write_manifest(f, dict(manifest_of(f), layout_fingerprint="0" * 16)),
        r"fingerprint"),
}


@pytest.fixture
def damaged(good, tmp_path, request):
    folder = tmp_path / "ckpt"
    shutil.copytree(good, folder)
    damage, _ = DAMAGES[request.param]
    damage(folder)
    return folder


def one_line(text):
    text = text.strip()
    assert not BACKTRACE.search(text), text
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("damaged", list(DAMAGES), indirect=True)
def test_ema_load_refuses_with_one_line_and_changes_nothing(damaged, request):
    expected = DAMAGES[request.node.callspec.params["damaged"]][1]
    m = model()
    ema = shardema.EMA(m, HALF)
    ema.update()
    ema.fence()
    before = {k: v.clone() for k, v in ema.local_ema().items()}
    with pytest.raises(ValueError) as excinfo:
        ema.load_checkpoint(str(damaged))
    assert re.search(expected, one_line(str(excinfo.value))), str(excinfo.value)
    assert ema.step == 1
    after = ema.local_ema()
    assert all(torch.equal(before[k], after[k]) for k in before)


def cli():
    path = os.environ.get("SHARDEMA_CLI")
    if not path:
        pytest.skip("SHARDEMA_CLI is not set: the build has no shardema CLI (tools off)")
    return path


@pytest.mark.parametrize("damaged", list(DAMAGES), indirect=True)
def test_inspect_and_export_refuse_with_one_line_and_write_nothing(damaged, request, tmp_path):
    expected = DAMAGES[request.node.callspec.params["damaged"]][1]
    shardema_cli = cli()
    inspect = subprocess.run([shardema_cli, "inspect", str(damaged)], capture_output=True,
                             text=True, timeout=60)
    assert inspect.returncode != 0, inspect.stdout
    assert re.search(expected, one_line(inspect.stderr)), inspect.stderr
    out = tmp_path / "out.safetensors"
    export = subprocess.run([shardema_cli, "export", "--checkpoint", str(damaged), "--out",
                             str(out)], capture_output=True, text=True, timeout=60)
    assert export.returncode != 0, export.stdout
    assert re.search(expected, one_line(export.stderr)), export.stderr
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], os.listdir(tmp_path)


def test_the_undamaged_folder_passes_all_three(good, tmp_path):
    """The corpus's refusals are the damage's: the same folder, untouched,
    loads, inspects and exports."""
    ema = shardema.EMA(model(), HALF)
    ema.load_checkpoint(str(good))
    assert ema.step == 2
    shardema_cli = cli()
    subprocess.run([shardema_cli, "inspect", str(good)], check=True, capture_output=True,
                   timeout=60)
    subprocess.run([shardema_cli, "export", "--checkpoint", str(good), "--out",
                    str(tmp_path / "out.safetensors")], check=True, capture_output=True, timeout=60)
    assert (tmp_path / "out.safetensors").stat().st_size > 0


def test_the_state_checksum_is_the_one_docs_files_md_describes(good):
    """shardema.state_xxh64 recomputed with the xxhash package from the rank
    file's own keys, as docs/files.md writes it down."""
    data = rank_file(good).read_bytes()
    metadata = json.loads(data[8:8 + header_length(data)])["__metadata__"]
    keys = ["shardema.kind", "shardema.step", "shardema.initialized", "shardema.last_decay",
            "shardema.schedule", "shardema.roles"]
    text = b"".join(k.encode() + b"\0" + metadata[k].encode() + b"\0" for k in keys)
    assert metadata["shardema.state_xxh64"] == xxhash.xxh64(text).hexdigest()
