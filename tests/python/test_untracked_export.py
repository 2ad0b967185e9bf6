"""export_weights(include_untracked=True) of a LoRA model's EMA
(trainable_only=True: the adapters' EMA, the frozen base and buffers the
model's own), one file or split: the engine's writer puts the model's
tensors among the EMA's in state_dict() order, so the folder is what
huggingface_hub's split_torch_state_dict_into_shards gives for the
combined state dict (same files, index and total_size), transformers'
from_pretrained loads it with nothing missing or unexpected and the EMA's
outputs, and huggingface_hub's load_torch_model loads it strict. Real peft
adapters (inject_adapter_in_model in a transformers class, get_peft_model
on a small net) on tiny Llama (non-persistent rotary buffers) and GPT-2
(a frozen tied embedding and head) configs built here, no download; the
adapters' EMA against a float64 EMA recomputed here. FSDP2 at W = 2:
trainable_worker.py."""
import json
import os

import pytest
import torch

import shardema

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")
from huggingface_hub import load_torch_model, split_torch_state_dict_into_shards  # noqa: E402
from safetensors import safe_open  # noqa: E402

DECAY = 0.5
STEPS = 3
VOCAB = 128


def lora_config(kind):
    if kind == "gpt2":  # Conv1D layers: fan_in_fan_out
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                               init_lora_weights=False, fan_in_fan_out=True)
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           init_lora_weights=False)


def config(kind):
    if kind == "gpt2":  # tie_word_embeddings: lm_head.weight is wte.weight, frozen
        return transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                       n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=32,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0)


class LoraLlama(transformers.LlamaForCausalLM):
    """A transformers class whose modules hold LoRA adapters (peft's
    inject_adapter_in_model, which freezes the base): what from_pretrained
    builds before it loads the folder."""

    def __init__(self, config):
        super().__init__(config)
        peft.inject_adapter_in_model(lora_config("llama"), self)


class LoraGPT2(transformers.GPT2LMHeadModel):
    def __init__(self, config):
        super().__init__(config)
        peft.inject_adapter_in_model(lora_config("gpt2"), self)


CLASSES = {"llama": LoraLlama, "gpt2": LoraGPT2}


def ids(step):
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(step))


def trained(kind):
    """A LoRA model trained STEPS SGD steps, its trainable-only EMA
    (constant decay, the first update a copy) and the float64 EMA of its
    adapters."""
    torch.manual_seed(0)
    model = CLASSES[kind](config(kind))
    adapters = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert adapters and all("lora_" in n for n in adapters)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY),
                       trainable_only=True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    reference = {}
    for step in range(1, STEPS + 1):
        batch = ids(step)
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        params = dict(model.named_parameters())
        for name in adapters:
            w = params[name].detach().double()
            reference[name] = w if step == 1 else DECAY * reference[name] + (1 - DECAY) * w
    ema.wait()
    model.eval()
    return model, ema, reference


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def run(request):
    return request.param, *trained(request.param)


def combined(model, ema_values):
    """The dict huggingface_hub splits: model.state_dict() with the EMA's
    values where it has them, in state_dict() order except that a tied
    tensor's other names follow its first (as full_state_dict() gives the
    EMA's), a tensor of its own under each name (each counted, as the EMA's
    own split export counts them)."""
    state = model.state_dict()
    groups = {}
    for name, value in state.items():
        same = (value.data_ptr(), value.dtype, tuple(value.shape)) if value.numel() else name
        groups.setdefault(same, []).append(name)
    return {name: (ema_values[name] if name in ema_values else state[name]).detach().clone()
            for names in groups.values() for name in names}


