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


def _abi_of(version: str):
    """What of a torch version string decides whether our extension loads
    and runs with it: the minor release (torch's C++ ABI changes between
    minor releases, not between patch releases) and the CUDA major version
    of the build (the extension links the same libcudart.so.N as torch);
    "cpu" builds have none; a version without a local tag does not say."""
    public, _, local = version.partition("+")
    major_minor = tuple(public.split(".")[:2])
    if local.startswith("cu") and local[2:].isdigit() and len(local) > 3:
        return major_minor, "cuda " + local[2:-1]
    return major_minor, local or None


def _same_torch(built: str, running: str) -> bool:
    (built_minor, built_flavor), (running_minor, running_flavor) = _abi_of(built), _abi_of(running)
    unknown = built_flavor is None or running_flavor is None
    return built_minor == running_minor and (unknown or built_flavor == running_flavor)


if not _same_torch(_C.built_with_torch, torch.__version__):
    raise ImportError(
        f"shardema was built against torch {_C.built_with_torch} but this is torch "
        f"{torch.__version__}, whose C++ ABI differs (another minor release or CUDA major "
        "version): rebuild it in this environment (pip install --no-build-isolation .), "
        f"or install torch {_C.built_with_torch}."
    )

from ._shards import FlatParamLayout, LocalShard, ShardSpec, layout_spec  # noqa: E402
from ._ema import EMA  # noqa: E402
from ._posthoc import PostHocEMA, read_tensor_file, synthesize_snapshot_folder  # noqa: E402

# CMakeLists.txt's project() version: the wheel's, `shardema --version`'s.
__version__ = _C.version
DecaySchedule = _C.DecaySchedule
LoadReport = _C.LoadReport
# The per-node cost model of `shardema plan` (shardema/core/node_plan.h).
plan_node = _C.plan_node
NodePlan = _C.NodePlan


def __getattr__(name):
    # EMALoadPlanner (DCP's load planner that lets a checkpoint without an
    # EMA cold-start it) is made on first use: torch.distributed.checkpoint
    # takes most of a second to import.
    if name == "EMALoadPlanner":
        from ._dcp import EMALoadPlanner
        return EMALoadPlanner
    raise AttributeError(f"module 'shardema' has no attribute {name!r}")


__all__ = [
    "EMA",
    "EMALoadPlanner",
    "PostHocEMA",
    "synthesize_snapshot_folder",
    "read_tensor_file",
    "DecaySchedule",
    "LoadReport",
    "plan_node",
    "NodePlan",
    "LocalShard",
    "ShardSpec",
    "FlatParamLayout",
    "layout_spec",
]
