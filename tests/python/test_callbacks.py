"""shardema.callbacks in a small trainer loop that calls the hooks in
Lightning's order: gradient accumulation with a partial last window,
BatchNorm, a frozen layer, checkpoints, an interrupted and resumed run,
and the validation swap. The EMACallback's values are checked against an
independent float64 implementation of the VersatIL callback's behaviour."""
import copy
import io
import os
import shutil

import pytest
import torch

from shardema.callbacks import DDPPostHocEMACallback, EMACallback

BATCHES = 8  # per epoch
ACCUMULATE = 3  # optimizer steps at batch 2, 5 and 7 (the partial window)


class Trainer:
    """The attributes the callbacks read."""

    def __init__(self, root):
        self.global_step = 0
        self.accumulate_grad_batches = ACCUMULATE
        self.is_last_batch = False
        self.default_root_dir = root


class Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.policy = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                                          torch.nn.ReLU(), torch.nn.Linear(8, 2))
        self.frozen = torch.nn.Linear(2, 2)
        self.frozen.requires_grad_(False)
        self.logged = {}

    def forward(self, x):
        return self.frozen(self.policy(x))

    def log(self, name, value, **kwargs):
        self.logged[name] = value


def data(epoch, batch):
    g = torch.Generator().manual_seed(1000 * epoch + batch)
    return torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)


def run_epochs(module, callback, trainer, optimizer, epochs, reference=None):
    """Lightning's order: forward/backward each batch; on the window's end
    (or the last batch) on_before_optimizer_step, step, global_step += 1;
    then on_train_batch_end."""
    for epoch in epochs:
        for batch in range(BATCHES):
            x, y = data(epoch, batch)
            loss = torch.nn.functional.mse_loss(module(x), y) / ACCUMULATE
            loss.backward()
            trainer.is_last_batch = batch == BATCHES - 1
            if (batch + 1) % ACCUMULATE == 0 or trainer.is_last_batch:
                callback.on_before_optimizer_step(trainer, module, optimizer)
                optimizer.step()
                optimizer.zero_grad()
                trainer.global_step += 1
            callback.on_train_batch_end(trainer, module, None, (x, y), batch)
            if reference is not None:
                reference.on_train_batch_end(trainer, module, batch)


class ReferenceEMA:
    """The VersatIL EMACallback's update, in float64: a copy of the policy at
    fit start; on optimizer steps, buffers and BatchNorm / frozen parameters
    copied, the rest lerped with the warmup decay of global_step."""

    def __init__(self, policy, power=0.75, inv_gamma=1.0, max_value=0.9999):
        self.ema = copy.deepcopy(policy).double()
        self.power, self.inv_gamma, self.max_value = power, inv_gamma, max_value

    def decay(self, step):
        e = max(0, step - 1)
        return 0.0 if e <= 0 else min(self.max_value, 1 - (1 + e / self.inv_gamma) ** -self.power)

    def on_train_batch_end(self, trainer, module, batch):
        if (batch + 1) % trainer.accumulate_grad_batches != 0 and not trainer.is_last_batch:
            return
        d = self.decay(trainer.global_step)
        with torch.no_grad():
            for live, ema in zip(module.policy.modules(), self.ema.modules()):
                for b, eb in zip(live.buffers(recurse=False), ema.buffers(recurse=False)):
                    eb.copy_(b)
                for p, ep in zip(live.parameters(recurse=False), ema.parameters(recurse=False)):
                    if isinstance(live, torch.nn.BatchNorm1d) or not p.requires_grad:
                        ep.copy_(p)
                    else:
                        ep.mul_(d).add_(p.double() * (1 - d))


def fresh(root):
    module = Module()
    return module, torch.optim.SGD(module.parameters(), lr=0.05), Trainer(root)


def test_ema_callback_matches_the_reference_behaviour(tmp_path):
    module, optimizer, trainer = fresh(str(tmp_path))
    module.policy[3].weight.requires_grad_(False)  # frozen inside the policy
    callback = EMACallback(attribute="policy")
    callback.on_fit_start(trainer, module)
    reference = ReferenceEMA(module.policy)
    run_epochs(module, callback, trainer, optimizer, range(2), reference)
    assert trainer.global_step == 6  # 3 optimizer steps per epoch
    assert callback.decay == pytest.approx(reference.decay(6))
    callback.ema.wait()
    ours = callback.ema.full_state_dict()
    expected = reference.ema.state_dict()
    assert list(ours) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(ours[name].double(), value.double(), rtol=1e-6, atol=1e-6, msg=name)
    live = module.policy.state_dict()
    assert torch.equal(ours["1.running_mean"], live["1.running_mean"])  # buffers copied
    assert torch.equal(ours["3.weight"], live["3.weight"])  # frozen parameter copied
    assert not torch.equal(ours["0.weight"], live["0.weight"])  # averaged


