#!/usr/bin/env python3
"""The Python package on a GPU machine (run by bench/gpu/run.sh after pip
install): the CUDA copy engine under shardema.EMA and a real fully_shard
model on the GPU, each against a float64 recomputation of the EMA from the
full weights of every step; and EMACallback's checkpoint of that model
through a real sharded state dict (DTensors: the EMA stays sharded) and
its resume.

    python_check.py            (one process; starts its own NCCL group of 1)
"""
import os
import socket
import sys

import torch
import torch.distributed as dist

import shardema

DECAY = 0.9
STEPS = 6


def model_on(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(),
                               torch.nn.Linear(160, 33)).to(device)


def reference_step(ref, full, first):
    for name, value in full.items():
        v = value.detach().double().cpu()
        ref[name] = v.clone() if first else ref[name] * DECAY + v * (1 - DECAY)


def train(model, optimizer, ema, ref, full_weights):
    """STEPS optimizer steps with the EMA fenced before and updated after
    each, and the float64 reference following the full weights. The EMA
    starts as a copy of the weights after the first step
    (copy_on_first_update, the default), and so does the reference."""
    for step in range(STEPS):
        model(torch.randn(8, 96, device="cuda")).square().mean().backward()
        ema.fence()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        reference_step(ref, full_weights(), step == 0)
    ema.wait()


def check(ema_full, ref, what):
    worst = max((ema_full[k].double() - ref[k]).abs().max().item() for k in ref)
    ok = worst < 1e-5
    print(f"{what}: max |EMA - float64 reference| = {worst:.2e} {'ok' if ok else 'FAILED'}")
    return ok


def cuda_engine_check():
    model = model_on("cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY), engine="cuda")
    ref = {}
    train(model, optimizer, ema, ref, lambda: dict(model.named_parameters()))
    free_before = torch.cuda.mem_get_info()[0]
    ok = check(ema.full_state_dict(), ref, "CUDA engine, pinned-host EMA")
    with ema.swap(model):
        swap_ok = torch.allclose(model[0].weight.double().cpu(), ref["0.weight"], atol=1e-5)
    ok &= swap_ok
    print(f"swap on the GPU model: {'ok' if swap_ok else 'FAILED'}; device memory used by the EMA: "
          f"{(free_before - torch.cuda.mem_get_info()[0]) / 2**20:.1f} MiB")
    return ok


def fsdp2_gpu_check():
    from torch.distributed.fsdp import fully_shard
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    model = model_on("cuda")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY))
    assert ema.layout == "fsdp2", ema.layout
    ref = {}
    train(model, optimizer, ema, ref,
          lambda: {n: p.full_tensor() for n, p in model.named_parameters()})
    ok = check(ema.full_state_dict(), ref, "FSDP2 on the GPU (NCCL, 1 rank)")
    try:
        ok &= fsdp2_callback_checkpoint_check()
    except Exception:  # report, and let the other checks' results stand
        import traceback
        traceback.print_exc()
        print("EMACallback checkpoint of a fully_shard model: FAILED")
        ok = False
    dist.destroy_process_group()
    return ok


def sharded_model():
    from torch.distributed.fsdp import fully_shard
    model = model_on("cuda")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def fsdp2_callback_checkpoint_check():
    """EMACallback over a fully_shard model: on_save_checkpoint on the
    sharded state dict Lightning's ModelParallelStrategy saves
    (get_model_state_dict, DTensor entries) keeps DTensors holding this
    rank's EMA rows and the raw weights beside them; a fresh model and
    callback resumed from it get both back."""
    from types import SimpleNamespace
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from shardema.callbacks import EMACallback
    model = sharded_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = SimpleNamespace(global_step=0, accumulate_grad_batches=1, is_last_batch=False)
    callback = EMACallback(power=0.75)
    callback.on_fit_start(trainer, model)
    for batch in range(STEPS):
        model(torch.randn(8, 96, device="cuda")).square().mean().backward()
        callback.on_before_optimizer_step(trainer, model, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, model, None, None, batch)
    callback.ema.wait()
    expected = callback.ema.local_ema()
    checkpoint = {"state_dict": get_model_state_dict(model)}
    callback.on_save_checkpoint(trainer, model, checkpoint)
    state, raw = checkpoint["state_dict"], checkpoint[EMACallback.RAW_STATE_KEY]
    ok = True
    for name, param in model.named_parameters():
        rows = state[name].to_local()
        ok &= type(state[name]).__name__ == "DTensor"
        ok &= torch.equal(rows.float().cpu().reshape(-1), expected[name])
        ok &= torch.equal(raw[name].to_local(), param.to_local())
    resumed = sharded_model()
    callback2 = EMACallback(power=0.75)
    callback2.on_load_checkpoint(trainer, resumed, checkpoint)
    callback2.on_fit_start(trainer, resumed)
    for name, param in resumed.named_parameters():
        ok &= torch.equal(param.to_local(), raw[name].to_local())
    got = callback2.ema.local_ema()
    ok &= all(torch.equal(got[n], v) for n, v in expected.items())
    print(f"EMACallback checkpoint of a fully_shard model (sharded state dict, resume): "
          f"{'ok' if ok else 'FAILED'}")
    return ok


def main():
    if not torch.cuda.is_available():
        print("python_check: no CUDA device")
        return 2
    print(f"torch {torch.__version__}, shardema built with {shardema._C.built_with_torch}")
    ok = cuda_engine_check()
    ok &= fsdp2_gpu_check()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
