"""The `shardema` command of the Python package (shardema/_cli.py, the
console script `pip install .` installs; `python -m shardema` here): the
C++ CLI's commands run inside the extension, plus what only torch's Python
reads, a DCP checkpoint's EMA. Each result is compared with the Python
API's own: export from a DCP folder against ema.export_weights' file,
tensor by tensor; a resharded DCP EMA loaded back with load_checkpoint;
inspect of a post-hoc folder against the snapshots PostHocEMA wrote."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardema

import rank_launch  # noqa: E402
from conftest import python_for_workers  # noqa: E402


def shardema_command(*args, cwd=None):
    """(status, stdout, stderr) of `shardema ARGS` from the package."""
    done = subprocess.run([sys.executable, "-m", "shardema", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def refused(status, out, err, *needles):
    """A refusal: status 2, nothing on stdout, one line on stderr holding
    every needle."""
    assert status == 2, (status, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert str(needle) in lines[0], (needle, lines[0])
    return lines[0]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 5)
        self.norm = torch.nn.BatchNorm1d(5)  # float buffers and an int64 counter
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.norm(self.fc(x)))


def trained_ema(steps=7):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ema = shardema.EMA(model, beta=0.9, update_after_step=0, update_every=1,
                       copy_names=["head.bias"])  # a role other than the policy's default
    for _ in range(steps):
        model(torch.randn(8, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
    ema.wait()
    return model, optimizer, ema


@pytest.fixture
def dcp_run(tmp_path):
    """A DCP checkpoint of model, optimizer and EMA, as docs/python.md saves
    one, and the EMA's own export of the same state."""
    model, optimizer, ema = trained_ema()
    folder = tmp_path / "dcp"
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
              "ema": ema.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    reference = tmp_path / "reference.safetensors"
    ema.export_weights(str(reference))
    return folder, reference, ema, model


def test_version_is_the_package_version():
    status, out, err = shardema_command("--version")
    assert (status, out, err) == (0, f"shardema {shardema.__version__}\n", "")
    assert shardema.__version__.count(".") == 2
    if os.environ.get("SHARDEMA_CLI"):  # the C++ CLI prints the same
        done = subprocess.run([os.environ["SHARDEMA_CLI"], "--version"], capture_output=True,
                              text=True, timeout=60)
        assert done.stdout == out


def test_the_commands_are_the_cli_s(tmp_path):
    status, out, _ = shardema_command("schedule", "--kind", "warmup", "--power", "0.75",
                                      "--steps", "10")
    schedule = shardema.DecaySchedule.warmup(power=0.75)
    assert status == 0 and out.split()[0] == "10"
    assert float(out.split()[1]) == schedule.decay_at(10)
    status, out, _ = shardema_command("--help")
    assert status == 0 and all(c in out for c in ("inspect", "export", "synthesize", "--version"))
    refused(*shardema_command("export", "--checkpoint"), "shardema export", "--checkpoint")


def test_export_of_a_dcp_folder_equals_export_weights(dcp_run, tmp_path):
    folder, reference, ema, _ = dcp_run
    out = tmp_path / "from_dcp.safetensors"
    status, text, err = shardema_command("export", "--checkpoint", folder, "--out", out)
    assert status == 0, err
    assert text.startswith(f"exported {folder} to {out}: ") and "step 7" in text, text
    ours = shardema.read_tensor_file(str(out))
    theirs = shardema.read_tensor_file(str(reference))
    assert list(ours["tensors"]) == list(theirs["tensors"])
    for name, tensor in theirs["tensors"].items():
        assert ours["tensors"][name].dtype == tensor.dtype, name
        assert torch.equal(ours["tensors"][name], tensor), name
    assert ours["metadata"]["shardema.step"] == "7"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".shardema-dcp-")]
    # --dtype and the --checkpoint=DIR spelling reach the same export.
    half = tmp_path / "bf16.safetensors"
    status, _, err = shardema_command("export", f"--checkpoint={folder}", "--out", half,
                                      "--dtype", "bf16")
    assert status == 0, err
    for name, tensor in shardema.read_tensor_file(str(half))["tensors"].items():
        expected = theirs["tensors"][name]
        expected = expected.bfloat16() if expected.is_floating_point() else expected
        assert torch.equal(tensor, expected), name


def test_a_dcp_ema_resharded_loads_with_its_progress(dcp_run, tmp_path):
    folder, _, ema, model = dcp_run
    target = tmp_path / "per_rank"
    status, text, err = shardema_command("export", "--checkpoint", folder, "--world-size", "1",
                                         "--out", target)
    assert status == 0 and text.startswith(f"resharded {folder} to {target}"), (text, err)
    fresh = shardema.EMA(model, beta=0.9, update_after_step=0, update_every=1,
                         copy_names=["head.bias"])
    fresh.load_checkpoint(str(target))
    assert fresh.step == ema.step and fresh.last_decay == ema.last_decay
    mine, theirs = fresh.full_state_dict(), ema.full_state_dict()
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name


