"""shardema.plan_node (the C++ planNode) and `shardema plan`: the Python map
against the model worked out by hand, its errors in Python's terms, and
docs/performance.md's tables at scale reproduced by the command written
above each of them."""
import os
import pathlib
import re
import subprocess

import pytest

import shardema

ROOT = pathlib.Path(__file__).resolve().parents[2]
PERFORMANCE = ROOT / "docs" / "performance.md"


def test_a_7b_model_on_8_ranks_by_hand():
    # node_plan.h's model with its defaults, worked out by hand (the C++ test
    # NodePlanTest.SevenBillionOnEightRanksByHand has the same figures).
    plan = shardema.plan_node(7e9, ranks=8)
    assert plan.elements_per_rank == 875_000_000
    assert plan.pcie_bytes == 28_000_000_000
    assert plan.pcie_seconds == pytest.approx(3.5e9 / 50e9, rel=1e-15)
    assert plan.host_memory_bytes == 7_000_000_000 * (2 * 4 + 8)
    assert plan.host_memory_seconds == pytest.approx(0.28, rel=1e-15)
    assert plan.step_seconds == pytest.approx(6 * 7e9 * 8192 / 400e12, rel=1e-15)
    assert plan.cores_needed == 8
    assert plan.ema_seconds == pytest.approx(0.28, rel=1e-15)
    assert plan.overhead_fraction(10) == pytest.approx(1.4e-3 / 10 / plan.step_seconds)
    assert plan.host_ram_bytes == 28_000_000_000 + 8 * 32 * 2**20
    assert plan.inputs.source_bytes == 4 and plan.inputs.profiles == 1
    assert "ranks=8" in repr(plan)


def test_every_input_reaches_the_model():
    # Each keyword changes what it should, against the default plan.
    base = shardema.plan_node(70e9, ranks=64)
    post_hoc = shardema.plan_node(70e9, ranks=64, profiles=2, source_bytes=2)
    assert post_hoc.host_memory_bytes == base.elements_per_node * (2 * 2 + 16)
    assert post_hoc.host_ram_bytes - 8 * 32 * 2**20 == base.elements_per_node * 8
    slow_link = shardema.plan_node(70e9, ranks=64, pcie_gbps=5)
    assert slow_link.pcie_seconds == pytest.approx(base.pcie_seconds * 10)
    assert shardema.plan_node(70e9, ranks=64, step_seconds=0.01).overhead_seconds == \
        pytest.approx(base.ema_seconds - 0.01 + 1.4e-3)
    assert shardema.plan_node(70e9, ranks=64, tokens_per_gpu=4096, gpu_tflops=800).step_seconds \
        == pytest.approx(base.step_seconds / 4)
    assert shardema.plan_node(70e9, ranks=64, gpus_per_node=4).ranks_per_node == 4
    assert shardema.plan_node(70e9, ranks=64, core_gbps=0.5).cores_needed > 8
    assert shardema.plan_node(70e9, ranks=64, node_ram_gib=1024).ram_fraction == \
        pytest.approx(2 * base.ram_fraction)
    assert shardema.plan_node(70e9, ranks=64, staging_bytes_per_rank=0).host_ram_bytes == \
        base.elements_per_node * 4
    assert shardema.plan_node(70e9, ranks=64, update_call_seconds=0).overhead_seconds == 0
    assert shardema.plan_node(70e9, ranks=64, host_memory_gbps=40).host_memory_seconds == \
        pytest.approx(10 * base.host_memory_seconds)


@pytest.mark.parametrize("kwargs, message", [
    (dict(parameters=0), "plan_node: parameters (0"),
    (dict(parameters=7.5), "plan_node: parameters (7.5"),
    (dict(parameters=7e9, ranks=0), "plan_node: ranks (0) must be >= 1"),
    (dict(parameters=7e9, source_bytes=8), "plan_node: source_bytes (8)"),
    (dict(parameters=7e9, profiles=17), "plan_node: profiles (17) must be in [1, 16]"),
    (dict(parameters=7e9, pcie_gbps=0), "plan_node: pcie_gbps (0) must be > 0"),
    (dict(parameters=7e9, step_seconds=-1), "plan_node: step_seconds (-1)"),
])
def test_bad_inputs_name_the_keyword(kwargs, message):
    with pytest.raises(ValueError) as error:
        shardema.plan_node(**kwargs)
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)


def test_overhead_fraction_refuses_update_every_0():
    with pytest.raises(ValueError, match=r"^NodePlan\.overhead_fraction: update_every \(0\)"):
        shardema.plan_node(7e9).overhead_fraction(0)


def test_inputs_are_keywords():
    with pytest.raises(TypeError):
        shardema.plan_node(7e9, 8)


# docs/performance.md: each table at scale follows a comment naming the
# command that prints it, and ends at "<!-- end of shardema plan -->".
TABLE = re.compile(r"<!-- (shardema plan [^>]*?) -->\n(.*?)<!-- end of shardema plan -->",
                   re.DOTALL)


def documented_tables():
    return TABLE.findall(PERFORMANCE.read_text(encoding="utf-8"))


def test_the_docs_have_the_tables_at_scale():
    tables = documented_tables()
    # One EMA, post-hoc's two profiles, and short steps.
    assert len(tables) == 3, [command for command, _ in tables]
    assert sum("--profiles 2" in command for command, _ in tables) == 1
    assert all(table.count("\n| ") >= 10 for _, table in tables)


@pytest.mark.parametrize("command, table", documented_tables(),
                         ids=[c for c, _ in documented_tables()])
def test_shardema_plan_reproduces_the_docs_table(command, table):
    cli = os.environ.get("SHARDEMA_CLI")
    if not cli:
        pytest.skip("SHARDEMA_CLI is not set: the build has no shardema CLI (tools off)")
    printed = subprocess.run([cli, *command.split()[1:]], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    assert printed.strip() == table.strip()
