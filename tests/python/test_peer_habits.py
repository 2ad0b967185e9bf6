"""The calls users of timm and diffusers already write, in shardema: the
unambiguous ones work and give the numbers shardema's own calls give
(checked against a float64 EMA of the weights at each update); the others
are one line in shardema's terms naming what to write instead.

- timm's ModelEmaV3.update(model, step=None): ema.update(model) and
  ema.update(model, step=n), the model the EMA was built on or a wrapper of
  it; another model is a ValueError;
- diffusers' EMAModel(model.parameters()): a TypeError saying to pass the
  nn.Module; its ema.step(parameters) is ema.update() (ema.step is the step
  count, as ema-pytorch's)."""
import pytest
import torch

import shardema

HALF = shardema.DecaySchedule.constant(0.5)


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def values(model):
    return {n: t.detach().double().clone() for n, t in model.state_dict().items()}


def train_step(model, optimizer, seed):
    torch.manual_seed(seed)
    model(torch.randn(5, 4)).square().mean().backward()
    optimizer.step()  # waits for the EMA's read of the weights first
    optimizer.zero_grad()


def assert_ema(ema, want):
    got = ema.full_state_dict()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.allclose(got[name].double(), value, atol=1e-6), name


def test_timms_update_with_the_model_and_step_folds_as_update_does():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = shardema.EMA(model, HALF)
    assert ema.update(model)  # timm's ModelEmaV3.update(model): the first copies
    want = values(model)
    assert ema.step == 1
    # the step given as timm's train.py gives it; wrappers of the same model
    for step, given in ((2, model), (3, torch.compile(model)), (5, model)):
        train_step(model, optimizer, step)
        assert ema.update(given, step=step)
        now = values(model)
        want = {n: want[n] * 0.5 + now[n] * 0.5 for n in now}
        assert ema.step == step
    train_step(model, optimizer, 6)
    assert ema.update(model, 6)  # positional, as timm's signature allows
    now = values(model)
    want = {n: want[n] * 0.5 + now[n] * 0.5 for n in now}
    ema.wait()
    assert_ema(ema, want)


def test_update_with_another_model_is_refused_and_the_ema_goes_on():
    model = mlp()
    ema = shardema.EMA(model, HALF)
    ema.update()
    want = values(model)
    with pytest.raises(ValueError) as excinfo:
        ema.update(mlp(seed=1))
    message = str(excinfo.value)
    assert message.startswith("shardema.EMA.update: this EMA tracks another model: it follows "
                              "the model it was built on (Sequential)"), message
    assert "\n" not in message
    assert ema.step == 1
    assert_ema(ema, want)
    assert ema.update(model)  # usable


def test_update_with_a_model_of_a_named_tensor_ema_is_refused():
    model = mlp()
    ema = shardema.EMA(list(model.named_parameters()), HALF)
    with pytest.raises(ValueError, match="^shardema.EMA.update: this EMA was built from named "
                                         r"tensors, not a model, and works on those tensors: "
                                         r"call update\(\) without a model$"):
        ema.update(model)
    assert ema.step == 0


def test_a_step_given_twice_or_parameters_are_one_type_error_each():
    model = mlp()
    ema = shardema.EMA(model, HALF)
    cases = ((lambda: ema.update(3, step=4), "shardema.EMA.update: the step given twice"),
             (lambda: ema.update(model.parameters()), "shardema.EMA.update: takes the model "
                                                      "the EMA was built on (or nothing), not "
                                                      "parameters: call update()"),
             (lambda: ema.update(list(model.parameters()), step=2), "not parameters"),
             # diffusers' EMAModel.copy_to(parameters)
             (lambda: ema.copy_to(model.parameters()), "shardema.EMA.copy_to: takes the model"))
    for call, start in cases:
        with pytest.raises(TypeError) as excinfo:
            call()
        message = str(excinfo.value)
        assert start in message and "\n" not in message, message
    assert ema.step == 0
    assert ema.update(step=2) and ema.step == 2


@pytest.mark.parametrize("given", [lambda m: m.parameters(), lambda m: list(m.parameters()),
                                   lambda m: [p for p in m.parameters() if p.requires_grad]])
def test_diffusers_ema_model_of_parameters_is_told_to_pass_the_module(given):
    # diffusers: EMAModel(model.parameters()); was "model_or_named_tensors[0]:
    # expected a (name, tensor) pair"
    model = mlp()
    with pytest.raises(TypeError) as excinfo:
        shardema.EMA(given(model))
    message = str(excinfo.value)
    assert message.startswith("shardema.EMA: got a tensor without a name"), message
    assert "pass the nn.Module itself, EMA(model)" in message and "\n" not in message


def test_named_tensors_that_are_not_pairs_name_the_index_and_the_type():
    with pytest.raises(TypeError, match=r"^shardema.EMA: model_or_named_tensors\[1\]: expected "
                                        r"a \(name, tensor\) pair, got str$"):
        shardema.EMA([("w", torch.zeros(2)), "b"])
