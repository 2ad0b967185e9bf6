"""Post-hoc EMA (Karras et al.): several power-function profiles updated
together, snapshots on disk, any sigma_rel synthesized afterwards. The names
follow ema-pytorch's PostHocEMA."""
import math
import numbers
import os
import tempfile
from datetime import timedelta
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from . import _C
from ._model import (Plan, Tracked, _default_group, is_dtensor, module_tensors, plan_layout,
                     unwrap)
from ._plan import checked_group
from ._selection import keep_trainable, refuse_unfrozen

OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- constructor arguments, checked when given ---------------------------------
# The C++ engine checks the same ranges when it is built (naming its own
# fields); these name the Python parameter, and run in the constructor, not
# at fit start. One line each: TypeError for a wrong type, ValueError for a
# value out of range.
def checked_int(api: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{api}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{api}: {name} must be >= {minimum}, got {value}")
    return int(value)


def checked_bool(api: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{api}: {name} must be True or False, got {type(value).__name__} "
                        f"{value!r}")
    return value


def checked_choice(api: str, name: str, value: Any, choices: Tuple[str, ...]) -> str:
    accepted = " or ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise TypeError(f"{api}: {name} must be {accepted}, got {type(value).__name__} "
                        f"{value!r}")
    if value not in choices:
        raise ValueError(f"{api}: {name} must be {accepted}, got {value!r}")
    return value


