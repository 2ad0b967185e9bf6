"""shardema.callbacks.DDPPostHocEMACallback in real Lightning 2.6 Trainers
on CPU: the default strategy (in this process), DDPStrategy on 2 processes
(layout "rank0") and ModelParallelStrategy with FSDP2 on 2 processes
(layout "sharded": each rank keeps the profiles of its DTensors' rows),
and with tensor parallelism (one run, each rank its Shard(0) / Shard(1)
pieces),
with attribute="policy", accumulate_grad_batches 2, a resume from a
checkpoint taken between two snapshot steps, and a finished 2-epoch run
extended to 4 epochs through ckpt_path (posthoc_lightning_worker.py); DDP
with layout "sharded" runs the extension too.

Checked against references the test computes itself, in float64, from the
raw weights recorded after every optimizer step: each snapshot profile (the
power-function EMA of its sigma_rel), and the synthesis, a least-squares
solve over the snapshots' profiles (Karras et al., Algorithm 3), both for
shardema.synthesize_snapshot_folder and for what validation saw. The
resumed run and the extended one must equal the uninterrupted one bit for
bit: raw weights, snapshot files, validation weights, offline synthesis,
deployable weights. Bit for bit, not to rounding: each continues from the
float32 EMAs it saved (the snapshot or resume file of its step), the raw
weights and optimizer state Lightning restores, and the same batches, so
every later profile update runs the same float32 operations on the same
inputs; the synthesis then solves the same system over byte-identical
files."""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import posthoc_lightning_worker as worker  # noqa: E402
import posthoc_reference  # noqa: E402
import rank_launch  # noqa: E402

import shardema  # noqa: E402

WORLD = 2
STEPS = 8  # 4 epochs of 2 optimizer steps
SNAPSHOT_STEPS = (3, 6, 8)  # every 3rd step, and the final one at train end
TRACKED = ("inp.weight", "inp.bias", "out.weight", "out.bias", "offset", "updates")


def launch(scenario, out):
    """Both ranks of `scenario` with torchrun's environment (Lightning
    starts the group): their exit codes and errors."""
    ranks = rank_launch.launch("posthoc_lightning_worker.py", scenario, WORLD, out, timeout=120,
                               torchrun=True)
    return ranks.codes, ranks.errors


# --- float64 references (posthoc_reference.py) -------------------------------
def reference_profiles(trace, sigma_rel):
    """{step: {name: float64 EMA}} of the tracked tensors (nitrous, with
    its step size correction)."""
    return posthoc_reference.power_profiles(trace, sigma_rel, TRACKED)


def reference_synthesis(profiles, steps, sigma_rel, at):
    """float64 least-squares synthesis of `sigma_rel` at step `at` from the
    reference profiles' snapshots at `steps`."""
    return posthoc_reference.synthesis_of({s: profiles[s] for s in worker.SIGMA_RELS}, steps,
                                          sigma_rel, at, TRACKED)


# --- the checks ---------------------------------------------------------------
def load(out, name, rank=0):
    return torch.load(os.path.join(out, f"{name}.rank{rank}.pt"), weights_only=False)


def snapshot_files(folder):
    """{relative path: (tensors, metadata)} of the snapshots (resume states
    and snapshots set aside by a resume left out: the synthesis reads
    neither)."""
    found = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in ("resume", "superseded")]
        for f in files:
            if f.endswith(".safetensors"):
                path = os.path.join(root, f)
                read = shardema.read_tensor_file(path)
                found[os.path.relpath(path, folder)] = (read["tensors"], read["metadata"])
    return found


def assert_same(a, b, what):
    assert sorted(a) == sorted(b), what
    differ = [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
    assert differ == [], f"{what}: {differ} differ"


def close(actual, expected, what, scale=1.0):
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-6 * scale, msg=what)


