"""shardema.EMA's constructor arguments, checked when they are given and
turned into the engine's options (shardema._C.EmaOptions): a DecaySchedule
from the arguments users bring from ema-pytorch (beta, update_after_step,
update_every, power, inv_gamma, min_value) or from timm and Lightning
(decay, warmup, min_decay, ...), with those libraries' defaults, or the
DecaySchedule given; several of them (schedules=[...], beta=[...],
decay=[...]) for several profiles. One ValueError or TypeError per bad
argument, naming it in Python's terms."""
import numbers
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _C

POLICIES = ("ema_pytorch", "versatil")
STORAGES = ("pinned_host", "device")
ENGINES = ("auto", "host", "cuda")

# ema-pytorch's EMA(...) defaults (ema_pytorch 0.8, ema_pytorch.py).
EMA_PYTORCH_DEFAULTS = {"beta": 0.9999, "update_after_step": 100, "update_every": 10,
                        "power": 2 / 3, "inv_gamma": 1.0, "min_value": 0.0}
# timm's ModelEmaV3 (and Lightning's EMAWeightAveraging's decay) defaults.
TIMM_DEFAULTS = {"decay": 0.9999, "min_decay": 0.0, "update_after_step": 0, "update_every": 1,
                 "warmup": False, "warmup_gamma": 1.0, "warmup_power": 2 / 3}

# Other libraries' arguments shardema has no use for, with what to do
# instead: refused by name rather than dropped in silence.
NOT_HERE = {
    "ema_model": "shardema keeps the EMA itself (read it with ema.module() or swap())",
    "include_online_model": "shardema's state_dict() holds the EMA only",
    "update_model_with_ema_every": "call ema.copy_to() every N steps",
    "update_model_with_ema_beta": "call ema.copy_to() every N steps",
    "forward_method_names": "run the EMA weights with ema.swap() or ema.module()",
    "lazy_init_ema": "the EMA is built from the model's weights at construction",
    "exclude_buffers": "leave them out with ignore_names= or copy them with copy_names=",
    "device": "the EMA lives in pinned host memory (storage='pinned_host') or beside the "
              "parameters (storage='device')",
}
# ...and the ones that only pick an implementation there: accepted, unused.
HARMLESS = ("allow_different_devices", "use_foreach", "foreach", "coerce_dtype",
            "move_ema_to_online_device")
# ema-pytorch's names for shardema's selection arguments.
RENAMED = {"ignore_startswith_names": "ignore_prefixes",
           "param_or_buffer_names_no_ema": "copy_names", "use_warmup": "warmup"}


def _number(name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"shardema.EMA: {name} must be a number, got {type(value).__name__} "
                        f"{value!r}")
    value = float(value)
    if not (low < value <= high if open_low else low <= value <= high):
        side = "(" if open_low else "["
        raise ValueError(f"shardema.EMA: {name} must be in {side}{low}, {high}], got {value}")
    return value


def _count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"shardema.EMA: {name} must be an int, got {type(value).__name__} "
                        f"{value!r}")
    if int(value) < low:
        raise ValueError(f"shardema.EMA: {name} must be >= {low}, got {int(value)}")
    return int(value)


