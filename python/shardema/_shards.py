"""Local shards and their specs: what ``EMA.from_local_shards`` takes when
the layout is not one ``EMA`` detects (FSDP1's FlatParameter, or any split
described by hand). The classes are the C++ ones; this module also accepts
plain tuples and dicts for them."""
from typing import Any, Mapping, Sequence, Union

from . import _C

ShardSpec = _C.ShardSpec
LocalShard = _C.LocalShard
FlatParamLayout = _C.FlatParamLayout
layout_spec = _C.layout_spec

ShardLike = Union["_C.LocalShard", Sequence[Any], Mapping[str, Any]]


def _spec_of(value: Any, where: str) -> "_C.ShardSpec":
    if isinstance(value, ShardSpec):
        return value
    if isinstance(value, Mapping):
        keys = {"name", "global_shape", "dtype", "kind", "ranges"}
        missing = keys - set(value)
        if missing:
            raise ValueError(f"{where}: a spec dict needs {sorted(keys)}; missing {sorted(missing)}")
        return ShardSpec(value["name"], list(value["global_shape"]), value["dtype"], value["kind"],
                         [tuple(r) for r in value["ranges"]])
    if isinstance(value, Sequence) and len(value) == 5:
        name, shape, dtype, kind, ranges = value
        return ShardSpec(name, list(shape), dtype, kind, [tuple(r) for r in ranges])
    raise TypeError(f"{where}: expected a shardema.ShardSpec, a dict or a (name, global_shape, "
                    f"dtype, kind, ranges) tuple, got {type(value).__name__}")


def as_local_shard(value: ShardLike, index: int) -> "_C.LocalShard":
    """A LocalShard from a LocalShard, a dict {local, spec[, role,
    changes_in_forward]} or a tuple (local, spec[, role[, changes_in_forward]])."""
    where = f"shards[{index}]"
    if isinstance(value, LocalShard):
        return value
    if isinstance(value, Mapping):
        if "local" not in value or "spec" not in value:
            raise ValueError(f"{where}: a shard dict needs 'local' and 'spec'")
        return LocalShard(value["local"], _spec_of(value["spec"], where), value.get("role", "average"),
                          bool(value.get("changes_in_forward", False)))
    if isinstance(value, Sequence) and 2 <= len(value) <= 4:
        local, spec, *rest = value
        role = rest[0] if rest else "average"
        changes = bool(rest[1]) if len(rest) > 1 else False
        return LocalShard(local, _spec_of(spec, where), role, changes)
    raise TypeError(f"{where}: expected a shardema.LocalShard, a dict or a (local, spec[, role]) "
                    f"tuple, got {type(value).__name__}")
