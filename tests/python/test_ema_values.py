"""EMA.swap_in / swap_out / swapped, ema_tensors and load_ema_values on one
process: the public methods shardema.callbacks drives the EMA with. The
several-rank cases (a Replicate() DTensor held whole but averaged in
rows, Shard(0) rows) are in test_callback_dtensors.py."""
import pytest
import torch

import shardema


def model_and_ema():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(0.5), storage="device")
    ema.update(1)  # the first update copies the weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(2)  # the EMA is half way from the first weights to these
    return model, ema


def test_ema_tensors_are_the_ema_in_the_models_shapes():
    model, ema = model_and_ema()
    got = ema.ema_tensors()
    assert list(got) == list(model.state_dict())
    for name, value in model.state_dict().items():
        assert got[name].shape == value.shape, name
    weight = model[0].weight.detach().double()
    # the mean of the first weights (w - 1) and these (w)
    torch.testing.assert_close(got["0.weight"].double(), weight - 0.5, rtol=0, atol=1e-6)
    assert list(ema.ema_tensors(["0.bias"])) == ["0.bias"]
    with pytest.raises(ValueError, match=r"\['nope'\] are not tracked"):
        ema.ema_tensors(["nope"])


def test_load_ema_values_takes_them_and_names_every_misfit_at_once():
    model, ema = model_and_ema()
    values = {name: torch.full_like(value, 7.0) for name, value in ema.ema_tensors().items()}
    ema.load_ema_values(values)
    assert all(torch.equal(v, values[k]) for k, v in ema.ema_tensors().items())
    before = ema.ema_tensors()
    bad = dict(values)
    bad["0.weight"] = torch.zeros(3, 4)  # (4, 3) tracked
    bad["1.bias"] = torch.zeros(5)
    del bad["0.bias"]
    bad["2.weight"] = torch.zeros(1)
    with pytest.raises(ValueError) as error:
        ema.load_ema_values(bad)
    message = str(error.value)
    for text in ("missing ['0.bias']", "unexpected ['2.weight']",
                 "'0.weight' (3, 4), the EMA here (4, 3)", "'1.bias' (5,), the EMA here (4,)",
                 "Nothing was loaded"):
        assert text in message, message
    assert all(torch.equal(v, before[k]) for k, v in ema.ema_tensors().items())
    partial = {"0.bias": torch.ones(4)}
    with pytest.raises(ValueError, match=r"missing \['0.weight'"):
        ema.load_ema_values(partial)
    ema.load_ema_values(partial, strict=False)  # the others keep their EMA
    after = ema.ema_tensors()
    assert torch.equal(after["0.bias"], torch.ones(4))
    assert torch.equal(after["0.weight"], before["0.weight"])


def test_swap_in_and_out_as_separate_calls():
    model, ema = model_and_ema()
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    expected = ema.ema_tensors()
    assert not ema.swapped
    ema.swap_in(model)
    assert ema.swapped
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name].to(value.dtype)), name
    with pytest.raises(RuntimeError, match="already swapped in"):
        ema.swap_in()
    ema.swap_out()
    assert not ema.swapped
    assert all(torch.equal(v, raw[k]) for k, v in model.state_dict().items())
    ema.swap_out()  # nothing swapped in: nothing to do
    assert all(torch.equal(v, raw[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="another model"):
        ema.swap_in(torch.nn.Linear(3, 4))
    assert not ema.swapped
