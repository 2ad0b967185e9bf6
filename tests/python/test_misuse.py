"""The misuse table of shardema.EMA (issue 23): each wrong call gets one
clear error that names what is wrong, no C++ backtrace, and leaves the EMA
as it was; a parameter replaced after the EMA was built is followed or
refused, never silently dropped. The expected EMA values are recomputed
here in float64."""
import re
import warnings

import pytest
import torch

import shardema
from shardema import _C

HALF = shardema.DecaySchedule.constant(0.5)
BACKTRACE = re.compile(r"Exception raised from|frame #\d")


def fresh(model=None, **kwargs):
    torch.manual_seed(0)
    model = model if model is not None else torch.nn.Linear(3, 3)
    return model, shardema.EMA(model, HALF, **kwargs)


def one_line_error(excinfo):
    text = str(excinfo.value)
    assert not BACKTRACE.search(text), text
    assert "\n" not in text, text
    return text


def ema_of(ema):
    ema.wait()
    return {k: v.clone() for k, v in ema.local_ema().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- errors without backtraces ------------------------------------------------

def test_load_checkpoint_errors_carry_no_backtrace(tmp_path):
    model, ema = fresh()
    ema.update()
    ema.fence()
    before = ema_of(ema)
    with pytest.raises(ValueError) as excinfo:
        ema.load_checkpoint(str(tmp_path / "missing"))
    assert "manifest.json missing" in one_line_error(excinfo)
    assert same(before, ema_of(ema))


def test_load_into_another_model_names_the_tensor_and_gives_no_reshard_advice(tmp_path):
    model, ema = fresh()
    ema.update()
    ema.wait()
    ema.save_checkpoint(str(tmp_path / "ckpt"))
    wider = torch.nn.Linear(3, 5)
    other = shardema.EMA(wider, HALF)
    before = ema_of(other)
    with pytest.raises(ValueError) as excinfo:
        other.load_checkpoint(str(tmp_path / "ckpt"))
    text = one_line_error(excinfo)
    assert "tensor 'weight' has shape [3, 3] in the checkpoint but [5, 3] here" in text, text
    assert "reshard" not in text and "export" not in text, text
    assert same(before, ema_of(other))
    # A renamed tensor is named as missing on one side.
    renamed = shardema.EMA([("w", torch.zeros(3, 3)), ("bias", torch.zeros(3))], HALF)
    with pytest.raises(ValueError, match="tensor 'weight' is in the checkpoint but not tracked"):
        renamed.load_checkpoint(str(tmp_path / "ckpt"))


def test_load_state_dict_of_another_model_names_the_tensor():
    _, ema = fresh()
    other = shardema.EMA(torch.nn.Linear(3, 5), HALF)
    with pytest.raises(ValueError) as excinfo:
        other.load_state_dict(ema.state_dict())
    assert "tensor 'weight' has 9 elements on this rank in the state but 15 here" in \
        one_line_error(excinfo)


# --- a failed EMA is restored by a load ---------------------------------------

def failed_ema(tmp_path):
    """An EMA failed by its background math (the failpoint makes step 3's
    first chunk throw on the worker); the saved state and checkpoint are of
    step 2, and state_dict() is not called after that (a load must not need
    it)."""
    model, ema = fresh()
    ema.update()
    ema.update()
    ema.save_checkpoint(str(tmp_path / "ckpt"))
    saved = ema_of(ema)
    state = ema.state_dict()
    failpoint = _C._Failpoint("offload.pipeline.chunk", 3, 0)
    try:
        ema.update()
        with pytest.raises(RuntimeError, match="injected fault"):
            ema.wait()
    finally:
        failpoint.close()
    return model, ema, saved, state


def test_a_failed_ema_refuses_fence_and_the_other_calls(tmp_path):
    _, ema, _, _ = failed_ema(tmp_path)
    for call in (ema.fence, ema.wait, ema.local_ema, ema.update):
        with pytest.raises(RuntimeError, match="failed") as excinfo:
            call()
        one_line_error(excinfo)


def test_a_failed_ema_is_restored_by_load_checkpoint(tmp_path):
    _, ema, saved, _ = failed_ema(tmp_path)
    ema.load_checkpoint(str(tmp_path / "ckpt"))
    assert same(saved, ema_of(ema))
    ema.fence()
    assert ema.update()


def test_a_failed_ema_is_restored_by_load_state_dict(tmp_path):
    _, ema, saved, state = failed_ema(tmp_path)
    ema.load_state_dict(state)
    assert same(saved, ema_of(ema))


def test_a_failed_ema_that_never_gave_a_state_dict_is_restored_by_one(tmp_path):
    # The state comes from another EMA of the same model (a resumed job's
    # checkpoint): the failed one never called state_dict() itself.
    model, ema = fresh()
    saver = shardema.EMA(model, HALF)
    saver.update()
    state = saver.state_dict()
    failpoint = _C._Failpoint("offload.pipeline.chunk", 1, 0)
    try:
        ema.update()
        with pytest.raises(RuntimeError, match="injected fault"):
            ema.wait()
    finally:
        failpoint.close()
    assert ema.failed if hasattr(ema, "failed") else True
    ema.load_state_dict(state)
    assert same(ema_of(saver), ema_of(ema))
    assert ema.step == saver.step == 1
    assert ema.update()
    ema.wait()


# --- swap misuse ----------------------------------------------------------------

def test_update_inside_swap_is_refused_and_changes_nothing():
    model, ema = fresh()
    ema.update()
    ema.fence()
    before = ema_of(ema)
    with ema.swap():
        with pytest.raises(ValueError, match="holds the EMA weights shardema.EMA swapped in") \
                as excinfo:
            ema.update()
        one_line_error(excinfo)
    assert ema.step == 1
    assert same(before, ema_of(ema))


def test_swap_of_a_model_on_an_ema_of_named_tensors_is_refused():
    tracked = torch.nn.Linear(2, 2)
    ema = shardema.EMA(list(tracked.named_parameters()), HALF)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="built from named tensors"):
        with ema.swap(other):
            pass
    with pytest.raises(ValueError, match="built from named tensors"):
        ema.copy_to(other)
    assert not ema._engine.swapped