def rows_of(full, rank, world):
    """This rank's FSDP2 rows of a full tensor (torch.chunk along dim 0; a
    0-d tensor is one row), flattened."""
    rows = full.shape[0] if full.dim() else 1
    size = -(-rows // world)
    start, end = min(rank * size, rows), min((rank + 1) * size, rows)
    per_row = full.numel() // rows
    return full.reshape(-1)[start * per_row:end * per_row]


def check_runs(out, world=1, sharded=False):
    a, c = load(out, "A"), load(out, "C")
    assert a["problems"] == [] and c["problems"] == [], (a["problems"], c["problems"])
    trace = a["trace"]
    assert [s for s, _ in trace] == list(range(STEPS + 1))  # optimizer steps only
    assert a["calls"] == c["calls"] == a["global_step"] == c["global_step"] == STEPS

    # Each snapshot profile is the float64 power-function EMA of its sigma_rel
    # (names relative to attribute="policy"); sharded: each rank's file holds
    # exactly its rows.
    profiles = {s: reference_profiles(trace, s) for s in worker.SIGMA_RELS}
    files = snapshot_files(a["folder"])
    ranks = [f"rank_{r:05d}" for r in range(world)] if sharded else [""]
    expected_names = sorted(os.path.join(r, f"{i}.{t}.safetensors") for r in ranks
                            for i in range(len(worker.SIGMA_RELS)) for t in SNAPSHOT_STEPS)
    assert sorted(files) == expected_names
    for rank, prefix in enumerate(ranks):
        for i, sigma in enumerate(worker.SIGMA_RELS):
            for t in SNAPSHOT_STEPS:
                tensors, _ = files[os.path.join(prefix, f"{i}.{t}.safetensors")]
                assert sorted(tensors) == sorted(TRACKED)
                for k in TRACKED:
                    want = profiles[sigma][t][k]
                    if sharded:
                        want = rows_of(want, rank, world)
                    close(tensors[k].reshape(want.shape), want, f"{prefix} profile {sigma} "
                          f"step {t} '{k}'")

    # The synthesis: offline over the folder, and what each validation saw
    # (the synthesis at the newest snapshot then; none before step 3).
    synthesized = shardema.synthesize_snapshot_folder(a["folder"], 0.05)
    expected = reference_synthesis(profiles, SNAPSHOT_STEPS, 0.05, STEPS)
    for k in TRACKED:
        close(synthesized[k], expected[k], f"synthesized '{k}'")
    assert [s for s, _ in a["validation_seen"]] == [2, 4, 6, 8]
    for step, seen in a["validation_seen"]:
        newest = max((t for t in SNAPSHOT_STEPS if t <= step and t % 3 == 0), default=None)
        if newest is None:
            assert_same(seen, {k: trace[step][1][k] for k in seen}, f"validation at {step}")
            continue
        want = reference_synthesis(profiles, [t for t in (3, 6) if t <= newest], 0.05, newest)
        assert sorted(seen) == sorted(TRACKED)
        for k in seen:
            close(seen[k], want[k], f"validation at step {step}: '{k}'")
            if k != "offset":  # a constant buffer: its EMA is itself
                assert not torch.equal(seen[k], trace[step][1][k]), f"validation {step}: '{k}'"

    # The resume from step 4 (between the snapshots of 3 and 6) goes on as
    # the uninterrupted run, bit for bit.
    assert_same(c["raw"], a["raw"], "resumed raw weights")
    # (The trace's first entries: on_fit_start, before Lightning has
    # restored global_step, and the restored step 4 seen after a
    # micro-batch, whose forward already counted in `updates`.)
    assert [s for s, _ in c["trace"][2:]] == list(range(5, STEPS + 1))
    for (step, weights), (_, want) in zip(c["trace"][2:], trace[5:]):
        assert_same(weights, want, f"resumed raw weights at step {step}")
    assert [s for s, _ in c["validation_seen"]] == [6, 8]
    for (step, seen), (_, want) in zip(c["validation_seen"], a["validation_seen"][2:]):
        assert_same(seen, want, f"resumed validation at step {step}")
    resumed_files = snapshot_files(c["folder"])
    assert sorted(resumed_files) == sorted(files)
    for name, (tensors, metadata) in files.items():
        assert_same(resumed_files[name][0], tensors, f"resumed snapshot {name}")
        assert resumed_files[name][1] == metadata, name
    assert_same(shardema.synthesize_snapshot_folder(c["folder"], 0.05), synthesized,
                "synthesis of the resumed run")
    assert a["output_path"] and c["output_path"] and a["output_path"] != c["output_path"]
    assert_same(shardema.read_tensor_file(c["output_path"])["tensors"],
                shardema.read_tensor_file(a["output_path"])["tensors"], "deployable weights")
    # The checkpoint of step 4 wrote each rank's resume state beside its
    # snapshots, where the synthesis does not look.
    for prefix in ranks:
        resume = os.path.join(a["folder"], prefix, "resume")
        assert {"0.4.safetensors", "1.4.safetensors"} <= set(os.listdir(resume))
    return a, c


def check_extended(out, world=1, sharded=False):
    """E (B's finished 2 epochs extended to 4 through ckpt_path, in B's
    folder) against A (4 epochs straight): the same snapshots, synthesis,
    validation and deployable weights, bit for bit. B's final snapshot of
    step 4 (off the every-3 grid) left the synthesis set but was kept: in
    resume/ beside the resume state of B's checkpoint, or, that being
    there already, under superseded/resumed_at_4/, equal to A's profiles at
    step 4."""
    a, b, e = load(out, "A"), load(out, "B"), load(out, "E")
    assert b["problems"] == [] and e["problems"] == [], (b["problems"], e["problems"])
    assert b["calls"] == b["global_step"] == 4
    assert e["calls"] == e["global_step"] == STEPS
    assert b["folder"] == e["folder"] != a["folder"]
    assert_same(e["raw"], a["raw"], "extended raw weights")
    straight, extended = snapshot_files(a["folder"]), snapshot_files(e["folder"])
    assert sorted(extended) == sorted(straight)
    for name, (tensors, metadata) in straight.items():
        assert_same(extended[name][0], tensors, f"extended snapshot {name}")
        assert extended[name][1] == metadata, name
    # sigma_rels the profiles do not hold (0.05 at a snapshot step is that
    # snapshot itself, whatever else the folder holds).
    for sigma, step in ((0.07, None), (0.15, 6)):
        assert_same(shardema.synthesize_snapshot_folder(e["folder"], sigma, step=step),
                    shardema.synthesize_snapshot_folder(a["folder"], sigma, step=step),
                    f"extended synthesis of {sigma} at step {step or STEPS}")
    assert [s for s, _ in e["validation_seen"]] == [6, 8]
    for (step, seen), (_, want) in zip(e["validation_seen"], a["validation_seen"][2:]):
        assert_same(seen, want, f"extended validation at step {step}")
    assert_same(shardema.read_tensor_file(e["output_path"])["tensors"],
                shardema.read_tensor_file(a["output_path"])["tensors"], "deployable weights")
    # Nothing B saved was lost: its deployable weights of step 4, and its
    # final snapshot of step 4 in superseded/ (its checkpoint's resume
    # state of step 4 being in resume/ already), both equal to A's profiles.
    assert os.path.isfile(b["output_path"])
    ranks = [f"rank_{r:05d}" for r in range(world)] if sharded else [""]
    for prefix in ranks:
        for i in range(len(worker.SIGMA_RELS)):
            want = shardema.read_tensor_file(
                os.path.join(a["folder"], prefix, "resume", f"{i}.4.safetensors"))["tensors"]
            for kept in ("resume", os.path.join("superseded", "resumed_at_4")):
                path = os.path.join(e["folder"], prefix, kept, f"{i}.4.safetensors")
                assert_same(shardema.read_tensor_file(path)["tensors"], want, path)


def test_single_device(tmp_path):
    import lightning.pytorch as L
    worker.posthoc_runs(L, str(tmp_path))
    check_runs(str(tmp_path))
    check_extended(str(tmp_path))


def test_ddp_two_processes_rank0_layout(tmp_path):
    codes, errors = launch("ddp", tmp_path)
    assert errors == {} and codes == [0] * WORLD, (codes, errors)
    check_runs(str(tmp_path))
    check_extended(str(tmp_path))
    for name in "ACBE":  # every rank trained on the same raw weights
        assert load(str(tmp_path), name, 1)["problems"] == []
        assert_same(load(str(tmp_path), name, 1)["raw"], load(str(tmp_path), name)["raw"], name)


def test_model_parallel_fsdp2_two_processes_sharded_layout(tmp_path):
    codes, errors = launch("model_parallel", tmp_path)
    assert errors == {} and codes == [0] * WORLD, (codes, errors)
    check_runs(str(tmp_path), world=WORLD, sharded=True)
    check_extended(str(tmp_path), world=WORLD, sharded=True)
    for name in "ACBE":
        rank1, rank0 = load(str(tmp_path), name, 1), load(str(tmp_path), name)
        assert rank1["problems"] == []
        assert_same(rank1["raw"], rank0["raw"], name)
        # Each rank swapped its rows in and the buffers whole: the same EMA.
        for (_, seen1), (_, seen0) in zip(rank1["validation_seen"], rank0["validation_seen"]):
            assert_same(seen1, seen0, f"{name}: rank 1's validation weights")


def test_a_tensor_parallel_resume_ends_with_the_interpreters_own_exit(tmp_path):
    """Issue 32: rank 1 of a tensor-parallel Lightning resume (both
    callbacks' EMAs alive at exit, no destroy_process_group) once died with
    "terminate called without an active exception" after a correct fit. The
    other workers leave with os._exit; this one runs Python's finalization
    and the C++ exit handlers, so a thread that outlives its owner in any
    exit order shows here."""
    codes, errors = launch("tp_resume_exit", tmp_path)
    outputs = [(tmp_path / f"output{rank}.txt").read_text() for rank in range(WORLD)]
    assert errors == {} and codes == [0] * WORLD, (codes, errors)
    for rank, text in enumerate(outputs):
        assert "terminate called" not in text and "Aborted" not in text, (rank, text[-2000:])


def test_model_parallel_tensor_parallel_two_processes_sharded_layout(tmp_path):
    """ModelParallelStrategy's tensor-parallel mesh (ColwiseParallel `inp`,
    RowwiseParallel `out`): each rank's snapshots hold its pieces in their
    own layout, and the offline synthesis, what validation saw (on every
    rank) and the deployable weights match the float64 reference in the
    tensors' own shapes."""
    codes, errors = launch("model_parallel_tp", tmp_path)
    assert errors == {} and codes == [0] * WORLD, (codes, errors)
    a, a1 = load(str(tmp_path), "A"), load(str(tmp_path), "A", 1)
    assert a["problems"] == [] and a1["problems"] == [], (a["problems"], a1["problems"])
    trace = a["trace"]
    # Every rank reads all of the batches (no data parallelism): 3 steps an epoch.
    steps = a["global_step"]
    assert steps == 12 and [s for s, _ in trace] == list(range(steps + 1))
    snapshot_steps = list(range(3, steps + 1, 3))
    profiles = {s: reference_profiles(trace, s) for s in worker.SIGMA_RELS}
    files = snapshot_files(a["folder"])
    for rank in range(WORLD):
        tensors, metadata = files[os.path.join(f"rank_{rank:05d}", "0.6.safetensors")]
        assert metadata["shardema.split_dims"] == '{"out.weight":1}', metadata
        want = profiles[0.05][6]["out.weight"].chunk(WORLD, dim=1)[rank]
        close(tensors["out.weight"].reshape(want.shape), want, f"rank {rank} out.weight")
    expected = reference_synthesis(profiles, snapshot_steps, 0.05, steps)
    synthesized = shardema.synthesize_snapshot_folder(a["folder"], 0.05)
    deployable = shardema.read_tensor_file(a["output_path"])["tensors"]
    for k in TRACKED:
        assert synthesized[k].shape == deployable[k].shape == expected[k].shape, k
        close(synthesized[k], expected[k], f"synthesized '{k}'")
        close(deployable[k], expected[k], f"deployable '{k}'")
    for result in (a, a1):
        assert [s for s, _ in result["validation_seen"]] == [3, 6, 9, 12]
        for step, seen in result["validation_seen"]:
            newest = max((t for t in snapshot_steps if t <= step), default=None)
            if newest is None:
                continue
            want = reference_synthesis(profiles, [t for t in snapshot_steps if t <= newest],
                                       0.05, newest)
            for k in seen:
                close(seen[k], want[k], f"validation at step {step}: '{k}'")


def test_ddp_two_processes_sharded_layout_extended(tmp_path):
    """DDP with layout "sharded": every rank keeps the profiles of its rows
    of the replicated model in its rank_NNNNN folder; a finished run
    extended through ckpt_path synthesizes what the uninterrupted one does."""
    codes, errors = launch("ddp_sharded", tmp_path)
    assert errors == {} and codes == [0] * WORLD, (codes, errors)
    check_extended(str(tmp_path), world=WORLD, sharded=True)
    for name in "ABE":
        assert load(str(tmp_path), name, 1)["problems"] == []
        assert_same(load(str(tmp_path), name, 1)["raw"], load(str(tmp_path), name)["raw"], name)


@pytest.mark.parametrize("order", ["ema_first", "posthoc_first"])
def test_ddp_beside_ema_callback_trains_as_alone(tmp_path, order):
    """EMACallback (validate_with_ema=False) and DDPPostHocEMACallback in
    one DDP Trainer (2 processes), validation each epoch (steps 2 and 4 fall
    between the post-hoc snapshot steps 3 and 6): the fit ends on both
    ranks, with the raw weights of the run with the post-hoc callback
    alone, bit for bit, and validation seeing the same post-hoc EMA as
    alone. Both asking to validate on their EMA is refused at fit start
    (test_two_validation_swaps_are_refused_at_fit_start). Before issue 32 it failed in either order: each callback waited
    only for its own update before its swap wrote the parameters, so the
    other's update still in flight failed; now every swap waits for every
    EMA of the process (fenceEveryAverager) and one validation swaps one
    EMA in."""
    codes, errors = launch(f"two_callbacks_{order}", tmp_path)
    assert errors == {} and codes == [0] * WORLD, (codes, errors)
    for rank in range(WORLD):
        alone, both = load(str(tmp_path), "R", rank), load(str(tmp_path), "T", rank)
        assert alone["problems"] == [] and both["problems"] == []
        assert_same(both["raw"], alone["raw"], f"rank {rank}: raw weights beside EMACallback")
        assert [s for s, _ in both["validation_seen"]] == [s for s, _ in alone["validation_seen"]]
        assert alone["validation_seen"]
        for (step, seen), (_, want) in zip(both["validation_seen"], alone["validation_seen"]):
            assert_same(seen, want, f"rank {rank}: validation at step {step} beside EMACallback")


def test_two_validation_swaps_are_refused_at_fit_start(tmp_path):
    """Both callbacks asking to validate on their EMA of the same module
    (the defaults) is refused by name when fit starts, before a step runs
    or a file is written; with validate_with_ema=False on one, the same
    Trainer fits, and disjoint attribute= submodules may each validate on
    their own EMA."""
    import lightning.pytorch as L

    from shardema.callbacks import DDPPostHocEMACallback, EMACallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.policy = torch.nn.Linear(3, 1)
            self.critic = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            return (self.policy(batch[0]) + self.critic(batch[0])).square().mean()

        def validation_step(self, batch, batch_idx):
            self.log("val", self.policy(batch[0]).square().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)),
                                       batch_size=4)

    def fit(callbacks, name):
        module = Module()
        before = {k: v.clone() for k, v in module.state_dict().items()}
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=callbacks,
                            default_root_dir=str(tmp_path / name))
        trainer.fit(module, data, data)
        return module, before

    for order in (0, 1):
        callbacks = [EMACallback(attribute="policy"),
                     DDPPostHocEMACallback(attribute="policy", checkpoint_every=1,
                                           checkpoint_folder=str(tmp_path / f"refused{order}"))]
        if order:
            callbacks.reverse()
        with pytest.raises(ValueError, match="both swap their EMA into the model for validation"
                           ".*validate_with_ema=False"):
            module, before = fit(callbacks, f"refused{order}")
        assert not os.path.exists(tmp_path / f"refused{order}") or \
            not any(os.scandir(tmp_path / f"refused{order}"))
    fit([EMACallback(attribute="policy", validate_with_ema=False),
         DDPPostHocEMACallback(attribute="policy", checkpoint_every=1,
                               checkpoint_folder=str(tmp_path / "posthoc"))], "one")
    assert any(os.scandir(tmp_path / "posthoc"))
    fit([EMACallback(attribute="policy"), EMACallback(attribute="critic")], "disjoint")
