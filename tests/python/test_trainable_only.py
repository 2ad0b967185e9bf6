"""EMA(model, trainable_only=True) against the real partner, peft's LoRA
adapters on a small locally built model (no download), and a float64 EMA
of the trainable parameters recomputed here: what is kept and read, swap,
copy_to, module(), state_dict and checkpoints that leave the frozen
weights to the model, the export with and without the model's own values
(a strict load into the plain model), and what a requires_grad changed
afterwards does. The callbacks' trainable_only too; FSDP2 at W = 2 in
trainable_worker.py."""
import copy
import json
import os
import sys

import pytest
import torch
from torch import nn

import shardema
from shardema.callbacks import DDPPostHocEMACallback, EMACallback

peft = pytest.importorskip("peft")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from rank_launch import assert_passed, launched_once  # noqa: E402

DECAY = 0.9


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.attn = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.attn(self.norm(self.embed(x)))))


def lora_model(seed=0):
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["attn", "out"],
                             init_lora_weights=False)
    return peft.get_peft_model(Net(), config)


def trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


class Float64Ema:
    """The EMA of `names` in float64: a copy at the first update, then
    ema = DECAY * ema + (1 - DECAY) * w."""

    def __init__(self):
        self.values = {}

    def update(self, model, names):
        params = dict(model.named_parameters())
        for name in names:
            w = params[name].detach().double()
            self.values[name] = w.clone() if name not in self.values else \
                DECAY * self.values[name] + (1 - DECAY) * w


def train(model, ema, reference, steps, seed=1):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(6, 8, generator=g)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        reference.update(model, sorted(ema.full_state_dict()))
    ema.wait()


def built(seed=0):
    model = lora_model(seed)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY),
                       trainable_only=True)
    return model, ema


def assert_close_to(ema_values, reference):
    assert sorted(ema_values) == sorted(reference.values)
    for name, value in reference.values.items():
        torch.testing.assert_close(ema_values[name].double(), value, atol=1e-6, rtol=1e-6,
                                   msg=name)


def test_lora_ema_equals_float64_ema_of_the_adapters_and_reads_only_them():
    model, ema = built()
    names = sorted(trainable(model))
    assert names and all("lora_" in n for n in names)
    reference = Float64Ema()
    train(model, ema, reference, 5)
    assert_close_to(ema.full_state_dict(), reference)
    assert sorted(ema.local_ema()) == names
    # Host memory and reads: the adapters' bytes only, at every update.
    adapter_bytes = sum(p.numel() * p.element_size() for p in trainable(model).values())
    assert ema.offload_stats()["source_bytes"] == 5 * adapter_bytes
    held = sum(t.numel() * t.element_size() for t in ema.local_ema().values())
    assert held == adapter_bytes


def test_swap_copy_to_and_module_leave_frozen_weights_and_buffers_to_the_model():
    model, ema = built()
    reference = Float64Ema()
    train(model, ema, reference, 4)
    model.eval()
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 8)
    # An eager copy holding the float64 reference EMA and the model's own rest.
    expected_model = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in expected_model.named_parameters():
            if name in reference.values:
                p.copy_(reference.values[name])
    expected = expected_model(x)
    with ema.swap(model):
        inside = model.state_dict()
        for key, value in inside.items():
            if key in reference.values:
                torch.testing.assert_close(value.double(), reference.values[key], atol=1e-6,
                                           rtol=1e-6)
            else:
                assert torch.equal(value, raw[key]), key  # frozen and buffers: the model's
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(v, raw[k]) for k, v in model.state_dict().items())
    copy_of = ema.module()
    torch.testing.assert_close(copy_of(x), expected, atol=1e-5, rtol=1e-5)
    ema.copy_to(model)
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


def test_export_holds_the_adapters_and_with_include_untracked_loads_strict(tmp_path):
    model, ema = built()
    reference = Float64Ema()
    train(model, ema, reference, 4)
    model.eval()
    only = str(tmp_path / "adapters.safetensors")
    ema.export_weights(only)
    with safe_open(only, framework="pt") as f:
        assert sorted(f.keys()) == sorted(reference.values)
    whole = str(tmp_path / "whole.safetensors")
    ema.export_weights(whole, include_untracked=True)
    plain = lora_model(seed=7)  # other values everywhere
    plain.eval()
    missing, unexpected = load_model(plain, whole, strict=True)
    assert not missing and not unexpected
    x = torch.randn(3, 8)
    with ema.swap(model):
        torch.testing.assert_close(plain(x), model(x), atol=1e-6, rtol=1e-6)
    with safe_open(whole, framework="pt") as f:
        from_model = json.loads(f.metadata()["shardema.from_model"])
        assert set(from_model) == set(model.state_dict()) - set(reference.values)
        assert "shardema.step" in f.metadata()  # the EMA writer's metadata kept
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]
    with pytest.raises(TypeError, match="include_untracked"):
        ema.export_weights(whole, include_untracked="yes")


def test_state_dict_and_checkpoint_round_trips_hold_the_adapters_only(tmp_path):
    model, ema = built()
    train(model, ema, Float64Ema(), 3)
    folder = str(tmp_path / "ckpt")
    ema.save_checkpoint(folder)
    state = ema.state_dict()
    model2, ema2 = built()
    ema2.load_checkpoint(folder)
    model3, ema3 = built()
    ema3.load_state_dict(state)
    for other in (ema2, ema3):
        for name, value in ema.full_state_dict().items():
            assert torch.equal(other.full_state_dict()[name], value), name
        assert other.step == ema.step


