"""The EMA implementations python_bench.py times, each built over one model
and reduced to what the benchmark needs: an update function, what it holds
beyond the model, and the dtype it averages in. One function per peer, so
what each peer is given (its options, its copy of the model) reads in one
place. A peer whose package is missing is left out with a note."""
import types
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

DECAY = 0.999


@dataclass
class Method:
    name: str
    update: Callable[[int], None]  # runs one update for optimizer step `step`
    wait: Callable[[], None]  # returns once the update's math is done
    extra_bytes: int  # what the method holds beyond the model
    where: str  # where that lives ("beside the params" or "pinned host")
    ema_dtype: str
    returns: Optional[List[float]] = None  # shardema: update() return times


def tensors_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def module_bytes(module: torch.nn.Module) -> int:
    return tensors_bytes(list(module.parameters()) + list(module.buffers()))


def no_wait() -> None:
    pass


def foreach_lerp(model: torch.nn.Module) -> Method:
    """What a hand-written loop does: fp32 EMA lists, torch._foreach_lerp_,
    the bf16 sources cast to fp32 first (foreach needs equal dtypes)."""
    params = list(model.parameters())
    emas = [p.detach().float().clone() for p in params]

    def update(step: int) -> None:
        with torch.no_grad():
            sources = [p.detach() if p.dtype == torch.float32 else p.detach().float()
                       for p in params]
            torch._foreach_lerp_(emas, sources, 1 - DECAY)
    return Method("torch._foreach_lerp_ (fp32 lists)", update, no_wait, tensors_bytes(emas),
                  "beside the params", "float32")


def timm_v3(model: torch.nn.Module) -> Optional[Method]:
    try:
        from timm.utils.model_ema import ModelEmaV3
    except ImportError:
        return None
    # dtype=float32 keeps an fp32 EMA of a bf16 model, as shardema does.
    ema = ModelEmaV3(model, decay=DECAY, dtype=torch.float32, foreach=True)
    return Method("timm ModelEmaV3 (foreach, fp32)", lambda step: ema.update(model), no_wait,
                  module_bytes(ema.module), "beside the params", "float32")


def ema_pytorch(model: torch.nn.Module) -> Optional[Method]:
    try:
        from ema_pytorch import EMA
    except ImportError:
        return None
    # Its EMA is a deep copy in the model's dtype (bf16 for a bf16 model).
    ema = EMA(model, beta=DECAY, update_after_step=0, update_every=1, use_foreach=True,
              include_online_model=False)
    return Method("ema-pytorch EMA (use_foreach)", lambda step: ema.update(), no_wait,
                  module_bytes(ema.ema_model), "beside the params",
                  str(next(ema.ema_model.parameters()).dtype).replace("torch.", ""))


def averaged_model(model: torch.nn.Module) -> Method:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=False)
    return Method("torch AveragedModel (multi_avg_fn)",
                  lambda step: averaged.update_parameters(model), no_wait,
                  module_bytes(averaged.module), "beside the params",
                  str(next(averaged.module.parameters()).dtype).replace("torch.", ""))


def lightning_ema(model: torch.nn.Module) -> Optional[Method]:
    try:
        from lightning.pytorch.callbacks import EMAWeightAveraging
    except ImportError:
        return None
    callback = EMAWeightAveraging(decay=DECAY, use_buffers=True)
    callback.setup(None, model, "fit")  # builds its AveragedModel, as Trainer.fit does
    trainer = types.SimpleNamespace(global_step=0)

    def update(step: int) -> None:
        # The hook Lightning calls after each training batch; it updates when
        # global_step moved on (and should_update() agrees: every step here).
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, model, None, None, 0)
    return Method("Lightning EMAWeightAveraging", update, no_wait,
                  module_bytes(callback._average_model.module), "beside the params",
                  str(next(callback._average_model.module.parameters()).dtype).replace(
                      "torch.", ""))


def shardema_ema(model: torch.nn.Module) -> Method:
    import shardema
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY),
                       policy="ema_pytorch")
    returns: List[float] = []

    def update(step: int) -> None:
        import time
        ema.fence()
        start = time.perf_counter()
        ema.update(step)
        returns.append(time.perf_counter() - start)
    held = sum(t.numel() * 4 for t in model.parameters()) + \
        int(ema.offload_stats()["staging_bytes"])
    method = Method("shardema.EMA update+wait", update, ema.wait, held, "pinned host",
                    "float32", returns)
    method.ema = ema  # the benchmark reads offload_stats() off it
    return method


ALL = (shardema_ema, foreach_lerp, timm_v3, ema_pytorch, averaged_model, lightning_ema)
