"""Non-persistent buffers (register_buffer(..., persistent=False), a rotary
inv_freq, a running statistic a model keeps out of its checkpoints): the EMA
keeps them as ema-pytorch does (it averages named_buffers()), and swap()
shows them, but what it hands out as the model's state (full_state_dict(),
export_weights(), `shardema export` of a save_checkpoint() folder) holds
exactly state_dict()'s keys, so a strict load_state_dict finds nothing
unexpected. The EMA's own state (state_dict(), checkpoints) keeps them, so a
resume restores them. Checked beside the real ema_pytorch.EMA."""
import json
import os
import subprocess

import ema_pytorch
import pytest
import safetensors.torch
import torch

import shardema

SETTINGS = dict(beta=0.9, update_after_step=0, update_every=1)


class Rope(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(1.0, 5.0), persistent=False)
        self.register_buffer("scale", torch.ones(4), persistent=False)  # trained below
        self.register_buffer("seen", torch.zeros(4))  # persistent


def model_and_emas():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Rope(), torch.nn.Linear(4, 2))
    theirs = ema_pytorch.EMA(model, **SETTINGS)
    ours = shardema.EMA(model, policy="ema_pytorch", **SETTINGS)
    return model, theirs, ours


def train(model, theirs, ours, steps=4):
    for step in range(1, steps + 1):
        ours.fence()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * step)
            model[0].scale.mul_(1.5)
            model[0].seen.add_(1)
        theirs.update()
        ours.update()
    ours.wait()


TRANSIENT = {"0.inv_freq", "0.scale"}


@pytest.fixture
def trained():
    model, theirs, ours = model_and_emas()
    train(model, theirs, ours)
    assert TRANSIENT.isdisjoint(model.state_dict()) and TRANSIENT <= set(dict(
        model.named_buffers()))
    return model, theirs, ours


def test_kept_and_swapped_as_ema_pytorch_but_in_no_state_of_the_model(trained, tmp_path):
    model, theirs, ours = trained
    # ema-pytorch averages every named buffer, non-persistent ones too.
    with ours.swap(model):
        for name, value in theirs.ema_model.named_buffers():
            torch.testing.assert_close(dict(model.named_buffers())[name], value, rtol=1e-6,
                                       atol=1e-6)
    assert set(ours.ema_tensors()) >= TRANSIENT
    full = ours.full_state_dict()
    assert list(full) == list(theirs.ema_model.state_dict()) == list(model.state_dict())
    named = ours.full_state_dict(names=sorted(TRANSIENT))  # still there when asked by name
    torch.testing.assert_close(named["0.scale"], theirs.ema_model[0].scale)
    path = str(tmp_path / "ema.safetensors")
    ours.export_weights(path)
    fresh = torch.nn.Sequential(Rope(), torch.nn.Linear(4, 2))
    fresh.load_state_dict(safetensors.torch.load_file(path), strict=True)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, theirs.ema_model.state_dict()[name], msg=name)
    folder = tmp_path / "split"
    ours.export_weights(str(folder), max_shard_size=64)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    ours.export_weights(str(tmp_path / "all.safetensors"), include_untracked=True)
    assert set(safetensors.torch.load_file(str(tmp_path / "all.safetensors"))) == \
        set(model.state_dict())


def test_resumes_restore_them(trained, tmp_path):
    model, theirs, ours = trained
    want = ours.ema_tensors()
    state = ours.state_dict()
    ours.save_checkpoint(str(tmp_path / "ckpt"))
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert sorted(manifest["non_persistent"]) == sorted(TRANSIENT)
    for load in (lambda e: e.load_state_dict(state),
                 lambda e: e.load_checkpoint(str(tmp_path / "ckpt"))):
        _, _, other = model_and_emas()
        load(other)
        got = other.ema_tensors()
        for name in want:
            assert torch.equal(got[name], want[name]), name


def test_a_manifest_naming_an_unknown_non_persistent_tensor_is_refused(trained, tmp_path):
    _, _, ours = trained
    folder = tmp_path / "ckpt"
    ours.save_checkpoint(str(folder))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["non_persistent"] = ["0.nothing"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _, _, other = model_and_emas()
    with pytest.raises(ValueError, match=r"non_persistent holds \"0\.nothing\""):
        other.load_checkpoint(str(folder))


def test_cli_export_of_a_checkpoint_leaves_them_out(trained, tmp_path):
    cli = os.environ.get("SHARDEMA_CLI")
    if not cli:
        pytest.skip("SHARDEMA_CLI is not set: the build has no shardema CLI (tools off)")
    model, theirs, ours = trained
    ours.save_checkpoint(str(tmp_path / "ckpt"))
    out = tmp_path / "ema.safetensors"
    done = subprocess.run([cli, "export", "--checkpoint", str(tmp_path / "ckpt"), "--out",
                           str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    exported = safetensors.torch.load_file(str(out))
    assert list(exported) == list(model.state_dict())
    for name, value in exported.items():
        torch.testing.assert_close(value, theirs.ema_model.state_dict()[name], msg=name)
    inspected = subprocess.run([cli, "inspect", str(tmp_path / "ckpt")], capture_output=True,
                               text=True)
    assert inspected.returncode == 0, inspected.stderr
    marked = {line.split()[1] for line in inspected.stdout.splitlines()
              if line.strip().startswith("tensor ") and "non-persistent" in line}
    assert marked == TRANSIENT, inspected.stdout
