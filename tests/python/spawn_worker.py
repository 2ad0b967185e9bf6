"""A real Trainer(strategy="ddp_spawn", devices=2, accelerator="cpu") with
one shardema callback, for test_pickling.py. Lightning pickles the
callbacks and the module to send them to the 2 processes it spawns, which
import this file again (as __mp_main__: hence the __main__ guard and the
module-level classes):

    spawn_worker.py CALLBACK OUT        CALLBACK: ema or posthoc

Each rank writes {CALLBACK}.rank{r}.pt: the policy's weights after each
optimizer step (step 0: fit start), from which the test computes its
float64 reference, and the callback's result: the EMA as full tensors
(ema), or the snapshot folder and call count (posthoc)."""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from lightning_worker import Policy, full_state, loader  # noqa: E402

import lightning.pytorch as L  # noqa: E402

WORLD = 2
EPOCHS = 2
BATCHES_PER_EPOCH = 2  # per rank, one optimizer step each: 4 steps
CHECKPOINT_EVERY = 2
SIGMA_RELS = (0.05, 0.1)


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.policy = Policy()
        self.trace = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            self.policy.updates += 1  # a buffer, the same on every rank
        return torch.nn.functional.mse_loss(self.policy(x), y)

    def on_fit_start(self):
        self.trace = [(int(self.trainer.global_step), full_state(self.policy))]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step > self.trace[-1][0]:
            self.trace.append((int(self.trainer.global_step), full_state(self.policy)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


class Recorder(L.Callback):
    """After the shardema callback (placed after it): writes this rank's
    results once training ended."""

    def __init__(self, out, kind):
        self.out, self.kind = out, kind

    def on_train_end(self, trainer, pl_module):
        from shardema.callbacks import DDPPostHocEMACallback, EMACallback
        result = {"trace": pl_module.trace, "global_step": int(trainer.global_step)}
        for callback in trainer.callbacks:
            if isinstance(callback, EMACallback):
                # Collective: every rank calls it here.
                result["ema"] = callback.ema.full_state_dict(rank0_only=False)
            if isinstance(callback, DDPPostHocEMACallback):
                result["folder"] = callback.checkpoint_folder
                result["calls"] = callback.calls
        torch.save(result, os.path.join(self.out, f"{self.kind}.rank{trainer.global_rank}.pt"))


def main():
    kind, out = sys.argv[1:3]
    from shardema.callbacks import DDPPostHocEMACallback, EMACallback
    if kind == "ema":
        callback = EMACallback(attribute="policy")
    else:
        callback = DDPPostHocEMACallback(
            sigma_rels=SIGMA_RELS, checkpoint_every=CHECKPOINT_EVERY,
            checkpoint_folder=os.path.join(out, "posthoc"), attribute="policy")
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp_spawn",
                        max_epochs=EPOCHS, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[callback, Recorder(out, kind)], default_root_dir=out)
    trainer.fit(Module(), loader(WORLD, 1, BATCHES_PER_EPOCH))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
