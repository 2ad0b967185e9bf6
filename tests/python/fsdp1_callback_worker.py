"""One rank of test_fsdp1_callbacks.py: EMACallback and DDPPostHocEMACallback
over a LightningModule that torch's real FSDP1 (FullyShardedDataParallel)
wraps as Lightning's FSDPStrategy does (the root unit around the
LightningModule, `policy` a nested unit), on CPU/Gloo.

Lightning refuses FSDPStrategy without a GPU, so a small loop plays the
Trainer: Lightning's own forward redirection runs training_step and
validation_step through the FSDP1 root, the full-state-dict configuration
of Lightning's context (less the CPU offload, see lightning_checkpoint)
builds the checkpoint's state_dict and Lightning's own loader puts it
back, and the hooks come in the Trainer's order (on_fit_start; per batch
backward, on_before_optimizer_step and the step at the end of each
accumulation window, on_train_batch_end; validation between
on_validation_start and on_validation_end; on_save_checkpoint; on resume
on_fit_start, then the model load, then on_load_checkpoint, as
FSDPStrategy restores after setup). The stand-in trainer carries what the
callbacks read, its strategy.model the FSDP1 root.

Started by rank_launch.launch; rank_worker.py says how and what it reports."""
import functools
import os
import shutil
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, \
    StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import lightning.pytorch as pl
from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
from lightning.fabric.strategies.model_parallel import _load_raw_module_state
from lightning.pytorch.strategies.strategy import _ForwardRedirection

import shardema
from shardema.callbacks import DDPPostHocEMACallback, EMACallback
from fsdp1_worker import Float64Ema, close, full_tensors  # noqa: E402
import rank_worker

ACCUMULATE = 2
BATCHES = 8  # one epoch: 4 optimizer steps
SIGMA_RELS = (0.05, 0.1)
REDIRECT = _ForwardRedirection()


class Module(pl.LightningModule):
    """`policy` (7 -> 5 -> 3, with a BatchNorm unless batch_norm=False) and
    `head` (3 -> 2, left out when the callbacks average `policy`): sizes
    that split unevenly over 2 ranks. validation_step asserts that the
    forward computes what the batch's reference output says (the test
    computes it from the EMA it expects)."""

    def __init__(self, batch_norm=True):
        super().__init__()
        torch.manual_seed(0)
        middle = nn.BatchNorm1d(5) if batch_norm else nn.Tanh()
        self.policy = nn.Sequential(nn.Linear(7, 5), middle, nn.Linear(5, 3))
        self.head = nn.Linear(3, 2)
        self.validated = 0

    def forward(self, x):
        return self.head(self.policy(x))

    def training_step(self, batch, batch_idx):
        return self(batch).square().mean()

    def validation_step(self, batch, batch_idx):
        x, expected = batch
        out = self(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"validation did not compute with the EMA: {m}")
        self.validated += 1
        return out


def wrapped(use_orig_params, batch_norm=True):
    """(FSDP1 root, the LightningModule inside it), as FSDPStrategy builds
    them with auto_wrap_policy={nn.Sequential}."""
    module = Module(batch_norm)
    root = FSDP(module, use_orig_params=use_orig_params, device_id=torch.device("cpu"),
                auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    assert root.module is module
    return root, module


def stand_in_trainer(root, out):
    return SimpleNamespace(global_step=0, accumulate_grad_batches=ACCUMULATE,
                           is_last_batch=False, strategy=SimpleNamespace(model=root),
                           ckpt_path=None, default_root_dir=out)


def batch_of(index, rank):
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(1000 * rank + index))


def plain_module(weights, batch_norm=True):
    """Module without FSDP1 holding `weights` (full tensors by name), in
    eval mode: what a forward with those weights computes."""
    module = Module(batch_norm)
    module.load_state_dict({n: t.to(torch.float32) if t.is_floating_point() else t
                            for n, t in weights.items()})
    return module.eval()


