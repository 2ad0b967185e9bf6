"""Exports that Hugging Face's own clients load: EMA.export_weights(folder,
max_shard_size=) and `shardema export --max-shard-size` write the layout of
transformers' save_pretrained, checked against the real partners in the
same test: transformers' from_pretrained (no missing or unexpected key, the
EMA's logits), huggingface_hub's split (the same files for the same
tensors) and load_torch_model (strict), safetensors' load_model (strict,
one file). Tiny GPT-2 (tied embedding and head) and Llama configs built
here, no download; the EMA against a float64 EMA recomputed here. At W = 2
(hf_export_worker.py, Gloo on CPU): FSDP2, DDP and FSDP1 exports split
into several files, against a float64 EMA of full_tensor() and with the
model's plain names."""
import json
import os
import subprocess
import sys

import pytest
import torch

import shardema

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_launch import assert_passed, launched_once  # noqa: E402

transformers = pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")
safetensors_torch = pytest.importorskip("safetensors.torch")
from huggingface_hub import load_torch_model, split_torch_state_dict_into_shards  # noqa: E402
from safetensors import safe_open  # noqa: E402

DECAY = 0.5
STEPS = 3

runs = launched_once("hf_export_worker.py", [(2, ["fsdp2", "ddp", "fsdp1"])], timeout=240)
VOCAB = 256


def config(kind):
    if kind == "gpt2":  # tie_word_embeddings: lm_head.weight is wte.weight
        return transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2,
                                       n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=32,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0)


def ids(step):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(step))


