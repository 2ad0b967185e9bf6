"""One rank of test_lightning_buffers.py: a real Lightning Trainer with DDP
on 2 CPU processes (Gloo), gradient accumulation 3, a BatchNorm whose
statistics differ between the ranks (each rank sees its own data) and a
frozen layer, run twice from the same seed: once with shardema's
EMACallback, once with a reference written here from the VersatIL seed's
documented behaviour (SeedLikeEMA). Rank r writes {name}.rank{r}.pt: the
validation outputs it saw, each rank's EMA at each validation start, and
its final raw weights; rank 0's Lightning checkpoints are in OUT/{name}/.
Started by rank_launch.launch with torchrun's environment as scenarios
ours and seed (Lightning starts the group); rank_worker.py says how and
what it reports."""
import copy
import functools
import os

import torch

import rank_worker

EPOCHS = 2
BATCHES_PER_EPOCH = 4  # per rank; with ACCUMULATE 3: a full window, then a partial one
ACCUMULATE = 3
BATCH = 4


def warmup_decay(step):
    """The seed's default warmup (power 0.75, inv_gamma 1, min 0, max
    0.9999): 0 up to the first step, then 1 - (1 + e) ** -0.75, e = step - 1."""
    e = step - 1
    return 0.0 if e <= 0 else min(0.9999, 1 - (1 + e) ** -0.75)


class Policy(torch.nn.Module):
    """Linear -> BatchNorm -> tanh -> Linear -> a frozen Linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.out = torch.nn.Linear(6, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.out(torch.tanh(self.norm(self.inp(x)))))


def loader(world, seed, batches):
    """Rows alternate between the ranks (Lightning's DistributedSampler
    without shuffling); rank 1's rows are shifted and scaled, so the two
    ranks' BatchNorm statistics differ by much more than rounding."""
    g = torch.Generator().manual_seed(seed)
    n = batches * BATCH * world
    x = torch.randn(n, 4, generator=g)
    x[1::2] = x[1::2] * 2.0 + 1.5
    data = torch.utils.data.TensorDataset(x, torch.randn(n, 3, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def plain_state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def seed_like_callback(L):
    """The seed's EMACallback as its documentation describes it, in other
    words: a deep copy of the policy at fit start (eval mode, no grad); at
    the end of each accumulation window (and at an epoch's last batch), on
    every rank: buffers copied, BatchNorm and frozen parameters copied, the
    others moved towards the weights with the warmup decay of the global
    step; validation runs with the copy put in the policy's place; a
    checkpoint's state_dict holds the copy's values, the raw ones under
    raw_policy_state_dict."""
    from torch.nn.modules.batchnorm import _BatchNorm

    class SeedLikeEMA(L.Callback):
        def __init__(self):
            super().__init__()
            self.ema_model = None
            self.raw_policy = None

        def on_fit_start(self, trainer, pl_module):
            self.ema_model = copy.deepcopy(pl_module.policy).eval().requires_grad_(False)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            window_done = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
            if not (window_done or trainer.is_last_batch):
                return
            decay = warmup_decay(trainer.global_step)
            pairs = zip(pl_module.policy.modules(), self.ema_model.modules())
            with torch.no_grad():
                for live, kept in pairs:
                    for b, kb in zip(live.buffers(recurse=False), kept.buffers(recurse=False)):
                        kb.copy_(b)
                    for p, kp in zip(live.parameters(recurse=False),
                                     kept.parameters(recurse=False)):
                        if isinstance(live, _BatchNorm) or not p.requires_grad:
                            kp.copy_(p)
                        else:
                            kp.copy_(decay * kp + (1.0 - decay) * p)

        def on_validation_start(self, trainer, pl_module):
            self.raw_policy = pl_module.policy
            pl_module.policy = self.ema_model

        def on_validation_end(self, trainer, pl_module):
            pl_module.policy = self.raw_policy
            self.raw_policy = None

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            raw = {}
            for key, value in self.ema_model.state_dict().items():
                key = "policy." + key
                if key in checkpoint["state_dict"]:
                    raw[key] = checkpoint["state_dict"][key].clone()
                    checkpoint["state_dict"][key] = value.clone()
            checkpoint["raw_policy_state_dict"] = raw

        def ema_state(self):
            return plain_state(self.ema_model)

    return SeedLikeEMA


def module_class(L):
    class Module(L.LightningModule):
        def __init__(self, ema_state):
            super().__init__()
            self.policy = Policy()
            self.ema_state = ema_state  # the callback's EMA of this rank, by name
            self.outputs = []
            self.emas = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.policy(x), y)

        def on_validation_start(self):
            # Before the first validation forward, in which DDP broadcasts
            # rank 0's buffers of whatever the policy then holds.
            self.emas.append(self.ema_state())

        def validation_step(self, batch, batch_idx):
            self.outputs.append(self.policy(batch[0]).detach().clone())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    return Module


def fit(L, name, out, world):
    from shardema.callbacks import EMACallback
    if name == "ours":
        callback = EMACallback(attribute="policy")

        def ema_state():
            held = callback.ema.ema_tensors()  # this rank's EMA of each tensor
            return {k: v.detach().clone() for k, v in held.items()}
    else:
        callback = seed_like_callback(L)()
        ema_state = callback.ema_state
    module = module_class(L)(ema_state)
    saver = L.callbacks.ModelCheckpoint(dirpath=os.path.join(out, name), filename="{epoch}",
                                        save_top_k=-1, every_n_epochs=1)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_epochs=EPOCHS,
                        accumulate_grad_batches=ACCUMULATE, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[callback, saver],
                        default_root_dir=out, limit_val_batches=1)
    trainer.fit(module, loader(world, 1, BATCHES_PER_EPOCH), loader(world, 2, 1))
    result = {"outputs": module.outputs, "emas": module.emas, "raw": plain_state(module.policy),
              "global_step": int(trainer.global_step)}
    torch.save(result, os.path.join(out, f"{name}.rank{trainer.global_rank}.pt"))


def run(name, rank, world, out):
    import lightning.pytorch as L
    fit(L, name, out, world)


SCENARIOS = {name: functools.partial(run, name) for name in ("ours", "seed")}


if __name__ == "__main__":
    rank_worker.main(SCENARIOS, start_group=False)
