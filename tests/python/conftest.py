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


def python_for_workers() -> str:
    return os.environ.get("SHARDEMA_TEST_PYTHON") or __import__("sys").executable
