"""EMACallback(schedules=[...], profile=p) in a real Lightning Trainer:
validation runs with profile p swapped in (against a float64 EMA of the
weights after each optimizer step), the checkpoint's state_dict holds
profile p and the others beside it, a resume continues every profile bit
for bit as the uninterrupted run, and a callback of other schedules or
another profile refuses the checkpoint naming them."""
import os

import pytest
import torch

import shardema
from shardema.callbacks import EMACallback

L = pytest.importorskip("lightning.pytorch")

DECAYS = [0.5, 0.8, 0.95]
STEPS_PER_EPOCH = 3


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 2)
        self.after_steps = [{k: v.detach().clone() for k, v in self.net.state_dict().items()}]
        self.validated = []

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.after_steps.append({k: v.detach().clone() for k, v in self.net.state_dict().items()})

    def validation_step(self, batch, batch_idx):
        self.validated.append((self.global_step,
                               {k: v.detach().clone() for k, v in self.net.state_dict().items()}))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def loader(seed):
    g = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS_PER_EPOCH, 3, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=1)


def callback(profile=1, decays=DECAYS):
    return EMACallback(schedules=[shardema.DecaySchedule.constant(d) for d in decays],
                       profile=profile)


def fit(module, cb, out, epochs, resume=None, checkpoints=False):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, enable_checkpointing=checkpoints,
                        callbacks=[cb] + ([L.callbacks.ModelCheckpoint(
                            dirpath=out, filename="{epoch}", save_top_k=-1)]
                            if checkpoints else []),
                        default_root_dir=out, limit_val_batches=1)
    trainer.fit(module, loader(1), loader(2), ckpt_path=resume)
    return trainer


def float64_ema(after_steps, decay, steps):
    """The VersatIL start (the weights at fit start), then one lerp per
    optimizer step with the constant decay."""
    ema = {k: v.double() for k, v in after_steps[0].items()}
    for weights in after_steps[1:steps + 1]:
        ema = {k: decay * ema[k] + (1 - decay) * weights[k].double() for k in ema}
    return ema


def test_validation_runs_with_the_chosen_profile_and_a_resume_keeps_every_one(tmp_path):
    module, cb = Tiny(), callback(profile=1)
    fit(module, cb, str(tmp_path / "a"), epochs=3, checkpoints=True)
    assert [step for step, _ in module.validated] == [3, 6, 9]
    for step, seen in module.validated:
        expected = float64_ema(module.after_steps, DECAYS[1], step)
        for name, value in seen.items():
            torch.testing.assert_close(value.double(), expected[name], rtol=0, atol=1e-6)
    # Outside validation the raw weights are back.
    assert all(torch.equal(module.net.state_dict()[k], module.after_steps[-1][k])
               for k in module.after_steps[-1])
    every = [cb.ema.full_state_dict(profile=p) for p in range(3)]

    ckpt = os.path.join(str(tmp_path / "a"), "epoch=1.ckpt")
    saved = torch.load(ckpt, weights_only=False)
    at_6 = float64_ema(module.after_steps, DECAYS[1], 6)
    for name in at_6:
        torch.testing.assert_close(saved["state_dict"][f"net.{name}"].double(), at_6[name],
                                   rtol=0, atol=1e-6)
    assert sorted(saved[EMACallback.EMA_PROFILES_KEY]) == ["0", "2"]

    resumed, again = Tiny(), callback(profile=1)
    fit(resumed, again, str(tmp_path / "b"), epochs=3, resume=ckpt)
    for p in range(3):
        got = again.ema.full_state_dict(profile=p)
        assert all(torch.equal(got[n], every[p][n]) for n in got), p

    for other in (callback(profile=0), callback(profile=1, decays=DECAYS[:2]),
                  callback(profile=1, decays=[0.5, 0.8, 0.9])):
        with pytest.raises(ValueError, match="EMA profile"):
            fit(Tiny(), other, str(tmp_path / "c"), epochs=3, resume=ckpt)


def test_bad_profile_arguments_are_refused_by_name():
    with pytest.raises(IndexError, match="profile 3 does not exist; the callback keeps 3"):
        callback(profile=3)
    with pytest.raises(IndexError, match="keeps 1 profile"):
        EMACallback(profile=1)
    with pytest.raises(TypeError, match="profile must be an int"):
        callback(profile="1")
    with pytest.raises(ValueError, match="schedules= and"):
        EMACallback(schedule=shardema.DecaySchedule.constant(0.9),
                    schedules=[shardema.DecaySchedule.constant(0.9)])
    with pytest.raises(TypeError, match=r"EMACallback: schedules\[0\]"):
        EMACallback(schedules=[0.9])
