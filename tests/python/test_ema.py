"""shardema.EMA in one process: values against a float64 recomputation,
the swap, resume state, the checkpoint folder and export, and the errors a
user gets for bad input."""
import os

import pytest
import torch

import shardema


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 4))
    return model.to(dtype)


def train_step(model, step):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.sin(torch.arange(p.numel(), dtype=torch.float64) * 0.1 * (step + i))
                   .reshape(p.shape).to(p.dtype))


def reference_ema(model_states, schedule, policy_average):
    """float64 EMA of a sequence of state dicts (the initial one first); the
    first due update copies (copy_on_first_update)."""
    ema = {k: v.double().clone() for k, v in model_states[0].items()}
    for step, state in enumerate(model_states[1:], start=1):
        decay = schedule.decay_at(step) if step > 1 else 0.0
        for k, v in state.items():
            if policy_average(k):
                ema[k] = ema[k] * decay + v.double() * (1 - decay)
            else:
                ema[k] = v.double().clone()
    return ema


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ema_matches_float64_recomputation(dtype):
    model = make_model(dtype)
    schedule = shardema.DecaySchedule.constant(0.9)
    ema = shardema.EMA(model, schedule=schedule, policy="ema_pytorch", chunk_mib=0.001)
    states = [{k: v.clone() for k, v in model.state_dict().items()}]
    for step in range(1, 8):
        ema.fence()  # before the optimizer step
        train_step(model, step)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        assert ema.update() is True
    ema.wait()
    assert ema.step == 7 and ema.last_decay == pytest.approx(0.9)
    expected = reference_ema(states, schedule, lambda k: "num_batches" not in k)
    got = ema.full_state_dict()
    assert list(got) == list(model.state_dict())
    for name, value in got.items():
        if name.endswith("num_batches_tracked"):
            assert value.dtype == torch.int64  # copied once, ema_pytorch policy
            continue
        assert value.dtype == torch.float32
        torch.testing.assert_close(value.double(), expected[name], rtol=1e-6, atol=1e-6)


def test_versatil_policy_copies_buffers_batchnorm_and_frozen():
    model = make_model()
    model[2].weight.requires_grad_(False)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(0.5), policy="versatil")
    for step in range(1, 4):
        ema.fence()
        train_step(model, step)
        ema.update()
    ema.wait()
    got = ema.full_state_dict()
    live = model.state_dict()
    for copied in ("1.weight", "1.bias", "1.running_mean", "2.weight"):
        assert torch.equal(got[copied].to(live[copied].dtype), live[copied]), copied
    assert not torch.equal(got["0.weight"], live["0.weight"])  # averaged


def test_swap_puts_ema_in_and_raw_back_even_on_error():
    model = make_model()
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(0.5))
    ema.update()
    ema.fence()
    train_step(model, 1)
    ema.update()
    ema.wait()
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    averaged = ema.full_state_dict()
    with ema.swap(model):
        torch.testing.assert_close(model[0].weight.detach(), averaged["0.weight"])
    assert all(torch.equal(raw[k], v) for k, v in model.state_dict().items())
    with pytest.raises(KeyError):
        with ema.swap():
            raise KeyError("validation failed")
    assert all(torch.equal(raw[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="another model"):
        with ema.swap(make_model()):
            pass


def test_state_dict_round_trip_through_torch_save(tmp_path):
    model = make_model()
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.warmup())
    for step in range(1, 4):
        ema.fence()
        train_step(model, step)
        ema.update(step)
    state = ema.state_dict()
    torch.save(state, tmp_path / "ema.pt")
    other = shardema.EMA(make_model(), schedule=shardema.DecaySchedule.warmup())
    other.load_state_dict(torch.load(tmp_path / "ema.pt"))
    assert other.step == 3
    a, b = ema.full_state_dict(), other.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="schedule"):
        shardema.EMA(make_model(), schedule=shardema.DecaySchedule.constant(0.5)).load_state_dict(state)


