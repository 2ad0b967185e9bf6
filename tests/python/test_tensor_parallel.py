"""shardema.EMA over tensor-parallel DTensors and HSDP, through
torch.distributed.checkpoint, on CPU/Gloo: each rank checks itself against
a float64 EMA of the full tensors (tensor_parallel_worker.py); here, that
each scenario passed on every rank. Three launches, each started once and
in order, since a later one reads the checkpoints of an earlier one:
W = 4 (HSDP 2 x 2), W = 2 (tensor parallelism; HSDP's checkpoint under
FSDP2), W = 1 (tensor parallelism's checkpoint). export_weights() of
tensor-parallel EMAs runs apart (tensor_parallel_export_worker.py), at
W = 2 and W = 4 (HSDP over tensor parallelism)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from rank_launch import assert_passed, launched_once  # noqa: E402

RUNS = [(4, ["hsdp_dcp", "hsdp_slow_writer", "hsdp_buffers", "hsdp_missing_writer"]),
        (2, ["tp_train", "hsdp_load_fsdp2", "tp_load_full", "tp_callback_one_file",
             "whole_gather_only"]),
        (1, ["tp_load_one"])]
# A later launch reads the checkpoints of an earlier one.
runs = launched_once("tensor_parallel_worker.py", RUNS, timeout=150, in_order=True)
export_runs = launched_once("tensor_parallel_export_worker.py",
                            [(2, ["tp_export", "tp_export_memory"]), (4, ["tp_hsdp_export"])],
                            timeout=150, name="export_runs")


def test_hsdp_state_dict_saves_once_per_chunk_and_loads_back_at_2x2(runs):
    assert_passed(runs(4), "hsdp_dcp")


def test_hsdp_buffers_each_rank_its_own_global_rank_0s_for_the_job(runs):
    assert_passed(runs(4), "hsdp_buffers")


def test_hsdp_waiting_replicas_fail_within_the_ema_timeout(runs):
    assert_passed(runs(4), "hsdp_missing_writer")


def test_tensor_parallel_ema_equals_float64_reference_and_saves_through_dcp(runs):
    assert_passed(runs(2), "tp_train")


def test_hsdp_checkpoint_loads_under_fsdp2_at_w2(runs):
    assert_passed(runs(2), "hsdp_load_fsdp2")


def test_hsdp_writer_slower_than_the_timeout_completes_on_every_replica(runs):
    assert_passed(runs(4), "hsdp_slow_writer")


def test_full_tensors_load_into_a_tensor_parallel_ema_each_rank_its_piece(runs):
    assert_passed(runs(2), "tp_load_full")


def test_callback_one_file_checkpoint_of_a_tensor_parallel_model_resumes(runs):
    assert_passed(runs(2), "tp_callback_one_file")


def test_swap_and_copy_to_gather_only_the_tensors_held_whole(runs):
    assert_passed(runs(2), "whole_gather_only")


def test_tensor_parallel_checkpoint_loads_at_w1(runs):
    assert_passed(runs(1), "tp_load_one")


def test_export_weights_of_tensor_parallel_shards_equals_full_state_dict(export_runs):
    assert_passed(export_runs(2), "tp_export")


def test_export_weights_holds_at_most_one_full_tensor_at_a_time(export_runs):
    assert_passed(export_runs(2), "tp_export_memory")


def test_export_weights_under_hsdp_over_tensor_parallelism(export_runs):
    assert_passed(export_runs(4), "tp_hsdp_export")
