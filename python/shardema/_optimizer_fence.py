"""Once per process, torch's global optimizer step pre-hook fences every EMA
of the process (the C++ registry: shardema._C.fence_every_averager,
lib/include/shardema/averager_registry.h) before any optimizer writes the
weights. So the loop ema-pytorch users write, optimizer.step() then
ema.update() with no fence(), is exact, and so is update() before
optimizer.step(): an update in flight has read the weights before the step
writes them. Installed when the first EMA is built; costs one call into
C++ per optimizer step, which returns at once when nothing is in flight."""
from . import _C

_handle = None


def install() -> None:
    global _handle
    if _handle is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _handle = register_optimizer_step_pre_hook(
            lambda optimizer, args, kwargs: _C.fence_every_averager())
