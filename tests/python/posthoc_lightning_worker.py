"""Real Lightning Trainers with shardema's DDPPostHocEMACallback, for
test_lightning_posthoc.py.

The single-device runs are called in the test's process; the 2-process
ones (DDPStrategy with layout "rank0", ModelParallelStrategy with FSDP2 and
layout "sharded", both on CPU over Gloo) start this file once per rank
through rank_launch.launch with torchrun's environment (Lightning starts
the group); rank_worker.py says how and what it reports.

Each scenario runs, on every rank:
  A: 4 epochs (8 optimizer steps, accumulate_grad_batches 2), snapshots
     every 3 steps, validation each epoch (the synthesized EMA swapped in),
     checkpoints after epochs 1 and 3. At the start of epoch 2 (after the
     checkpoint of step 4 was written) it copies its snapshot folder: the
     folder as a run that crashed right after that checkpoint left it.
  C: resumed from A's checkpoint of step 4 (between the snapshots of steps
     3 and 6) in that copy, to the end of epoch 3.
  B: A's first 2 epochs as a finished run: its checkpoint of step 4 (the
     last one), then the end of training's final snapshot at step 4, off
     the every-3 grid.
  E: B extended to 4 epochs: resumed from B's last checkpoint with
     max_epochs 4, in B's own snapshot folder (what a user does to train a
     finished run longer).
Scenarios two_callbacks_*: R, A's Trainer (DDP, layout "rank0"), then T,
the same with EMACallback before or after the post-hoc callback.
Per rank it writes {name}.rank{r}.pt: the policy's raw weights after each
optimizer step (full tensors), the final raw weights, what the policy held
in each validation, and where the callback put its files."""
import functools
import os
import shutil
import sys

import rank_worker

EPOCHS = 4
CHECKPOINT_EVERY = 3
SIGMA_RELS = (0.05, 0.1)


def _modules(L):
    import torch

    from lightning_worker import Policy, forward_with, full_state

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.policy = Policy()
            self.trace = []
            self.validation_seen = []
            self.problems = []

        def _check(self, stage, x, out, state):
            """The forward ran on `state` (full tensors): FSDP2 all-gathers
            before a forward, so what the shards hold may not be what ran."""
            if not torch.equal(out.detach(), forward_with(state, x)):
                self.problems.append(f"{stage} at step {self.trainer.global_step}: the forward "
                                     "did not run on the weights the policy holds")

        def training_step(self, batch, batch_idx):
            x, y = batch
            with torch.no_grad():
                self.policy.updates += 1  # a buffer the profiles average too
            out = self.policy(x)
            # The raw weights (validation swapped the EMA out again).
            self._check("training", x, out, full_state(self.policy))
            return torch.nn.functional.mse_loss(out, y)

        def validation_step(self, batch, batch_idx):
            # What the policy holds during validation, gathered (every rank
            # runs this step, so full_tensor's collective is matched).
            seen = {}
            for name, value in [*self.policy.named_parameters(), *self.policy.named_buffers()]:
                seen[name] = (value.full_tensor() if hasattr(value, "full_tensor")
                              else value).detach().clone()
            self.validation_seen.append((int(self.trainer.global_step), seen))
            self._check("validation", batch[0], self.policy(batch[0]), seen)

        def on_fit_start(self):
            self.trace = [(int(self.trainer.global_step), full_state(self.policy))]

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.trainer.global_step > self.trace[-1][0]:
                self.trace.append((int(self.trainer.global_step), full_state(self.policy)))

        def configure_optimizers(self):
            # Momentum: a resume that lost the optimizer state would differ.
            return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    class ShardedModule(Module):
        """`inp` its own fully_shard unit, the root (`policy`) holding
        `out` (3 rows over 2 ranks: uneven) and the buffers."""

        def configure_model(self):
            from torch.distributed.fsdp import FSDPModule, fully_shard
            if isinstance(self.policy, FSDPModule):
                return
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.policy.inp, mesh=mesh)
            fully_shard(self.policy, mesh=mesh)

    class TensorParallelModule(Module):
        """`inp` column-parallel (Shard(0)), `out` row-parallel (Shard(1)
        weight, Replicate() bias), over ModelParallelStrategy's
        tensor-parallel mesh; the buffers plain. The row-parallel sum runs
        in pieces, so the forward matches the full one to rounding only."""

        def configure_model(self):
            from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                           parallelize_module)
            if hasattr(self.policy.inp.weight, "placements"):
                return
            parallelize_module(self.policy, self.device_mesh["tensor_parallel"],
                               {"inp": ColwiseParallel(), "out": RowwiseParallel()})

        def _check(self, stage, x, out, state):
            if not torch.allclose(out.detach(), forward_with(state, x), rtol=1e-5, atol=1e-6):
                self.problems.append(f"{stage} at step {self.trainer.global_step}")

    Module.TensorParallel = TensorParallelModule
    return Module, ShardedModule


