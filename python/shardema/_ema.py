"""shardema.EMA: the EMA of a model's (local shards of) weights, in pinned
host memory, updated in the background."""
import contextlib
import warnings
from datetime import timedelta
from typing import Any, Dict, Iterable, Iterator, Optional, Sequence, Union

import torch

from . import _C
from ._model import Plan, checked_group, is_dtensor, module_tensors, named_tensors, plan_layout, \
    refuse_tensor_parallel, unwrap
from ._replicas import write_on_first_replica
from ._selection import select
from ._shards import as_local_shard
from . import _ema_values
from ._view import copy_model_into_ema, materialize, model_values, reshard_fsdp


_optimizer_fence = None


def _fence_before_every_optimizer_step() -> None:
    """Once per process: torch's global optimizer step pre-hook fences every
    EMA (the C++ registry, shardema._C.fence_every_averager), so an update
    in flight has read the weights before any optimizer writes them: the
    ema-pytorch loop, optimizer.step() then ema.update() with no fence(),
    is exact, and so is update() before optimizer.step()."""
    global _optimizer_fence
    if _optimizer_fence is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _optimizer_fence = register_optimizer_step_pre_hook(
            lambda optimizer, args, kwargs: _C.fence_every_averager())


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
    ignore_names, ignore_prefixes: names (state_dict keys) left out of the
    EMA, exactly or by prefix (ema-pytorch's ignore_names and
    ignore_startswith_names): not averaged, saved or exported; swap(),
    copy_to() and module() leave them at the model's own values.
    copy_names: names whose current value is copied at each due update
    instead of averaged (ema-pytorch's param_or_buffer_names_no_ema). A name
    or prefix that matches no tracked tensor is a ValueError.

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
                 refuse_non_finite: bool = False, ignore_names: Iterable[str] = (),
                 ignore_prefixes: Iterable[str] = (), copy_names: Iterable[str] = ()) -> None:
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
        tracked = select(tracked, ignore_names, ignore_prefixes, copy_names)
        # What copy_from() reads when there is no model: the tensors given.
        self._given = None if self._model is not None else [(t.name, t.tensor) for t in tracked]
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
        self._given = None  # copy_from() reads the local shards' tensors
        self._local_shards = local
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
        _fence_before_every_optimizer_step()
        self._hooks: list = []
        self._watched = plan.watched
        self._replicas = plan.replicas  # HSDP: only the first replica writes files
        self._timeout_s = _seconds(timeout)  # HSDP's waiting replicas honour it too
        # Shard(d > 0) DTensors by name: kept out of the engine's per-rank
        # files (refuse_tensor_parallel); its gathers reorder them.
        self._tensor_parallel = plan.tensor_parallel
        self._aliases = plan.aliases  # tied tensors' other names, for load_ema_values()
        self._schedule = schedule
        self._more_schedules = list(more_schedules)
        # The parameters whose requires_grad decides, at each update, whether
        # their shard is averaged or copied (in shard order), and each one's
        # place in that list by shard index (a replaced one is followed).
        # Held here, not by the engine: see PythonEma::Owner.
        self._deciders = [owner[2] for owner in plan.owners
                          if len(owner) > 2 and owner[2] is not None]
        self._decider_of = {}
        for index, owner in enumerate(plan.owners):
            if len(owner) > 2 and owner[2] is not None:
                self._decider_of[index] = len(self._decider_of)
        self._engine = _C.Ema(plan.group, _seconds(timeout), plan.shards, plan.whole, schedule,
                              list(more_schedules), bool(copy_on_first_update), storage,
                              chunk_bytes, int(num_slots), bool(fence_in_update),
                              engine, plan.layout, plan.owners, bool(refuse_non_finite))
        # How this rank holds each tracked tensor, for ema_tensors() and
        # load_ema_values().
        self._held = _ema_values.held_of(plan)

    # --- stepping -------------------------------------------------------
    def update(self, step: Optional[int] = None) -> bool:
        """Folds the current weights in as optimizer step `step` (1-based,
        increasing; None: one more than the last). Returns at once; whether
        the schedule said the step was due.

        A tracked tensor replaced since (a new nn.Parameter, `p.data = t`)
        is followed, with a warning, when its shape, dtype and device are the
        same; otherwise this raises a ValueError naming it (module.to(dtype)
        after building the EMA, say)."""
        # One C loop each over the lists kept here (_follow mutates them in
        # place): a Python loop over 1000 tensors cost 0.5 ms with cold caches.
        if self._watched:
            for i in _C.replaced_watched(self._watched):
                self._follow(i)
        if self._deciders:
            self._engine.mirror_trainable(self._deciders)
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
        if index in self._decider_of:
            self._deciders[self._decider_of[index]] = replacement

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
    def schedule(self) -> "_C.DecaySchedule":
        """The decay schedule: update(n) averages with schedule.decay_at(n)
        when schedule.is_due_at(n), so the next update() uses
        schedule.decay_at(step + 1)."""
        return self._schedule

    def get_current_decay(self) -> float:
        """What ema-pytorch's EMA.get_current_decay() returns at the same
        point of the loop: the schedule's decay at the last step folded in
        (0.0 before any), the decay that update averaged with if it was due
        (ema-pytorch counts the call before computing it). The next update()
        uses schedule.decay_at(step + 1)."""
        return self._schedule.decay_at(self.step) if self.step > 0 else 0.0

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
        replicated model on several ranks. An FSDP2 model is resharded on
        entry and exit, so that forwards see what the shards hold."""
        self.swap_in(model)
        try:
            yield
        finally:
            self.swap_out()

    @property
    def swapped(self) -> bool:
        """Whether the EMA is swapped into the model (swap_in(), or inside
        swap())."""
        return self._engine.swapped

    def swap_in(self, model: Any = None) -> None:
        """swap()'s entry, for hooks that cannot hold a with-block (a
        trainer's validation start and end): the EMA weights into the model
        (its local shards), the raw ones kept for swap_out(). A failure (a
        gather that times out) puts the raw weights back before it raises.
        RuntimeError when already swapped in (swaps do not nest). Collective
        for a replicated model on several ranks. FSDP2 modules are resharded
        first, so that forwards see what the shards hold."""
        self._check_model(model, "swap_in")
        reshard_fsdp(self._model)
        self._engine.swap_in()

    def swap_out(self, model: Any = None) -> None:
        """swap()'s exit: the raw weights back (nothing to do when not
        swapped in), then FSDP2 modules resharded. No communication."""
        self._check_model(model, "swap_out")
        self._engine.swap_out()
        reshard_fsdp(self._model)

    def copy_to(self, model: Any = None) -> None:
        """Writes the EMA weights into the model for good."""
        self._check_model(model, "copy_to")
        self._engine.copy_to()
        reshard_fsdp(self._model)

    def module(self, device: Any = None, into: Optional[torch.nn.Module] = None) -> torch.nn.Module:
        """A module holding what swap() would put in the model (the EMA
        weights, the model's own values for names left out of the EMA),
        without touching the model: ema-pytorch's ema_model, built on
        demand. A snapshot: call it again after more updates.

        device=None: a deep copy of the model whose parameters and buffers
        are on `device` (None: each where the model's is), in the model's
        dtypes, with requires_grad False: one model-sized copy, plus under a
        split layout (DDP, rank0) full tensors gathered 64 MiB at a time.
        into: a module of the same structure to write into instead, and
        return; needed under FSDP2, whose models torch will not deep-copy:
        build the same model and fully_shard it the same way, and each rank
        writes only its local rows (one shard-sized copy per rank).
        Collective where rows are gathered (several ranks: every rank calls
        it). Waits for the update in flight. FSDP2 modules (the model's and
        into's) are resharded first, their values unchanged."""
        if self._model is None:
            raise ValueError("EMA.module: this EMA was built from named tensors or local shards, "
                             "not a model; read it with full_state_dict() or local_ema()")
        self._refuse_fsdp1("module")
        return materialize(self, self._model, device, into)

    def _refuse_fsdp1(self, api: str) -> None:
        # Under FSDP1 a rank's EMA of a parameter is a range of a flattened
        # FlatParameter shard: neither a DTensor (state_dict) nor a module
        # sharded like the model (module, copy_from) can describe it.
        if self.layout == "fsdp1":
            raise ValueError(f"EMA.{api} is not supported for an FSDP1 model "
                             "(FullyShardedDataParallel: each rank's EMA is a range of a "
                             "flattened parameter); use save_checkpoint() / load_checkpoint(), "
                             "export_weights(), full_state_dict() or swap()")

    def copy_from(self, model: Any = None) -> None:
        """The EMA of every tracked tensor becomes its current value (ema-
        pytorch's copy_params_from_model_to_ema), after the update in
        flight. The step and the schedule go on, as in ema-pytorch: the
        next update averages into these values with the schedule's decay at
        its step (to restart a warmup, build a new EMA). This rank's rows
        only, no communication. Refused inside swap() (the model holds the
        EMA there) and with more_schedules (one profile would move)."""
        self._check_model(model, "copy_from")
        self._refuse_fsdp1("copy_from")
        if self.swapped:
            raise RuntimeError("EMA.copy_from: the EMA is swapped into the model; leave swap() "
                               "first (the model holds the EMA weights inside it)")
        if self._more_schedules:
            raise ValueError("EMA.copy_from: this EMA has more_schedules; copying the model into "
                             "one profile only would leave them inconsistent")
        if self._model is not None:
            full, local = model_values(self._model)
        elif self._given is not None:
            full = [(n, t) for n, t in self._given if not is_dtensor(t)]
            local = [(n, t.to_local()) for n, t in self._given if is_dtensor(t)]
        else:
            full, local = [], [(s.spec.name, s.local) for s in self._local_shards]
        copy_model_into_ema(self, full, local)

    # --- state ----------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """{"weights": {name: tensor}, "progress": {...}}, for DCP beside the
        model and optimizer (or torch.save with one process): fresh copies,
        fp32 where averaged; DTensors (Shard(0) rows) where ranks hold rows,
        so DCP reshards them on another world size. The progress is plain
        values, equal on every rank. See docs/python.md, "Checkpoints with
        torch.distributed.checkpoint"."""
        self._refuse_fsdp1("state_dict")
        from . import _dcp
        return _dcp.state_dict(self)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Adopts state_dict()'s structure as DCP (or torch.load) filled it,
        at any world size; {} (what shardema.EMALoadPlanner leaves for a
        checkpoint without an EMA) restarts the EMA from the model's weights
        at step 0, with a warning. An older state_dict() ({"tensors",
        "metadata"}) loads on the same rank, world size and layout."""
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict: expected a dict, got {type(state).__name__}")
        if "tensors" in state and "metadata" in state:
            self._engine.load_state_dict(state)
            return
        self._refuse_fsdp1("load_state_dict")
        from . import _dcp
        _dcp.load_state_dict(self, state)

    def save_checkpoint(self, folder: str) -> None:
        """Collective: this rank's file and (rank 0) the manifest in `folder`."""
        refuse_tensor_parallel(self._tensor_parallel, "save_checkpoint")
        write_on_first_replica(self._replicas, lambda: self._engine.save_checkpoint(str(folder)),
                               self._timeout_s, "save_checkpoint")

    def load_checkpoint(self, folder: str) -> None:
        """Collective: every rank loads its file of a checkpoint of the same
        layout; if one rank fails, every rank raises and none changed."""
        refuse_tensor_parallel(self._tensor_parallel, "load_checkpoint")
        self._engine.load_checkpoint(str(folder))

    def export_weights(self, path: str, dtype: torch.dtype = torch.float32) -> None:
        """Collective: rank 0 writes deployable safetensors of the full
        tensors (floating ones as `dtype`)."""
        write_on_first_replica(self._replicas,
                               lambda: self._engine.export_weights(str(path), dtype),
                               self._timeout_s, "export_weights")

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

    def ema_tensors(self, names: Optional[Sequence[str]] = None) -> Dict[str, torch.Tensor]:
        """The EMA of each tracked tensor (`names`, the same on every rank;
        else all) in the shape this rank holds the tensor in: a DTensor's
        to_local() (its rows under Shard(0), the whole under Replicate()),
        the whole of a plain tensor. Fresh copies (float32 where averaged)
        where the EMA lives (host memory by default), gathered ones on the
        CPU. Collective where this rank holds the whole of a tensor
        whose EMA the ranks split (a plain tensor under DDP or
        layout="rank0", a Replicate() DTensor): those are gathered, so every
        rank calls it. Waits for the update in flight."""
        return _ema_values.ema_tensors(self, self._held, names)

    def load_ema_values(self, values: Dict[str, Any], strict: bool = True) -> None:
        """The EMA of each named tensor becomes the value given (converted to
        the EMA's dtype): a DTensor, or a tensor shaped as ema_tensors()
        gives it, stands for what this rank holds (each rank keeps its rows
        of a whole); a plain tensor of a DTensor's full shape is the whole,
        of which this rank takes its part (a checkpoint every rank reads
        whole). The step and the schedule are unchanged. strict: every
        tracked name must be given (else the others keep their EMA). One
        ValueError lists every missing, unexpected and misshapen name, and
        then nothing was loaded. No communication; waits for the update in
        flight."""
        _ema_values.load_ema_values(self, self._held, values, bool(strict))

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