def train(root, module, callback, trainer, optimizer, batches, after_step=None):
    """Lightning's automatic optimization over `batches` (indices into the
    epoch): the step at the end of each window of ACCUMULATE batches."""
    for batch_idx in batches:
        x = batch_of(batch_idx, dist.get_rank())
        trainer.is_last_batch = batch_idx == BATCHES - 1
        loss = REDIRECT(root, module, "training_step", x, batch_idx)
        (loss / ACCUMULATE).backward()
        stepped = (batch_idx + 1) % ACCUMULATE == 0 or trainer.is_last_batch
        if stepped:
            callback.on_before_optimizer_step(trainer, module, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            trainer.global_step += 1
        callback.on_train_batch_end(trainer, module, loss, x, batch_idx)
        if stepped and after_step is not None:
            after_step(trainer.global_step)
    return loss


def validate(root, module, callback, trainer, expected_weights, batch_norm=True):
    """The validation loop: eval mode, the callback's swap around
    validation_step, whose assertion checks the forward against a plain
    module holding `expected_weights`."""
    root.eval()
    x = batch_of(99, dist.get_rank())
    with torch.no_grad():
        expected = plain_module(expected_weights, batch_norm)(x)
    before = module.validated
    callback.on_validation_start(trainer, module)
    with torch.no_grad():
        REDIRECT(root, module, "validation_step", (x, expected), 0)
    callback.on_validation_end(trainer, module)
    assert module.validated == before + 1, "validation_step did not run"
    root.train()


def lightning_checkpoint(root, trainer):
    """What FSDPStrategy(state_dict_type="full") hands on_save_checkpoint:
    the LightningModule's full state dict on rank 0 (Lightning's keys), an
    empty one on the other ranks. Lightning's context
    (_get_full_state_dict_context) is FullStateDictConfig(offload_to_cpu=True,
    rank0_only=True); on a CPU model torch 2.11's offload to the CPU
    crashes rank 0 (a segmentation fault in the full state dict's clone of
    each parameter, the callbacks not involved), and there is nothing to
    offload, so the same config without it."""
    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with FSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT, config):
        state = root.state_dict()
    return {"state_dict": state, "global_step": trainer.global_step}


def lightning_load(path, root):
    """FSDPStrategy's load of a full checkpoint on every rank: the
    state_dict into the model, the rest for the hooks."""
    checkpoint = torch.load(path, weights_only=False)
    _load_raw_module_state(checkpoint.pop("state_dict"), module=root,
                           world_size=dist.get_world_size())
    return checkpoint


def only(tensors, prefix):
    return {n: t for n, t in tensors.items() if n.startswith(prefix)}


def assert_equal(got, want, what):
    assert sorted(got) == sorted(want), f"{what}: names {sorted(got)} != {sorted(want)}"
    for name, value in want.items():
        assert torch.equal(got[name].to(value.dtype), value), f"{what}: '{name}' differs"


