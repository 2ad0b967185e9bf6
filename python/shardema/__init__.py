"""shardema: the EMA of model weights for PyTorch training, sharded like the
model (FSDP2, DDP, FSDP1 through local shards) and kept in pinned host
memory in float32, updated asynchronously off the training loop.

The math, the files and the collectives are shardema's C++ engine
(``shardema._C``); this package only maps PyTorch objects onto it.
"""
import torch

try:
    from . import _C
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        f"shardema's extension (shardema._C) does not load with torch {torch.__version__}: "
        f"{error}. It must be built against the torch it runs with: reinstall it in this "
        "environment (pip install --no-build-isolation .) or rebuild with cmake."
    ) from error


def _same_torch(built: str, running: str) -> bool:
    # A local version suffix (+cu121, +cpu) names the same C++ ABI only when
    # equal, so the whole string is compared.
    return built == running


if not _same_torch(_C.built_with_torch, torch.__version__):
    raise ImportError(
        f"shardema was built against torch {_C.built_with_torch} but this is torch "
        f"{torch.__version__}: the extension must be built against the torch it runs with "
        "(pip install --no-build-isolation . in this environment)."
    )

from ._schedules import ConstantSchedule, PowerSchedule, WarmupSchedule  # noqa: E402
from ._shards import FlatParamLayout, LocalShard, ShardSpec, layout_spec  # noqa: E402
from ._ema import EMA  # noqa: E402
from ._posthoc import PostHocEMA, synthesize, read_safetensors  # noqa: E402

DecaySchedule = _C.DecaySchedule

__all__ = [
    "EMA",
    "PostHocEMA",
    "synthesize",
    "read_safetensors",
    "WarmupSchedule",
    "ConstantSchedule",
    "PowerSchedule",
    "DecaySchedule",
    "LocalShard",
    "ShardSpec",
    "FlatParamLayout",
    "layout_spec",
]