def test_swap_shows_the_ema_and_puts_the_raw_weights_back():
    model, ema = fresh()
    ema.update()
    ema.fence()
    with torch.no_grad():
        model.weight.add_(1.0)
    raw = model.weight.detach().clone()
    ema.update()
    ema.wait()
    expected = (raw.double() - 1.0) * 0.5 + raw.double() * 0.5
    with ema.swap(model):
        torch.testing.assert_close(model.weight.double(), expected, rtol=0, atol=1e-6)
    assert torch.equal(model.weight.detach(), raw)


# --- sparse tensors ---------------------------------------------------------------

def test_sparse_tensors_are_refused_by_name_at_every_entry_point():
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(ValueError, match="'s' has layout torch.sparse_coo") as excinfo:
        shardema.EMA([("s", sparse)])
    one_line_error(excinfo)
    model = torch.nn.Linear(3, 3)
    model.register_buffer("table", sparse)
    with pytest.raises(ValueError, match="'table' has layout torch.sparse_coo"):
        shardema.EMA(model)
    with pytest.raises(ValueError, match="tensor 's' has layout Sparse") as excinfo:
        shardema._C.shards_from_full_tensors([("s", sparse)], ["average"], [False],
                                             "replicated", 0, 1)
    one_line_error(excinfo)


# --- smaller defects ----------------------------------------------------------------

def test_update_zero_says_steps_are_one_based():
    _, ema = fresh()
    with pytest.raises(ValueError, match="1-based optimizer steps; got step 0") as excinfo:
        ema.update(0)
    assert "after step" not in one_line_error(excinfo)
    assert ema.update(1)


def test_export_into_a_checkpoint_folder_is_refused_and_the_checkpoint_still_loads(tmp_path):
    model, ema = fresh()
    ema.update()
    ema.wait()
    folder = tmp_path / "ckpt"
    ema.save_checkpoint(str(folder))
    saved = ema_of(ema)
    manifest = (folder / "manifest.json").read_bytes()
    for target in (folder / "manifest.json", folder / "weights.safetensors"):
        with pytest.raises(ValueError, match="inside the checkpoint folder") as excinfo:
            ema.export_weights(str(target))
        one_line_error(excinfo)
    assert (folder / "manifest.json").read_bytes() == manifest
    assert not (folder / "weights.safetensors").exists()
    ema.fence()
    ema.update()
    ema.load_checkpoint(str(folder))
    assert same(saved, ema_of(ema))


# --- a replaced parameter is followed or refused ------------------------------------