def ema_callback(use_orig_params, attribute, rank, world, out):
    """EMACallback(attribute=...) under FSDP1: the EMA after every optimizer
    step equals a float64 EMA of the full parameters (rank 0's buffers, as
    FSDP1's full state dict), validation computes with it and training goes
    on with the raw weights, and a checkpoint (Lightning's keys, the EMA in
    the state_dict, the raw weights beside it) resumes bitwise."""
    prefix = f"{attribute}." if attribute else ""
    tag = f"{'orig' if use_orig_params else 'flat'}_{attribute or 'all'}"
    root, module = wrapped(use_orig_params)
    trainer = stand_in_trainer(root, out)
    callback = EMACallback(attribute=attribute)
    callback.on_fit_start(trainer, module)
    assert callback.ema is not None and callback.ema.layout == "fsdp1", \
        f"the EMA is not built over the FSDP1 root: layout {getattr(callback.ema, 'layout', None)}"
    reference = Float64Ema(("policy.1.",))
    optimizer = torch.optim.SGD(root.parameters(), lr=0.3)

    def check(step):
        reference.update(step, only(full_tensors(root), prefix))
        callback.ema.wait()
        full = callback.ema.full_state_dict(rank0_only=False)
        assert sorted(full) == sorted(reference.ema), \
            f"step {step}: EMA names {sorted(full)}, expected {sorted(reference.ema)}"
        for name, want in reference.ema.items():
            close(full[name], want, f"step {step}: EMA '{name}'")

    train(root, module, callback, trainer, optimizer, range(0, 4), check)
    assert trainer.global_step == 2
    # Validation sees the EMA where the callback averages, the raw weights
    # elsewhere (head, with attribute="policy"); afterwards the raw weights
    # are back, in the shards and in what the next forward gathers.
    raw_here = full_tensors(root, rank0_buffers=False)
    validate(root, module, callback, trainer, {**raw_here, **reference.ema})
    assert_equal(full_tensors(root, rank0_buffers=False), raw_here, "after validation")
    x = batch_of(4, rank)
    with torch.no_grad():
        first_after = plain_module(raw_here).train()(x).square().mean()
    # The checkpoint of step 2, as FSDPStrategy saves it: rank 0 writes it.
    saved_ema = callback.ema.full_state_dict(rank0_only=False)
    saved_raw = full_tensors(root)
    checkpoint = lightning_checkpoint(root, trainer)
    callback.on_save_checkpoint(trainer, module, checkpoint)
    path = os.path.join(out, f"{tag}.ckpt")
    if rank == 0:
        state = checkpoint["state_dict"]
        for name, value in saved_ema.items():
            if name in state:  # the non-persistent buffers are in no state dict
                assert torch.equal(state[name], value.to(state[name].dtype)), \
                    f"checkpoint: state_dict['{name}'] is not the EMA"
        raw = checkpoint[EMACallback.RAW_STATE_KEY]
        expected_keys = sorted(n for n in state if n.startswith(prefix))
        assert sorted(raw) == expected_keys, f"raw keys {sorted(raw)} != {expected_keys}"
        for name, value in raw.items():
            assert torch.equal(value, saved_raw[name].to(value.dtype)), \
                f"checkpoint: raw '{name}' is not the raw weight"
        torch.save(checkpoint, path)
    dist.barrier()
    # The first training forward after validation runs on the raw weights
    # (FSDP1 reuses the root's gathered copy of a forward without backward).
    loss = train(root, module, callback, trainer, optimizer, range(4, 5))
    torch.testing.assert_close(loss.detach(), first_after, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"first training step after validation: {m}")
    train(root, module, callback, trainer, optimizer, range(5, BATCHES), check)
    final_ema = callback.ema.full_state_dict(rank0_only=False)
    final_raw = full_tensors(root)

    # Resume from the checkpoint, as FSDPStrategy does: a new model and
    # callback, on_fit_start, the model load, on_load_checkpoint.
    root2, module2 = wrapped(use_orig_params)
    trainer2 = stand_in_trainer(root2, out)
    trainer2.global_step = 2
    resumed = EMACallback(attribute=attribute)
    resumed.on_fit_start(trainer2, module2)
    checkpoint = lightning_load(path, root2)
    resumed.on_load_checkpoint(trainer2, module2, checkpoint)
    assert_equal(only(full_tensors(root2), prefix), only(saved_raw, prefix),
                 "raw weights after resume")
    assert_equal(resumed.ema.full_state_dict(rank0_only=False), saved_ema, "EMA after resume")
    optimizer2 = torch.optim.SGD(root2.parameters(), lr=0.3)
    train(root2, module2, resumed, trainer2, optimizer2, range(4, BATCHES))
    assert_equal(resumed.ema.full_state_dict(rank0_only=False), final_ema,
                 "EMA of the resumed run at the end")
    assert_equal(only(full_tensors(root2), prefix), only(final_raw, prefix),
                 "raw weights of the resumed run at the end")


