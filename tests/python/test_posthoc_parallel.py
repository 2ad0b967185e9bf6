"""The sharded post-hoc EMA (DDPPostHocEMACallback's lifecycle and
shardema.PostHocEMA) under HSDP (a 2 x 2 mesh, W = 4) and tensor
parallelism (W = 2), on CPU/Gloo: each rank checks its snapshots, the
synthesis of any sigma_rel, the validation swap, the deployable weights
and a bit-exact resume against a float64 recomputation over the full
tensors, and PostHocEMA against the reference run in tests/data
(posthoc_parallel_worker.py); here, that each scenario passed on every
rank."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from rank_launch import assert_passed, launched_once  # noqa: E402

RUNS = [(4, ["posthoc_hsdp", "posthoc_hsdp_golden"]), (2, ["posthoc_tp", "posthoc_tp_golden"])]
runs = launched_once("posthoc_parallel_worker.py", RUNS, timeout=150)


def test_hsdp_first_replica_writes_and_every_replica_validates_on_the_synthesis(runs):
    assert_passed(runs(4), "posthoc_hsdp")


def test_hsdp_synthesis_equals_the_reference_run(runs):
    assert_passed(runs(4), "posthoc_hsdp_golden")


def test_tensor_parallel_pieces_synthesize_and_export_in_their_own_shapes(runs):
    assert_passed(runs(2), "posthoc_tp")


def test_tensor_parallel_synthesis_equals_the_reference_run(runs):
    assert_passed(runs(2), "posthoc_tp_golden")
