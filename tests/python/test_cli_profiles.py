"""`shardema export` / `inspect` of a save_checkpoint() folder of an EMA of
several profiles (EMA(beta=[...])): export --profile P writes what
ema.export_weights(path, profile=P) writes (the same tensors bit for bit,
shardema.schedule that profile's), with --dtype and --max-shard-size too;
inspect lists the profiles; export --world-size keeps every profile, so
load_checkpoint after a reshard and back restores each bit for bit; every
refusal is one line naming the flag. The package's command (python -m
shardema) runs the C++ CLI's code; the binary (SHARDEMA_CLI) is checked
alike where the build has one. A DCP checkpoint of such an EMA (read by the
package's command only) exports, lists and reshards every profile alike."""
import json
import os
import subprocess
import sys

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

import shardema

BETAS = [0.6, 0.95]


def commands():
    """The `shardema` commands to check: the package's, and the binary when
    the build made one."""
    found = [[sys.executable, "-m", "shardema"]]
    if os.environ.get("SHARDEMA_CLI"):
        found.append([os.environ["SHARDEMA_CLI"]])
    return found


@pytest.fixture(params=commands(), ids=lambda c: "binary" if len(c) == 1 else "package")
def shardema_cli(request):
    def run(*args):
        done = subprocess.run([*request.param, *map(str, args)], capture_output=True, text=True,
                              timeout=300)
        return done.returncode, done.stdout, done.stderr
    return run


def refused(result, *needles):
    status, out, err = result
    assert status == 2, result
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert str(needle) in lines[0], (needle, lines[0])