def posthoc_callback(use_orig_params, rank, world, out):
    """DDPPostHocEMACallback(layout="sharded", attribute="policy") under
    FSDP1, beside a peer run in this process: shardema.PostHocEMA over a
    plain copy of the policy that holds the full parameters after every
    step. Validation computes with the callback's synthesized default sigma,
    which equals the peer's; a checkpoint between snapshot steps resumes in
    a copy of the snapshot folder and ends where the run does; the weights
    synthesized at the end equal the peer's."""
    tag = "orig" if use_orig_params else "flat"
    # The peer's post-hoc EMA is this rank's alone.
    own = [dist.new_group([r]) for r in range(world)][rank]
    root, module = wrapped(use_orig_params, batch_norm=False)
    trainer = stand_in_trainer(root, out)
    folder = os.path.join(out, f"posthoc_{tag}")

    def callback_in(snapshots):
        return DDPPostHocEMACallback(sigma_rels=SIGMA_RELS, checkpoint_every=2,
                                     checkpoint_folder=snapshots, layout="sharded",
                                     attribute="policy")
    callback = callback_in(folder)
    callback.on_fit_start(trainer, module)
    peer_model = Module(batch_norm=False)
    peer = shardema.PostHocEMA(peer_model.policy, sigma_rels=SIGMA_RELS,
                               checkpoint_every_num_steps=2, step_size_correction=True,
                               checkpoint_folder=os.path.join(out, f"peer_{tag}_{rank}"),
                               process_group=own)

    def peer_step(step):
        weights = only(full_tensors(root), "policy.")
        peer.fence()
        with torch.no_grad():
            for name, tensor in peer_model.policy.state_dict(keep_vars=True).items():
                tensor.copy_(weights[f"policy.{name}"])
        peer.update()
        assert callback.calls == step == peer.step, (callback.calls, step, peer.step)

    optimizer = torch.optim.SGD(root.parameters(), lr=0.3)
    train(root, module, callback, trainer, optimizer, range(0, 4), peer_step)
    peer.wait()
    synthesized = {f"policy.{n}": t for n, t in peer.synthesize(SIGMA_RELS[0]).items()}
    raw_here = full_tensors(root, rank0_buffers=False)
    validate(root, module, callback, trainer, {**raw_here, **synthesized}, batch_norm=False)
    assert_equal(full_tensors(root, rank0_buffers=False), raw_here, "after validation")
    train(root, module, callback, trainer, optimizer, range(4, 6), peer_step)
    # A checkpoint at step 3, between snapshot steps, and a copy of the
    # snapshot folder as it is then (where the resumed run goes on).
    checkpoint = {}
    callback.on_save_checkpoint(trainer, module, checkpoint)
    saved_raw = {n: t.float() for n, t in full_tensors(root).items()}
    copy = os.path.join(out, f"posthoc_{tag}_resumed")
    dist.barrier()
    if rank == 0:
        shutil.copytree(folder, copy)
    dist.barrier()
    train(root, module, callback, trainer, optimizer, range(6, BATCHES), peer_step)
    callback.on_train_end(trainer, module)
    peer.wait()
    if rank == 0:
        final = shardema.read_tensor_file(callback.output_path)["tensors"]
        want = peer.synthesize(SIGMA_RELS[0])
        assert sorted(final) == sorted(want), f"synthesized names {sorted(final)}"
        for name, value in want.items():
            close(final[name], value.double(), f"synthesized '{name}' at the end")

    root2, module2 = wrapped(use_orig_params, batch_norm=False)
    _load_raw_module_state(saved_raw, module=root2, world_size=world)
    trainer2 = stand_in_trainer(root2, out)
    trainer2.global_step = 3
    resumed = callback_in(copy)
    resumed.on_fit_start(trainer2, module2)
    resumed.on_load_checkpoint(trainer2, module2, checkpoint)
    optimizer2 = torch.optim.SGD(root2.parameters(), lr=0.3)
    train(root2, module2, resumed, trainer2, optimizer2, range(6, BATCHES))
    resumed.on_train_end(trainer2, module2)
    assert resumed.calls == 4, resumed.calls
    if rank == 0:
        again = shardema.read_tensor_file(resumed.output_path)["tensors"]
        assert_equal(again, final, "synthesized weights of the resumed run")


def refusals(rank, world, out):
    """What the callbacks cannot do under FSDP1 is an error naming it: a
    distributed checkpoint (FSDPStrategy(state_dict_type="sharded"), whose
    entries FSDP1 re-chunks by rows while the EMA keeps ranges of flat
    shards), the post-hoc callback's rank-0 layout and buffers (whole and
    unequal on the ranks under FSDP1), an attribute that is not a
    submodule."""
    root, module = wrapped(True)
    trainer = stand_in_trainer(root, out)
    callback = EMACallback(attribute="policy")
    callback.on_fit_start(trainer, module)
    with _get_sharded_state_dict_context(root):
        state = root.state_dict()
    cases = [
        (lambda: callback.on_save_checkpoint(trainer, module, {"state_dict": state}),
         "state_dict_type='sharded'"),
        (lambda: DDPPostHocEMACallback(layout="rank0", checkpoint_folder=os.path.join(
            out, "refused")).on_fit_start(trainer, module), "layout='sharded'"),
        # FSDP1 leaves the BatchNorm's buffers whole and unequal on the ranks
        (lambda: DDPPostHocEMACallback(layout="sharded", checkpoint_folder=os.path.join(
            out, "refused")).on_fit_start(trainer, module),
         "'policy.1.running_mean' is not in an FSDP1 FlatParameter"),
        (lambda: EMACallback(attribute="nothing").on_fit_start(trainer, module),
         "attribute 'nothing'"),
    ]
    for call, says in cases:
        try:
            call()
        except ValueError as error:
            assert says in str(error), f"the error says: {error}"
        else:
            raise AssertionError(f"no ValueError saying {says!r}")


SCENARIOS = {
    "ema_orig_policy": functools.partial(ema_callback, True, "policy"),
    "ema_flat_all": functools.partial(ema_callback, False, None),
    "posthoc_orig": functools.partial(posthoc_callback, True),
    "posthoc_flat": functools.partial(posthoc_callback, False),
    "refusals": refusals,
}


if __name__ == "__main__":
    rank_worker.main(SCENARIOS)
