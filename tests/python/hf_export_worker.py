"""One rank of test_hf_export.py's W = 2 runs: a tiny GPT-2 (tied embedding
and head) under FSDP2 (fully_shard on every block and the root), DDP and
FSDP1, trained with shardema.EMA, then export_weights(folder,
max_shard_size=) split into several files. Every rank checks the folder
rank 0 wrote: huggingface_hub's split of the same tensors, each tensor
against a float64 EMA of full_tensor() recomputed here (FSDP2), plain names
(no "module.", no "_fsdp_wrapped_module."), a strict load_torch_model into
a plain GPT-2 and transformers' from_pretrained with nothing missing or
unexpected. Started by rank_launch.launch; rank_worker.py says how and
what it reports."""
import json
import os

import torch
import torch.distributed as dist
import transformers
from huggingface_hub import load_torch_model, split_torch_state_dict_into_shards
from safetensors import safe_open
from torch.distributed.tensor import DTensor

import rank_worker
import shardema

DECAY = 0.5
STEPS = 3
VOCAB = 256
LIMIT = "40KB"  # wte (64 KiB) alone; the blocks' tensors across several files


def config():
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2,
                                   n_head=4, bos_token_id=0, eos_token_id=0)


def plain_model():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config())


def ids(step, rank):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(step * 7 + rank))


def full_values(model):
    """state_dict() with each DTensor gathered, float64."""
    out = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")] = \
            value.detach().double()
    return out


def train(model, ema, rank, reference=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(1, STEPS + 1):
        batch = ids(step, rank)
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        if reference is not None:
            for name, value in full_values(model).items():
                reference[name] = value if name not in reference else \
                    DECAY * reference[name] + (1 - DECAY) * value
    ema.wait()


def export_and_check(ema, out, scenario, reference=None):
    """The split export rank 0 writes, checked on every rank."""
    folder = os.path.join(out, scenario)
    ema.export_weights(folder, max_shard_size=LIMIT)
    full = ema.full_state_dict(rank0_only=False)
    dist.barrier()
    expected = plain_model().state_dict()
    assert sorted(full) == sorted(expected), f"{sorted(full)} != plain {sorted(expected)}"
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    split = split_torch_state_dict_into_shards(full, max_shard_size=LIMIT)
    assert len(split.filename_to_tensors) > 2, split.filename_to_tensors
    assert index["weight_map"] == split.tensor_to_filename, index["weight_map"]
    assert index["metadata"] == split.metadata
    for name in split.filename_to_tensors:
        with safe_open(os.path.join(folder, name), "pt") as f:
            assert f.metadata()["format"] == "pt"
            for key in f.keys():
                value = f.get_tensor(key)
                assert torch.equal(value, full[key]), key
                if reference is not None:
                    torch.testing.assert_close(value.double(), reference[key], rtol=1e-5,
                                               atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    fresh = plain_model()
    result = load_torch_model(fresh, folder, strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    dist.barrier()  # every rank read the folder before config.json joins it
    if dist.get_rank() == 0:
        config().save_pretrained(folder)
    dist.barrier()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] \
        and not info["mismatched_keys"], info
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, full[name]), name
    return loaded.eval()


def fsdp2(rank, world, out):
    from torch.distributed.fsdp import fully_shard
    model = plain_model()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY), timeout=60)
    reference = {}
    train(model, ema, rank, reference)
    loaded = export_and_check(ema, out, "fsdp2", reference)
    batch = ids(100, 0)
    model.eval()
    with torch.no_grad(), ema.swap(model):
        sharded = model(batch).logits
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).logits, sharded, rtol=1e-5, atol=1e-6)


def ddp(rank, world, out):
    model = torch.nn.parallel.DistributedDataParallel(plain_model())
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY), timeout=60)
    reference = {}
    train(model, ema, rank, reference)
    export_and_check(ema, out, "ddp", reference)


def fsdp1(rank, world, out):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    model = FSDP(plain_model(), use_orig_params=True, device_id=torch.device("cpu"),
                 auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY), timeout=60)
    train(model, ema, rank)
    export_and_check(ema, out, "fsdp1")


if __name__ == "__main__":
    rank_worker.main({"fsdp2": fsdp2, "ddp": ddp, "fsdp1": fsdp1})