def _choice(name: str, value: Any, words: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in words:
        raise ValueError(f"shardema.EMA: {name} must be one of {', '.join(map(repr, words))}, "
                         f"got {value!r}")
    return value


def split_foreign(extra: Dict[str, Any]) -> Dict[str, Any]:
    """Maps the other libraries' argument names to shardema's, refuses the
    ones shardema has no use for (naming what to do instead), and drops the
    harmless ones. Returns shardema's keyword arguments."""
    out: Dict[str, Any] = {}
    for name, value in extra.items():
        if name in RENAMED:
            out[RENAMED[name]] = value
        elif name in NOT_HERE:
            raise TypeError(f"shardema.EMA: {name}= is not one of shardema's arguments: "
                            f"{NOT_HERE[name]}")
        elif name not in HARMLESS:
            raise TypeError(f"shardema.EMA: unexpected argument {name}=")
    return out


def schedule_of(schedule: Any, ema_pytorch: Dict[str, Any], timm: Dict[str, Any],
                shared: Dict[str, Any]) -> "_C.DecaySchedule":
    """The DecaySchedule: `schedule` itself, or the one ema-pytorch's or
    timm's arguments describe with that library's defaults for the rest
    (`shared`: update_after_step / update_every, which both take), or
    DecaySchedule.warmup() when nothing is given."""
    if schedule is not None:
        given = sorted(ema_pytorch) + sorted(timm) + sorted(shared)
        if given:
            raise ValueError(f"shardema.EMA: schedule= and {', '.join(given)} both describe the "
                             "decay; give one or the other")
        if not isinstance(schedule, _C.DecaySchedule):
            hint = " (ema-pytorch's second argument, ema_model, is not needed here)" \
                if hasattr(schedule, "parameters") else ""
            raise TypeError("shardema.EMA: schedule must be a shardema.DecaySchedule "
                            "(DecaySchedule.warmup(), .constant(), .power_function()), got "
                            f"{type(schedule).__name__}{hint}")
        return schedule
    if ema_pytorch and timm:
        raise ValueError(f"shardema.EMA: {', '.join(sorted(ema_pytorch))} (ema-pytorch's) and "
                         f"{', '.join(sorted(timm))} (timm's) both describe the decay; give one "
                         "library's arguments")
    if timm:
        return _timm_schedule({**TIMM_DEFAULTS, **timm, **shared})
    if ema_pytorch or shared:
        return _ema_pytorch_schedule({**EMA_PYTORCH_DEFAULTS, **ema_pytorch, **shared})
    return _C.DecaySchedule.warmup()


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def schedules_of(schedule: Any, schedules: Any, ema_pytorch: Dict[str, Any],
                 timm: Dict[str, Any], shared: Dict[str, Any]) -> List["_C.DecaySchedule"]:
    """One DecaySchedule per profile, profile 0 first: `schedules` itself,
    or one per value of a list given as beta= (ema-pytorch's) or decay=
    (timm's), the other arguments shared by all, or schedule_of's one."""
    if schedules is not None:
        given = (["schedule"] if schedule is not None else []) + sorted(ema_pytorch) + \
            sorted(timm) + sorted(shared)
        if given:
            raise ValueError(f"shardema.EMA: schedules= and {', '.join(given)} both describe the "
                             "decay; give one or the other")
        if isinstance(schedules, (_C.DecaySchedule, str, bytes)) or \
                not isinstance(schedules, (list, tuple)):
            raise TypeError("shardema.EMA: schedules must be a list of DecaySchedule (one per "
                            f"profile), got {type(schedules).__name__}; one schedule is "
                            "schedule=")
        for index, one in enumerate(schedules):
            if not isinstance(one, _C.DecaySchedule):
                raise TypeError(f"shardema.EMA: schedules[{index}] must be a DecaySchedule, got "
                                f"{type(one).__name__}")
        return _checked_profiles(list(schedules), "schedules")
    lists = sorted(k for k, v in {**ema_pytorch, **timm, **shared}.items() if _is_list(v))
    if not lists:
        return [schedule_of(schedule, ema_pytorch, timm, shared)]
    if lists not in (["beta"], ["decay"]):
        raise TypeError(f"shardema.EMA: {', '.join(lists)} given as a list; only beta= "
                        "(ema-pytorch's) or decay= (timm's) takes one value per profile, the "
                        "other arguments are shared by every profile")
    key = lists[0]
    family = ema_pytorch if key == "beta" else timm
    values = list(family[key])
    if not values:
        raise ValueError(f"shardema.EMA: {key}=[] gives no profile; give one value or more")
    out = [schedule_of(schedule, {**ema_pytorch, key: v} if key == "beta" else ema_pytorch,
                       {**timm, key: v} if key == "decay" else timm, shared) for v in values]
    return _checked_profiles(out, key)


def _checked_profiles(schedules: List["_C.DecaySchedule"], name: str) -> List["_C.DecaySchedule"]:
    """Profiles are updated together: at most _C.max_profiles of them, one
    update_every for all."""
    if not schedules:
        raise ValueError(f"shardema.EMA: {name}=[] gives no profile; give one schedule or more")
    if len(schedules) > _C.max_profiles:
        raise ValueError(f"shardema.EMA: {name} gives {len(schedules)} profiles; one EMA keeps "
                         f"at most {_C.max_profiles}")
    every = schedules[0].update_every
    for index, one in enumerate(schedules):
        if one.update_every != every:
            raise ValueError(f"shardema.EMA: {name}[{index}] updates every {one.update_every} "
                             f"steps but {name}[0] every {every}; the profiles of one EMA share "
                             "their due steps (give them one update_every, or build separate "
                             "EMAs)")
    return schedules


def _ema_pytorch_schedule(a: Dict[str, Any]) -> "_C.DecaySchedule":
    beta = _number("beta", a["beta"], 0.0, 1.0)
    return _C.DecaySchedule.warmup(
        inv_gamma=_number("inv_gamma", a["inv_gamma"], 0.0, float("inf"), open_low=True),
        power=_number("power", a["power"], 0.0, float("inf"), open_low=True),
        min_value=_number("min_value", a["min_value"], 0.0, beta),
        max_value=beta,
        update_after_step=_count("update_after_step", a["update_after_step"], 0),
        update_every=_count("update_every", a["update_every"], 1))


def _timm_schedule(a: Dict[str, Any]) -> "_C.DecaySchedule":
    decay = _number("decay", a["decay"], 0.0, 1.0)
    after = _count("update_after_step", a["update_after_step"], 0)
    every = _count("update_every", a["update_every"], 1)
    if not isinstance(a["warmup"], bool):
        raise TypeError(f"shardema.EMA: warmup must be a bool, got {a['warmup']!r}")
    if a["warmup"]:
        return _C.DecaySchedule.warmup(
            inv_gamma=_number("warmup_gamma", a["warmup_gamma"], 0.0, float("inf"),
                              open_low=True),
            power=_number("warmup_power", a["warmup_power"], 0.0, float("inf"), open_low=True),
            min_value=_number("min_decay", a["min_decay"], 0.0, decay), max_value=decay,
            update_after_step=after, update_every=every)
    if after == 0:
        # The first update copies (copy_on_first_update), then `decay`.
        return _C.DecaySchedule.constant(decay, update_every=every)
    # timm copies (decay 0) up to step update_after_step + 1, then `decay`:
    # the warmup schedule clamped to [decay, decay] is exactly that.
    return _C.DecaySchedule.warmup(min_value=decay, max_value=decay, update_after_step=after,
                                   update_every=every)


def seconds(timeout: Union[float, timedelta]) -> float:
    value = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    return _number("timeout", value, 0.0, float("inf"), open_low=True)


def options_of(schedules: List["_C.DecaySchedule"], *, storage: str, chunk_mib: Optional[float],
               num_slots: Optional[int], copy_on_first_update: bool, fence_in_update: bool,
               engine: str, timeout: Union[float, timedelta],
               refuse_non_finite: bool) -> "_C.EmaOptions":
    """The engine's options, each checked and named."""
    for name, flag in (("copy_on_first_update", copy_on_first_update),
                       ("fence_in_update", fence_in_update),
                       ("refuse_non_finite", refuse_non_finite)):
        if not isinstance(flag, bool):
            raise TypeError(f"shardema.EMA: {name} must be a bool, got {flag!r}")
    chunk_bytes = _C.default_chunk_bytes if chunk_mib is None else \
        int(_number("chunk_mib", chunk_mib, 0.0, float("inf"), open_low=True) * (1 << 20))
    return _C.EmaOptions(
        schedules=schedules, copy_on_first_update=copy_on_first_update,
        storage=_choice("storage", storage, STORAGES), chunk_bytes=max(chunk_bytes, 64),
        num_slots=_C.default_num_slots if num_slots is None else _count("num_slots", num_slots, 1),
        fence_in_update=fence_in_update, engine=_choice("engine", engine, ENGINES),
        refuse_non_finite=refuse_non_finite, timeout_seconds=seconds(timeout))


def policy_of(policy: Any) -> str:
    return _choice("policy", policy, POLICIES)


def families(beta=None, power=None, inv_gamma=None, min_value=None, decay=None, warmup=None,
             min_decay=None, warmup_gamma=None, warmup_power=None, update_after_step=None,
             update_every=None) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]:
    """(ema-pytorch's, timm's, both's) arguments that were given."""
    def given(**kw):
        return {k: v for k, v in kw.items() if v is not None}
    return (given(beta=beta, power=power, inv_gamma=inv_gamma, min_value=min_value),
            given(decay=decay, warmup=warmup, min_decay=min_decay, warmup_gamma=warmup_gamma,
                  warmup_power=warmup_power),
            given(update_after_step=update_after_step, update_every=update_every))