def test_save_load_export_agree_with_full_state_dict(tmp_path):
    model = make_model()
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(0.7))
    for step in range(1, 4):
        ema.fence()
        train_step(model, step)
        ema.update()
    folder = str(tmp_path / "ckpt")
    ema.save_checkpoint(folder)
    assert os.path.exists(os.path.join(folder, "manifest.json"))
    path = str(tmp_path / "ema.safetensors")
    ema.export_weights(path)
    exported = shardema.read_tensor_file(path)
    full = ema.full_state_dict()
    assert list(exported["tensors"]) == list(full)
    assert all(torch.equal(exported["tensors"][k], full[k]) for k in full)
    assert exported["metadata"]["shardema.kind"] == "deployable_weights"
    exported_bf16 = str(tmp_path / "ema_bf16.safetensors")
    ema.export_weights(exported_bf16, dtype=torch.bfloat16)
    assert shardema.read_tensor_file(exported_bf16)["tensors"]["0.weight"].dtype == torch.bfloat16

    resumed = shardema.EMA(make_model(), schedule=shardema.DecaySchedule.constant(0.7))
    resumed.load_checkpoint(folder)
    assert resumed.step == 3
    again = resumed.full_state_dict()
    assert all(torch.equal(again[k], full[k]) for k in full)


def test_load_of_another_layout_is_a_value_error_and_changes_nothing(tmp_path):
    ema = shardema.EMA(make_model(), schedule=shardema.DecaySchedule.constant(0.7))
    ema.save_checkpoint(str(tmp_path / "ckpt"))
    small = torch.nn.Linear(3, 3)
    other = shardema.EMA(small, schedule=shardema.DecaySchedule.constant(0.7))
    before = other.full_state_dict()
    with pytest.raises(ValueError, match="layout"):
        other.load_checkpoint(str(tmp_path / "ckpt"))
    after = other.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_named_tensors_and_device_storage():
    a = torch.nn.Parameter(torch.ones(5))
    ema = shardema.EMA({"a": a}, schedule=shardema.DecaySchedule.constant(0.5), storage="device")
    with torch.no_grad():
        a.fill_(3.0)
    ema.update()
    with torch.no_grad():
        a.fill_(5.0)
    ema.update()
    assert torch.equal(ema.full_state_dict()["a"], torch.full((5,), 4.0))


def test_offload_stats_count_the_bytes_read_in_place():
    model = torch.nn.Linear(64, 256)  # no buffers: every tensor every update
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(0.5), chunk_mib=0.01)
    for _ in range(3):
        ema.fence()
        ema.update()
    ema.wait()
    stats = ema.offload_stats()
    assert set(stats) == {"updates", "chunks", "source_bytes", "staged_bytes", "staging_bytes",
                          "fence_wait_seconds", "last_fence_wait_seconds", "waiter_chunks"}
    assert stats["updates"] == 3
    assert stats["source_bytes"] == 3 * (64 * 256 + 256) * 4
    assert stats["staged_bytes"] == 0  # CPU parameters are read in place
    assert stats["chunks"] >= 3 * 7  # 65 KiB in chunks of at most 10 KiB
    assert 0 <= stats["waiter_chunks"] <= stats["chunks"]
    assert stats["fence_wait_seconds"] >= stats["last_fence_wait_seconds"] >= 0.0


# --- misuse ---------------------------------------------------------------
def test_float64_parameter_is_refused_naming_it():
    model = torch.nn.Linear(2, 2).double()
    with pytest.raises((ValueError, TypeError), match="weight"):
        shardema.EMA(model)


def test_non_increasing_step_is_a_value_error():
    ema = shardema.EMA(torch.nn.Linear(2, 2))
    ema.update(5)
    ema.fence()
    with pytest.raises(ValueError, match="increase"):
        ema.update(5)


