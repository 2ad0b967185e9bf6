"""A model changed after its EMA was built: followed, or refused naming the
tensor, never a crash and never averaged wrong in silence. The expected
EMAs are recomputed here in float64 from the values the model held at each
update.

- a submodule replaced by one of the same shapes (model[2] = nn.Linear):
  followed, with a warning naming its tensors;
- a parameter replaced (a new nn.Parameter, p.data = t) and then swap() or
  copy_to() before any update: the swap writes into the new tensors;
- a parameter or buffer added, a module removed, a tied weight untied:
  ValueError naming it, the EMA unchanged and usable;
- fully_shard(model) after EMA(model): ValueError naming the parameter
  (was a segfault);
- a float64 model, a step that is not an int: one line in Python's terms."""
import warnings

import pytest
import torch

import shardema
from rank_launch import free_port

HALF = shardema.DecaySchedule.constant(0.5)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def values(model):
    return {n: t.detach().double().clone() for n, t in model.state_dict().items()}


def half_lerp(ema_values, now):
    return {n: ema_values[n] * 0.5 + now[n] * 0.5 for n in now}


def assert_ema(ema, want):
    got = ema.full_state_dict()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name].double(), value, rtol=1e-6, atol=1e-7, msg=name)


def test_a_replaced_submodule_of_the_same_shapes_is_followed():
    model = mlp()
    ema = shardema.EMA(model, HALF)
    ema.update()
    want = values(model)
    torch.manual_seed(5)
    model[2] = torch.nn.Linear(6, 3)  # a new module object, new parameters
    with pytest.warns(UserWarning, match=r"'2.weight', '2.bias' were replaced"):
        ema.update()
    want = half_lerp(want, values(model))
    # A write outside the optimizer: after fence(), or the background read of
    # the update above may see part of it (docs/python.md, "Writes to the
    # weights"), which made this test fail now and then on a busy machine.
    ema.fence()
    with torch.no_grad():
        model[2].weight.add_(1.0)  # writes to the new module reach the EMA
    ema.update()
    assert_ema(ema, half_lerp(want, values(model)))


def test_swap_and_copy_to_after_a_replacement_write_into_the_new_tensors():
    model = mlp()
    ema = shardema.EMA(model, HALF)
    ema.update()
    want = values(model)["0.weight"]
    model[0].weight = torch.nn.Parameter(torch.full((6, 4), 7.0))
    with pytest.warns(UserWarning, match="'0.weight' was replaced"):
        with ema.swap():
            torch.testing.assert_close(model[0].weight.detach().double(), want)
    assert torch.equal(model[0].weight.detach(), torch.full((6, 4), 7.0))
    model[0].weight.data = torch.full((6, 4), 3.0)  # p.data = t
    with pytest.warns(UserWarning, match="'0.weight' was replaced"):
        ema.copy_to()
    torch.testing.assert_close(model[0].weight.detach().double(), want)


@pytest.mark.parametrize("change", ["parameter", "buffer", "module"])
def test_a_tensor_added_is_refused_naming_it_and_the_ema_goes_on(change):
    model = mlp()
    ema = shardema.EMA(model, HALF)
    ema.update()
    before = ema.full_state_dict()
    if change == "parameter":
        model[0].scale = torch.nn.Parameter(torch.ones(6))
        name = "0.scale"
    elif change == "buffer":
        model[2].register_buffer("seen", torch.zeros(3))
        name = "2.seen"
    else:
        model.add_module("3", torch.nn.Linear(3, 2))
        name = "3.weight"
    with pytest.raises(ValueError, match=f"'{name}'.* added") as excinfo:
        ema.update()
    assert "\n" not in str(excinfo.value)
    got = ema.full_state_dict()
    assert all(torch.equal(got[n], before[n]) for n in before)
    assert ema.step == 1


def test_a_module_without_tensors_added_is_fine():
    model = mlp()
    ema = shardema.EMA(model, HALF)
    ema.update()
    model.add_module("3", torch.nn.Tanh())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ema.update()


def test_a_removed_module_is_refused_naming_its_tensors():
    model = mlp()
    ema = shardema.EMA(model, HALF)
    ema.update()
    del model[2]
    with pytest.raises(ValueError, match="'2.weight', '2.bias' removed"):
        ema.update()


