"""Every ```python block of README.md's "From Python" section runs as a test,
each in a fresh folder, as a user would paste it: the FSDP2 block on two
processes with a real fully_shard model, the Lightning block in a real
Trainer. A leading "# ranks: N" comment starts a block on N processes with
torchrun's environment (Gloo on loopback)."""
import os
import pathlib
import re
import socket
import subprocess

import pytest

from conftest import python_for_workers

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def section_blocks():
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## From Python\n")
    end = text.index("\n## ", start + 1)
    return re.findall(r"^```python\n(.*?)^```", text[start:end], flags=re.S | re.M)


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
