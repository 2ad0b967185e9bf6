"""Real Lightning Trainers with shardema's EMACallback, for test_lightning.py.

The single-device runs are called in the test's process; the 2-process
ones (DDP, ModelParallelStrategy with FSDP2, both on CPU over Gloo) start
this file once per rank, the ranks created outside Lightning as torchrun
would (rank_launch.launch with torchrun=True sets its environment; Lightning
starts the group), so one process can run several Trainers in a row;
rank_worker.py says how and what it reports.

Every run writes, per rank, {name}.rank{r}.pt: the policy's final raw
weights and the callback's EMA (full tensors), the raw weights after each
optimizer step (for the test's float64 reference) and the problems the
module saw inside its steps: a training forward that did not use the raw
weights, a validation forward that did not use the EMA, a test forward
that did not use the final raw weights."""
import os
import weakref

import torch

import rank_worker

EPOCHS = 3
BATCHES_PER_EPOCH = 3  # per rank; with ACCUMULATE 2: a full window and a partial one
ACCUMULATE = 2
STEPS_PER_EPOCH = 2
BATCH = 2


def framework(name):
    if name == "lightning":
        import lightning.pytorch as L
    else:
        import pytorch_lightning as L
    return L


class Policy(torch.nn.Module):
    """Rows that do not split evenly over 2 ranks (out: 3 rows), a constant
    buffer and one counted in every training step (the same on every rank)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 6)
        self.out = torch.nn.Linear(6, 3)
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, 4))
        self.register_buffer("updates", torch.zeros(()))
        self.to(dtype)

    def forward(self, x):
        x = x.to(self.out.weight.dtype) + self.offset
        return self.out(torch.tanh(self.inp(x)))


def full_state(module):
    """The module's state dict as full plain tensors (DTensors gathered:
    collective, every rank calls it at the same point)."""
    out = {}
    for name, value in module.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[name] = value.detach().clone()
    return out


def forward_with(state, x):
    reference = Policy(next(iter(state.values())).dtype)
    reference.load_state_dict(state)
    with torch.no_grad():
        return reference(x)


def _module_classes(L):
    class Module(L.LightningModule):
        def __init__(self, dtype=torch.float32):
            super().__init__()
            self.policy = Policy(dtype)
            self.ema_callback_ref = None
            self.validation_sees_ema = True
            self.problems = []
            self.trace = []
            self.raw_at_train_end = None

        def _check(self, stage, x, out, state, what):
            with torch.no_grad():
                expected = forward_with(state, x)
            if not torch.equal(out.detach(), expected):
                diff = (out.detach().double() - expected.double()).abs().max().item()
                self.problems.append(f"{stage} at step {self.trainer.global_step}: the forward "
                                     f"is not the one of {what} (max difference {diff:.3g})")

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.policy(x)
            self._check("training", x, out, full_state(self.policy), "the raw weights")
            with torch.no_grad():
                self.policy.updates += 1
            return torch.nn.functional.mse_loss(out.float(), y)

        def validation_step(self, batch, batch_idx):
            x, _ = batch
            out = self.policy(x)
            # No state_dict() here: FSDP2 reshards the module in it, which
            # would hide a root left unsharded (holding the EMA) for the
            # next training step.
            raw = self.trace[-1][1]
            if self.validation_sees_ema:
                ema = self.ema_callback_ref().ema.full_state_dict(rank0_only=False)
                as_model = {k: ema[k].to(v.dtype) for k, v in raw.items()}
                self._check("validation", x, out, as_model, "the EMA")
                if torch.equal(forward_with(as_model, x), forward_with(raw, x)):
                    self.problems.append("validation: EMA and raw forwards are equal, "
                                         "the check above proves nothing")
            else:
                self._check("validation", x, out, raw, "the raw weights")

        def test_step(self, batch, batch_idx):
            x, _ = batch
            self._check("test", x, self.policy(x), self.raw_at_train_end, "the final raw weights")

        def on_fit_start(self):
            self.trace = [(int(self.trainer.global_step), full_state(self.policy))]

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.trainer.global_step > self.trace[-1][0]:
                self.trace.append((int(self.trainer.global_step), full_state(self.policy)))

        def on_train_end(self):
            self.raw_at_train_end = full_state(self.policy)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    class ShardedModule(Module):
        """FSDP2 under ModelParallelStrategy: `inp` its own unit, the root
        (`policy`) holds `out`, so both an inner unit (resharded after
        forward) and the root (kept unsharded after forward) are covered."""

        def configure_model(self):
            from torch.distributed.fsdp import FSDPModule, fully_shard
            if isinstance(self.policy, FSDPModule):  # trainer.test sets up again
                return
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.policy.inp, mesh=mesh)
            fully_shard(self.policy, mesh=mesh)

    return Module, ShardedModule


_CLASSES = {}


def module_classes(L):
    if L.__name__ not in _CLASSES:
        _CLASSES[L.__name__] = _module_classes(L)
    return _CLASSES[L.__name__]


def loader(world, seed, batches):
    g = torch.Generator().manual_seed(seed)
    n = batches * BATCH * world
    data = torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g),
                                          torch.randn(n, 3, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def no_swap_callback(base):
    """The same callback without its validation swap: the run every
    EMACallback run must equal bit for bit in raw weights and EMA."""
    class NoSwap(base):
        def on_validation_start(self, trainer, pl_module):
            pass

        def on_validation_end(self, trainer, pl_module):
            pass
    return NoSwap


def fit(L, name, out, *, callback, world=1, strategy="auto", epochs=EPOCHS, dtype=torch.float32,
        sharded=False, checkpoints=False, resume=None, validate=True, test=False,
        validation_sees_ema=True, extra_callbacks=(), pass_one_callback=False):
    """One Trainer.fit (and test); returns and saves this rank's results."""
    Module, ShardedModule = module_classes(L)
    module = (ShardedModule if sharded else Module)(dtype)
    # A weak reference: EMAWeightAveraging deep-copies the module, and the
    # callback (its EMA in pinned memory) is not the module's to copy.
    module.ema_callback_ref = weakref.ref(callback)
    module.validation_sees_ema = validation_sees_ema
    callbacks = [callback, *extra_callbacks]
    assert not pass_one_callback or not (extra_callbacks or checkpoints)
    if checkpoints:
        # Every 2nd epoch: after epoch 0's validation the next training
        # step comes with no save in between (a save reshards FSDP2).
        callbacks.append(L.callbacks.ModelCheckpoint(dirpath=os.path.join(out, name),
                                                     filename="{epoch}", save_top_k=-1,
                                                     every_n_epochs=2))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs,
                        accumulate_grad_batches=ACCUMULATE, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, enable_checkpointing=checkpoints,
                        callbacks=callbacks[0] if pass_one_callback else callbacks,
                        default_root_dir=out, limit_val_batches=1 if validate else 0)
    trainer.fit(module, loader(world, 1, BATCHES_PER_EPOCH), loader(world, 2, 1),
                ckpt_path=resume)
    result = {"raw": full_state(module.policy),
              "ema": callback.ema.full_state_dict(rank0_only=False) if callback.ema else None,
              "trace": module.trace, "global_step": int(trainer.global_step)}
    if test:
        trainer.test(module, loader(world, 3, 1), verbose=False)
    result["problems"] = list(module.problems)
    torch.save(result, os.path.join(out, f"{name}.rank{trainer.global_rank}.pt"))
    return result