def checkpoint_of(module, callback, trainer):
    ckpt = {"state_dict": {k: v.clone() for k, v in module.state_dict().items()},
            "global_step": trainer.global_step}
    callback.on_save_checkpoint(trainer, module, ckpt)
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_checkpoint_holds_ema_with_raw_weights_and_resume_is_bit_identical(tmp_path):
    # Uninterrupted: two epochs.
    module, optimizer, trainer = fresh(str(tmp_path))
    callback = EMACallback(attribute="policy")
    callback.on_fit_start(trainer, module)
    run_epochs(module, callback, trainer, optimizer, range(2))
    final = checkpoint_of(module, callback, trainer)

    # Interrupted after one epoch, resumed in a new "process".
    module, optimizer, trainer = fresh(str(tmp_path))
    callback = EMACallback(attribute="policy")
    callback.on_fit_start(trainer, module)
    run_epochs(module, callback, trainer, optimizer, range(1))
    saved = checkpoint_of(module, callback, trainer)
    ema_now = callback.ema.full_state_dict()
    raw_now = module.policy.state_dict()
    for name in ema_now:
        assert torch.equal(saved["state_dict"][f"policy.{name}"], ema_now[name].to(raw_now[name].dtype))
        assert torch.equal(saved[EMACallback.RAW_STATE_KEY][f"policy.{name}"], raw_now[name])
    assert "frozen.weight" not in saved[EMACallback.RAW_STATE_KEY]  # outside the policy

    module, optimizer, trainer = fresh(str(tmp_path))
    callback = EMACallback(attribute="policy")
    module.load_state_dict(saved["state_dict"])  # Lightning loads the (EMA) state dict first
    callback.on_load_checkpoint(trainer, module, saved)
    trainer.global_step = saved["global_step"]
    callback.on_fit_start(trainer, module)
    run_epochs(module, callback, trainer, optimizer, range(1, 2))
    resumed = checkpoint_of(module, callback, trainer)
    for key in ("state_dict", EMACallback.RAW_STATE_KEY):
        assert list(resumed[key]) == list(final[key])
        for name, value in final[key].items():
            assert torch.equal(resumed[key][name], value), (key, name)


def test_validation_swap_also_when_validation_raises(tmp_path):
    module, optimizer, trainer = fresh(str(tmp_path))
    callback = EMACallback(attribute="policy")
    callback.on_fit_start(trainer, module)
    run_epochs(module, callback, trainer, optimizer, range(1))
    raw = {k: v.clone() for k, v in module.policy.state_dict().items()}
    ema = callback.ema.full_state_dict()
    callback.on_validation_start(trainer, module)
    assert torch.equal(module.policy[0].weight.detach(), ema["0.weight"])
    with pytest.raises(RuntimeError, match="swapped"):
        callback.on_save_checkpoint(trainer, module, {"state_dict": module.state_dict()})
    callback.on_validation_end(trainer, module)
    assert all(torch.equal(raw[k], v) for k, v in module.policy.state_dict().items())
    try:
        callback.on_validation_start(trainer, module)
        raise ValueError("validation step failed")
    except ValueError as error:
        callback.on_exception(trainer, module, error)
    assert all(torch.equal(raw[k], v) for k, v in module.policy.state_dict().items())


def test_callback_hooks_before_fit_start_do_nothing(tmp_path):
    module, optimizer, trainer = fresh(str(tmp_path))
    callback = EMACallback()
    callback.on_train_batch_end(trainer, module, None, None, 0)
    callback.on_before_optimizer_step(trainer, module, optimizer)
    ckpt = {"state_dict": module.state_dict()}
    callback.on_save_checkpoint(trainer, module, ckpt)
    assert EMACallback.RAW_STATE_KEY not in ckpt
    with pytest.raises(ValueError, match="power"):
        EMACallback(power=-1.0)