def test_inspect_of_a_dcp_folder_lists_the_ema(dcp_run):
    folder, _, ema, _ = dcp_run
    status, out, err = shardema_command("inspect", folder)
    assert status == 0 and err == "", err
    lines = out.splitlines()
    assert lines[0].startswith(f"DCP checkpoint {folder}: shardema EMA under 'ema', step 7, "
                               f"{len(ema.full_state_dict())} tensors")
    tensors = {line.split()[1]: line.split(None, 3)[2:] for line in lines
               if line.startswith("  tensor ")}
    assert tensors["fc.weight"] == ["average", "float32 [5, 6]"]
    assert tensors["head.bias"] == ["copy", "float32 [3]"]
    assert tensors["norm.num_batches_tracked"][1] == "int64 []"
    assert f"  schedule {ema.schedule!r}" in lines


def test_bad_dcp_folders_are_refused_in_one_line(dcp_run, tmp_path):
    folder, _, _, model = dcp_run
    # No EMA in it: the model's state only.
    plain = tmp_path / "plain"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(plain), no_dist=True)
    refused(*shardema_command("inspect", plain), "shardema inspect:", plain / ".metadata",
            "no shardema EMA", "model")
    # A data file cut short.
    cut = tmp_path / "cut"
    cut.mkdir()
    for item in folder.iterdir():
        data = item.read_bytes()
        (cut / item.name).write_bytes(data[:len(data) // 2] if item.suffix == ".distcp" else data)
    refused(*shardema_command("export", "--checkpoint", cut, "--out", tmp_path / "x"),
            "shardema export:", cut, "do not read")
    assert not (tmp_path / "x").exists()
    # The commit file missing (a save interrupted), then garbled.
    (cut / ".metadata").unlink()
    refused(*shardema_command("inspect", cut), cut / ".metadata", "missing")
    (cut / ".metadata").write_bytes(b"not a pickle")
    refused(*shardema_command("inspect", cut), cut / ".metadata", "not DCP metadata")
    # An EMA of several profiles: test_cli_profiles.py.


FSDP2_SAVE = """
import sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
import shardema

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.GELU(), torch.nn.Linear(9, 5))
for layer in (model[0], model[2], model):
    fully_shard(layer)   # 9 and 5 rows over 2 ranks: uneven shards
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ema = shardema.EMA(model, schedule=shardema.DecaySchedule.power_function(sigma_rel=0.05))
ema.attach(optimizer)
for _ in range(6):
    model(torch.randn(4, 6)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
ema.export_weights(sys.argv[1] + "/reference.safetensors")
dcp.save({"model": model.state_dict(), "ema": ema.state_dict()}, checkpoint_id=sys.argv[1] + "/dcp")
dist.destroy_process_group()
"""


def test_export_of_an_fsdp2_dcp_folder_on_two_ranks_equals_export_weights(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(FSDP2_SAVE)
    ranks = rank_launch.run_ranks(lambda rank, port: [python_for_workers(), str(script),
                                                      str(tmp_path)],
                                  2, tmp_path / "ranks", timeout=240, torchrun=True)
    assert not ranks.errors, ranks.errors
    out = tmp_path / "from_dcp.safetensors"
    status, _, err = shardema_command("export", "--checkpoint", tmp_path / "dcp", "--out", out)
    assert status == 0, err
    ours = shardema.read_tensor_file(str(out))["tensors"]
    theirs = shardema.read_tensor_file(str(tmp_path / "reference.safetensors"))["tensors"]
    assert list(ours) == list(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def run_posthoc(folder, layout="rank0"):
    model = torch.nn.Linear(3, 2)
    ema = shardema.PostHocEMA(model, sigma_rels=(0.05, 0.1), checkpoint_every_num_steps=10,
                              checkpoint_folder=str(folder), layout=layout)
    for k in range(1, 31):
        ema.fence()  # before the "optimizer step" writes the weight
        with torch.no_grad():
            model.weight.add_(0.01 * k)
        ema.update()
    ema.wait()
    return ema


def test_inspect_names_a_posthoc_folder_and_what_it_holds(tmp_path):
    folder = tmp_path / "posthoc"
    run_posthoc(folder)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    status, out, err = shardema_command("inspect", folder)
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0] == (f"post-hoc snapshot folder {folder} (rank-0 full copy, {len(files)} "
                        "snapshots of sigma_rel 0.050000000000000003, 0.10000000000000001, "
                        "steps 10-30)")
    steps = sorted({int(name.split(".")[1]) for name in files})
    assert f"  profile 0 sigma_rel 0.050000000000000003 gamma " in lines[1]
    assert lines[1].endswith("steps " + " ".join(map(str, steps)))
    listed = [line.split()[1] for line in lines if line.startswith("  snapshot ")]
    assert sorted(os.path.basename(p) for p in listed) == files
    assert [line for line in lines if line.startswith("  tensor ")] == [
        "  tensor weight F32 [2, 3]", "  tensor bias F32 [2]"]
    refused(*shardema_command("export", "--checkpoint", folder, "--out", tmp_path / "x"),
            "post-hoc snapshot folder", "shardema synthesize --snapshots")


def test_inspect_of_a_sharded_posthoc_folder_and_a_damaged_snapshot(tmp_path):
    folder = tmp_path / "sharded"
    run_posthoc(folder, layout="sharded")
    status, out, err = shardema_command("inspect", folder)
    assert status == 0, err
    assert out.startswith(f"post-hoc snapshot folder {folder} (sharded over 1 ranks, ")
    assert "  tensor weight Float [2, 3]" in out.splitlines()
    victim = sorted((folder / "rank_00000").glob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x40  # the last tensor's last byte
    victim.write_bytes(bytes(data))
    refused(*shardema_command("inspect", folder), "shardema inspect:", victim)
