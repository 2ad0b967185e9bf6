"""Every ```python block of README.md's "From Python" section runs as a test,
each in a fresh folder, as a user would paste it. A block's leading comments
say what it needs: "# ranks: N" starts it on N processes with torchrun's
environment (Gloo on loopback); "# needs: torch >= 2.6 ..." and "# needs:
lightning ..." skip it where those are missing (torch 1.13 here, no
Lightning on Debian 12), and bench/gpu/run.sh runs it where they are."""
import importlib.util
import os
import pathlib
import re
import socket
import subprocess

import pytest
import torch

from conftest import python_for_workers

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def section_blocks():
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## From Python\n")
    end = text.index("\n## ", start + 1)
    return re.findall(r"^```python\n(.*?)^```", text[start:end], flags=re.S | re.M)


def needs_met(block):
    """(ok, reason) from the block's '# needs:' line."""
    match = re.search(r"^# needs: (.*)$", block, flags=re.M)
    if not match:
        return True, ""
    need = match.group(1)
    if need.startswith("torch >= 2"):
        ok = int(torch.__version__.split(".")[0]) >= 2 and \
            importlib.util.find_spec("torch.distributed.fsdp") is not None
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except Exception:
            ok = False
        return ok, need
    if need.startswith("lightning"):
        return importlib.util.find_spec("lightning") is not None, need
    return False, f"unknown need: {need}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BLOCKS = section_blocks()


def test_the_section_has_its_blocks():
    # one process, DDP, FSDP2, FSDP1, post-hoc, Lightning
    assert len(BLOCKS) == 6


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    block = BLOCKS[index]
    ok, reason = needs_met(block)
    if not ok:
        pytest.skip(f"README block {index + 1} needs {reason}")
    script = tmp_path / f"block{index + 1}.py"
    script.write_text(block)
    ranks = int(re.search(r"^# ranks: (\d+)", block, flags=re.M).group(1)) \
        if re.search(r"^# ranks: (\d+)", block, flags=re.M) else 1
    port = str(free_port())
    procs = []
    for rank in range(ranks):
        env = dict(os.environ)
        if ranks > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                       LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks))
        procs.append(subprocess.Popen([python_for_workers(), str(script)], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"README block {index + 1} hung")
        outputs.append(out.decode(errors="replace"))
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"README block {index + 1}, rank {rank}:\n{out}"