def test_ddp_posthoc_callback_lifecycle(tmp_path):
    module, optimizer, trainer = fresh(str(tmp_path))
    folder = str(tmp_path / "snapshots")
    callback = DDPPostHocEMACallback(checkpoint_every=2, checkpoint_folder=folder)
    callback.on_fit_start(trainer, module)
    run_epochs(module, callback, trainer, optimizer, range(2))
    assert callback.calls == 6
    ckpt = {}
    callback.on_save_checkpoint(trainer, module, ckpt)
    assert ckpt[DDPPostHocEMACallback.STATE_KEY]["shardema.posthoc.calls"] == "6"
    raw = {k: v.clone() for k, v in module.state_dict().items()}
    callback.on_validation_start(trainer, module)
    assert not torch.equal(module.policy[0].weight, raw["policy.0.weight"])
    callback.on_validation_end(trainer, module)
    assert all(torch.equal(raw[k], v) for k, v in module.state_dict().items())
    callback.on_train_end(trainer, module)
    assert callback.output_path and os.path.exists(callback.output_path)
    import shardema
    written = shardema.read_tensor_file(callback.output_path)["tensors"]
    offline = shardema.synthesize_snapshot_folder(folder, 0.05, step=6)
    assert list(written) == list(offline)
    assert all(torch.equal(written[k], offline[k]) for k in offline)



def test_ddp_posthoc_callback_resume_continues_with_the_same_values(tmp_path):
    """A run interrupted at step 6 and resumed in a new "process" (a copy of
    the snapshot folder, the raw weights of step 6) takes epoch 2 as the
    uninterrupted run does: the same validation weights and the same
    train-end output, bit for bit."""
    import shardema
    module, optimizer, trainer = fresh(str(tmp_path))
    folder = str(tmp_path / "snapshots")
    callback = DDPPostHocEMACallback(checkpoint_every=2, checkpoint_folder=folder)
    callback.on_fit_start(trainer, module)
    run_epochs(module, callback, trainer, optimizer, range(2))
    ckpt = {}
    callback.on_save_checkpoint(trainer, module, ckpt)
    resumed_folder = str(tmp_path / "snapshots_resumed")
    shutil.copytree(folder, resumed_folder)
    raw_at_6 = {k: v.clone() for k, v in module.state_dict().items()}

    module2, optimizer2, trainer2 = fresh(str(tmp_path))  # SGD: no optimizer state
    module2.load_state_dict(raw_at_6)
    trainer2.global_step = 6
    resumed = DDPPostHocEMACallback(checkpoint_every=2, checkpoint_folder=resumed_folder)
    resumed.on_load_checkpoint(trainer2, module2, ckpt)
    resumed.on_fit_start(trainer2, module2)
    assert resumed.calls == 6

    def last_epoch(m, cb, tr, opt):
        run_epochs(m, cb, tr, opt, range(2, 3))
        raw = {k: v.clone() for k, v in m.state_dict().items()}
        cb.on_validation_start(tr, m)
        seen = {k: v.clone() for k, v in m.state_dict().items()}
        cb.on_validation_end(tr, m)
        cb.on_train_end(tr, m)
        return raw, seen, shardema.read_tensor_file(cb.output_path)["tensors"]

    raw, seen, written = last_epoch(module, callback, trainer, optimizer)
    raw2, seen2, written2 = last_epoch(module2, resumed, trainer2, optimizer2)
    assert resumed.calls == callback.calls == 9
    assert not torch.equal(seen["policy.0.weight"], raw["policy.0.weight"])  # the EMA was in
    for a, b in ((raw, raw2), (seen, seen2), (written, written2)):
        assert list(a) == list(b)
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert differ == [], differ


def test_resume_refuses_raw_weights_of_another_model(tmp_path):
    module, optimizer, trainer = fresh(str(tmp_path))
    callback = EMACallback(attribute="policy")
    callback.on_fit_start(trainer, module)
    run_epochs(module, callback, trainer, optimizer, range(1))
    saved = checkpoint_of(module, callback, trainer)
    raw = saved[EMACallback.RAW_STATE_KEY]
    raw["policy.9.weight"] = raw.pop("policy.3.weight")
    module2, _, trainer2 = fresh(str(tmp_path))
    module2.load_state_dict(saved["state_dict"])
    with pytest.raises(ValueError, match=r"missing \['policy.3.weight'\], unexpected "
                                         r"\['policy.9.weight'\]"):
        EMACallback(attribute="policy").on_load_checkpoint(trainer2, module2, saved)