def read_folder(folder):
    """{name: tensor} of every file the index names, and the files' metadata."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors, metadata = {}, {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / name), "pt") as f:
            metadata[name] = f.metadata()
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return index, tensors, metadata


def test_the_adapters_ema_is_the_float64_one(run):
    _, model, ema, reference = run
    full = ema.full_state_dict()
    assert sorted(full) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(full[name].double(), value, rtol=1e-6, atol=1e-6)


def test_split_export_is_huggingface_hubs_split_of_the_combined_state_dict(run, tmp_path):
    kind, model, ema, _ = run
    whole = combined(model, ema.full_state_dict())
    folder = tmp_path / "hf"
    limit = "20KB"  # the embedding (16 KiB) fills a file; the layers span several
    ema.export_weights(str(folder), max_shard_size=limit, include_untracked=True)
    split = split_torch_state_dict_into_shards(whole, max_shard_size=limit)
    assert split.is_sharded and len(split.filename_to_tensors) > 2
    index, tensors, metadata = read_folder(folder)
    assert index["weight_map"] == split.tensor_to_filename
    assert index["metadata"] == split.metadata  # total_size
    assert sorted(os.listdir(folder)) == sorted(split.filename_to_tensors) + \
        ["model.safetensors.index.json"]
    assert sorted(tensors) == sorted(whole)
    for name, value in whole.items():
        assert tensors[name].dtype == value.dtype and torch.equal(tensors[name], value), name
    untracked = sorted(set(whole) - set(ema.full_state_dict()))
    for meta in metadata.values():
        assert meta["format"] == "pt" and meta["shardema.kind"] == "deployable_weights"
        assert json.loads(meta["shardema.from_model"]) == untracked
    if kind == "gpt2":  # the frozen tie, under both names
        assert {"transformer.wte.weight", "lm_head.weight"} <= set(untracked)
    else:  # no non-persistent buffer
        assert not [n for n in tensors if "inv_freq" in n]


def test_from_pretrained_loads_it_with_the_emas_outputs(run, tmp_path):
    kind, model, ema, _ = run
    folder = tmp_path / "hf"
    ema.export_weights(str(folder), max_shard_size="20KB", include_untracked=True)
    config(kind).save_pretrained(str(folder))
    loaded, info = CLASSES[kind].from_pretrained(str(folder), output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() \
        and info["mismatched_keys"] == set(), info
    loaded.eval()
    whole = combined(model, ema.full_state_dict())
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, whole[name]), name
    batch = ids(100)
    with torch.no_grad():
        with ema.swap(model):
            expected = model(batch).logits
        assert torch.equal(loaded(batch).logits, expected)


def test_load_torch_model_strict_and_one_file_holds_the_same(run, tmp_path):
    kind, model, ema, _ = run
    whole = combined(model, ema.full_state_dict())
    ema.export_weights(str(tmp_path / "hf"), max_shard_size="20KB", include_untracked=True)
    torch.manual_seed(5)
    fresh = CLASSES[kind](config(kind))  # other values everywhere
    result = load_torch_model(fresh, str(tmp_path / "hf"), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, whole[name]), name
    # One file: the same writer, the same tensors.
    path = tmp_path / "all.safetensors"
    ema.export_weights(str(path), include_untracked=True)
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == sorted(whole)
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), whole[name]), name
        assert json.loads(f.metadata()["shardema.from_model"]) == \
            sorted(set(whole) - set(ema.full_state_dict()))
    assert sorted(os.listdir(tmp_path)) == ["all.safetensors", "hf"]  # no temporary left


def test_bfloat16_converts_the_models_floats_too(run, tmp_path):
    _, model, ema, _ = run
    whole = {k: v.bfloat16() if v.is_floating_point() else v
             for k, v in combined(model, ema.full_state_dict()).items()}
    folder = tmp_path / "bf16"
    ema.export_weights(str(folder), dtype=torch.bfloat16, max_shard_size=12_000,
                       include_untracked=True)
    index, tensors, _ = read_folder(folder)
    assert index["weight_map"] == \
        split_torch_state_dict_into_shards(whole, max_shard_size=12_000).tensor_to_filename
    for name, value in whole.items():
        assert torch.equal(tensors[name], value), name


def test_a_failed_split_export_leaves_the_old_folder_as_it_was(run, tmp_path):
    _, model, ema, _ = run
    folder = tmp_path / "hf"
    ema.export_weights(str(folder), max_shard_size="20KB", include_untracked=True)
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    files = sorted(n for n in before if n.startswith("model-"))
    # The last file's temporary name is taken by a folder: the export fails
    # after every other file was written.
    blocker = folder / (files[-1] + ".tmp")
    blocker.mkdir()
    with torch.no_grad():  # other values, so a partial write would show
        for p in model.parameters():
            if not p.requires_grad:
                p.add_(1.0)
    try:
        with pytest.raises(ValueError, match=files[-1]):
            ema.export_weights(str(folder), max_shard_size="20KB", include_untracked=True)
    finally:
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:
                    p.sub_(1.0)
    blocker.rmdir()
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)  # float buffers and an int64 counter
        self.attn = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.attn(self.norm(self.embed(x)))))


def test_get_peft_model_split_export_loads_strict_with_the_emas_outputs(tmp_path):
    # The peft wrapper's own names (base_model.model...), buffers between
    # the adapters in state_dict() order, a limit that splits every layer.
    def lora_net(seed):
        torch.manual_seed(seed)
        return peft.get_peft_model(Net(), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["attn", "out"], init_lora_weights=False))
    model = lora_net(0)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY),
                       trainable_only=True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
    ema.wait()
    model.eval()
    whole = combined(model, ema.full_state_dict())
    folder = tmp_path / "split"
    ema.export_weights(str(folder), max_shard_size=300, include_untracked=True)
    split = split_torch_state_dict_into_shards(whole, max_shard_size=300)
    index, tensors, _ = read_folder(folder)
    assert len(split.filename_to_tensors) > 3
    assert index["weight_map"] == split.tensor_to_filename
    assert index["metadata"] == split.metadata
    assert sorted(tensors) == sorted(whole)
    assert tensors["base_model.model.norm.num_batches_tracked"].dtype == torch.int64
    fresh = lora_net(7)
    fresh.eval()
    result = load_torch_model(fresh, str(folder), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(3, 8)
    with torch.no_grad(), ema.swap(model):
        assert torch.equal(fresh(x), model(x))
