"""EMACallback: VersatIL's Lightning EMACallback as a drop-in (a warmup
EMA updated on optimizer steps only, the validation swap), over
shardema.EMA; its checkpoints are _ema_callback_checkpoint.py's."""
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _C, _ema_arguments
from ._ema import EMA
from ._ema_callback_checkpoint import CheckpointHooks
from ._fsdp1 import fsdp1_names, fsdp1_non_persistent, fsdp1_root
from ._ema_arguments import POLICIES, STORAGES
from ._lightning import CALLBACK_BASES, optimizer_stepped, refuse_two_validation_swaps, reshard, \
    submodule
from ._model import LAYOUTS, is_dtensor, module_tensors, unwrap, wrapper_prefix
from ._selection import keep_trainable

class EMACallback(CheckpointHooks, *CALLBACK_BASES):  # type: ignore[misc]
    """Warmup EMA of the LightningModule (or of its `attribute`, e.g.
    "policy"), in pinned host memory, sharded as the module is.

    schedule: another DecaySchedule (e.g. DecaySchedule.constant(0.999,
    update_every=2)) instead of the warmup that power, inv_gamma, min_value
    and max_value describe (give one or the other). update_after_step: the
    average starts after this optimizer step; in the warmup it is the
    schedule's own (decay 0, the weights copied, up to step
    update_after_step + 1), with another schedule the steps up to it are
    skipped. copy_on_first_update: the first due update copies the weights
    (Lightning's EMAWeightAveraging, ema-pytorch) instead of averaging with
    the weights at fit start (VersatIL, the default). validate_with_ema
    (default True, the seed's): validation runs with the EMA swapped into
    the module; with several EMA callbacks on one module, give all but one
    False. copy_ema_at_fit_end (default False, the seed's): True writes the
    EMA into the module when fit ends, as Lightning's EMAWeightAveraging
    does, so the trained module holds the average. policy (default
    "versatil", the seed's: buffers and BatchNorm parameters copied, frozen
    parameters copied while frozen; "ema_pytorch": every floating parameter
    and buffer averaged, as Lightning's EMAWeightAveraging), storage and
    layout as shardema.EMA's. trainable_only (default False): the EMA of
    the parameters that require grad at fit start only (LoRA adapters),
    as shardema.EMA's; checkpoints then hold the EMA of those and the
    model's own frozen weights and buffers. schedules: several EMAs of the
    module from one read of its weights, one DecaySchedule per profile
    (instead of schedule= or the warmup's arguments); profile (default 0):
    the one validation runs with, copy_ema_at_fit_end writes and
    checkpoints hold as the model's weights (the others are kept beside
    them for a resume). Several profiles are for one process and DDP (not
    FSDP or DTensor models)."""

    #: Where the raw (online) weights are kept: a key of the checkpoint; in a
    #: distributed (DCP) checkpoint, a prefix of its state_dict keys, so
    #: each rank's rows are saved.
    RAW_STATE_KEY = "raw_policy_state_dict"
    #: The EMA as kept (float32) where state_dict's copy was narrowed to the
    #: model's dtype (bf16 and fp16 models), so a resume loses nothing; a
    #: key or a state_dict prefix as RAW_STATE_KEY.
    EMA_FLOAT32_KEY = "ema_state_dict_float32"
    #: The callback's own record: whether the average had started, and
    #: which state_dict entries of a distributed checkpoint are its own.
    STATE_KEY = "shardema_ema"
    #: With several profiles (schedules=), the full EMA of each profile but
    #: the one the state_dict holds (`profile`), by profile index: a key of
    #: the checkpoint.
    EMA_PROFILES_KEY = "ema_profiles_state_dict"

    _WARMUP_DEFAULTS = {"power": 0.75, "inv_gamma": 1.0, "min_value": 0.0, "max_value": 0.9999}

    def __init__(self, power: float = 0.75, update_after_step: int = 0, inv_gamma: float = 1.0,
                 min_value: float = 0.0, max_value: float = 0.9999,
                 attribute: Optional[str] = None, *, schedule: Optional["_C.DecaySchedule"] = None,
                 copy_on_first_update: bool = False, storage: str = "pinned_host",
                 layout: str = "auto", process_group: Any = None,
                 validate_with_ema: bool = True, copy_ema_at_fit_end: bool = False,
                 policy: str = "versatil", trainable_only: bool = False,
                 schedules: Optional[Sequence["_C.DecaySchedule"]] = None,
                 profile: int = 0) -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"EMACallback: policy must be one of {', '.join(map(repr, POLICIES))}"
                             f", got {policy!r}")
        self.policy = policy
        for name, flag in (("copy_on_first_update", copy_on_first_update),
                           ("validate_with_ema", validate_with_ema),
                           ("copy_ema_at_fit_end", copy_ema_at_fit_end),
                           ("trainable_only", trainable_only)):
            if not isinstance(flag, bool):
                raise TypeError(f"EMACallback: {name} must be a bool, got {flag!r}")
        if storage not in STORAGES:
            raise ValueError(f"EMACallback: storage must be one of {STORAGES}, got {storage!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"EMACallback: layout must be one of {LAYOUTS}, got {layout!r}")
        if attribute is not None and not isinstance(attribute, str):
            raise TypeError(f"EMACallback: attribute must be a str (the LightningModule's "
                            f"attribute holding the module), got {type(attribute).__name__}")
        self.validate_with_ema = validate_with_ema
        self.copy_ema_at_fit_end = copy_ema_at_fit_end
        self.trainable_only = trainable_only
        self.power = power
        self.update_after_step = update_after_step
        self.inv_gamma = inv_gamma
        self.min_value = min_value
        self.max_value = max_value
        self.attribute = attribute
        self.copy_on_first_update = bool(copy_on_first_update)
        self.decay = 0.0
        self.ema: Optional[EMA] = None
        self._storage = storage
        self._layout = layout
        self._process_group = process_group
        self._resume_ema_state: Optional[Dict[str, Any]] = None
        # FSDPStrategy's FSDP1 root around the LightningModule (on_fit_start),
        # which the EMA is built over, and the names (Lightning's keys) of
        # what it averages that a state dict holds; None without FSDP1.
        self._root: Any = None
        self._root_saved: List[str] = []
        # Whether a due update has been folded in: a resumed average has
        # started, so its first update after the resume must not copy.
        self._started = False
        self._own_schedule = schedule is not None or schedules is not None
        if schedules is not None:
            given = {k: v for k, v in (("power", power), ("inv_gamma", inv_gamma),
                                       ("min_value", min_value), ("max_value", max_value))
                     if v != self._WARMUP_DEFAULTS[k]}
            if schedule is not None or given:
                raise ValueError(f"EMACallback: schedules= and "
                                 f"{sorted(given) + (['schedule'] if schedule else [])} both "
                                 "describe the decay; give one or the other")
            try:
                self._schedules = _ema_arguments.schedules_of(None, schedules, {}, {}, {})
            except (TypeError, ValueError) as error:
                raise type(error)(f"EMACallback: {str(error).replace('shardema.EMA: ', '')}") \
                    from None
            schedule = self._schedules[0]
        if schedule is None:
            # Validates the options now, as the seed's constructor stores them.
            try:
                self._schedule = _C.DecaySchedule.warmup(
                    inv_gamma=inv_gamma, power=power, min_value=min_value, max_value=max_value,
                    update_after_step=update_after_step)
            except (TypeError, ValueError) as error:
                raise type(error)(f"EMACallback: {error}") from None
        else:
            if not isinstance(schedule, _C.DecaySchedule):
                raise TypeError("EMACallback: schedule must be a shardema.DecaySchedule, got "
                                f"{type(schedule).__name__}")
            given = {k: v for k, v in (("power", power), ("inv_gamma", inv_gamma),
                                       ("min_value", min_value), ("max_value", max_value))
                     if v != self._WARMUP_DEFAULTS[k]}
            if given:
                raise ValueError(f"EMACallback: {sorted(given)} shape the warmup schedule; with "
                                 "schedule= give none of them")
            if int(update_after_step) < 0:
                raise ValueError("EMACallback: update_after_step must be >= 0, got "
                                 f"{update_after_step}")
            self._schedule = schedule
        if schedules is None:
            self._schedules = [self._schedule]
        count = len(self._schedules)
        if isinstance(profile, bool) or not isinstance(profile, int):
            raise TypeError(f"EMACallback: profile must be an int (an index into schedules), "
                            f"got {type(profile).__name__} {profile!r}")
        if not 0 <= profile < count:
            raise IndexError(f"EMACallback: profile {profile} does not exist; the callback "
                             f"keeps {count} profile{'s' if count > 1 else ''} (0 to "
                             f"{count - 1}; several with schedules=)")
        self.profile = profile
        # The other profiles of a checkpoint, for the EMA at on_fit_start.
        self._resume_profiles: Dict[int, Dict[str, Any]] = {}

    def _target(self, pl_module: Any) -> torch.nn.Module:
        # The module inside a compiled attribute (self.net = torch.compile(net)):
        # the one the EMA is built on, under plain names.
        return unwrap(submodule("EMACallback", pl_module, self.attribute))

    def _prefix(self, pl_module: Any = None) -> str:
        """The attribute's state_dict prefix, with the wrappers the module's
        own keys hold (`net._orig_mod.` for a compiled attribute) when
        `pl_module` is given."""
        prefix = f"{self.attribute}." if self.attribute else ""
        if pl_module is None or not self.attribute:
            return prefix
        return prefix + wrapper_prefix(submodule("EMACallback", pl_module, self.attribute))

    def _build(self, pl_module: Any) -> EMA:
        if self._root is not None:
            return self._build_fsdp1()
        return EMA(self._target(pl_module), schedules=self._schedules, policy=self.policy,
                   storage=self._storage, layout=self._layout, process_group=self._process_group,
                   copy_on_first_update=self.copy_on_first_update and not self._started,
                   trainable_only=self.trainable_only)

    def _fsdp1_saved(self, root: torch.nn.Module) -> Tuple[List[str], List[str]]:
        """(the names the EMA averages under FSDP1 root `root`: its clean
        names under the attribute's prefix, Lightning's keys; the names it
        leaves out). ValueError when the attribute holds nothing tracked."""
        kept, others = fsdp1_names([t.name for t in module_tensors(root, "versatil")],
                                   self._prefix())
        if not kept:
            raise ValueError(f"EMACallback: attribute {self.attribute!r} holds no parameter or "
                             "buffer of the FSDP1 model")
        return kept, others

    def _build_fsdp1(self) -> EMA:
        # shardema.EMA takes an FSDP1 model at its root only (the module
        # inside it holds 1-D pieces of flat shards), so the EMA is built
        # over the root and, with attribute=, leaves the rest out by name:
        # under the root the names are FSDP1's clean ones, Lightning's keys.
        kept, others = self._fsdp1_saved(self._root)
        transient = fsdp1_non_persistent(self._root)
        self._root_saved = [n for n in kept if n not in transient]
        return EMA(self._root, schedules=self._schedules, policy=self.policy,
                   storage=self._storage,
                   layout=self._layout, process_group=self._process_group,
                   copy_on_first_update=self.copy_on_first_update and not self._started,
                   ignore_names=others, trainable_only=self.trainable_only)

    def _tracked(self, target: torch.nn.Module) -> Dict[str, Any]:
        """The tracked tensors a state dict of `target` holds (not the
        non-persistent buffers; tied weights once, under their first name),
        by name. Read from the modules, not from state_dict() (FSDP2
        reshards in it), and the same on every rank, so the ranks agree on
        every collective of a save. trainable_only: what the EMA keeps (the
        parameters that required grad when it was built; before it is, those
        that require grad now, as it will be built)."""
        tracked = [t for t in module_tensors(target, "versatil") if t.persistent]
        if self.trainable_only:
            kept = set(self.ema._names) if self.ema is not None else \
                {t.name for t in keep_trainable(tracked)[0]}
            tracked = [t for t in tracked if t.name in kept]
        return {t.name: t.tensor for t in tracked}

    def _refuse_sharded_profiles(self, pl_module: Any) -> None:
        """Several profiles are kept in checkpoints as full tensors beside
        the state_dict (EMA_PROFILES_KEY): for one process and DDP."""
        if len(self._schedules) == 1:
            return
        if self._root is not None or any(is_dtensor(t) for t in
                                         self._tracked(self._target(pl_module)).values()):
            raise ValueError("EMACallback: schedules= with several profiles is for one process "
                             "and DDP, and this module is sharded (FSDP or DTensor parameters); "
                             "give each callback one schedule, or use shardema.EMA(schedules="
                             "...) with its state_dict() in the DCP checkpoint")

    def _validation_target(self, pl_module: Any) -> Optional[torch.nn.Module]:
        """The module validation sees this EMA in (None: it does not swap)."""
        return self._target(pl_module) if self.validate_with_ema else None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # The seed deep-copies the module here; that copy is the start of the
        # average, and every optimizer step lerps with the scheduled decay.
        self._root = fsdp1_root(trainer, pl_module)
        refuse_two_validation_swaps(trainer, pl_module, self)
        self._refuse_sharded_profiles(pl_module)
        self.ema = self._build(pl_module)
        if self._resume_ema_state is not None:
            self._load_ema(self._resume_ema_state)
            self._resume_ema_state = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.ema is not None:
            self.ema.fence()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.ema is None or not optimizer_stepped(trainer, batch_idx):
            return
        step = int(trainer.global_step)
        if self._own_schedule and step <= int(self.update_after_step):
            return
        if self.ema.update(step):
            self._started = True
        self.decay = self.ema._engine.last_decay(self.profile)
        if trainer.global_step % 100 == 0 and hasattr(pl_module, "log"):
            pl_module.log("ema_decay", self.decay, on_step=True, on_epoch=False)

    # --- checkpoints ------------------------------------------------------
    # --- validation -------------------------------------------------------
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # swap_in() reshards the averaged module; an FSDP2 root above it
        # (the LightningModule, with attribute=) is resharded here.
        if self.ema is not None and self.validate_with_ema and not self.ema.swapped:
            reshard(pl_module)
            self.ema.swap_in(profile=self.profile)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.ema is not None:
            self.ema.swap_out()
            reshard(pl_module)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        # Collective where the EMA's rows are gathered (DDP): every rank runs
        # on_fit_end.
        if self.ema is not None and self.copy_ema_at_fit_end:
            self.ema.copy_to(profile=self.profile)
            reshard(pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning skips on_validation_end when validation raises.
        if self.ema is not None:
            self.ema.swap_out()
            reshard(pl_module)