def ema_after(mutate):
    """EMA (decay 0.5) of a Linear: copy at step 1, `mutate`, every
    parameter set to 2, step 2. Returns (model, ema, the EMA's weight)."""
    model, ema = fresh()
    ema.update()
    ema.fence()
    start = model.weight.detach().double().clone()
    mutate(model)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ema.update()
    ema.wait()
    return start, ema_of(ema)["weight"].double().reshape(3, 3), caught


@pytest.mark.parametrize("mutate", [
    lambda m: setattr(m.weight, "data", torch.zeros(3, 3)),
    lambda m: setattr(m, "weight", torch.nn.Parameter(torch.zeros(3, 3))),
    lambda m: m.load_state_dict({"weight": torch.zeros(3, 3), "bias": torch.zeros(3)},
                                assign=True),
], ids=["p.data=", "new Parameter", "load_state_dict(assign=True)"])
def test_a_replacement_of_the_same_shape_and_dtype_is_followed_with_a_warning(mutate):
    start, ema, caught = ema_after(mutate)
    torch.testing.assert_close(ema, start * 0.5 + 2.0 * 0.5, rtol=0, atol=1e-6)
    assert any("'weight'" in str(w.message) and "follows the new tensor" in str(w.message)
               for w in caught), [str(w.message) for w in caught]


def test_a_resize_of_p_data_is_followed_without_a_warning():
    # p.data.resize_ keeps the parameter's own shape: it is the same tensor.
    start, ema, caught = ema_after(lambda m: m.weight.data.resize_(100))
    torch.testing.assert_close(ema, start * 0.5 + 2.0 * 0.5, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mutate,change", [
    (lambda m: m.to(torch.bfloat16), "to torch.bfloat16"),
    (lambda m: setattr(m.weight, "data", torch.zeros(9, 1)), "to torch.float32 [9, 1]"),
    (lambda m: setattr(m, "weight", torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.float64))),
     "to torch.float64"),
], ids=["module.to(bfloat16)", "p.data= another shape", "new Parameter of another dtype"])
def test_a_replacement_of_another_dtype_or_shape_is_refused_naming_it(mutate, change):
    model, ema = fresh()
    ema.update()
    ema.fence()
    before = ema_of(ema)
    mutate(model)
    with pytest.raises(ValueError) as excinfo:
        ema.update()
    text = one_line_error(excinfo)
    assert "tensor 'weight' changed after the EMA was built" in text, text
    assert change in text, text
    assert ema.step == 1
    assert same(before, ema_of(ema))


def test_a_replaced_buffer_is_followed():
    model = torch.nn.BatchNorm1d(3)
    ema = shardema.EMA(model, HALF, policy="versatil")
    ema.update()
    ema.fence()
    model.running_mean = torch.full((3,), 4.0)  # a new tensor under the buffer's name
    with pytest.warns(UserWarning, match="'running_mean'"):
        ema.update()
    ema.wait()
    # versatil copies buffers: the EMA holds the new buffer's value.
    assert torch.equal(ema_of(ema)["running_mean"], torch.full((3,), 4.0))


def test_a_removed_parameter_is_refused_naming_it():
    model, ema = fresh()
    ema.update()
    ema.fence()
    model.bias = None
    with pytest.raises(ValueError, match="'bias' was removed from the model"):
        ema.update()


# --- non-finite weights -----------------------------------------------------------

def test_non_finite_weights_are_averaged_by_default_as_the_references_do():
    model, ema = fresh()
    ema.update()
    ema.fence()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    ema.update()
    ema.wait()
    assert torch.isnan(ema_of(ema)["weight"][0])  # ema-pytorch and AveragedModel do the same


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_refuse_non_finite_names_the_tensor_and_leaves_the_ema(bad):
    model, ema = fresh(refuse_non_finite=True)
    ema.update()
    ema.fence()
    before = ema_of(ema)
    with torch.no_grad():
        model.bias[1] = bad
    with pytest.raises(ValueError) as excinfo:
        ema.update()
    text = one_line_error(excinfo)
    assert "tensor 'bias' holds NaN or Inf at step 2" in text, text
    assert ema.step == 1
    assert same(before, ema_of(ema))
    with torch.no_grad():
        model.bias[1] = 0.0
    assert ema.update(2)  # the same step, once the weights are finite again


# --- warnings reach Python ----------------------------------------------------------