def checked_sigma(api: str, name: str, value: Any) -> float:
    """A sigma_rel some power-function EMA of the engine has: in (0,
    1/sqrt(12)). sigma_rel(gamma) = sqrt((gamma+1) / ((gamma+2)^2 (gamma+3)))
    falls from 1/sqrt(12) at gamma = 0 (a uniform average) as gamma grows,
    and the engine's profiles have gamma > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{api}: {name} must be a number, got {type(value).__name__} {value!r}")
    sigma = float(value)
    if not (0.0 < sigma < _C.max_sigma_rel):  # NaN too
        raise ValueError(f"{api}: {name} must lie in (0, 1/sqrt(12) = {_C.max_sigma_rel!r}), "
                         f"the sigma_rel of power-function EMAs with gamma > 0, got {sigma!r}")
    return sigma


def checked_sigma_rels(api: str, name: str, values: Any) -> Tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{api}: {name} must be a sequence of numbers, got "
                        f"{type(values).__name__} {values!r}")
    sigmas = tuple(checked_sigma(api, f"{name}[{i}]", v) for i, v in enumerate(values))
    if len(sigmas) < 2:
        raise ValueError(f"{api}: {name} needs at least 2 values (the synthesis solves over "
                         f"profiles), got {len(sigmas)}")
    if len(sigmas) > _C.max_profiles:
        raise ValueError(f"{api}: {name} holds {len(sigmas)} values; at most "
                         f"{_C.max_profiles} profiles are tracked in one pass")
    for i, sigma in enumerate(sigmas):
        if sigma in sigmas[:i]:
            raise ValueError(f"{api}: {name} lists {sigma!r} twice; two equal profiles make the "
                             "synthesis singular")
    return sigmas


def checked_folder(api: str, name: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{api}: {name} must be a path (str or os.PathLike), got "
                        f"{type(value).__name__} {value!r}")
    folder = os.fspath(value)
    if not isinstance(folder, str) or folder == "":
        raise ValueError(f"{api}: {name} must name a folder, got {value!r}")
    return folder


def checked_output_dtype(api: str, name: str, value: Any) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{api}: {name} must be a torch.dtype, got {type(value).__name__} "
                        f"{value!r}")
    if value not in OUTPUT_DTYPES:
        raise ValueError(f"{api}: {name} must be torch.float32, torch.bfloat16 or "
                         f"torch.float16, got {value}")
    return value


def checked_seconds(api: str, name: str, value: Any) -> float:
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{api}: {name} must be seconds (a number) or a datetime.timedelta, got "
                        f"{type(value).__name__} {value!r}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{api}: {name} must be a positive, finite time, got {value!r}")
    return seconds


def checked_group_of(api: str, value: Any) -> Any:
    try:
        return checked_group(value)
    except TypeError as error:
        raise TypeError(f"{api}: {error}") from None


def read_tensor_file(path: str) -> Dict[str, Any]:
    """A safetensors file shardema wrote, validated (sizes, per-tensor
    checksums): {"tensors": {name: tensor}, "metadata": {key: text}}."""
    return _C.read_tensor_file(str(path))


def synthesize_snapshot_folder(folder: str, sigma_rel: float, step: Optional[int] = None,
                               path: Optional[str] = None, dtype: torch.dtype = torch.float32,
                               normalize: bool = False,
                               buffer_mib: int = 64) -> Union[str, Dict[str, torch.Tensor]]:
    """Offline: the EMA of profile `sigma_rel` at `step` (default: the newest
    snapshot) from a snapshot folder (rank-0 or sharded). Writes deployable
    safetensors to `path` and returns it; without a path returns the tensors."""
    def run(out: str) -> None:
        _C.synthesize_snapshot_folder(str(folder), out, float(sigma_rel), int(step or 0),
                                      bool(normalize), dtype, int(buffer_mib) << 20)

    if path is not None:
        run(str(path))
        return str(path)
    with tempfile.TemporaryDirectory(prefix="shardema-synth-") as tmp:
        out = os.path.join(tmp, "synthesized.safetensors")
        run(out)
        return dict(read_tensor_file(out)["tensors"])


def _sharded_plan(tracked: List[Tracked], layout: str, process_group: Any) -> Plan:
    """This rank's pieces of a model with DTensor parameters: the post-hoc
    profiles of each DTensor's to_local() (FSDP2's rows, tensor
    parallelism's Shard(d) piece in its own layout, recorded with its
    split), and of this rank's rows of the tensors every rank holds whole
    (buffers), over the mesh's last dimension. Under HSDP plan.replicas is
    the group of the replicas of these pieces. ValueError naming what the
    post-hoc snapshots cannot hold."""
    first = next(t.name for t in tracked if is_dtensor(t.tensor))
    if layout != "sharded":
        raise ValueError(f"layout='{layout}' keeps full EMAs on rank 0, but '{first}' is a "
                         "DTensor (fully_shard, tensor parallelism): each rank holds only its "
                         "piece. Use layout='sharded', where each rank keeps the profiles of "
                         "its piece")
    return plan_layout(tracked, "fsdp2", process_group, buffers="replicated")  # rows in snapshots


def start_engine(model: torch.nn.Module, *, sigma_rels: Sequence[float], update_every: int,
                 checkpoint_every: int, folder: str, start_iter: int, default_sigma: float,
                 step_size_correction: bool, layout: str, policy: str,
                 output_dtype: torch.dtype, process_group: Any, seconds: float,
                 trainable_only: bool = False) -> Tuple[Any, list]:
    """The C++ post-hoc engine (the PostHocCallback) over `model`'s tensors,
    started: what PostHocEMA and DDPPostHocEMACallback share. A model with
    DTensor parameters runs over the group of its mesh's last dimension
    (unless `process_group` names one), each rank on its own piece; on a
    2-D (replicate, shard) mesh (HSDP) the first replica keeps the profiles
    and writes the files for all. Also the frozen parameters
    trainable_only=True left out (_selection.keep_trainable), which the
    caller checks with refuse_unfrozen at each step."""
    tracked, frozen = module_tensors(model, policy), []
    from ._zero3 import Partition
    zero3 = next((t.name for t in tracked if isinstance(t.piece, Partition)), None)
    if zero3 is not None:
        raise ValueError(f"'{zero3}' is partitioned by DeepSpeed ZeRO-3: the post-hoc EMA does "
                         "not follow ZeRO-3 partitions (shardema.EMA does)")
    if trainable_only:
        tracked, frozen = keep_trainable(tracked)
    plan = None
    group = process_group if process_group is not None else _default_group()
    replicas = None
    if any(is_dtensor(t.tensor) for t in tracked):
        plan = _sharded_plan(tracked, layout, process_group)
        group, replicas = plan.group, plan.replicas
    engine = _C.PostHoc(
        [float(s) for s in sigma_rels], int(update_every), int(checkpoint_every), str(folder),
        int(start_iter), float(default_sigma), bool(step_size_correction), layout, policy, "",
        "shardema_ema_final", output_dtype, group, float(seconds), replicas)
    if plan is not None:
        engine.on_fit_start(plan.shards, plan.whole)
    else:
        engine.on_fit_start([(t.name, t.tensor) for t in tracked], [t.role for t in tracked],
                            [t.is_buffer for t in tracked])
    return engine, frozen


class PostHocEMA:
    """Post-hoc EMA of a model: one power-function EMA per sigma_rel, updated
    in one pass, snapshotted every checkpoint_every_num_steps updates into
    checkpoint_folder. layout "rank0" (rank 0 keeps full EMAs, as under
    DDP) or "sharded" (every rank its FSDP2-style rows; a model with
    DTensor parameters needs it: fully_shard, tensor parallelism's Shard(d)
    pieces, HSDP's 2-D mesh. Each rank then keeps the profiles of its
    DTensors' to_local(), over the group of the mesh's last dimension;
    under HSDP only the first replica keeps them and writes the files).

    update() after optimizer.step() (returns at once) and fence() before the
    next one; synthesize(sigma_rel) for any profile afterwards.

    trainable_only: True keeps the profiles of the parameters that require
    grad only, as shardema.EMA's (snapshots and syntheses hold those); a
    parameter left out that requires grad later is a ValueError naming it
    at the next update().

    Every argument is checked here: a one-line ValueError for a value out of
    range (each sigma_rel in (0, 1/sqrt(12)), at least 2 and distinct; the
    step counts >= 1) and a TypeError for a wrong type, naming it.
    """

    def __init__(self, model: torch.nn.Module, sigma_rels: Sequence[float] = (0.05, 0.1),
                 update_every: int = 1, checkpoint_every_num_steps: int = 1000,
                 checkpoint_folder: str = "./post-hoc-ema-checkpoints",
                 layout: str = "rank0", step_size_correction: bool = False, *,
                 policy: str = "ema_pytorch", process_group: Any = None,
                 output_dtype: torch.dtype = torch.float32,
                 timeout: Union[float, timedelta] = 300.0, trainable_only: bool = False) -> None:
        api = "PostHocEMA"
        model = unwrap(model)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{api}: model must be an nn.Module, got {type(model).__name__}")
        sigmas = checked_sigma_rels(api, "sigma_rels", sigma_rels)
        every = checked_int(api, "update_every", update_every, 1)
        snapshot_every = checked_int(api, "checkpoint_every_num_steps",
                                     checkpoint_every_num_steps, 1)
        self.checkpoint_folder = checked_folder(api, "checkpoint_folder", checkpoint_folder)
        layout = checked_choice(api, "layout", layout, ("rank0", "sharded"))
        correction = checked_bool(api, "step_size_correction", step_size_correction)
        policy = checked_choice(api, "policy", policy, ("ema_pytorch", "versatil"))
        process_group = checked_group_of(api, process_group)
        output_dtype = checked_output_dtype(api, "output_dtype", output_dtype)
        seconds = checked_seconds(api, "timeout", timeout)
        trainable_only = checked_bool(api, "trainable_only", trainable_only)
        self._engine, self._frozen = start_engine(
            model, sigma_rels=sigmas, update_every=every, checkpoint_every=snapshot_every,
            folder=self.checkpoint_folder, start_iter=0, default_sigma=sigmas[0],
            step_size_correction=correction, layout=layout, policy=policy,
            output_dtype=output_dtype, process_group=process_group, seconds=seconds,
            trainable_only=trainable_only)
        self.sigma_rels = sigmas

    def update(self) -> bool:
        """One optimizer step; returns whether it was counted (always)."""
        refuse_unfrozen(self._frozen, "PostHocEMA.update")
        calls = self._engine.calls
        return self._engine.on_train_batch_end(calls + 1, 0, 1, True)

    def fence(self) -> None:
        self._engine.on_before_optimizer_step()

    def wait(self) -> None:
        self._engine.wait()

    @property
    def step(self) -> int:
        """Updates so far."""
        return self._engine.calls

    def synthesize(self, sigma_rel: float, step: Optional[int] = None, path: Optional[str] = None,
                   dtype: torch.dtype = torch.float32) -> Union[str, Dict[str, torch.Tensor]]:
        """The EMA of profile `sigma_rel` at `step` (default: the newest
        snapshot) from this run's snapshots; see shardema.synthesize_snapshot_folder. Reads
        the snapshot folder (every rank's, for the sharded layout; under HSDP
        the first replica's), so in a multi-rank job call it once every
        rank's update() has returned (after a dist.barrier(), say): a rank
        still writing its snapshots would leave the folder incomplete."""
        self._engine.wait()
        return synthesize_snapshot_folder(self.checkpoint_folder, sigma_rel, step=step,
                                          path=path, dtype=dtype)