def test_unfreezing_a_left_out_parameter_is_refused_by_name_until_frozen_again():
    model, ema = built()
    reference = Float64Ema()
    train(model, ema, reference, 2)
    base = model.base_model.model.attn.base_layer.weight
    base.requires_grad_(True)
    with pytest.raises(ValueError, match=r"'base_model\.model\.attn\.base_layer\.weight'.*"
                                         "trainable_only"):
        ema.update()
    with pytest.raises(ValueError, match="trainable_only"):
        with ema.swap(model):
            pass
    base.requires_grad_(False)
    train(model, ema, reference, 2)  # not failed for good, and still exact
    assert_close_to(ema.full_state_dict(), reference)


def test_a_frozen_parameter_replaced_by_a_trainable_one_is_refused():
    model, ema = built()
    train(model, ema, Float64Ema(), 1)
    layer = model.base_model.model.embed
    layer.weight = nn.Parameter(layer.weight.detach().clone())  # requires grad
    with pytest.raises(ValueError, match=r"'base_model\.model\.embed\.weight'"):
        ema.update()


def test_a_kept_parameter_frozen_later_is_still_averaged():
    model, ema = built()
    reference = Float64Ema()
    train(model, ema, reference, 2)
    frozen_name = next(n for n in trainable(model) if "lora_B" in n)
    dict(model.named_parameters())[frozen_name].requires_grad_(False)
    train(model, ema, reference, 3)
    assert frozen_name in reference.values
    assert_close_to(ema.full_state_dict(), reference)


def test_buffers_and_ignore_names_with_trainable_only():
    torch.manual_seed(0)
    net = Net()
    net.embed.requires_grad_(False)
    ema = shardema.EMA(net, trainable_only=True, ignore_names=["out.bias"])
    assert sorted(ema.full_state_dict()) == ["attn.bias", "attn.weight", "norm.bias",
                                             "norm.weight", "out.weight"]


def test_bad_arguments_are_refused_in_python_terms():
    net = Net()
    with pytest.raises(TypeError, match="trainable_only must be a bool"):
        shardema.EMA(net, trainable_only="yes")
    with pytest.raises(ValueError, match="trainable_only=True needs an nn.Module"):
        shardema.EMA(list(net.named_parameters()), trainable_only=True)
    net.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter of the model requires grad"):
        shardema.EMA(net, trainable_only=True)


class Trainer:
    def __init__(self, root):
        self.global_step, self.accumulate_grad_batches = 0, 1
        self.is_last_batch, self.default_root_dir = False, root


def callback_steps(model, callback, trainer, steps):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(3)
    for batch in range(steps):
        model(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
        callback.on_before_optimizer_step(trainer, model, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, model, None, None, batch)


def test_ema_callback_trainable_only_checkpoint_holds_the_frozen_weights_as_they_are(tmp_path):
    model = lora_model()
    trainer = Trainer(str(tmp_path))
    callback = EMACallback(trainable_only=True, policy="ema_pytorch",
                           schedule=shardema.DecaySchedule.constant(DECAY),
                           copy_on_first_update=True)
    callback.on_fit_start(trainer, model)
    callback_steps(model, callback, trainer, 3)
    names = sorted(trainable(model))
    ema = callback.ema.full_state_dict()
    assert sorted(ema) == names
    checkpoint = {"state_dict": {k: v.clone() for k, v in model.state_dict().items()}}
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    callback.on_save_checkpoint(trainer, model, checkpoint)
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(value, ema[key] if key in ema else raw[key]), key
    assert sorted(checkpoint[EMACallback.RAW_STATE_KEY]) == names
    resumed = EMACallback(trainable_only=True, policy="ema_pytorch",
                          schedule=shardema.DecaySchedule.constant(DECAY))
    model2 = lora_model()
    model2.load_state_dict(checkpoint["state_dict"])
    resumed.on_load_checkpoint(trainer, model2, checkpoint)
    resumed.on_fit_start(trainer, model2)
    for name, value in ema.items():
        assert torch.equal(resumed.ema.full_state_dict()[name], value), name
        assert torch.equal(dict(model2.named_parameters())[name], raw[name])


def test_posthoc_callback_trainable_only_keeps_the_adapters(tmp_path):
    model = lora_model()
    trainer = Trainer(str(tmp_path))
    callback = DDPPostHocEMACallback(checkpoint_every=2, checkpoint_folder=str(tmp_path / "ph"),
                                     trainable_only=True)
    callback.on_fit_start(trainer, model)
    callback_steps(model, callback, trainer, 4)
    callback.on_train_end(trainer, model)
    out = shardema.read_tensor_file(callback.output_path)["tensors"]
    assert sorted(out) == sorted(trainable(model))
    model.base_model.model.out.base_layer.bias.requires_grad_(True)
    with pytest.raises(ValueError, match=r"base_model\.model\.out\.base_layer\.bias"):
        callback.on_train_batch_end(trainer, model, None, None, 0)


runs = launched_once("trainable_worker.py", [(2, ["hand_frozen_fsdp2", "posthoc_sharded_fsdp2"])],
                     timeout=150)


def test_hand_frozen_layers_under_fsdp2_equal_float64_ema_of_full_tensors(runs):
    assert_passed(runs(2), "hand_frozen_fsdp2")


def test_sharded_posthoc_ema_of_the_trainable_parameters_under_fsdp2(runs):
    assert_passed(runs(2), "posthoc_sharded_fsdp2")
