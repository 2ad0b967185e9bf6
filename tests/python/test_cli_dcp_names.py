"""`shardema export` of a DCP folder writes the model's state_dict() keys,
as ema.export_weights() does: a tied weight under every name, no
non-persistent buffer, read from the EMA state's progress.state_dict_names
(_dcp_progress.py). Checked against export_weights' own file (and split
folder) of the same EMA, tensor by tensor and in order, and against a strict
load_state_dict into the plain model. A state saved before the entry
existed exports as it did, and loads through shardema.EMALoadPlanner."""
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardema


def shardema_command(*args):
    done = subprocess.run([sys.executable, "-m", "shardema", *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


class Tied(torch.nn.Module):
    """GPT-2's tie (test_tied_weights.py) and a module held twice."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.again = self.mid
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.again(self.mid(self.emb(idx)))))


class Rope(torch.nn.Module):
    """Non-persistent buffers (test_non_persistent_buffers.py) beside a
    persistent one."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(1.0, 5.0), persistent=False)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        return self.fc(x * self.inv_freq)


def make(kind):
    torch.manual_seed(0)
    return Tied() if kind == "tied" else torch.nn.Sequential(Rope(), torch.nn.Linear(4, 2))


def inputs(kind, step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 11, (8,), generator=g) if kind == "tied" else torch.randn(5, 4,
                                                                                     generator=g)


@pytest.fixture(params=["tied", "rope"])
def saved(request, tmp_path):
    """A trained EMA of the model, dcp.save of its state_dict() beside the
    model's, and export_weights' file of it."""
    kind = request.param
    model = make(kind)
    ema = shardema.EMA(model, beta=0.8, update_after_step=0, update_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 5):
        model(inputs(kind, step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            if kind == "rope":
                model[0].inv_freq.mul_(1.1)
                model[0].seen.add_(1)
        ema.update()
    ema.wait()
    folder = tmp_path / "dcp"
    dcp.save({"model": model.state_dict(), "ema": ema.state_dict()}, checkpoint_id=str(folder),
             no_dist=True)
    reference = tmp_path / "reference.safetensors"
    ema.export_weights(str(reference))
    return kind, model, ema, folder, reference


def test_the_state_records_the_names(saved):
    kind, model, ema, _, _ = saved
    names = json.loads(ema.state_dict()["progress"]["state_dict_names"])
    if kind == "tied":
        assert names == {"aliases": {"emb.weight": ["head.weight"],
                                     "mid.bias": ["again.bias"],
                                     "mid.weight": ["again.weight"]}}
    else:
        assert names == {"non_persistent": ["0.inv_freq"]}
    # A model with neither: no entry, the state as before.
    plain = shardema.EMA(torch.nn.Linear(2, 2), decay=0.9)
    assert "state_dict_names" not in plain.state_dict()["progress"]


def test_cli_export_equals_export_weights_tensor_by_tensor(saved, tmp_path):
    kind, model, ema, folder, reference = saved
    out = tmp_path / "from_dcp.safetensors"
    status, _, err = shardema_command("export", "--checkpoint", folder, "--out", out)
    assert status == 0, err
    ours = shardema.read_tensor_file(str(out))["tensors"]
    theirs = shardema.read_tensor_file(str(reference))["tensors"]
    assert list(ours) == list(theirs)
    assert sorted(theirs) == sorted(model.state_dict())  # every key, nothing else
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    fresh = make(kind)
    fresh.load_state_dict(ours, strict=True)
    if kind == "tied":
        assert fresh.head.weight is fresh.emb.weight  # still tied
    # Split: the same folder as export_weights' split.
    status, _, err = shardema_command("export", "--checkpoint", folder, "--out",
                                      tmp_path / "split", "--max-shard-size", "40")
    assert status == 0, err
    ema.export_weights(str(tmp_path / "split_reference"), max_shard_size=40)
    index = (tmp_path / "split" / "model.safetensors.index.json").read_text()
    assert index == (tmp_path / "split_reference" / "model.safetensors.index.json").read_text()
    for name in set(json.loads(index)["weight_map"].values()):
        mine = shardema.read_tensor_file(str(tmp_path / "split" / name))["tensors"]
        want = shardema.read_tensor_file(str(tmp_path / "split_reference" / name))["tensors"]
        assert list(mine) == list(want)
        assert all(torch.equal(mine[n], want[n]) for n in want), name


def test_inspect_lists_the_other_names_and_marks_the_non_persistent(saved):
    kind, _, _, folder, _ = saved
    status, out, err = shardema_command("inspect", folder)
    assert status == 0, err
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("  tensor ")}
    if kind == "tied":
        assert lines["emb.weight"].endswith(" also head.weight")
        assert lines["mid.weight"].endswith(" also again.weight")
        assert "non-persistent" not in out
    else:
        assert lines["0.inv_freq"].endswith(" non-persistent (not exported)")
        assert not lines["0.seen"].endswith(")") and " also " not in out


def test_an_older_save_exports_as_before_and_loads_through_the_planner(saved, tmp_path):
    kind, model, ema, _, _ = saved
    state = ema.state_dict()
    del state["progress"]["state_dict_names"]  # as saved before the entry existed
    older = tmp_path / "older"
    dcp.save({"ema": state}, checkpoint_id=str(older), no_dist=True)
    out = tmp_path / "older.safetensors"
    status, _, err = shardema_command("export", "--checkpoint", older, "--out", out)
    assert status == 0, err
    tensors = shardema.read_tensor_file(str(out))["tensors"]
    tracked = set(ema.ema_tensors())  # first names, non-persistent ones too
    assert set(tensors) == tracked
    assert ("head.weight" in tensors, "0.inv_freq" in tensors) == (False, kind == "rope")
    # Loading it: DCP asks for every entry of the dict it loads into; the
    # planner leaves the one the save lacks out.
    again = shardema.EMA(make(kind), beta=0.8, update_after_step=0, update_every=1)
    target = {"ema": again.state_dict()}
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    with pytest.raises(CheckpointException, match="state_dict_names"):
        dcp.load(target, checkpoint_id=str(older), no_dist=True)
    target = {"ema": again.state_dict()}
    dcp.load(target, checkpoint_id=str(older), planner=shardema.EMALoadPlanner(), no_dist=True)
    again.load_state_dict(target["ema"])
    assert again.step == ema.step
    for name, value in ema.full_state_dict().items():
        assert torch.equal(again.full_state_dict()[name], value), name


def test_a_new_save_round_trips_through_dcp_load(saved):
    kind, _, ema, folder, _ = saved
    again = shardema.EMA(make(kind), beta=0.8, update_after_step=0, update_every=1)
    target = {"ema": again.state_dict()}
    dcp.load(target, checkpoint_id=str(folder), no_dist=True)
    again.load_state_dict(target["ema"])
    for name, value in ema.ema_tensors().items():
        assert torch.equal(again.ema_tensors()[name], value), name


def test_a_damaged_entry_is_refused_in_one_line(saved, tmp_path):
    kind, _, ema, _, _ = saved
    for bad, needle in [("not json", "not the JSON object"),
                        (json.dumps({"aliases": {"nope": ["x"]}}), "'nope'"),
                        (json.dumps({"non_persistent": "0.inv_freq"}), "not a list"),
                        (json.dumps({"aliases": {"emb.weight": ["mid.weight"]}}
                                    if kind == "tied" else {"aliases": {"0.fc.weight":
                                                                        ["1.weight"]}}),
                         "does not load")]:
        state = ema.state_dict()
        state["progress"]["state_dict_names"] = bad
        folder = tmp_path / f"bad{abs(hash(bad))}"
        dcp.save({"ema": state}, checkpoint_id=str(folder), no_dist=True)
        status, out, err = shardema_command("export", "--checkpoint", folder, "--out",
                                            tmp_path / "x.safetensors")
        assert status == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert needle in err and str(folder) in err, err
        assert not (tmp_path / "x.safetensors").exists()