def _copy_folder_at_epoch(L, callback, destination, epoch):
    """A callback that copies this rank's part of `callback`'s snapshot
    folder (its files and resume states) to `destination` when `epoch`
    starts."""
    class CopyFolder(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch != epoch:
                return
            source = callback._engine.snapshot_folder
            if not os.path.isdir(source):
                return  # a rank-0 layout's other ranks keep nothing
            relative = os.path.relpath(source, callback.checkpoint_folder)
            shutil.copytree(source, os.path.join(destination, relative), dirs_exist_ok=True)
    return CopyFolder()


def snapshot_folder(out, name):
    return os.path.join(out, name, "posthoc")


def fit(L, name, out, *, world, strategy, layout, sharded, resume=None, crash_copy=None,
        epochs=EPOCHS, folder_of=None, ema_callback=None):
    import torch

    from lightning_worker import full_state, loader
    from shardema.callbacks import DDPPostHocEMACallback

    Module, ShardedModule = _modules(L)
    module = (Module.TensorParallel if sharded == "tp" else ShardedModule if sharded
              else Module)()
    callback = DDPPostHocEMACallback(
        sigma_rels=SIGMA_RELS, checkpoint_every=CHECKPOINT_EVERY,
        checkpoint_folder=snapshot_folder(out, folder_of or name), layout=layout,
        attribute="policy")
    callbacks = [callback, L.callbacks.ModelCheckpoint(
        dirpath=os.path.join(out, name), filename="{epoch}", save_top_k=-1, every_n_epochs=2)]
    if crash_copy is not None:
        callbacks.append(_copy_folder_at_epoch(L, callback, crash_copy, epoch=2))
    if ema_callback is not None:  # "before" or "after" the post-hoc callback
        from shardema.callbacks import EMACallback
        # One validation sees one EMA: the post-hoc callback's, as alone.
        callbacks.insert(0 if ema_callback == "before" else 1,
                         EMACallback(attribute="policy", validate_with_ema=False))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs,
                        accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=callbacks, default_root_dir=out, limit_val_batches=1)
    trainer.fit(module, loader(world, 1, 3), loader(world, 2, 1), ckpt_path=resume)
    result = {"raw": full_state(module.policy), "trace": module.trace,
              "validation_seen": module.validation_seen, "problems": module.problems,
              "global_step": int(trainer.global_step),
              "calls": callback.calls, "output_path": callback.output_path,
              "folder": callback.checkpoint_folder}
    torch.save(result, os.path.join(out, f"{name}.rank{trainer.global_rank}.pt"))
    return result


def checkpoint_of_epoch(out, name, epoch):
    return os.path.join(out, name, f"epoch={epoch}.ckpt")


def posthoc_runs(L, out, *, world=1, strategy=lambda: "auto", layout="rank0", sharded=False,
                 resume_mid_run=True):
    common = dict(world=world, layout=layout, sharded=sharded)
    crashed = snapshot_folder(out, "C")
    fit(L, "A", out, strategy=strategy(), crash_copy=crashed, **common)
    if resume_mid_run:
        fit(L, "C", out, strategy=strategy(), resume=checkpoint_of_epoch(out, "A", 1), **common)
    fit(L, "B", out, strategy=strategy(), epochs=2, **common)
    fit(L, "E", out, strategy=strategy(), resume=checkpoint_of_epoch(out, "B", 1), folder_of="B",
        **common)


def run(scenario, rank, world, out):
    import lightning.pytorch as L
    if scenario == "ddp":
        posthoc_runs(L, out, world=world, strategy=lambda: "ddp", layout="rank0")
    elif scenario == "ddp_sharded":
        posthoc_runs(L, out, world=world, strategy=lambda: "ddp", layout="sharded",
                     resume_mid_run=False)
    elif scenario in ("two_callbacks_ema_first", "two_callbacks_posthoc_first"):
        # The post-hoc callback alone, then beside EMACallback: validation
        # at steps 2 and 4 falls between snapshot steps (3, 6).
        common = dict(world=world, strategy="ddp", layout="rank0", sharded=False)
        fit(L, "R", out, **common)
        fit(L, "T", out, ema_callback="before" if "ema_first" in scenario else "after", **common)
    elif scenario == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy
        posthoc_runs(L, out, world=world, layout="sharded", sharded=True,
                     strategy=lambda: ModelParallelStrategy(data_parallel_size=world,
                                                            tensor_parallel_size=1))
    elif scenario == "model_parallel_tp":
        # Tensor parallelism: every rank sees the same batches.
        from lightning.pytorch.strategies import ModelParallelStrategy
        fit(L, "A", out, world=world, layout="sharded", sharded="tp",
            strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world))
    elif scenario == "tp_resume_exit":
        # A fit and its resume with both callbacks, then the interpreter's
        # own exit (rank_worker's os._exit skipped): the EMAs, their
        # threads and the Gloo group (never destroyed) end in its order.
        from lightning.pytorch.strategies import ModelParallelStrategy
        common = dict(world=world, layout="sharded", sharded="tp", ema_callback="before")
        tp = dict(data_parallel_size=1, tensor_parallel_size=world)
        fit(L, "A", out, strategy=ModelParallelStrategy(**tp), **common)
        fit(L, "C", out, strategy=ModelParallelStrategy(**tp), folder_of="A",
            resume=checkpoint_of_epoch(out, "A", 1), **common)
    else:
        raise ValueError(scenario)


SCENARIOS = {name: functools.partial(run, name)
             for name in ("ddp", "ddp_sharded", "two_callbacks_ema_first",
                          "two_callbacks_posthoc_first", "model_parallel",
                          "model_parallel_tp", "tp_resume_exit")}


if __name__ == "__main__":
    rank_worker.main(SCENARIOS, start_group=False,
                     exit_normally=sys.argv[1] == "tp_resume_exit")
