"""shardema.EMA's model half: the EMA weights into the model (swap,
swap_in/swap_out, copy_to), a module holding them (module), and the model's
values into the EMA (copy_from), each checking the model it is handed. A
base class of EMA (_ema.py), beside the state half (_ema_state.py); every
method maps onto the engine (shardema._C.Ema, the C++ PythonEma) or onto
_view.py."""
import contextlib
from typing import Any, Iterable, Iterator, Optional

import torch

from . import _C
from ._model import is_dtensor, unwrap
from ._view import copy_model_into_ema, materialize, model_values, reshard_fsdp


class EmaModelTransfer:
    """The model half of shardema.EMA (see EMA)."""

    _engine: Any
    _model: Any
    _given: Any
    _names: Any
    _schedules: list

    # --- evaluation -----------------------------------------------------
    def _check_model(self, model: Any, api: str) -> None:
        if model is None:
            return
        if isinstance(model, int):
            raise TypeError(f"shardema.EMA.{api}: the first argument is the model; choose a "
                            f"profile by keyword: {api}(profile={model})")
        if _are_parameters(model):  # diffusers' EMAModel.step(parameters), copy_to(parameters)
            raise TypeError(f"shardema.EMA.{api}: takes the model the EMA was built on (or "
                            f"nothing), not parameters: call {api}()")
        if self._model is None:
            raise ValueError(f"shardema.EMA.{api}: this EMA was built from named tensors, not a "
                             f"model, and works on those tensors: call {api}() without a model")
        if unwrap(model) is not self._model:
            raise ValueError(f"shardema.EMA.{api}: this EMA tracks another model: it follows the "
                             f"model it was built on ({type(self._model).__name__}); pass that "
                             f"model (or a DDP or torch.compile wrapper of it), or nothing")

    @contextlib.contextmanager
    def swap(self, model: Any = None, *, profile: int = 0) -> Iterator[None]:
        """The EMA weights (of `profile`) in the model (its local shards)
        inside the block, the raw ones back on exit, also on exceptions.
        Collective for a replicated model on several ranks. An FSDP2 model
        is resharded on entry and exit, so that forwards see what the
        shards hold."""
        self._swap_in(model, profile, "swap")
        try:
            yield
        finally:
            self.swap_out()

    @property
    def swapped(self) -> bool:
        """Whether the EMA is swapped into the model (swap_in(), or inside
        swap())."""
        return self._engine.swapped

    def swap_in(self, model: Any = None, *, profile: int = 0) -> None:
        """swap()'s entry, for hooks that cannot hold a with-block (a
        trainer's validation start and end): the EMA weights (of `profile`)
        into the model
        (its local shards), the raw ones kept in host memory for swap_out().
        Every EMA of the process has read the weights first, and none may
        update while the swap lasts (ValueError naming the tensor). A
        failure (a gather that times out) puts the raw weights back before
        it raises. RuntimeError when already swapped in, ValueError when
        another EMA's swap holds the model (swaps do not nest). Collective
        for a replicated model on several ranks. FSDP2 modules are resharded
        first, so that forwards see what the shards hold."""
        self._swap_in(model, profile, "swap_in")

    def _swap_in(self, model: Any, profile: Any, api: str) -> None:
        # `api`: the call the user made (swap or swap_in), for the errors.
        self._check_model(model, api)
        profile = self._profile(profile, api)
        reshard_fsdp(self._model)
        self._engine.swap_in(self._replan, profile, f"shardema.EMA.{api}")

    def swap_out(self, model: Any = None) -> None:
        """swap()'s exit: the raw weights back (nothing to do when not
        swapped in), then FSDP2 modules resharded. No communication."""
        self._check_model(model, "swap_out")
        self._engine.swap_out()
        reshard_fsdp(self._model)

    def copy_to(self, model: Any = None, *, profile: int = 0) -> None:
        """Writes the EMA weights (of `profile`) into the model for good."""
        self._check_model(model, "copy_to")
        profile = self._profile(profile, "copy_to")
        self._engine.copy_to(self._replan, profile)
        reshard_fsdp(self._model)

    def module(self, device: Any = None, into: Optional[torch.nn.Module] = None, *,
               profile: int = 0) -> torch.nn.Module:
        """A module holding what swap(profile=profile) would put in the model (the EMA
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
        it). Waits for the update in flight."""
        if self._model is None:
            raise ValueError("shardema.EMA.module: this EMA was built from named tensors or "
                             "local shards, not a model; read it with full_state_dict() or "
                             "local_ema()")
        self._refuse_fsdp1("module")
        self._check_model_for_read("module")
        profile = self._profile(profile, "module")
        return materialize(self, self._model, device, into, self._names, profile)

    def copy_from(self, model: Any = None) -> None:
        """The EMA of every tracked tensor becomes its current value (ema-
        pytorch's copy_params_from_model_to_ema), after the update in
        flight. The step and the schedule go on, as in ema-pytorch: the
        next update averages into these values with the schedule's decay at
        its step (to restart a warmup, build a new EMA). This rank's rows
        only, no communication. Refused inside swap() (the model holds the
        EMA there) and with several profiles (one would move)."""
        self._check_model(model, "copy_from")
        self._refuse_fsdp1("copy_from")
        self._check_model_for_read("copy_from")
        if self.swapped:
            raise RuntimeError("shardema.EMA.copy_from: the EMA is swapped into the model; "
                               "leave swap() first (the model holds the EMA weights inside it)")
        if len(self._schedules) > 1:
            raise ValueError(f"shardema.EMA.copy_from: this EMA keeps {len(self._schedules)} "
                             "profiles (schedules); copy_from() sets one EMA, not several: "
                             "build a new EMA to start them all from the model")
        if self._model is not None:
            full, local = model_values(self._model)
        elif self._given is not None:
            full = [(n, t) for n, t in self._given if not is_dtensor(t)]
            local = [(n, t.to_local()) for n, t in self._given if is_dtensor(t)]
        else:
            full, local = [], [(s.spec.name, s.local) for s in self._local_shards]
        for name, tensor in full + local:
            # Inside another EMA's swap the model holds that EMA's weights.
            owner = _C.swapped_in_by(tensor)
            if owner is not None:
                raise ValueError(f"shardema.EMA.copy_from: '{name}' holds the EMA weights "
                                 f"{owner} swapped in; copy_from() after that swap ends (it "
                                 "would copy those EMA weights, not the model's)")
        copy_model_into_ema(self, full, local, self._names)


def _are_parameters(given: Any) -> bool:
    """Whether `given` is a collection (model.parameters(), a list), not a
    model or a step: what diffusers' EMAModel calls take."""
    return not isinstance(given, (torch.nn.Module, str, bytes, torch.Tensor)) and \
        isinstance(given, Iterable)