def trained(steps=6, betas=BETAS):
    """A model with a copied buffer (BatchNorm's counter) and an EMA of two
    profiles over several SGD steps, so the profiles differ."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5),
                                torch.nn.Linear(5, 3))
    ema = shardema.EMA(model, beta=betas, update_after_step=0, update_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(8, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    ema.wait()
    return model, ema


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profiles")
    model, ema = trained()
    ema.save_checkpoint(str(folder / "ckpt"))
    return folder, model, ema


def metadata(path):
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def assert_same_file_tensors(a, b):
    ta, tb = load_file(str(a)), load_file(str(b))
    assert list(ta) == list(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name


@pytest.mark.parametrize("profile", [0, 1])
def test_export_profile_writes_what_export_weights_writes(saved, shardema_cli, tmp_path, profile):
    folder, _, ema = saved
    reference = tmp_path / "reference.safetensors"
    ema.export_weights(str(reference), profile=profile)
    out = tmp_path / "cli.safetensors"
    status, text, err = shardema_cli("export", "--checkpoint", folder / "ckpt", "--profile",
                                     profile, "--out", out)
    assert status == 0, err
    assert f"profile {profile}" in text
    assert_same_file_tensors(out, reference)
    assert metadata(out)["shardema.schedule"] == metadata(reference)["shardema.schedule"]
    assert json.loads(metadata(out)["shardema.schedule"]) == json.loads(
        ema.schedules[profile].to_json())
    # The file holds that profile: the EMA's own view of it, and not the other.
    full = ema.full_state_dict(profile=profile)
    other = ema.full_state_dict(profile=1 - profile)
    exported = load_file(str(out))
    assert all(torch.equal(exported[n], full[n]) for n in full)
    assert not torch.equal(exported["0.weight"], other["0.weight"])


def test_export_profile_with_dtype_and_max_shard_size(saved, shardema_cli, tmp_path):
    folder, _, ema = saved
    reference = tmp_path / "reference"
    ema.export_weights(str(reference), dtype=torch.bfloat16, max_shard_size=40, profile=1)
    out = tmp_path / "cli"
    status, _, err = shardema_cli("export", "--checkpoint", folder / "ckpt", "--profile=1",
                                  "--dtype", "bf16", "--max-shard-size", "40", "--out", out)
    assert status == 0, err
    names = sorted(os.listdir(reference))
    assert sorted(os.listdir(out)) == names and len(names) > 2  # several files and the index
    assert json.load(open(out / "model.safetensors.index.json")) == \
        json.load(open(reference / "model.safetensors.index.json"))
    for name in names:
        if name.endswith(".safetensors"):
            assert_same_file_tensors(out / name, reference / name)
            assert metadata(out / name)["shardema.schedule"] == \
                metadata(reference / name)["shardema.schedule"]


def test_inspect_lists_every_profile(saved, shardema_cli):
    folder, _, ema = saved
    status, text, err = shardema_cli("inspect", folder / "ckpt")
    assert status == 0, err
    lines = text.splitlines()
    assert "  2 EMA profiles (export --profile P):" in lines
    for p, schedule in enumerate(ema.schedules):
        assert f"  profile {p} schedule {schedule!r}" in lines, (p, text)


def test_bad_profiles_are_refused_in_one_line(saved, shardema_cli, tmp_path):
    folder = saved[0]
    ckpt, out = folder / "ckpt", tmp_path / "x.safetensors"
    refused(shardema_cli("export", "--checkpoint", ckpt, "--profile", 2, "--out", out),
            "--profile 2 does not exist", ckpt, "2 EMA profiles (0 to 1)")
    refused(shardema_cli("export", "--checkpoint", ckpt, "--profile=-1", "--out", out),
            "--profile -1 does not exist")
    refused(shardema_cli("export", "--checkpoint", ckpt, "--profile", "one", "--out", out),
            "--profile")
    refused(shardema_cli("export", "--checkpoint", ckpt, "--profile", 1, "--world-size", 2,
                         "--out", tmp_path / "w2"), "--profile does not apply to --world-size")
    refused(shardema_cli("export", "--checkpoint", ckpt, "--profile", 1, "--layout",
                         tmp_path / "layout.json", "--out", tmp_path / "w2"),
            "--profile does not apply to --layout")
    assert not out.exists() and not (tmp_path / "w2").exists()
    # A one-profile checkpoint has profile 0 alone.
    _, one = trained(steps=2, betas=0.9)
    one.save_checkpoint(str(tmp_path / "one"))
    refused(shardema_cli("export", "--checkpoint", tmp_path / "one", "--profile", 1, "--out", out),
            "--profile 1 does not exist", "1 EMA profile (0)")
    status, _, err = shardema_cli("export", "--checkpoint", tmp_path / "one", "--profile", 0,
                                  "--out", out)
    assert status == 0, err


def test_reshard_keeps_every_profile_there_and_back(shardema_cli, tmp_path):
    model, ema = trained()  # its own: it goes on training below
    ema.save_checkpoint(str(tmp_path / "ckpt"))
    w2, w1 = tmp_path / "w2", tmp_path / "w1"
    status, _, err = shardema_cli("export", "--checkpoint", tmp_path / "ckpt", "--world-size", 2,
                                  "--out", w2)
    assert status == 0, err
    status, text, err = shardema_cli("inspect", w2)
    assert status == 0 and "world size 2" in text and "2 EMA profiles" in text, (text, err)
    # The two-rank checkpoint exports each profile as the EMA does.
    for p in (0, 1):
        reference = tmp_path / f"reference_{p}.safetensors"
        ema.export_weights(str(reference), profile=p)
        status, _, err = shardema_cli("export", "--checkpoint", w2, "--profile", p, "--out",
                                      tmp_path / f"w2_{p}.safetensors")
        assert status == 0, err
        assert_same_file_tensors(tmp_path / f"w2_{p}.safetensors", reference)
    status, _, err = shardema_cli("export", "--checkpoint", w2, "--world-size", 1, "--out", w1)
    assert status == 0, err
    # A fresh EMA of the same profiles, trained elsewhere, takes every profile back.
    fresh_model, fresh = trained(steps=2)
    fresh.load_checkpoint(str(w1))
    assert fresh.step == ema.step
    for p in (0, 1):
        want, got = ema.full_state_dict(profile=p), fresh.full_state_dict(profile=p)
        assert list(got) == list(want)
        for name in want:
            assert torch.equal(got[name], want[name]), (p, name)
        assert fresh.get_current_decay(profile=p) == ema.get_current_decay(profile=p)
    # And both go on alike.
    fresh_model.load_state_dict(model.state_dict())
    for e, m in ((ema, model), (fresh, fresh_model)):
        with torch.no_grad():
            for param in m.parameters():
                param.add_(0.5)
        e.update()
    for p in (0, 1):
        want, got = ema.full_state_dict(profile=p), fresh.full_state_dict(profile=p)
        assert all(torch.equal(got[n], want[n]) for n in want), p


def package_cli(*args):
    done = subprocess.run([sys.executable, "-m", "shardema", *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def test_a_dcp_checkpoint_of_several_profiles_exports_each(tmp_path):
    model, ema = trained()
    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict(), "ema": ema.state_dict()},
                 checkpoint_id=str(folder), no_dist=True)
    status, text, err = package_cli("inspect", folder)
    assert status == 0, err
    lines = text.splitlines()
    assert "  2 EMA profiles (export --profile P):" in lines
    for p, schedule in enumerate(ema.schedules):
        assert f"  profile {p} schedule {schedule!r}" in lines, (p, text)
    for p in (0, 1):
        reference = tmp_path / f"reference_{p}.safetensors"
        ema.export_weights(str(reference), profile=p)
        out = tmp_path / f"cli_{p}.safetensors"
        status, _, err = package_cli("export", "--checkpoint", folder, "--profile", p,
                                     "--out", out)
        assert status == 0, err
        assert_same_file_tensors(out, reference)
        assert metadata(out)["shardema.schedule"] == metadata(reference)["shardema.schedule"]
    refused(package_cli("export", "--checkpoint", folder, "--profile", 2, "--out",
                        tmp_path / "x"), "--profile 2 does not exist", folder, "2 EMA profiles")
    assert not (tmp_path / "x").exists()
    # A reshard to a per-rank checkpoint keeps both profiles for load_checkpoint.
    status, _, err = package_cli("export", "--checkpoint", folder, "--world-size", 1, "--out",
                                 tmp_path / "w1")
    assert status == 0, err
    _, fresh = trained(steps=2)
    fresh.load_checkpoint(str(tmp_path / "w1"))
    for p in (0, 1):
        want, got = ema.full_state_dict(profile=p), fresh.full_state_dict(profile=p)
        assert all(torch.equal(got[n], want[n]) for n in want), p
