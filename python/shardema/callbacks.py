"""The two reference callbacks as drop-ins, over shardema's engine.

EMACallback: VersatIL's Lightning EMACallback (a warmup EMA updated on
optimizer steps only, checkpoints that hold the EMA with the raw weights
kept for resume, the validation swap). DDPPostHocEMACallback: FastVideo's
DDPPostHocEMACallback (nitrous post-hoc EMA on rank 0 under DDP), with a
sharded layout. Both are Callbacks of `lightning` and of
`pytorch_lightning` at once (each installed one), so either Trainer takes
them; without Lightning they work with any trainer object that carries the
attributes they read (global_step, accumulate_grad_batches, is_last_batch).
"""
from ._ema_callback import EMACallback
from ._posthoc_callback import DDPPostHocEMACallback

__all__ = ["EMACallback", "DDPPostHocEMACallback"]