def trained(kind):
    """A tiny causal LM trained STEPS SGD steps with an EMA (constant decay,
    the first update a copy) and the float64 EMA of its state_dict()."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(kind))
    # Nothing left out by hand: the EMA also tracks the non-persistent
    # buffers (Llama's rotary inv_freq), and its exports hold state_dict()'s
    # keys only, which from_pretrained loads without leftovers.
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference = {}
    for step in range(1, STEPS + 1):
        batch = ids(step)
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        for key, value in model.state_dict().items():
            value = value.detach().double()
            reference[key] = value if key not in reference else \
                DECAY * reference[key] + (1 - DECAY) * value
    ema.wait()
    return model, ema, reference


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def run(request):
    return request.param, *trained(request.param)


def ema_logits(model, ema, batch):
    model.eval()
    with torch.no_grad(), ema.swap(model):
        return model(batch).logits


def loaded_from(folder, kind, **options):
    """from_pretrained of `folder` (its config.json written here), with
    every key the model has found and nothing left over."""
    config(kind).save_pretrained(folder)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True, **options)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() \
        and info["mismatched_keys"] == set(), info
    return model.eval()


def test_from_pretrained_loads_a_split_export_with_the_emas_outputs(run, tmp_path):
    kind, model, ema, reference = run
    full = ema.full_state_dict()
    assert sorted(full) == sorted(model.state_dict())  # plain names, tied ones under both
    for name, value in full.items():
        torch.testing.assert_close(value.double(), reference[name], rtol=1e-6, atol=1e-6)
    folder = tmp_path / "hf"
    limit = "40KB"  # GPT-2's wte and Llama's embed_tokens (64 KiB) over it: files of their own
    ema.export_weights(str(folder), max_shard_size=limit)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    # huggingface_hub's own split of the same tensors: the same files
    split = split_torch_state_dict_into_shards(full, max_shard_size=limit)
    assert split.is_sharded and len(split.filename_to_tensors) > 2
    assert index["weight_map"] == split.tensor_to_filename
    assert index["metadata"] == split.metadata  # total_size
    for name in split.filename_to_tensors:
        with safe_open(str(folder / name), "pt") as f:
            assert f.metadata()["format"] == "pt" and \
                f.metadata()["shardema.kind"] == "deployable_weights"
            for key in f.keys():
                assert torch.equal(f.get_tensor(key), full[key]), key
    if kind == "gpt2":
        assert {"lm_head.weight", "transformer.wte.weight"} <= set(index["weight_map"])
    loaded = loaded_from(str(folder), kind)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, full[name]), name
    batch = ids(100)
    with torch.no_grad():
        assert torch.equal(loaded(batch).logits, ema_logits(model, ema, batch))


def test_non_persistent_buffers_are_tracked_but_in_no_export(run, tmp_path):
    kind, model, ema, _ = run
    saved = set(model.state_dict())
    transient = {name for name, _ in model.named_buffers() if name not in saved}
    assert (kind == "llama") == bool(transient)  # Llama's rotary_emb.inv_freq
    tracked = set(ema.ema_tensors())
    assert transient <= tracked
    for name in transient:  # swapped like any tensor; readable when named
        full = ema.full_state_dict(names=[name])[name]
        assert torch.equal(full, dict(model.named_buffers())[name].float()), name
    path = str(tmp_path / "ema.safetensors")
    ema.export_weights(path)
    with safe_open(path, "pt") as f:
        assert set(f.keys()) == saved
    assert set(ema.full_state_dict()) == saved


def test_bfloat16_split_export(run, tmp_path):
    kind, model, ema, _ = run
    full = ema.full_state_dict()
    folder = tmp_path / "bf16"
    ema.export_weights(str(folder), dtype=torch.bfloat16, max_shard_size=30_000)
    bf16 = {k: v.bfloat16() for k, v in full.items()}
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == \
        split_torch_state_dict_into_shards(bf16, max_shard_size=30_000).tensor_to_filename
    loaded = loaded_from(str(folder), kind, dtype=torch.bfloat16)
    for name, value in loaded.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, bf16[name]), name


def test_huggingface_hub_and_safetensors_load_strictly(run, tmp_path):
    kind, _, ema, _ = run
    full = ema.full_state_dict()
    ema.export_weights(str(tmp_path / "split"), max_shard_size="40KB")
    fresh = transformers.AutoModelForCausalLM.from_config(config(kind))
    result = load_torch_model(fresh, str(tmp_path / "split"), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, full[name]), name
    # One file, as before, "format": "pt". safetensors' strict load_model
    # takes save_model's files, which hold a tied tensor under one name: it
    # calls the second one unexpected. The export holds every key (issue
    # 32: a strict load_state_dict), so a tied model loads it with that.
    path = str(tmp_path / "ema.safetensors")
    ema.export_weights(path)
    fresh = transformers.AutoModelForCausalLM.from_config(config(kind))
    if kind == "gpt2":
        with pytest.raises(RuntimeError, match='Unexpected key.*"transformer.wte.weight"'):
            safetensors_torch.load_model(fresh, path, strict=True)
        fresh.load_state_dict(safetensors_torch.load_file(path), strict=True)
        assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied
    else:
        missing, unexpected = safetensors_torch.load_model(fresh, path, strict=True)
        assert not missing and not unexpected
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, full[name]), name
    with safe_open(path, "pt") as f:
        assert f.metadata()["format"] == "pt"
    # A limit everything fits under: one model.safetensors and no index,
    # as save_pretrained writes.
    folder = tmp_path / "whole"
    ema.export_weights(str(folder), max_shard_size="5GB")
    assert sorted(os.listdir(folder)) == ["model.safetensors"]
    loaded_from(str(folder), kind)


def test_a_new_export_replaces_the_old_set_and_a_failed_one_keeps_it(run, tmp_path):
    kind, _, ema, _ = run
    folder = tmp_path / "hf"
    ema.export_weights(str(folder), max_shard_size="40KB")
    first = sorted(os.listdir(folder))
    ema.export_weights(str(folder), max_shard_size="100KB")  # fewer files
    second = sorted(os.listdir(folder))
    assert len(second) < len(first) and "model.safetensors.index.json" in second
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(second) == sorted(set(index["weight_map"].values())) + \
        ["model.safetensors.index.json"]
    before = {name: (folder / name).read_bytes() for name in second}
    # The third file's temporary name is taken by a folder: the export fails
    # after two files were written, and the folder is as it was.
    third = [name for name in first if name.startswith("model-")][2]
    blocker = folder / (third + ".tmp")
    blocker.mkdir()
    with pytest.raises(ValueError, match=third):
        ema.export_weights(str(folder), max_shard_size="40KB")
    blocker.rmdir()
    assert sorted(os.listdir(folder)) == second
    assert {name: (folder / name).read_bytes() for name in second} == before
    loaded_from(str(folder), kind)
    ema.export_weights(str(folder), max_shard_size="40KB")  # the EMA still exports


def test_bad_sizes_and_paths_are_refused_naming_them(tmp_path):
    model = torch.nn.Linear(4, 4)
    ema = shardema.EMA(model, decay=0.9)
    ema.update()
    for bad, error in [(0, ValueError), (-1, ValueError), ("0GB", ValueError),
                       ("5XB", ValueError), ("", ValueError), (True, TypeError),
                       (2.5, TypeError), (b"5GB", TypeError)]:
        with pytest.raises(error, match="max_shard_size"):
            ema.export_weights(str(tmp_path / "out"), max_shard_size=bad)
    with pytest.raises(ValueError, match="names a .safetensors file; give a folder"):
        ema.export_weights(str(tmp_path / "ema.safetensors"), max_shard_size="1GB")
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        ema.export_weights(str(tmp_path / "a_file"), max_shard_size="1GB")
    assert (tmp_path / "a_file").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["a_file"]
    ema.export_weights(str(tmp_path / "out"), max_shard_size=64)  # 64 + 16 bytes: two files
    assert sorted(os.listdir(tmp_path / "out")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]


def test_cli_export_of_a_checkpoint_loads_with_from_pretrained(run, tmp_path):
    cli = os.environ.get("SHARDEMA_CLI")
    if not cli:
        pytest.skip("SHARDEMA_CLI is not set: the build has no shardema CLI (tools off)")
    kind, _, ema, _ = run
    full = {k: v.bfloat16() for k, v in ema.full_state_dict().items()}
    ema.save_checkpoint(str(tmp_path / "ckpt"))
    folder = tmp_path / "hf"
    result = subprocess.run([cli, "export", "--checkpoint", str(tmp_path / "ckpt"), "--out",
                             str(folder), "--max-shard-size", "40KB", "--dtype", "bf16"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == \
        split_torch_state_dict_into_shards(full, max_shard_size="40KB").tensor_to_filename
    assert f"in {len(set(index['weight_map'].values()))} files" in result.stdout
    assert set(index["weight_map"]) == set(full)  # no non-persistent buffer
    inspected = subprocess.run([cli, "inspect", str(tmp_path / "ckpt")], capture_output=True,
                               text=True)
    marked = {line.split()[1] for line in inspected.stdout.splitlines()
              if line.strip().startswith("tensor ") and "non-persistent" in line}
    assert marked == set(ema.ema_tensors()) - set(full), inspected.stdout
    loaded = loaded_from(str(folder), kind, dtype=torch.bfloat16)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, full[name]), name


def test_fsdp2_split_export_against_a_float64_ema_and_from_pretrained(runs):
    # rank 0 writes, tensor by tensor from both ranks' rows, across files
    assert_passed(runs(2), "fsdp2")


def test_ddp_and_fsdp1_exports_hold_the_plain_models_names(runs):
    # no "module." (DDP) or "_fsdp_wrapped_module." (FSDP1): strict loads
    # into a plain GPT-2 and from_pretrained with nothing unexpected
    assert_passed(runs(2), "ddp")
    assert_passed(runs(2), "fsdp1")
