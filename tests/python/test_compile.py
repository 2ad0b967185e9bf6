"""shardema.EMA with torch.compile (the real partner, CPU inductor): an EMA
built on the compiled module or on the eager one tracks the same tensors
under plain names (no '_orig_mod.' in its names, state_dict keys or
exported files) and swaps, copies to, copies from and exports either. A
compiled model trained with the EMA is validated inside ema.swap(compiled)
without a recompile, against an eager copy loaded with the EMA's export."""
import pytest
import torch
from torch import nn

import shardema

from safetensors import safe_open
from safetensors.torch import load_model

DECAY = 0.8


def tiny(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def train(compiled, ema, steps, reference):
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        compiled(torch.randn(5, 4, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        for name, p in compiled.named_parameters():
            name = name.replace("_orig_mod.", "")  # the reference's own plain names
            w = p.detach().double()
            reference[name] = w.clone() if name not in reference else \
                DECAY * reference[name] + (1 - DECAY) * w
    ema.wait()


def names_everywhere(ema, path):
    with safe_open(path, framework="pt") as f:
        exported = list(f.keys())
    return list(ema.full_state_dict()) + list(ema.state_dict()["weights"]) + exported


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("built_on", ["compiled", "eager"])
def test_validate_inside_swap_of_the_compiled_model_without_a_recompile(tmp_path, built_on):
    model = tiny()
    compiled = torch.compile(model)
    ema = shardema.EMA(compiled if built_on == "compiled" else model,
                       schedule=shardema.DecaySchedule.constant(DECAY))
    reference = {}
    train(compiled, ema, 3, reference)
    path = str(tmp_path / "ema.safetensors")
    ema.export_weights(path)
    every = names_everywhere(ema, path)
    assert every and not [n for n in every if "_orig_mod" in n], every
    assert sorted(ema.full_state_dict()) == sorted(reference)
    for name, value in ema.full_state_dict().items():
        torch.testing.assert_close(value.double(), reference[name], atol=1e-6, rtol=1e-6)

    eager = tiny(seed=5)
    load_model(eager, path, strict=True)
    x = torch.randn(7, 4)
    with torch.no_grad():
        compiled(x)  # the no_grad graph, compiled once before the swap
        frames = torch._dynamo.utils.counters["frames"]["ok"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            with ema.swap(compiled):
                swapped = compiled(x)
            raw = compiled(x)
        assert torch._dynamo.utils.counters["frames"]["ok"] == frames
        torch.testing.assert_close(swapped, eager(x), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(raw, model(x), atol=0, rtol=0)
        assert not torch.allclose(swapped, raw)


def test_either_module_is_taken_by_every_model_api(tmp_path):
    model = tiny()
    compiled = torch.compile(model)
    on_compiled = shardema.EMA(compiled, schedule=shardema.DecaySchedule.constant(DECAY))
    on_eager = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY))
    assert list(on_compiled.full_state_dict()) == list(on_eager.full_state_dict()) == \
        [n for n, _ in model.named_parameters()]
    def move_the_model():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    for ema in (on_compiled, on_eager):
        for target in (model, compiled):
            move_the_model()
            raw = {k: v.clone() for k, v in model.state_dict().items()}
            held = ema.full_state_dict()
            with ema.swap(target):
                for name, value in held.items():
                    assert torch.equal(model.state_dict()[name], value), name
                    assert not torch.equal(value, raw[name]), name
            assert all(torch.equal(v, raw[k]) for k, v in model.state_dict().items())
            ema.copy_from(target)
            for name, value in ema.full_state_dict().items():
                assert torch.equal(value, raw[name]), name
            move_the_model()
            ema.copy_to(target)
            assert all(torch.equal(v, raw[k]) for k, v in model.state_dict().items())
    into = tiny(seed=3)
    out = on_compiled.module(into=torch.compile(into))
    assert sorted(out.state_dict()) == sorted(model.state_dict())
    other = torch.compile(tiny())
    with pytest.raises(ValueError, match="tracks another model"):
        on_compiled.swap_in(other)


class Trainer:
    def __init__(self, root):
        self.global_step, self.accumulate_grad_batches = 0, 1
        self.is_last_batch, self.default_root_dir = False, root


class Holder(nn.Module):
    """A LightningModule's shape: a compiled submodule as an attribute, whose
    state_dict keys are 'policy._orig_mod.*'."""

    def __init__(self):
        super().__init__()
        self.policy = torch.compile(tiny())

    def forward(self, x):
        return self.policy(x)


def test_callbacks_on_a_compiled_attribute_use_plain_names_and_the_modules_keys(tmp_path):
    from shardema.callbacks import DDPPostHocEMACallback, EMACallback
    module, trainer = Holder(), Trainer(str(tmp_path))
    callback = EMACallback(attribute="policy", policy="ema_pytorch", copy_on_first_update=True,
                           schedule=shardema.DecaySchedule.constant(DECAY))
    posthoc = DDPPostHocEMACallback(attribute="policy", checkpoint_every=2,
                                    checkpoint_folder=str(tmp_path / "ph"),
                                    validate_with_ema=False)
    callback.on_fit_start(trainer, module)
    posthoc.on_fit_start(trainer, module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for batch in range(3):
        module(torch.randn(5, 4)).square().mean().backward()
        for cb in (callback, posthoc):
            cb.on_before_optimizer_step(trainer, module, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        trainer.global_step += 1
        for cb in (callback, posthoc):
            cb.on_train_batch_end(trainer, module, None, None, batch)
    ema = callback.ema.full_state_dict()
    assert sorted(ema) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    raw = {k: v.clone() for k, v in module.state_dict().items()}
    assert sorted(raw) == [f"policy._orig_mod.{n}" for n in sorted(ema)]
    checkpoint = {"state_dict": {k: v.clone() for k, v in raw.items()}}
    callback.on_save_checkpoint(trainer, module, checkpoint)
    for name, value in ema.items():
        assert torch.equal(checkpoint["state_dict"][f"policy._orig_mod.{name}"], value), name
    resumed, module2 = EMACallback(attribute="policy", policy="ema_pytorch",
                                   schedule=shardema.DecaySchedule.constant(DECAY)), Holder()
    module2.load_state_dict(checkpoint["state_dict"])
    resumed.on_load_checkpoint(trainer, module2, checkpoint)
    resumed.on_fit_start(trainer, module2)
    for name, value in ema.items():
        assert torch.equal(resumed.ema.full_state_dict()[name], value), name
    assert all(torch.equal(v, raw[k]) for k, v in module2.state_dict().items())
    posthoc.on_train_end(trainer, module)
    out = shardema.read_tensor_file(posthoc.output_path)["tensors"]
    assert sorted(out) == sorted(ema)
