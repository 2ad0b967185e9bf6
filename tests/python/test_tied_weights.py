"""Tied weights: one tensor under several state_dict keys (a tied embedding
and head, `head.weight = emb.weight`; a module used twice). shardema.EMA
tracks it once and gives it under every key: export_weights(),
full_state_dict() and `shardema export` of a save_checkpoint() folder hold
exactly model.state_dict()'s keys, each with data of its own (safetensors
refuses shared storage), so a strict load_state_dict() of the file into a
fresh model works; ignore_names, ignore_prefixes and copy_names take any
of the keys. Values against a float64 EMA recomputed here; files read
with safetensors."""
import os
import subprocess

import pytest
import safetensors.torch
import torch
from torch import nn

import shardema

DECAY = 0.75
STEPS = 4


class Tied(nn.Module):
    """An embedding whose weight is also the output head's (GPT-2's tie)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


class Twice(nn.Module):
    """One Linear held under two names: state_dict() lists it under both."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(5, 5)
        self.again = self.first
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(self.again(torch.relu(self.first(x))))


def make(kind, seed=0):
    torch.manual_seed(seed)
    return Tied() if kind == "tied" else Twice()


def batch(model, step):
    generator = torch.Generator().manual_seed(step)
    if isinstance(model, Tied):
        return torch.randint(0, 11, (8,), generator=generator)
    return torch.randn(4, 5, generator=generator)


def trained(kind, **ema_options):
    """STEPS SGD steps with an EMA (constant decay, the first update a copy)
    and the float64 EMA of model.state_dict(), key by key."""
    model = make(kind)
    ema = shardema.EMA(model, shardema.DecaySchedule.constant(DECAY), **ema_options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference = {}
    for step in range(1, STEPS + 1):
        model(batch(model, step)).square().mean().backward()
        ema.fence()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        for key, value in model.state_dict().items():
            value = value.detach().double()
            reference[key] = value if key not in reference else \
                DECAY * reference[key] + (1 - DECAY) * value
    ema.wait()
    return model, ema, reference


def assert_is_the_ema(values, model, reference, where):
    assert sorted(values) == sorted(model.state_dict()), where
    for key, value in values.items():
        torch.testing.assert_close(value.double(), reference[key], rtol=0, atol=1e-6,
                                   msg=lambda m: f"{where} '{key}': {m}")


@pytest.mark.parametrize("kind", ["tied", "twice"])
def test_export_and_full_state_dict_hold_every_key_and_load_strictly(kind, tmp_path):
    model, ema, reference = trained(kind)
    path = tmp_path / "ema.safetensors"
    ema.export_weights(str(path))
    exported = safetensors.torch.load_file(str(path))
    assert_is_the_ema(exported, model, reference, "export_weights")
    fresh = make(kind, seed=1)
    fresh.load_state_dict(exported, strict=True)
    # Still tied after the load: both keys held the same values.
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, exported[key].to(value.dtype)), key
    full = ema.full_state_dict()
    assert_is_the_ema(full, model, reference, "full_state_dict")
    pointers = [t.data_ptr() for t in full.values()]
    assert len(set(pointers)) == len(pointers), "each key its own data"
    safetensors.torch.save_file(full, str(tmp_path / "full.safetensors"))  # refuses shared data
    alias = "head.weight" if kind == "tied" else "again.weight"
    only = ema.full_state_dict(names=[alias])
    assert list(only) == [alias] and torch.equal(only[alias], full[alias])


def test_load_ema_values_takes_an_export_back_strictly(tmp_path):
    model, ema, reference = trained("tied")
    ema.export_weights(str(tmp_path / "ema.safetensors"))
    other = shardema.EMA(make("tied", seed=2))
    other.load_ema_values(safetensors.torch.load_file(str(tmp_path / "ema.safetensors")))
    assert_is_the_ema(other.full_state_dict(), model, reference, "loaded back")
    # The model's own state_dict(), both keys: the tensor once.
    other.load_ema_values(model.state_dict())
    assert torch.equal(other.full_state_dict()["head.weight"], model.emb.weight.detach())


@pytest.mark.parametrize("option", [{"ignore_names": ["head.weight"]},
                                    {"ignore_names": ["emb.weight"]},
                                    {"ignore_prefixes": ["head."]}],
                         ids=["ignore head", "ignore emb", "prefix head"])
def test_leaving_out_any_key_of_a_tied_tensor_leaves_out_the_tensor(option, tmp_path):
    model, ema, reference = trained("tied", **option)
    ema.export_weights(str(tmp_path / "ema.safetensors"))
    exported = safetensors.torch.load_file(str(tmp_path / "ema.safetensors"))
    assert sorted(exported) == ["mid.bias", "mid.weight"]
    assert sorted(ema.full_state_dict()) == ["mid.bias", "mid.weight"]
    for key, value in exported.items():
        torch.testing.assert_close(value.double(), reference[key], rtol=0, atol=1e-6)


def test_copying_either_key_copies_the_tensor(tmp_path):
    model, ema, _ = trained("tied", copy_names=["head.weight"])
    full = ema.full_state_dict()
    assert torch.equal(full["emb.weight"], model.emb.weight.detach())
    assert torch.equal(full["head.weight"], model.emb.weight.detach())
    with pytest.raises(ValueError, match="both left out"):
        shardema.EMA(make("tied"), ignore_names=["emb.weight"], copy_names=["head.weight"])
    with pytest.raises(ValueError, match=r"\['head\.bias'\] name no tracked tensor"):
        shardema.EMA(make("tied"), ignore_names=["head.bias"])


def test_shardema_export_of_a_checkpoint_writes_every_key(tmp_path):
    shardema_cli = os.environ.get("SHARDEMA_CLI")
    if not shardema_cli:
        pytest.skip("SHARDEMA_CLI is not set: the build has no shardema CLI (tools off)")
    model, ema, reference = trained("tied")
    ema.save_checkpoint(str(tmp_path / "ckpt"))
    shown = subprocess.run([shardema_cli, "inspect", str(tmp_path / "ckpt")], check=True,
                           capture_output=True, text=True, timeout=60).stdout
    assert "also head.weight" in shown, shown
    subprocess.run([shardema_cli, "export", "--checkpoint", str(tmp_path / "ckpt"), "--out",
                    str(tmp_path / "ema.safetensors")], check=True, capture_output=True,
                   timeout=60)
    exported = safetensors.torch.load_file(str(tmp_path / "ema.safetensors"))
    assert_is_the_ema(exported, model, reference, "shardema export")
    make("tied", seed=3).load_state_dict(exported, strict=True)
    # A reshard keeps them, and the checkpoint still loads.
    subprocess.run([shardema_cli, "export", "--checkpoint", str(tmp_path / "ckpt"),
                    "--world-size", "2", "--out", str(tmp_path / "w2")], check=True,
                   capture_output=True, timeout=60)
    assert "also head.weight" in subprocess.run(
        [shardema_cli, "inspect", str(tmp_path / "w2")], check=True, capture_output=True,
        text=True, timeout=60).stdout
    again = shardema.EMA(make("tied", seed=4), shardema.DecaySchedule.constant(DECAY))
    again.load_checkpoint(str(tmp_path / "ckpt"))
    assert_is_the_ema(again.full_state_dict(), model, reference, "load_checkpoint")