def test_engine_warnings_are_python_warnings_not_stderr_lines():
    """The engine's warnings (here the Averager's about a weight written in
    place while the background read of an update was held open) arrive as
    Python UserWarnings in Python terms, where filters and pytest see them,
    and not as c10's '[W... warning.cpp] Warning:' lines on stderr. A fresh
    process; on a machine without a GPU no CUDA warning at all."""
    import subprocess
    import sys
    code = ("import warnings, torch, shardema\n"
            "from shardema import _C\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    model = torch.nn.Linear(2, 2)\n"
            "    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(0.5))\n"
            "    ema.update()\n"
            "    ema.fence()\n"
            "    gate = _C._ChunkGate(2, 30.0)  # held: the chunks of step 2\n"
            "    ema.update()\n"
            "    assert gate.await_arrival(30.0)\n"
            "    with torch.no_grad():\n"
            "        model.weight.add_(1.0)\n"
            "    gate.open()\n"
            "    ema.fence()\n"
            "    gate.close()\n"
            "    ema.wait()\n"
            "print([str(w.message) for w in caught])\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Warning: " not in run.stderr, run.stderr
    caught = eval(run.stdout.strip().splitlines()[-1])
    written = [m for m in caught if "written in place" in m]
    assert len(written) == 1 and written[0].startswith("shardema.EMA: 'weight' was written"), \
        (caught, run.stderr)
    assert "::" not in written[0]
    if not torch.cuda.is_available():
        assert not any("CUDA" in message for message in caught), caught


def test_copy_from_inside_another_emas_swap_is_refused_and_changes_nothing():
    """Inside b.swap(model) the model holds b's EMA: a.copy_from(model)
    would make a's EMA b's (found by a user trial), as a.update() and
    a.copy_to() there are refused."""
    model = torch.nn.Linear(4, 4)
    a = shardema.EMA(model, decay=0.9)
    b = shardema.EMA(model, decay=0.5)
    for step in range(1, 4):
        with torch.no_grad():
            model.weight.add_(float(step))
        a.update()
        b.update()
    before = a.full_state_dict()
    with b.swap(model):
        with pytest.raises(ValueError, match=r"^shardema\.EMA\.copy_from: 'weight' holds the EMA "
                           r"weights .* swapped in; copy_from\(\) after that swap ends"):
            a.copy_from(model)
    after = a.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    a.copy_from(model)  # after the swap: the raw weights
    assert torch.equal(a.full_state_dict()["weight"], model.weight.detach())


def test_attach_twice_to_one_optimizer_is_refused():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = shardema.EMA(model, decay=0.9).attach(optimizer)
    with pytest.raises(ValueError, match="already attached to this SGD; each of its steps would "
                       "update the EMA twice"):
        ema.attach(optimizer)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert ema.step == 1
    ema.detach()
    ema.attach(optimizer)  # after detach(): once again
    optimizer.step()
    assert ema.step == 2


def test_engine_messages_name_python_arguments_and_torch_dtypes():
    model = torch.nn.Linear(2, 2)
    ema = shardema.EMA(model, decay=0.9, refuse_non_finite=True)
    ema.update()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"\(refuse_non_finite=True\)") as raised:
        ema.update()
    assert "refuseNonFinite" not in str(raised.value)
    with pytest.raises(ValueError, match=r"got torch\.float64$"):
        ema.export_weights("/tmp/never.safetensors", dtype=torch.float64)


def test_a_warning_from_the_optimizer_hook_points_at_the_users_step():
    """The write warning of an update that torch's optimizer pre-hook fenced
    names the user's optimizer.step() line, not torch's or shardema's code
    (a user trial saw torch/optim/optimizer.py)."""
    import inspect
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = shardema.EMA(model, decay=0.9)
    ema.update()
    ema.fence()
    gate = _C._ChunkGate(2, 30.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ema.update()
        assert gate.await_arrival(30.0)
        with torch.no_grad():
            model.weight.add_(1.0)  # while the background read is held
        gate.open()
        model(torch.ones(1, 4)).sum().backward()
        step_line = inspect.currentframe().f_lineno + 1
        optimizer.step()
    gate.close()
    written = [w for w in caught if "written in place" in str(w.message)]
    assert len(written) == 1, [str(w.message) for w in caught]
    assert (written[0].filename, written[0].lineno) == (__file__, step_line)
