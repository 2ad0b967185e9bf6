"""The pinned staging an EMA holds follows its model (offload/include/
shardema/offload/update_pipeline.h, "Staging memory"), read through
offload_stats()['staging_bytes']: none for a model in host memory (its
parameters are read in place), one slot of about the model's size for a
small model on a GPU, and at most num_slots x chunk size for a large one."""
import pytest
import torch

import shardema

PAGE = 4096


def _pages(nbytes: int) -> int:
    return (nbytes + PAGE - 1) // PAGE * PAGE


def _run(ema, steps=3):
    for _ in range(steps):
        ema.fence()
        ema.update()
    ema.wait()


def test_a_cpu_model_holds_no_staging():
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.BatchNorm1d(128))
    ema = shardema.EMA(model, engine="host")
    assert ema.offload_stats()["staging_bytes"] == 0
    _run(ema)
    stats = ema.offload_stats()
    assert stats["staged_bytes"] == 0
    assert stats["staging_bytes"] == 0


def test_swapping_a_bf16_cpu_model_stages_nothing():
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    ema = shardema.EMA(model, engine="host")
    _run(ema)
    ema.copy_to(model)
    assert ema.offload_stats()["staging_bytes"] == 0


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_gpu
def test_a_small_gpu_model_holds_one_slot_of_its_size():
    # 65,536 + 512 bytes, both whole cache lines: one staged chunk of the
    # model's size, rounded up to a page.
    model = torch.nn.Linear(128, 128).cuda()
    ema = shardema.EMA(model)
    assert ema.offload_stats()["staging_bytes"] == 0
    _run(ema)
    assert ema.offload_stats()["staging_bytes"] == _pages(128 * 128 * 4 + 128 * 4)


@needs_gpu
def test_a_large_gpu_model_holds_num_slots_chunks():
    model = torch.nn.Linear(1024, 1024).cuda()  # 4 MiB: 16 chunks of 256 KiB
    ema = shardema.EMA(model, chunk_mib=0.25, num_slots=3)
    _run(ema)
    assert ema.offload_stats()["staging_bytes"] == 3 * (256 << 10)
