"""The extension crosses the boundary with torch's own objects: a
ProcessGroup made by torch.distributed reaches the C++ engine as c10d's
(the one collectives then run on), and the import check refuses exactly
the torch builds whose C++ ABI differs from the one shardema was built
against. The real DTensor is in test_dtensor_detection.py."""
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import shardema
from shardema import _same_torch


def test_a_process_group_of_torch_distributed_runs_the_collectives(one_rank_group):
    group = dist.new_group([0])  # a group other than the default one, made by torch
    model = torch.nn.Linear(4, 3)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(0.5), process_group=group)
    assert ema.layout == "replicated" and ema.world_size == 1 and ema.rank == 0
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update()
    # full_state_dict gathers through that group's c10d backend
    torch.testing.assert_close(ema.full_state_dict()["weight"], model.weight.detach())
    dist.destroy_process_group(group)


def test_a_default_group_is_picked_up_without_being_named(one_rank_group):
    ema = shardema.EMA(torch.nn.Linear(2, 2))
    assert ema.layout == "replicated"


def test_something_else_as_the_group_is_a_type_error_that_says_what_it_wants():
    with pytest.raises(TypeError, match="ProcessGroup") as error:
        shardema.EMA(torch.nn.Linear(2, 2), process_group=object(), layout="replicated")
    assert "object" in str(error.value)


@pytest.mark.parametrize("built, running, same", [
    ("2.11.0+cu130", "2.11.0+cu130", True),
    ("2.11.0+cu130", "2.11.1+cu130", True),   # a patch release keeps the C++ ABI
    ("2.11.0+cu130", "2.11.0+cu131", True),   # the same libcudart.so.13
    ("2.11.0", "2.11.0+cu130", True),         # a build without a tag does not say
    ("2.11.0+cu130", "2.12.0+cu130", False),  # another minor release: another ABI
    ("2.11.0+cu130", "2.11.0+cu128", False),  # libcudart.so.12, not .13
    ("2.11.0+cu130", "2.11.0+cpu", False),    # no libtorch_cuda to link
])
def test_the_import_check_refuses_only_another_abi(built, running, same):
    assert _same_torch(built, running) is same


def test_importing_under_another_torch_says_what_to_do(tmp_path):
    # The check as the package runs it, with torch's version string changed
    # before the import (the extension itself loads: same libraries).
    script = ("import torch; torch.__version__ = '2.12.0+cu130'\n"
              "try:\n    import shardema\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert "built against torch " + torch.__version__ in out.stdout, out.stdout + out.stderr
    assert "pip install --no-build-isolation ." in out.stdout