def test_a_module_whose_children_dict_was_rebuilt_is_still_watched():
    # Sequential.__delitem__ builds a new _modules dict; the old one, back to
    # its size after an append and a delete, looked unchanged for good, and a
    # later replacement by another shape was averaged as the old layer.
    model = mlp()
    ema = shardema.EMA(model, HALF)
    ema.update()
    model.append(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="'3.weight', '3.bias' added"):
        ema.update()
    del model[-1]
    ema.update()  # the same tensors again, under a new dict: followed
    want = half_lerp(values(model), values(model))
    model[2] = torch.nn.Linear(6, 5)
    with pytest.raises(ValueError, match="'2.weight'"):
        ema.update()
    model[2] = torch.nn.Linear(6, 3)
    torch.nn.init.constant_(model[2].weight, 2.0)
    with pytest.warns(UserWarning, match="were replaced"):
        ema.update()
    with ema.swap(model):
        assert torch.equal(model[0].weight, ema.full_state_dict()["0.weight"])
    got = ema.full_state_dict()["2.weight"].double()
    torch.testing.assert_close(got, 0.5 * want["2.weight"] + 0.5 * 2.0)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 4)
        self.head = torch.nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight


def test_an_untied_weight_is_refused_naming_it():
    model = Tied()
    ema = shardema.EMA(model, HALF)
    ema.update()
    model.head.weight = torch.nn.Parameter(model.emb.weight.detach().clone())
    with pytest.raises(ValueError, match="'head.weight' added"):
        ema.update()


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fully_shard_after_the_ema_is_a_value_error_not_a_crash(one_rank_group):
    from torch.distributed.fsdp import fully_shard
    model = mlp()
    ema = shardema.EMA(model, HALF)
    ema.update()
    fully_shard(model)
    for call in (ema.update, ema.copy_to, ema.swap_in):
        with pytest.raises(ValueError, match="'0.weight' became a DTensor after the EMA was "
                                             "built") as excinfo:
            call()
        assert "\n" not in str(excinfo.value)
    assert not ema.swapped


def reads_of(ema, folder):
    """Every read of the EMA that answers from the plan it was built with,
    by the name each error must give."""
    return {
        "export_weights": lambda: ema.export_weights(folder / "ema.safetensors"),
        "export_weights ": lambda: ema.export_weights(folder / "all.safetensors",
                                                      include_untracked=True),
        "full_state_dict": ema.full_state_dict, "state_dict": ema.state_dict,
        "save_checkpoint": lambda: ema.save_checkpoint(folder / "checkpoint"),
        "module": ema.module, "ema_tensors": ema.ema_tensors, "local_ema": ema.local_ema,
        "copy_from": ema.copy_from, "load_state_dict": lambda: ema.load_state_dict({}),
    }


def test_fully_shard_after_the_ema_is_refused_by_every_read(one_rank_group, tmp_path):
    # export_weights() wrote the pre-shard EMA in silence; module() advised
    # into=, which would have read it the same way.
    from torch.distributed.fsdp import fully_shard
    model = mlp()
    ema = shardema.EMA(model, HALF)
    ema.update()
    fully_shard(model)
    for api, call in reads_of(ema, tmp_path).items():
        with pytest.raises(ValueError) as excinfo:
            call()
        message = str(excinfo.value)
        assert message.startswith(f"shardema.EMA.{api.strip()}: '0.weight' became a DTensor "
                                  "after the EMA was built"), message
        assert "build the EMA after sharding the model" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert ema.step == 1 and not ema.swapped


def test_a_followed_submodule_sharded_later_is_refused_by_the_reads(one_rank_group, tmp_path):
    # The reads look at the tensors the EMA follows now, not those of the
    # module it was built on.
    from torch.distributed.fsdp import fully_shard
    model = mlp()
    ema = shardema.EMA(model, HALF)
    ema.update()
    torch.manual_seed(5)
    model[2] = torch.nn.Linear(6, 3)
    with pytest.warns(UserWarning, match="'2.weight', '2.bias' were replaced"):
        ema.update()
    fully_shard(model[2])
    for api, call in reads_of(ema, tmp_path).items():
        with pytest.raises(ValueError, match=f"^shardema.EMA.{api.strip()}: '2.weight' became "
                                             "a DTensor"):
            call()
    with pytest.raises(ValueError, match="'2.weight' became a DTensor"):
        ema.update()


def test_a_float64_model_is_refused_in_python_terms():
    model = torch.nn.Linear(3, 3).double()
    with pytest.raises(TypeError) as excinfo:
        shardema.EMA(model)
    message = str(excinfo.value)
    assert "'weight'" in message and "float64" in message, message
    assert "sourceTypeOf" not in message and "::" not in message, message


@pytest.mark.parametrize("step", [2.5, "3", True])
def test_a_step_that_is_not_an_int_is_one_type_error(step):
    ema = shardema.EMA(torch.nn.Linear(2, 2), HALF)
    with pytest.raises(TypeError) as excinfo:
        ema.update(step)
    message = str(excinfo.value)
    assert message.startswith("shardema.EMA.update: step must be an int"), message
    assert "\n" not in message and "Invoked with" not in message
    assert ema.update(1)