def test_resume_names_every_raw_weight_that_does_not_match(tmp_path):
    """A resume whose raw weights are not this model's names each one that
    differs, all at once (missing, unexpected, shape, dtype), and changes
    nothing: not the first mismatch alone, nor a half-loaded model."""
    module, optimizer, trainer = fresh(str(tmp_path))
    callback = EMACallback(attribute="policy")
    callback.on_fit_start(trainer, module)
    run_epochs(module, callback, trainer, optimizer, range(1))
    saved = checkpoint_of(module, callback, trainer)
    raw = saved[EMACallback.RAW_STATE_KEY]
    raw["policy.0.weight"] = raw["policy.0.weight"][:, :5].clone()  # (8, 6) in the model
    raw["policy.3.weight"] = raw["policy.3.weight"].t().clone()  # (2, 8) in the model
    raw["policy.3.bias"] = raw["policy.3.bias"].double()  # float32 in the model

    def refused(checkpoint):
        module2, _, trainer2 = fresh(str(tmp_path))
        module2.load_state_dict(checkpoint["state_dict"])
        before = {k: v.clone() for k, v in module2.state_dict().items()}
        with pytest.raises(ValueError) as error:
            EMACallback(attribute="policy").on_load_checkpoint(trainer2, module2, checkpoint)
        after = module2.state_dict()
        assert [k for k in before if not torch.equal(before[k], after[k])] == []
        return str(error.value)

    mismatched = ["'policy.0.weight' (8, 5) in the checkpoint, (8, 6) in the model",
                  "'policy.3.weight' (8, 2) in the checkpoint, (2, 8) in the model",
                  "'policy.3.bias' torch.float64 in the checkpoint, torch.float32 in the model"]
    message = refused(saved)  # shapes and dtype only
    for text in mismatched:
        assert text in message, message
    raw.pop("policy.0.bias")
    raw["policy.7.weight"] = torch.zeros(2)
    message = refused(saved)  # and a missing and an unexpected name
    for text in mismatched + ["missing ['policy.0.bias']", "unexpected ['policy.7.weight']"]:
        assert text in message, message


def test_constant_schedule_copying_at_its_first_update_resumes_bit_identical(tmp_path):
    """EMAWeightAveraging's settings (constant decay, an update every 2nd
    step from step 2 on, the first update a copy): the resumed average has
    started, so its first update after the resume averages, as the
    uninterrupted run's does. Checked against a float64 recomputation."""
    import shardema

    def make():
        return EMACallback(attribute="policy", update_after_step=1, copy_on_first_update=True,
                           schedule=shardema.DecaySchedule.constant(0.8, update_every=2))

    module, optimizer, trainer = fresh(str(tmp_path))
    callback = make()
    callback.on_fit_start(trainer, module)
    weights = []
    steps = []

    class Recorder:
        def on_train_batch_end(self, trainer, module, batch):
            if trainer.global_step not in steps:
                steps.append(trainer.global_step)
                weights.append({k: v.double() for k, v in module.policy.state_dict().items()})
    run_epochs(module, callback, trainer, optimizer, range(2), Recorder())
    final = checkpoint_of(module, callback, trainer)
    expected = None
    for step, w in zip(steps, weights):
        if step <= 1 or (step - 1) % 2:
            continue  # due at 3 and 5
        expected = dict(w) if expected is None else {
            k: (expected[k] * 0.8 + v * 0.2 if k in ("0.weight", "0.bias", "3.weight", "3.bias")
                else v) for k, v in w.items()}
    ours = callback.ema.full_state_dict()
    for k, v in expected.items():
        torch.testing.assert_close(ours[k].double(), v, rtol=1e-6, atol=1e-6, msg=k)

    module, optimizer, trainer = fresh(str(tmp_path))
    callback = make()
    callback.on_fit_start(trainer, module)
    run_epochs(module, callback, trainer, optimizer, range(1))
    saved = checkpoint_of(module, callback, trainer)
    module, optimizer, trainer = fresh(str(tmp_path))
    callback = make()
    module.load_state_dict(saved["state_dict"])
    callback.on_load_checkpoint(trainer, module, saved)
    trainer.global_step = saved["global_step"]
    callback.on_fit_start(trainer, module)
    run_epochs(module, callback, trainer, optimizer, range(1, 2))
    resumed = checkpoint_of(module, callback, trainer)
    for key in ("state_dict", EMACallback.RAW_STATE_KEY):
        for name, value in final[key].items():
            assert torch.equal(resumed[key][name], value), (key, name)


def test_schedule_and_warmup_options_are_one_or_the_other():
    import shardema
    with pytest.raises(ValueError, match="power"):
        EMACallback(power=0.5, schedule=shardema.DecaySchedule.constant(0.9))
    with pytest.raises(TypeError, match="DecaySchedule"):
        EMACallback(schedule=0.9)
