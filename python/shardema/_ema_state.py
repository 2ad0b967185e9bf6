"""shardema.EMA's state and files: state_dict for DCP, the per-rank
checkpoints, deployable weights, gathers, and the EMA values in the shapes
a rank holds its tensors. A base class of EMA (_ema.py), so each file stays
one concept; every method maps onto the engine (shardema._C.Ema, the C++
PythonEma) or onto _dcp.py and _ema_values.py, which are handed the engine
rather than reach for it."""
import numbers
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from . import _ema_values
from ._model import refuse_tensor_parallel
from ._replicas import write_on_first_replica


class EmaState:
    """The state half of shardema.EMA (see EMA)."""

    _engine: Any
    _held: Dict[str, Any]
    _aliases: Dict[str, str]
    _names: Sequence[str]
    _model: Any
    _replicas: Any
    _tensor_parallel: Dict[str, Any]
    _timeout_s: float
    _schedules: List[Any]

    def _profile(self, profile: Any, api: str) -> int:
        """`profile` checked: an index into schedules (TypeError, or an
        IndexError naming the count)."""
        count = len(self._schedules)
        if isinstance(profile, bool) or not isinstance(profile, numbers.Integral):
            raise TypeError(f"shardema.EMA.{api}: profile must be an int (an index into "
                            f"schedules), got {type(profile).__name__} {profile!r}")
        if not 0 <= profile < count:
            raise IndexError(f"shardema.EMA.{api}: profile {profile} does not exist; this EMA "
                             f"keeps {count} profile{'s' if count > 1 else ''} "
                             f"(0 to {count - 1})")
        return int(profile)

    def _check_model_for_read(self, api: str) -> None:
        # fully_shard after the EMA: what the EMA holds follows the plan of
        # the plain model, and update() refuses from then on; a read would
        # answer for a model that is no longer there. The engine's check,
        # in update()'s words.
        self._engine.check_model_for_read(f"shardema.EMA.{api}")

    def _refuse_fsdp1(self, api: str) -> None:
        # Under FSDP1 a rank's EMA of a parameter is a range of a flattened
        # FlatParameter shard: neither a DTensor (state_dict) nor a module
        # sharded like the model (module, copy_from) can describe it.
        # ZeRO-3's partitions are such ranges too.
        model = {"fsdp1": "an FSDP1 model (FullyShardedDataParallel",
                 "zero3": "a DeepSpeed ZeRO-3 model (partitioned parameters"}.get(
                     self._engine.layout)
        if model is not None:
            raise ValueError(f"shardema.EMA.{api} is not supported for {model}: each rank's "
                             "EMA is a range of a flattened parameter); use save_checkpoint() / "
                             "load_checkpoint(), export_weights(), full_state_dict() or swap()")

    def _refuse_unshared_write(self, api: str) -> None:
        # Built before init_process_group, the EMA is each process's own
        # (layout "single"): every rank writing it writes the same files
        # over each other's (a rename racing another, a manifest naming
        # another rank's file). Rank 0 writes it; the others are refused.
        if self._group is not None or self._engine.layout != "single":
            return
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2 \
                or dist.get_rank() == 0:
            return
        raise ValueError(f"shardema.EMA.{api}: this EMA was built before "
                         "torch.distributed.init_process_group, so each process keeps its own "
                         f"whole copy, and this is rank {dist.get_rank()} of "
                         f"{dist.get_world_size()}: every rank would write the same files. Call "
                         f"{api}() on rank 0 only, or build the EMA after init_process_group "
                         "(then the ranks share the work and write together)")

    def state_dict(self) -> Dict[str, Any]:
        """{"weights": {name: tensor}, "progress": {...}} (and, with several
        profiles, "profile_weights": {"1": {name: tensor}, ...}), for DCP beside the
        model and optimizer (or torch.save with one process): fresh copies,
        fp32 where averaged; DTensors (Shard(0) rows) where ranks hold rows,
        so DCP reshards them on another world size. The progress is plain
        values, equal on every rank. See docs/python.md, "Checkpoints with
        torch.distributed.checkpoint"."""
        self._refuse_fsdp1("state_dict")
        self._check_model_for_read("state_dict")
        from . import _dcp
        return _dcp.state_dict(self, self._engine)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Adopts state_dict()'s structure as DCP (or torch.load) filled it,
        at any world size; {} (what shardema.EMALoadPlanner leaves for a
        checkpoint without an EMA) restarts the EMA from the model's weights
        at step 0, with a warning. An older state_dict() ({"tensors",
        "metadata"}) loads on the same rank, world size and layout. A failed
        EMA (its background update raised) is restored by it."""
        if not isinstance(state, dict):
            raise TypeError("shardema.EMA.load_state_dict: expected a dict, got "
                            f"{type(state).__name__}")
        if "tensors" in state and "metadata" in state:
            self._engine.load_state_dict(state)
            return
        self._refuse_fsdp1("load_state_dict")
        if not state:  # a cold start reads the model's weights
            self._check_model_for_read("load_state_dict")
        from . import _dcp
        _dcp.load_state_dict(self, self._engine, state)

    def save_checkpoint(self, folder: str) -> None:
        """Collective: this rank's file (every profile) and (rank 0) the
        manifest in `folder`."""
        refuse_tensor_parallel(self._tensor_parallel, "save_checkpoint")
        self._check_model_for_read("save_checkpoint")
        self._refuse_unshared_write("save_checkpoint")
        write_on_first_replica(self._replicas, lambda: self._engine.save_checkpoint(str(folder)),
                               self._timeout_s, "save_checkpoint")

    def load_checkpoint(self, folder: str) -> None:
        """Collective: every rank loads its file of a checkpoint (of the same
        world size, or of any layout when every rank holds the same
        elements, as after `shardema export --world-size 1`); if one rank
        fails, every rank raises and none changed. Restores a failed EMA."""
        refuse_tensor_parallel(self._tensor_parallel, "load_checkpoint")
        self._engine.load_checkpoint(str(folder))

    def export_weights(self, path: str, dtype: torch.dtype = torch.float32,
                       max_shard_size: Optional[Union[int, str]] = None, *,
                       include_untracked: bool = False, profile: int = 0) -> None:
        """Collective: rank 0 writes deployable safetensors of the full
        tensors of `profile` (floating ones as `dtype`), tied weights under
        every name, streamed tensor by tensor, metadata "format": "pt" and
        shardema.schedule that profile's. With `max_shard_size` (bytes, or
        "5GB" / "500MiB" as transformers' save_pretrained takes it), `path`
        is a folder that from_pretrained loads:
        model-00001-of-0000N.safetensors files of at most that size and
        model.safetensors.index.json, written last (one model.safetensors
        when everything fits); a tensor larger than the limit gets a file
        of its own.
        include_untracked: True also writes the model's own current values
        of what the EMA leaves out (frozen parameters under
        trainable_only=True, buffers, ignore_names), in state_dict() order
        among the EMA's, into the file or the split folder, so that it
        loads strict into the plain model (their names are listed in each
        file's metadata under "shardema.from_model"); rank 0 reads them
        from the model as it writes (a DTensor's it gathers first and holds
        while it writes)."""
        profile = self._profile(profile, "export_weights")
        self._refuse_unshared_write("export_weights")
        self._check_model_for_read("export_weights")
        if not isinstance(include_untracked, bool):
            raise TypeError("shardema.EMA.export_weights: include_untracked must be a bool, got "
                            f"{include_untracked!r}")
        untracked: list = []
        if include_untracked:
            if self._model is None:
                raise ValueError("shardema.EMA.export_weights: include_untracked=True takes the "
                                 "values from the model, and this EMA was built from named "
                                 "tensors or local shards")
            self._refuse_fsdp1("export_weights(include_untracked=True)")
            from ._export_untracked import untracked_tensors
            untracked = untracked_tensors(self._model, set(self._names), set(self._aliases),
                                          keep=self.rank == 0)
        write_on_first_replica(
            self._replicas,
            lambda: self._engine.export_weights(str(path), dtype, max_shard_size, profile,
                                                untracked),
            self._timeout_s, "export_weights")

    def full_state_dict(self, rank0_only: bool = True, names: Optional[Sequence[str]] = None, *,
                        profile: int = 0) -> Dict[str, torch.Tensor]:
        """Collective: the full EMA tensors of `profile` as CPU tensors, on
        rank 0 (empty dict on the others) or on every rank; `names` (the
        same on every rank): just those, else all. For small models and
        tests; export_weights() streams large ones."""
        profile = self._profile(profile, "full_state_dict")
        self._check_model_for_read("full_state_dict")
        chosen = None if names is None else [str(n) for n in names]
        return dict(self._engine.full_state_dict(rank0_only, chosen, profile))

    def local_ema(self, *, profile: int = 0) -> Dict[str, torch.Tensor]:
        """This rank's EMA pieces of `profile` (1-D clones), the elements it
        owns."""
        profile = self._profile(profile, "local_ema")
        self._check_model_for_read("local_ema")
        return dict(self._engine.local_ema(profile))

    def ema_tensors(self, names: Optional[Sequence[str]] = None, *,
                    profile: int = 0) -> Dict[str, torch.Tensor]:
        """The EMA of each tracked tensor (`names`, the same on every rank;
        else all) in the shape this rank holds the tensor in: a DTensor's
        to_local() (its rows under Shard(0), the whole under Replicate()),
        the whole of a plain tensor. Fresh copies (float32 where averaged)
        where the EMA lives (host memory by default), gathered ones on the
        CPU. Collective where this rank holds the whole of a tensor whose
        EMA the ranks split (a plain tensor under DDP or layout="rank0", a
        Replicate() DTensor): those are gathered, so every rank calls it.
        Waits for the update in flight. `profile`: which EMA (default 0)."""
        profile = self._profile(profile, "ema_tensors")
        self._check_model_for_read("ema_tensors")
        return _ema_values.ema_tensors(self._engine, self._held, names, profile)

    def load_ema_values(self, values: Dict[str, Any], strict: bool = True, *,
                        profile: int = 0) -> None:
        """The EMA of each named tensor becomes the value given (converted to
        the EMA's dtype): a DTensor, or a tensor shaped as ema_tensors()
        gives it, stands for what this rank holds (each rank keeps its rows
        of a whole); a plain tensor of a DTensor's full shape is the whole,
        of which this rank takes its part (a checkpoint every rank reads
        whole). The step and the schedule are unchanged. strict: every
        tracked name must be given (else the others keep their EMA). One
        ValueError lists every missing, unexpected and misshapen name, and
        then nothing was loaded. No communication; waits for the update in
        flight. `profile`: which EMA takes them (a copied tensor is one
        value shared by every profile)."""
        profile = self._profile(profile, "load_ema_values")
        _ema_values.load_ema_values(self._engine, self._held, values, bool(strict),
                                    self._aliases, profile)

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
