"""shardema.EMA: the EMA of a model's (local shards of) weights, in pinned
host memory, updated in the background."""
import contextlib
import warnings
from datetime import timedelta
from typing import Any, Dict, Iterable, Iterator, Optional, Sequence, Union

import torch

from . import _C
from ._model import Plan, checked_group, module_tensors, named_tensors, plan_layout, unwrap
from ._shards import as_local_shard


def _seconds(timeout: Union[float, timedelta]) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class EMA:
    """The EMA of a model, or of named tensors, on this rank.

    model_or_named_tensors: an nn.Module (DDP-wrapped or not; FSDP2
    DTensor parameters included) or (name, tensor) pairs.
    schedule: a DecaySchedule (default DecaySchedule.warmup()).
    policy: "versatil" (buffers and BatchNorm copied, frozen parameters
    copied) or "ema_pytorch" (floating tensors averaged, integer ones copied
    once).
    storage: "pinned_host" (the EMA in host memory, updated in the
    background) or "device" (beside the parameters, synchronous).
    layout: "auto" (FSDP2 for DTensor parameters; "replicated" under an
    initialised process group; one process otherwise), "replicated"
    (DDP: each rank averages its FSDP2-style rows), "rank0" (rank 0 keeps
    all of it) or "fsdp2".
    process_group: the group of the collectives (default: the mesh's for
    FSDP2, the default group otherwise).
    chunk_mib, num_slots: the staging of the offload pipeline (default: the
    engine's, shardema._C.default_chunk_bytes and default_num_slots).
    refuse_non_finite: True makes update() check the weights for NaN and Inf
    first and raise a ValueError naming the tensor (the step not taken);
    it costs one more read of the weights. False (default, as ema-pytorch,
    timm and torch's AveragedModel): they are averaged like any value.

    Call update() after optimizer.step() and fence() before the next one
    (or attach(optimizer)).
    """

    def __init__(self, model_or_named_tensors: Any, schedule: Optional["_C.DecaySchedule"] = None,
                 policy: str = "versatil", storage: str = "pinned_host", layout: str = "auto",
                 process_group: Any = None, chunk_mib: Optional[float] = None,
                 num_slots: Optional[int] = None, *,
                 copy_on_first_update: bool = True, fence_in_update: bool = False,
                 engine: str = "auto", timeout: Union[float, timedelta] = 300.0,
                 more_schedules: Sequence["_C.DecaySchedule"] = (),
                 refuse_non_finite: bool = False) -> None:
        model = unwrap(model_or_named_tensors)
        if isinstance(model, torch.nn.Module):
            tracked = module_tensors(model, policy)
            self._model = model
        elif isinstance(model, dict):
            tracked = named_tensors(list(model.items()), policy)
            self._model = None
        elif isinstance(model, Iterable) and not isinstance(model, (str, bytes, torch.Tensor)):
            tracked = named_tensors(list(model), policy)
            self._model = None
        else:
            raise TypeError("model_or_named_tensors must be an nn.Module, a dict of tensors or "
                            f"(name, tensor) pairs, got {type(model_or_named_tensors).__name__}")
        plan = plan_layout(tracked, layout, process_group)
        self._build(plan, schedule, storage, chunk_mib, num_slots, copy_on_first_update,
                    fence_in_update, engine, timeout, more_schedules, refuse_non_finite)

    @classmethod
    def from_local_shards(cls, shards: Sequence[Any], schedule: Optional["_C.DecaySchedule"] = None,
                          storage: str = "pinned_host", process_group: Any = None,
                          chunk_mib: Optional[float] = None, num_slots: Optional[int] = None,
                          **kwargs: Any) -> "EMA":
        """The EMA of this rank's local shards, each a shardema.LocalShard, a
        dict {local, spec[, role]} or a tuple (local, spec[, role]) with spec
        a shardema.ShardSpec, a dict or a (name, global_shape, dtype, kind,
        ranges) tuple: FSDP1 (FlatParamLayout.shards_from_flat_param) or any split.
        Every rank of process_group (default: the default group, or one
        process) calls it with specs for the group's world size."""
        self = cls.__new__(cls)
        self._model = None
        group = checked_group(process_group)
        if group is None:
            from ._model import _default_group
            group = _default_group()
        local = [as_local_shard(s, i) for i, s in enumerate(shards)]
        self._build(Plan("local_shards", group, local, []), schedule, storage, chunk_mib,
                    num_slots, kwargs.pop("copy_on_first_update", True),
                    kwargs.pop("fence_in_update", False), kwargs.pop("engine", "auto"),
                    kwargs.pop("timeout", 300.0), kwargs.pop("more_schedules", ()),
                    kwargs.pop("refuse_non_finite", False))
        if kwargs:
            raise TypeError(f"from_local_shards: unexpected arguments {sorted(kwargs)}")
        return self

    def _build(self, plan: Plan, schedule, storage, chunk_mib, num_slots, copy_on_first_update,
               fence_in_update, engine, timeout, more_schedules, refuse_non_finite) -> None:
        if schedule is None:
            schedule = _C.DecaySchedule.warmup()
        if not isinstance(schedule, _C.DecaySchedule):
            raise TypeError("schedule must be a shardema.DecaySchedule (DecaySchedule.warmup(), "
                            ".constant(), .power_function()), got "
                            f"{type(schedule).__name__}")
        chunk_bytes = (_C.default_chunk_bytes if chunk_mib is None
                       else int(chunk_mib * (1 << 20)) if chunk_mib > 0 else 0)
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_mib must be > 0, got {chunk_mib}")
        num_slots = _C.default_num_slots if num_slots is None else num_slots
        self._hooks: list = []
        self._watched = plan.watched
        self._engine = _C.Ema(plan.group, _seconds(timeout), plan.shards, plan.whole, schedule,
                              list(more_schedules), bool(copy_on_first_update), storage,
                              chunk_bytes, int(num_slots), bool(fence_in_update),
                              engine, plan.layout, plan.owners, bool(refuse_non_finite))

    # --- stepping -------------------------------------------------------
    def update(self, step: Optional[int] = None) -> bool:
        """Folds the current weights in as optimizer step `step` (1-based,
        increasing; None: one more than the last). Returns at once; whether
        the schedule said the step was due.

        A tracked tensor replaced since (a new nn.Parameter, `p.data = t`)
        is followed, with a warning, when its shape, dtype and device are the
        same; otherwise this raises a ValueError naming it (module.to(dtype)
        after building the EMA, say)."""
        for i, (container, key, tensor, index) in enumerate(self._watched):
            if container.get(key) is not tensor:
                self._follow(i)
        due = self._engine.update(step)
        followed = self._engine.take_followed()
        if followed:
            warnings.warn(f"shardema.EMA: {', '.join(repr(n) for n in followed)} replaced after "
                          "the EMA was built (a new nn.Parameter or p.data = ...); the EMA "
                          "follows the new tensor", stacklevel=2)
        return due

    def _follow(self, i: int) -> None:
        container, key, _, index = self._watched[i]
        replacement = container.get(key)
        if replacement is None:
            name = self._engine.names()[index]
            raise ValueError(f"shardema.EMA.update: '{name}' was removed from the model after the "
                             "EMA was built; build a new EMA for the new model")
        self._engine.rebind(index, replacement)
        self._watched[i] = (container, key, replacement, index)

    def fence(self) -> None:
        """Returns once the last update has read the weights: call it before
        the next optimizer.step()."""
        self._engine.fence()

    def wait(self) -> None:
        """Returns once the last update's math is done (raises its error)."""
        self._engine.wait()

    def attach(self, optimizer: torch.optim.Optimizer) -> "EMA":
        """Fence before every optimizer step and update after it, through the
        optimizer's step hooks; returns self. detach() removes them."""
        self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self.fence()))
        self._hooks.append(optimizer.register_step_post_hook(lambda *_: self.update()))
        return self

    def detach(self) -> None:
        """Removes the hooks attach() registered."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    @property
    def step(self) -> int:
        """The last step folded in (0 before any)."""
        return self._engine.step

    @property
    def last_decay(self) -> float:
        """The decay of the last due update (0 before any)."""
        return self._engine.last_decay

    @property
    def rank(self) -> int:
        return self._engine.rank

    @property
    def world_size(self) -> int:
        return self._engine.world_size

    @property
    def layout(self) -> str:
        return self._engine.layout

    # --- evaluation -----------------------------------------------------
    def _check_model(self, model: Any, api: str) -> None:
        if model is None:
            return
        if self._model is None:
            raise ValueError(f"{api}: this EMA was built from named tensors, not a model; it "
                             f"writes into those tensors: call {api}() without a model")
        if unwrap(model) is not self._model:
            raise ValueError(f"{api}: this EMA tracks another model")

    @contextlib.contextmanager
    def swap(self, model: Any = None) -> Iterator[None]:
        """The EMA weights in the model (its local shards) inside the block,
        the raw ones back on exit, also on exceptions. Collective for a
        replicated model on several ranks."""
        self._check_model(model, "swap")
        self._engine.swap_in()
        try:
            yield
        finally:
            self._engine.swap_out()

    def copy_to(self, model: Any = None) -> None:
        """Writes the EMA weights into the model for good."""
        self._check_model(model, "copy_to")
        self._engine.copy_to()

    # --- state ----------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's EMA tensors and progress (for torch.save or DCP)."""
        return self._engine.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores state_dict() of the same rank, world size and layout."""
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict: expected a dict, got {type(state).__name__}")
        self._engine.load_state_dict(state)

    def save_checkpoint(self, folder: str) -> None:
        """Collective: this rank's file and (rank 0) the manifest in `folder`."""
        self._engine.save_checkpoint(str(folder))

    def load_checkpoint(self, folder: str) -> None:
        """Collective: every rank loads its file of a checkpoint of the same
        layout; if one rank fails, every rank raises and none changed."""
        self._engine.load_checkpoint(str(folder))

    def export_weights(self, path: str, dtype: torch.dtype = torch.float32) -> None:
        """Collective: rank 0 writes deployable safetensors of the full
        tensors (floating ones as `dtype`)."""
        self._engine.export_weights(str(path), dtype)

    def full_state_dict(self, rank0_only: bool = True,
                        names: Optional[Sequence[str]] = None) -> Dict[str, torch.Tensor]:
        """Collective: the full EMA tensors as CPU tensors, on rank 0 (empty
        dict on the others) or on every rank; `names` (the same on every
        rank): just those, else all. For small models and tests;
        export_weights() streams large ones."""
        chosen = None if names is None else [str(n) for n in names]
        return dict(self._engine.full_state_dict(rank0_only, chosen))

    def local_ema(self) -> Dict[str, torch.Tensor]:
        """This rank's EMA pieces (1-D clones), the elements it owns."""
        return dict(self._engine.local_ema())

    def offload_stats(self) -> Dict[str, Any]:
        """What the background pipeline has done so far, all updates:
        updates, chunks, source_bytes (read from the parameters), staged_bytes
        (of those, copied through pinned staging: device parameters),
        staging_bytes (held), fence_wait_seconds / last_fence_wait_seconds
        (time the training loop blocked in fence()) and waiter_chunks (chunks
        whose math ran on the thread blocked in fence()/wait() because no
        worker had started them). A fence wait near zero means the EMA was
        hidden behind the training step."""
        return dict(self._engine.offload_stats())