def checkpoint_of_epoch(out, name, epoch):
    return os.path.join(out, name, f"epoch={epoch}.ckpt")


def ema_runs(L, out, *, world=1, strategy=lambda: "auto", dtype=torch.float32, sharded=False,
             prefix=""):
    """A: 3 epochs with validation (the EMA swapped in) and a checkpoint at
    the end of epoch 1; C: resumed from it, then tested; D: as A with the
    swap left out and no checkpoints."""
    from shardema.callbacks import EMACallback
    common = dict(world=world, dtype=dtype, sharded=sharded)
    fit(L, prefix + "A", out, callback=EMACallback(attribute="policy"), strategy=strategy(),
        checkpoints=True, **common)
    fit(L, prefix + "C", out, callback=EMACallback(attribute="policy"), strategy=strategy(),
        resume=checkpoint_of_epoch(out, prefix + "A", 1), test=True, **common)
    fit(L, prefix + "D", out, callback=no_swap_callback(EMACallback)(attribute="policy"),
        strategy=strategy(), validation_sees_ema=False, **common)


def parity_with_lightning(L, out, world):
    """Ours and Lightning's EMAWeightAveraging in one DDP run (the same raw
    weights for both): constant decay 0.9, an update every 2nd optimizer
    step, starting at step_idx 1 (global step 2); no validation, so neither
    swaps. Lightning copies its average into the model at train end."""
    from lightning.pytorch.callbacks import EMAWeightAveraging
    import shardema
    from shardema.callbacks import EMACallback
    ours = EMACallback(attribute="policy", update_after_step=1, copy_on_first_update=True,
                       schedule=shardema.DecaySchedule.constant(0.9, update_every=2))
    theirs = EMAWeightAveraging(decay=0.9, update_every_n_steps=2, update_starting_at_step=1,
                                use_buffers=False)
    fit(L, "E", out, callback=ours, world=world, strategy="ddp", epochs=4, validate=False,
        extra_callbacks=[theirs])


def lightning_averaging_on_fsdp2(L, out, world):
    """What EMAWeightAveraging does with a model that ModelParallelStrategy
    shards with FSDP2: the outcome is recorded, the test says what it was."""
    from lightning.pytorch.callbacks import EMAWeightAveraging
    from lightning.pytorch.strategies import ModelParallelStrategy
    from shardema.callbacks import EMACallback
    outcome = {}
    try:
        ours = EMACallback(attribute="policy")
        fit(L, "F", out, callback=ours, world=world, sharded=True, validate=False, epochs=1,
            strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            extra_callbacks=[EMAWeightAveraging(decay=0.9)])
        outcome["error"] = None
    except Exception as error:  # the outcome under test
        outcome["error"] = f"{type(error).__name__}: {error}"
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.save(outcome, os.path.join(out, f"F_outcome.rank{rank}.pt"))


def model_parallel(save_distributed):
    from lightning.pytorch.strategies import ModelParallelStrategy
    return lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                         save_distributed_checkpoint=save_distributed)


def ddp(rank, world, out):
    L = framework("lightning")
    ema_runs(L, out, world=world, strategy=lambda: "ddp")
    parity_with_lightning(L, out, world)


def model_parallel_runs(rank, world, out):
    # bf16 weights: the checkpoint must keep the float32 EMA (sharded).
    L = framework("lightning")
    ema_runs(L, out, world=world, strategy=model_parallel(True), dtype=torch.bfloat16,
             sharded=True)
    lightning_averaging_on_fsdp2(L, out, world)


def model_parallel_full_save(rank, world, out):
    # save_distributed_checkpoint=False: rank 0 writes one full checkpoint.
    ema_runs(framework("lightning"), out, world=world, strategy=model_parallel(False),
             sharded=True)


SCENARIOS = {"ddp": ddp, "model_parallel": model_parallel_runs,
             "model_parallel_full_save": model_parallel_full_save}


if __name__ == "__main__":
    rank_worker.main(SCENARIOS, start_group=False)