def test_updates_with_no_fence_in_between_are_fine():
    # Nothing was written between them: neither is refused, nothing fails
    # (the write rules themselves: test_source_writes.py).
    ema = shardema.EMA(torch.nn.Linear(2, 2))
    assert ema.update()
    assert ema.update()
    ema.wait()


def test_bad_arguments_name_the_parameter():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="layout"):
        shardema.EMA(model, layout="hsdp")
    with pytest.raises(ValueError, match="storage"):
        shardema.EMA(model, storage="gpu")
    with pytest.raises(ValueError, match="policy"):
        shardema.EMA(model, policy="timm")
    with pytest.raises(TypeError, match="schedule"):
        shardema.EMA(model, schedule=0.999)
    with pytest.raises(TypeError, match="model_or_named_tensors"):
        shardema.EMA(3)
    with pytest.raises(RuntimeError, match="torch.distributed group"):
        shardema.EMA(model, layout="replicated")
    with pytest.raises(ValueError, match="fsdp2"):
        shardema.EMA(model, layout="fsdp2")
    with pytest.raises(TypeError, match="dtype"):
        shardema.EMA(model).export_weights("/tmp/never.safetensors", dtype="bf16")


def test_attach_fences_before_and_updates_after_every_optimizer_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    schedule = shardema.DecaySchedule.warmup(power=1.0, max_value=0.9)
    ema = shardema.EMA(model, schedule=schedule).attach(optimizer)
    reference = None
    for step in range(1, 6):
        model(torch.randn(4, 3)).square().mean().backward()
        # The pre-hook fences: without it this second update would be refused.
        optimizer.step()  # the post-hook updates
        optimizer.zero_grad()
        now = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        decay = schedule.decay_at(step) if reference is not None else 0.0
        reference = now if reference is None else \
            {n: decay * reference[n] + (1 - decay) * now[n] for n in now}
        assert ema.step == step
    full = ema.full_state_dict()
    for name, want in reference.items():
        torch.testing.assert_close(full[name].double(), want, rtol=1e-6, atol=1e-7)
    ema.detach()
    model(torch.randn(4, 3)).square().mean().backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()  # a real step, no hook left: the EMA does not move
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert ema.step == 5
    assert all(torch.equal(full[k], v) for k, v in ema.full_state_dict().items())
    ema.update()  # by hand again (no fence needed: the last update was waited for)
    assert ema.step == 6


def test_load_state_dict_of_another_model_names_the_tensor_and_changes_nothing(tmp_path):
    def trained(model):
        ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(0.5))
        ema.update()
        ema.wait()
        return ema

    state = trained(make_model()).state_dict()
    trained(make_model()).save_checkpoint(str(tmp_path / "ckpt"))
    wider = make_model()
    wider.add_module("head", torch.nn.Linear(4, 2))  # 'head.weight' missing from the state
    narrower = make_model()
    narrower[2].bias = None  # '2.bias' in the state, not tracked here
    for model, name, says in ((wider, "head.weight", "tracked here but not in the"),
                              (narrower, "2.bias", "in the state but not tracked here")):
        ema = trained(model)
        before = ema.full_state_dict()
        with pytest.raises(ValueError, match=f"'{name}' (is )?{says}"):
            ema.load_state_dict(state)
        with pytest.raises(ValueError, match=f"'{name}' (is )?" +
                           says.replace("state", "checkpoint")):
            ema.load_checkpoint(str(tmp_path / "ckpt"))
        after = ema.full_state_dict()
        assert ema.step == 1 and all(torch.equal(before[k], after[k]) for k in before)


def test_load_state_dict_of_garbage_is_a_clear_error():
    ema = shardema.EMA(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError):
        ema.load_state_dict([1, 2])
    with pytest.raises(ValueError, match="tensors"):
        ema.load_state_dict({"x": 1})


