"""pytest setup of the Python package's tests: the golden data folder and
an import of shardema from the build tree (ctest puts it on PYTHONPATH)."""
import json
import os
import pathlib

import pytest

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def golden(name: str):
    with open(DATA / name) as f:
        return json.load(f)


@pytest.fixture
def tmp_folder(tmp_path):
    return str(tmp_path)


@pytest.fixture(scope="module")
def one_rank_group():
    """torch.distributed's default group with this process as its one rank
    (Gloo on loopback), for the tests of one module; destroyed after them,
    so the other modules see no group."""
    import torch.distributed as dist

    from rank_launch import free_port
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def python_for_workers() -> str:
    return os.environ.get("SHARDEMA_TEST_PYTHON") or __import__("sys").executable
