"""The checks of the tensor-parallel and HSDP scenarios
(tensor_parallel_worker.py, hsdp_scenarios.py,
tensor_parallel_export_worker.py): shardema's full tensors and this
rank's pieces against a float64 EMA of the full tensors
(fsdp2_worker.Float64Ema)."""
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2_worker import close, full_value, rows_of

#: Optimizer steps of every scenario's training.
STEPS = 3


def piece_of(value, t, shard_rank, shard_world):
    """What a rank holds of full tensor `value` for tensor `t`: torch.chunk
    along a DTensor's sharded dim (its to_local()), else the rows shardema
    gives each rank of what all hold whole and equal (Replicate(), plain
    parameters); a buffer (a plain tensor) each rank keeps whole."""
    if not isinstance(t, (DTensor, nn.Parameter)):
        return value
    if isinstance(t, DTensor) and t.placements[-1].is_shard():
        dim = t.placements[-1].dim % value.dim()
        chunks = value.chunk(shard_world, dim=dim)
        return chunks[shard_rank] if shard_rank < len(chunks) else value.narrow(dim, 0, 0)
    return rows_of(value, shard_rank, shard_world)


def module_tensors(module):
    return dict(list(module.named_parameters()) + list(module.named_buffers()))


class Checker:
    """shardema's full tensors (on every rank, and on rank 0 only) and this
    rank's pieces against the float64 EMA; DTensors' to_local() against
    the full tensors, so the pieces expected are the ones held."""

    def __init__(self, ema, reference, tensors, shard_rank, shard_world):
        self.ema, self.reference, self.tensors = ema, reference, tensors
        self.shard_rank, self.shard_world = shard_rank, shard_world

    def __call__(self, where):
        self.ema.wait()
        want = self.reference.ema
        full = self.ema.full_state_dict(rank0_only=False)
        assert sorted(full) == sorted(want), f"{where}: names {sorted(full)} != {sorted(want)}"
        first = self.ema.full_state_dict()
        assert sorted(first) == (sorted(want) if self.shard_rank == 0 else []), \
            f"{where}: rank0_only gave {sorted(first)}"
        local = self.ema.local_ema()
        for name, value in want.items():
            t = self.tensors[name]
            assert full[name].shape == value.shape, f"{where}: '{name}' {full[name].shape}"
            # the EMA stays fp32 (an integer buffer is copied as it is)
            assert full[name].dtype == torch.float32 or not value.is_floating_point(), \
                f"{where}: '{name}' is {full[name].dtype}"
            close(full[name], value, f"{where}: full '{name}'")
            if self.shard_rank == 0:
                assert torch.equal(first[name], full[name]), f"{where}: rank-0 '{name}'"
            if isinstance(t, DTensor):  # a Replicate() one holds it whole
                whole = full_value(t)
                held = piece_of(whole, t, self.shard_rank, self.shard_world) \
                    if t.placements[-1].is_shard() else whole
                assert torch.equal(full_value(t.to_local()), held), f"'{name}': to_local()"
            mine = piece_of(value, t, self.shard_rank, self.shard_world).reshape(-1)
            close(local[name], mine, f"{where}: local '{name}' of rank {self.shard_rank}")
        return full
