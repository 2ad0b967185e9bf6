"""One rank of test_trainable_only.py's FSDP2 case: hand-frozen layers
under torch's real fully_shard on CPU/Gloo, EMA(trainable_only=True),
checked after every update against a float64 EMA of the trainable
parameters' full_tensor() recomputed here; the swap, a refused unfreeze,
a checkpoint round trip and the export with the model's own frozen
weights, one file and split (huggingface_hub's split of the combined state
dict), loaded strict into a plain model.

Started by rank_launch.launch; rank_worker.py says how and what it reports."""
import os

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import shardema
import rank_worker

DECAY = 0.9


def full(t):
    with torch.no_grad():
        return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).clone()


def model_of():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 7), nn.Linear(7, 5), nn.Linear(5, 4), nn.BatchNorm1d(4))


def hand_frozen_fsdp2(rank, world, out):
    mesh = init_device_mesh("cpu", (world,))
    model = model_of()
    for part in (model[0], model[1], model[2]):
        fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY),
                       trainable_only=True, timeout=60)
    kept = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert kept == ["1.bias", "1.weight", "3.bias", "3.weight"], kept
    local_elements = sum(p.to_local().numel() for n, p in model.named_parameters()
                         if n in kept)
    assert sum(t.numel() for t in ema.local_ema().values()) == local_elements
    reference = {}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3)
    g = torch.Generator().manual_seed(5)
    for step in range(1, 5):
        model(torch.randn(4, 3, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        params = dict(model.named_parameters())
        for name in kept:
            w = full(params[name]).double()
            reference[name] = w if step == 1 else DECAY * reference[name] + (1 - DECAY) * w
        got = ema.full_state_dict(rank0_only=False)
        assert sorted(got) == kept, sorted(got)
        for name in kept:
            torch.testing.assert_close(got[name].double(), reference[name], atol=1e-6,
                                       rtol=1e-6, msg=f"step {step}: '{name}'")
    raw = {n: full(t) for n, t in model.state_dict().items()}
    with ema.swap(model):
        for name, t in model.state_dict().items():
            want = reference[name].float() if name in reference else raw[name]
            torch.testing.assert_close(full(t), want.to(t.dtype), atol=1e-6, rtol=1e-6,
                                       msg=f"swapped '{name}'")
    for name, t in model.state_dict().items():
        assert torch.equal(full(t), raw[name]), f"after the swap: '{name}'"
    # A frozen layer unfrozen: refused by name on every rank, then frozen again.
    model[0].weight.requires_grad_(True)
    try:
        ema.update()
    except ValueError as error:
        assert "'0.weight'" in str(error) and "trainable_only" in str(error), str(error)
    else:
        raise AssertionError("an unfrozen left-out parameter was not refused")
    model[0].weight.requires_grad_(False)
    folder = os.path.join(out, "trainable_ckpt")
    ema.save_checkpoint(folder)
    again = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY),
                         trainable_only=True, timeout=60)
    again.load_checkpoint(folder)
    for name, value in again.full_state_dict(rank0_only=False).items():
        assert torch.equal(value, ema.full_state_dict(rank0_only=False)[name]), name
    path = os.path.join(out, "trainable_export.safetensors")
    ema.export_weights(path, include_untracked=True)
    torch.distributed.barrier()
    if rank == 0:
        from safetensors.torch import load_model
        plain = model_of()
        torch.manual_seed(9)
        for p in plain.parameters():
            p.data.normal_()
        load_model(plain, path, strict=True)
        for name, t in plain.state_dict().items():
            want = reference[name].float() if name in reference else raw[name]
            torch.testing.assert_close(t, want.to(t.dtype), atol=1e-6, rtol=1e-6,
                                       msg=f"exported '{name}'")
    # Split: rank 0 writes the frozen layers' full_tensor() among the rows
    # both ranks send, in state_dict() order, as huggingface_hub splits the
    # combined state dict.
    folder = os.path.join(out, "trainable_split")
    ema.export_weights(folder, max_shard_size=64, include_untracked=True)
    ema_full = ema.full_state_dict(rank0_only=False)
    torch.distributed.barrier()
    if rank == 0:
        import json
        from huggingface_hub import load_torch_model, split_torch_state_dict_into_shards
        combined = {n: (ema_full[n] if n in ema_full else raw[n]).clone() for n in raw}
        split = split_torch_state_dict_into_shards(combined, max_shard_size=64)
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            index = json.load(f)
        assert len(split.filename_to_tensors) > 3, split.filename_to_tensors
        assert index["weight_map"] == split.tensor_to_filename, index["weight_map"]
        assert index["metadata"] == split.metadata, index["metadata"]
        plain = model_of()
        for p in plain.parameters():
            p.data.normal_()
        result = load_torch_model(plain, folder, strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        for name, t in plain.state_dict().items():
            assert torch.equal(t, combined[name]), f"split '{name}'"


def posthoc_sharded_fsdp2(rank, world, out):
    """PostHocEMA(layout="sharded", trainable_only=True) on the same
    hand-frozen FSDP2 model beside one of everything: the syntheses hold
    the trainable parameters only, each equal to the everything run's."""
    mesh = init_device_mesh("cpu", (world,))
    model = model_of()
    for part in (model[0], model[1], model[2]):
        fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    kept = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    runs = {}
    for name, only in (("trainable", True), ("everything", False)):
        runs[name] = shardema.PostHocEMA(
            model, sigma_rels=(0.05, 0.1), checkpoint_every_num_steps=2,
            checkpoint_folder=os.path.join(out, f"posthoc_{name}"), layout="sharded",
            trainable_only=only)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3)
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        model(torch.randn(4, 3, generator=g)).square().mean().backward()
        for run in runs.values():
            run.fence()
        optimizer.step()
        optimizer.zero_grad()
        for run in runs.values():
            run.update()
    for run in runs.values():
        run.wait()
    torch.distributed.barrier()
    if rank == 0:
        only = runs["trainable"].synthesize(0.07)
        everything = runs["everything"].synthesize(0.07)
        assert sorted(only) == kept, sorted(only)
        for name in kept:
            assert torch.equal(only[name], everything[name]), name
    torch.distributed.barrier()
    model[2].bias.requires_grad_(True)
    try:
        runs["trainable"].update()
    except ValueError as error:
        assert "2.bias" in str(error) and "trainable_only" in str(error), str(error)
    else:
        raise AssertionError("an unfrozen left-out parameter was not refused")


SCENARIOS = {"hand_frozen_fsdp2": hand_frozen_fsdp2, "posthoc_sharded_fsdp2": posthoc_sharded_fsdp2}


if __name__ == "__main__":
    rank_worker.main(SCENARIOS)
