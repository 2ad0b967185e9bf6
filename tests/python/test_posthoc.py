"""shardema.PostHocEMA and shardema.synthesize_snapshot_folder against ema-pytorch's and
nitrous-ema's post-hoc runs (tests/data/posthoc_ema_run.json): the same
100 updates of a 4-element parameter, snapshots every 10, synthesis of
each listed sigma_rel."""
import math

import pytest
import torch

import shardema
from conftest import golden

RUNS = {  # run -> (update_every, step_size_correction); fp16 snapshots left out
    "lucid_fp32": (1, False),
    "nitrous_u1_nocorr": (1, False),
    "nitrous_u1_corr_mmaudio": (1, True),
    "nitrous_u5_corr": (5, True),
    "lucid_u5_fp32": (5, False),
}


class Vec(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.theta = torch.nn.Parameter(theta_at(0))


def theta_at(k):
    i = torch.arange(4, dtype=torch.float64)
    return (torch.sin(0.1 * k * (i + 1)) + 0.01 * k * (i + 1)).float()


def run_posthoc(folder, update_every, correction, layout="rank0"):
    model = Vec()
    ema = shardema.PostHocEMA(model, sigma_rels=(0.05, 0.1), update_every=update_every,
                              checkpoint_every_num_steps=10, checkpoint_folder=folder,
                              layout=layout, step_size_correction=correction)
    for k in range(1, 101):
        ema.fence()  # before the "optimizer step" writes theta
        with torch.no_grad():
            model.theta.copy_(theta_at(k))
        ema.update()
    ema.wait()
    assert ema.step == 100
    return ema


def runs_by_name():
    return {run["run"]: run for run in golden("posthoc_ema_run.json")["runs"]}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_synthesis_matches_reference_run(name, tmp_path):
    run = runs_by_name()[name]
    update_every, correction = RUNS[name]
    ema = run_posthoc(str(tmp_path / "snapshots"), update_every, correction)
    assert len(run["synthesized"]) >= 1
    for key, expected in run["synthesized"].items():
        theta = ema.synthesize(expected["target_sigma_rel"], step=expected["target_step"])["theta"]
        assert theta.dtype == torch.float32
        for ours, ref in zip(theta.tolist(), expected["synthesized_theta"]):
            assert ours == pytest.approx(ref, abs=1e-6), (name, key)


def test_sharded_layout_and_offline_synthesis_agree(tmp_path):
    rank0 = run_posthoc(str(tmp_path / "rank0"), 1, True)
    sharded = run_posthoc(str(tmp_path / "sharded"), 1, True, layout="sharded")
    a = rank0.synthesize(0.07)["theta"]
    b = sharded.synthesize(0.07)["theta"]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    path = str(tmp_path / "out.safetensors")
    assert shardema.synthesize_snapshot_folder(str(tmp_path / "rank0"), 0.07, path=path) == path
    written = shardema.read_tensor_file(path)
    assert torch.equal(written["tensors"]["theta"], a)
    assert float(written["metadata"]["shardema.sigma_rel"]) == 0.07
    at_50 = shardema.synthesize_snapshot_folder(str(tmp_path / "rank0"), 0.07, step=50)["theta"]
    assert not torch.equal(at_50, a)  # an earlier target step uses fewer snapshots
    assert all(math.isfinite(v) for v in at_50.tolist())


def test_posthoc_bad_input_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="sigma"):
        shardema.PostHocEMA(Vec(), sigma_rels=(0.05, 0.5), checkpoint_folder=str(tmp_path))
    with pytest.raises(ValueError, match="layout"):
        shardema.PostHocEMA(Vec(), layout="everywhere", checkpoint_folder=str(tmp_path))
    with pytest.raises(ValueError):
        shardema.synthesize_snapshot_folder(str(tmp_path / "nothing"), 0.05)