@pytest.mark.parametrize("blocking", ["wait", "fence"])
def test_update_returns_before_its_math_and_waiting_releases_the_gil(blocking):
    """The math of step 2 is held at a gate (_C._ChunkGate: a C++ hook at the
    failpoint offload.pipeline.chunk) until this test opens it: update(2)
    returns meanwhile, so it did not run the math. The gate is opened by
    another Python thread once the main thread is inside wait() / fence(),
    which can happen only if they release the GIL; had either held it, the
    gate would have timed out (timed_out) instead."""
    import sys
    import threading
    import time
    w = torch.nn.Parameter(torch.zeros(1 << 16))
    ema = shardema.EMA({"w": w}, schedule=shardema.DecaySchedule.constant(0.5),
                       chunk_mib=0.05)  # 256 KiB in several chunks
    ema.update()
    ema.fence()
    chunks_before = ema.offload_stats()["chunks"]
    with torch.no_grad():
        w.fill_(2.0)
    gate = shardema._C._ChunkGate(step=2, timeout_seconds=20)
    main = threading.get_ident()

    def open_once_main_blocks():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main)
            if frame is not None and frame.f_code.co_name == blocking and \
                    frame.f_code.co_filename.endswith("_ema.py"):
                break
            time.sleep(0.001)
        gate.open()

    try:
        assert ema.update() is True
        assert gate.await_arrival(20), "the math of step 2 never started"
        assert gate.arrivals == 1  # held at its first chunk, after update() returned
        opener = threading.Thread(target=open_once_main_blocks)
        opener.start()
        getattr(ema, blocking)()
        opener.join()
    finally:
        gate.close()
    assert not gate.timed_out, f"{blocking}() kept the GIL, or update() waited for the math"
    assert gate.arrivals == ema.offload_stats()["chunks"] - chunks_before > 1  # all of step 2
    assert torch.equal(ema.full_state_dict()["w"], torch.full((1 << 16,), 1.0))


def thread_rank_group(store, rank, world):
    """A Gloo group of `world` ranks that are threads of this process."""
    from datetime import timedelta

    import torch.distributed as dist
    backend = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=30))
    group = dist.ProcessGroup(store, rank, world)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def test_collective_calls_release_the_gil(tmp_path):
    """Two ranks as two threads of this process: each collective returns
    only once both threads are inside it, which needs the first one in to
    have released the GIL; one that kept it fails on the EMA's timeout."""
    import threading

    import torch.distributed as dist
    store, world, errors, results = dist.HashStore(), 2, {}, {}

    def rank_main(rank):
        try:
            group = thread_rank_group(store, rank, world)
            rows = torch.nn.Parameter(torch.full((4, 3), float(rank + 1)))
            spec = shardema.layout_spec("w", [8, 3], torch.float32, "fsdp2", world)
            ema = shardema.EMA.from_local_shards([(rows, spec)], process_group=group, timeout=20)
            ema.update()
            ema.wait()
            results[rank] = ema.full_state_dict(rank0_only=False)["w"]
            ema.save_checkpoint(str(tmp_path / "ckpt"))
            ema.export_weights(str(tmp_path / "ema.safetensors"))
            ema.load_checkpoint(str(tmp_path / "ckpt"))
        except BaseException as error:  # reported below
            errors[rank] = f"{type(error).__name__}: {error}"

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a rank hung past 90 s"
    assert errors == {}
    want = torch.cat([torch.full((4, 3), 1.0), torch.full((4, 3), 2.0)])
    assert all(torch.equal(results[r], want) for r in range(world))
    exported = shardema.read_tensor_file(str(tmp_path / "ema.safetensors"))["tensors"]
    assert torch.equal(exported["w"], want)


def test_a_torch_other_than_the_one_built_against_is_an_import_error():
    import subprocess
    import sys
    code = ("import torch; torch.__version__ = '0.0.1'\n"
            "try:\n    import shardema\nexcept ImportError as e:\n    print('IMPORT ERROR:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "IMPORT ERROR" in out.stdout, out.stdout + out.stderr
    assert "built against torch" in out.stdout and "0.0.1" in out.stdout
