"""shardema.EMA: the EMA of a model's (local shards of) weights, in pinned
host memory, updated in the background. A thin map over the engine
(shardema._C.Ema, the C++ PythonEma): the constructor's arguments
(_ema_arguments.py), the plan of what this rank tracks (_model.py,
_fsdp1.py, _zero3.py), what is watched of the model (_model_watch.py), the model
half (swap, copy_to, module, copy_from: _ema_model_transfer.py) and the
state and files half (_ema_state.py)."""
from datetime import timedelta
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from . import _C, _ema_arguments, _optimizer_fence
from ._ema_model_transfer import EmaModelTransfer, _are_parameters
from ._ema_state import EmaState
from ._ema_values import held_of
from ._model import Plan, checked_group, module_tensors, named_tensors, plan_layout, unwrap
from ._model_watch import replan, watch_of
from ._selection import keep_trainable, select
from ._shards import as_local_shard


class EMA(EmaModelTransfer, EmaState):
    """The EMA of a model, or of named tensors, on this rank.

    model_or_named_tensors: an nn.Module (DDP-wrapped or not; FSDP2, FSDP1,
    HSDP and tensor-parallel DTensor parameters included; a DeepSpeed ZeRO-3
    engine or its module) or (name, tensor) pairs.

    The decay, one of:
    - ema-pytorch's arguments, with its defaults for the ones not given:
      beta (0.9999), update_after_step (100), update_every (10), power
      (2/3), inv_gamma (1.0), min_value (0.0): its warmup schedule;
    - timm's and Lightning's: decay (0.9999), warmup (False; timm's
      use_warmup), min_decay, warmup_gamma, warmup_power, and
      update_after_step (0) / update_every (1): the first update copies,
      then `decay` (or timm's warmup up to it);
    - schedule: a DecaySchedule (warmup, constant, power_function);
    - none of them: DecaySchedule.warmup() (power 0.75, max 0.9999).
    Several EMAs of the same weights from one read of them, one profile
    each, in the order given: schedules=[DecaySchedule, ...] (any mix), or
    a list as beta= or decay= (the other arguments shared). Every read
    takes profile= (an index, default 0): swap, copy_to, module,
    ema_tensors, full_state_dict, export_weights, get_current_decay;
    state_dict() and checkpoints hold every profile. docs/python.md,
    "Several EMAs from one read".
    policy: "ema_pytorch" (default, as ema-pytorch, timm and Lightning's
    EMAWeightAveraging: every floating parameter and buffer averaged,
    BatchNorm's and frozen ones included; integer buffers copied once) or
    "versatil" (VersatIL's callback: buffers and BatchNorm parameters copied
    at each update, frozen parameters copied while frozen).
    storage: "pinned_host" (the EMA in host memory, updated in the
    background) or "device" (beside the parameters, synchronous).
    layout: "auto" (FSDP2 for DTensor parameters; "replicated" under an
    initialised process group; one process otherwise), "replicated" (DDP:
    each rank averages its rows), "rank0" (rank 0 keeps all of it) or
    "fsdp2". process_group: the group of the collectives (default: the
    mesh's for FSDP2, the default group otherwise).
    chunk_mib, num_slots: the staging of the offload pipeline (default: the
    engine's, shardema._C.default_chunk_bytes and default_num_slots).
    refuse_non_finite: True makes update() check the weights for NaN and Inf
    first and raise a ValueError naming the tensor (the step not taken).
    ignore_names, ignore_prefixes (ema-pytorch's ignore_startswith_names):
    state_dict keys left out of the EMA; swap(), copy_to() and module()
    leave them at the model's own values. copy_names (ema-pytorch's
    param_or_buffer_names_no_ema): copied at each due update instead of
    averaged. A name that matches no tracked tensor is a ValueError.
    trainable_only: True keeps the EMA of the parameters that require grad
    only (LoRA adapters, a fine-tuned head): frozen parameters and buffers
    take no host memory and no update reads them; swap(), copy_to(),
    module(), checkpoints and export_weights() leave them to the model
    (export_weights(include_untracked=True) writes the model's own beside
    the EMA). A left-out parameter that requires grad later is a ValueError
    naming it at the next update, swap or copy; a kept one frozen later is
    still averaged. A model only (not named tensors), not FSDP1.

    Call update() after optimizer.step() (or before it): every optimizer
    step first waits until the EMA has read the weights, so the loop needs
    no fence(). docs/python.md, "Writes to the weights", says which other
    writes are safe and when.
    """

    def __init__(self, model_or_named_tensors: Any, schedule: Optional["_C.DecaySchedule"] = None,
                 policy: str = "ema_pytorch", storage: str = "pinned_host", layout: str = "auto",
                 process_group: Any = None, chunk_mib: Optional[float] = None,
                 num_slots: Optional[int] = None, *, beta: Optional[float] = None,
                 update_after_step: Optional[int] = None, update_every: Optional[int] = None,
                 power: Optional[float] = None, inv_gamma: Optional[float] = None,
                 min_value: Optional[float] = None, decay: Optional[float] = None,
                 warmup: Optional[bool] = None, min_decay: Optional[float] = None,
                 warmup_gamma: Optional[float] = None, warmup_power: Optional[float] = None,
                 copy_on_first_update: bool = True, fence_in_update: bool = False,
                 engine: str = "auto", timeout: Union[float, timedelta] = 300.0,
                 schedules: Optional[Sequence["_C.DecaySchedule"]] = None,
                 refuse_non_finite: bool = False, ignore_names: Iterable[str] = (),
                 ignore_prefixes: Iterable[str] = (), copy_names: Iterable[str] = (),
                 trainable_only: bool = False, **other_libraries: Any) -> None:
        # What a copy or an unpickled EMA is built with again (__getstate__).
        arguments = {k: v for k, v in locals().items()
                     if k not in ("self", "model_or_named_tensors", "other_libraries")}
        arguments.update(other_libraries)
        renamed = _ema_arguments.split_foreign(other_libraries)
        warmup = renamed.pop("warmup", warmup)
        ignore_prefixes = renamed.pop("ignore_prefixes", ignore_prefixes)
        copy_names = renamed.pop("copy_names", copy_names)
        policy = _ema_arguments.policy_of(policy)
        profiles = _ema_arguments.schedules_of(schedule, schedules, *_ema_arguments.families(
            beta, power, inv_gamma, min_value, decay, warmup, min_decay, warmup_gamma,
            warmup_power, update_after_step, update_every))
        options = _ema_arguments.options_of(
            profiles, storage=storage, chunk_mib=chunk_mib, num_slots=num_slots,
            copy_on_first_update=copy_on_first_update, fence_in_update=fence_in_update,
            engine=engine, timeout=timeout, refuse_non_finite=refuse_non_finite)
        if not isinstance(trainable_only, bool):
            raise TypeError(f"shardema.EMA: trainable_only must be a bool, got {trainable_only!r}")
        model = unwrap(model_or_named_tensors)
        # Kept for a replan: a generator would be spent after the first use
        # (a string or a non-collection stays as given, for select()'s error).
        selection = tuple(x if isinstance(x, (str, bytes)) or not isinstance(x, Iterable)
                          else tuple(x) for x in (ignore_names, ignore_prefixes, copy_names))
        if isinstance(model, torch.nn.Module):
            kept: list = []  # trainable_only: the names kept at construction

            def plan_again() -> Plan:
                # The model as it is now: the plan at construction, and the
                # one a changed model is compared against (_model_watch.py).
                tracked, frozen = select(module_tensors(model, policy), *selection), []
                if trainable_only:
                    tracked, frozen = keep_trainable(tracked, kept)
                planned = plan_layout(tracked, layout, process_group)
                planned.frozen = frozen
                return planned
            self._model, self._given, self._plan_again = model, None, plan_again
            self._rebuild = (model, arguments)
            plan = plan_again()
            kept.extend(shard.spec.name for shard in plan.shards)
        else:
            if trainable_only:
                raise ValueError("shardema.EMA: trainable_only=True needs an nn.Module; with "
                                 "named tensors, pass only the tensors to average")
            items = list(model.items()) if isinstance(model, dict) else model
            items = list(items) if isinstance(items, Iterable) and \
                not isinstance(items, (str, bytes, torch.Tensor)) else items
            self._rebuild = (items, arguments)
            tracked = select(self._named(items, model_or_named_tensors, policy), *selection)
            # What copy_from() reads when there is no model: the tensors given.
            self._model, self._plan_again = None, None
            self._given = [(t.name, t.tensor) for t in tracked]
            plan = plan_layout(tracked, layout, process_group)
        self._build(plan, options)

    @staticmethod
    def _named(model: Any, given: Any, policy: str) -> list:
        if isinstance(model, dict):
            return named_tensors(list(model.items()), policy)
        if isinstance(model, Iterable) and not isinstance(model, (str, bytes, torch.Tensor)):
            return named_tensors(list(model), policy)
        raise TypeError("shardema.EMA: model_or_named_tensors must be an nn.Module, a dict of "
                        f"tensors or (name, tensor) pairs, got {type(given).__name__}")

    @classmethod
    def from_local_shards(cls, shards: Sequence[Any], schedule: Optional["_C.DecaySchedule"] = None,
                          storage: str = "pinned_host", process_group: Any = None,
                          chunk_mib: Optional[float] = None, num_slots: Optional[int] = None,
                          *, copy_on_first_update: bool = True, fence_in_update: bool = False,
                          engine: str = "auto", timeout: Union[float, timedelta] = 300.0,
                          schedules: Optional[Sequence["_C.DecaySchedule"]] = None,
                          refuse_non_finite: bool = False) -> "EMA":
        """The EMA of this rank's local shards, each a shardema.LocalShard, a
        dict {local, spec[, role]} or a tuple (local, spec[, role]) with spec
        a shardema.ShardSpec, a dict or a (name, global_shape, dtype, kind,
        ranges) tuple: FSDP1 (FlatParamLayout.shards_from_flat_param) or any
        split. Every rank of process_group (default: the default group, or
        one process) calls it with specs for the group's world size."""
        self = cls.__new__(cls)
        self._model, self._given, self._plan_again = None, None, None
        self._rebuild = None  # local shards are one process's: not copied
        group = checked_group(process_group)
        if group is None:
            from ._model import _default_group
            group = _default_group()
        local = [as_local_shard(s, i) for i, s in enumerate(shards)]
        self._local_shards = local  # what copy_from() reads
        options = _ema_arguments.options_of(
            _ema_arguments.schedules_of(schedule, schedules, {}, {}, {}), storage=storage,
            chunk_mib=chunk_mib, num_slots=num_slots, copy_on_first_update=copy_on_first_update,
            fence_in_update=fence_in_update, engine=engine, timeout=timeout,
            refuse_non_finite=refuse_non_finite)
        self._build(Plan("local_shards", group, local, []), options)
        return self

    # --- copies and pickling -----------------------------------------------
    def __getstate__(self) -> dict:
        """What copy.deepcopy and pickle carry: the model (or the named
        tensors), the constructor's arguments and the state_dict() (the EMA
        values and progress). Built again from them, the copy is an
        independent EMA of the copied model, as deepcopy of a model that
        holds one (or Lightning's ddp_spawn) expects. An EMA over a process
        group or of local shards belongs to its ranks: a TypeError."""
        if self.swapped:
            # The model copied with it holds the EMA where its raw weights
            # belong, and the copy could never swap them back.
            raise TypeError("shardema.EMA: copied or pickled inside swap(); the model holds the "
                            "EMA weights there, not its own: copy it after the swap ends")
        if self._rebuild is None:
            raise TypeError("shardema.EMA: an EMA built with from_local_shards() cannot be "
                            "copied or pickled (its shards belong to this process's ranks); "
                            "save_checkpoint() and build a new one")
        if self._group is not None:
            # FSDP1's and ZeRO-3's ranges have no state_dict() (_refuse_fsdp1):
            # advise only what works for this layout.
            keep = "save_checkpoint() (or export_weights() for the weights alone)" \
                if self.layout in ("fsdp1", "zero3") else "state_dict() or save_checkpoint()"
            raise TypeError("shardema.EMA: an EMA over a process group cannot be copied or "
                            f"pickled (its ranks hold it together); use {keep} and build a new "
                            "EMA in the new process")
        model, arguments = self._rebuild
        return {"model": model, "arguments": arguments, "state": self.state_dict()}

    def __setstate__(self, saved: dict) -> None:
        self.__init__(saved["model"], **saved["arguments"])
        self.load_state_dict(saved["state"])

    def _build(self, plan: Plan, options: "_C.EmaOptions") -> None:
        _optimizer_fence.install()
        self._group = plan.group  # None: one process (copies and pickling allowed)
        self._hooks: list = []
        self._attached: list = []  # the optimizers attach() hooked, to refuse a second
        self._replicas = plan.replicas  # HSDP: only the first replica writes files
        self._timeout_s = options.timeout_seconds  # HSDP's waiting replicas honour it too
        # Shard(d > 0) DTensors by name: kept out of the engine's per-rank files.
        self._tensor_parallel = plan.tensor_parallel
        self._aliases = plan.aliases  # tied tensors' other names, for load_ema_values()
        self._schedules = list(options.schedules)  # one per profile, profile 0 first
        self._names = [shard.spec.name for shard in plan.shards]
        # Each tensor's other state_dict names and whether a key holds it,
        # which a DCP state records for readers without the model (_dcp_progress.py).
        self._state_dict_names = {shard.spec.name: (list(shard.aliases), bool(shard.persistent))
                                  for shard in plan.shards}
        slots, edges, counted, deciders = watch_of(self._model, plan, self._names)
        self._engine = _C.Ema(process_group=plan.group, shards=plan.shards,
                              whole_tensors=plan.whole, options=options, layout=plan.layout,
                              slots=slots, edges=edges, counted=counted, deciders=deciders,
                              frozen=plan.frozen)
        # How this rank holds each tracked tensor, for ema_tensors() and
        # load_ema_values().
        self._held = held_of(plan)

    def _replan(self) -> tuple:
        """The engine asks when the model's structure changed (a submodule
        replaced, a tensor added or removed): the new watch and the tensors
        to follow, or a ValueError naming what changed."""
        if self._plan_again is None:
            raise ValueError("shardema.EMA: the tensors changed after the EMA was built; build "
                             "a new EMA")
        return replan(self._model, self._plan_again, self._names, self.layout)

    # --- stepping -------------------------------------------------------
    def update(self, model_or_step: Any = None, step: Optional[int] = None) -> bool:
        """Folds the current weights in as optimizer step `step` (1-based,
        increasing; None: one more than the last): update(), update(n) or
        update(step=n). Returns at once; whether the schedule said the step
        was due. One call into the engine, which first checks the model: a
        tensor replaced since (a new nn.Parameter, `p.data = t`, a submodule
        of the same shapes) is followed with a warning, anything else
        (another shape or dtype, a DTensor, a tensor added or removed) is a
        ValueError naming it.
        timm's update(model) and update(model, step=n) are taken too, where
        `model` is the module the EMA was built on (or a DDP, DeepSpeed or
        torch.compile wrapper of it): the EMA always reads that model, so
        another one is a ValueError."""
        if step is not None or (model_or_step is not None and type(model_or_step) is not int):
            model_or_step = self._step_beside(model_or_step, step)
        return self._engine.update(model_or_step, self._replan)

    def _step_beside(self, first: Any, step: Any) -> Any:
        """update()'s step when the first argument is not a plain step: the
        model (timm's habit, checked), the step again, or parameters."""
        if first is None:
            return step
        if isinstance(first, torch.nn.Module) or _are_parameters(first):
            self._check_model(first, "update")
            return step
        if step is not None:
            raise TypeError(f"shardema.EMA.update: the step given twice ({first!r} and "
                            f"step={step!r}); call update(step) or update(model, step=step)")
        return first  # the engine names what is wrong with the step

    def fence(self) -> None:
        """Returns once the last update has read the weights. Every optimizer
        step calls it for you; call it yourself before any other in-place
        write to the weights that must not wait for the next update()."""
        self._engine.fence()

    def wait(self) -> None:
        """Returns once the last update's math is done (raises its error)."""
        self._engine.wait()

    def attach(self, optimizer: torch.optim.Optimizer) -> "EMA":
        """update() after every step of `optimizer`, through its step post
        hook, returns self. detach() removes it. Attaching to the same
        optimizer twice is a ValueError (each step would update twice)."""
        if any(attached is optimizer for attached in self._attached):
            raise ValueError(f"shardema.EMA.attach: already attached to this "
                             f"{type(optimizer).__name__}; each of its steps would update the "
                             "EMA twice (detach() first)")
        self._hooks.append(optimizer.register_step_post_hook(lambda *_: self.update()))
        self._attached.append(optimizer)
        return self

    def detach(self) -> None:
        """Removes the hook attach() registered."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._attached.clear()

    @property
    def step(self) -> int:
        """The last step folded in (0 before any)."""
        return self._engine.step

    @property
    def last_decay(self) -> float:
        """The decay of the last due update (0 before any), profile 0's
        (get_current_decay(profile=p) for another)."""
        return self._engine.last_decay(0)

    @property
    def schedule(self) -> "_C.DecaySchedule":
        """The decay schedule (of profile 0): update(n) averages with
        schedule.decay_at(n) when schedule.is_due_at(n), so the next
        update() uses schedule.decay_at(step + 1)."""
        return self._schedules[0]

    @property
    def schedules(self) -> list:
        """One DecaySchedule per profile, profile 0 first (a list of one
        unless built with schedules=, beta=[...] or decay=[...])."""
        return list(self._schedules)

    def get_current_decay(self, profile: int = 0) -> float:
        """What ema-pytorch's EMA.get_current_decay() returns at the same
        point of the loop: the schedule's decay at the last step folded in
        (0.0 before any), of `profile`. The next update() uses
        schedules[profile].decay_at(step + 1)."""
        schedule = self._schedules[self._profile(profile, "get_current_decay")]
        return schedule.decay_at(self.step) if self.step > 0 else 0.0

    @property
    def rank(self) -> int:
        return self._engine.rank

    @property
    def world_size(self) -> int:
        return self._engine.world_size

    @property
    def layout(self) -> str:
        return self._engine.layout
