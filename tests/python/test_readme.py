"""Every ```python block of README.md and docs/python.md runs as a test,
each in a fresh folder, as a user would paste it: the FSDP2 blocks on two
processes with a real fully_shard model (one in a Lightning Trainer with
ModelParallelStrategy), the Lightning block in a real Trainer. A leading
"# ranks: N" comment starts a block on N processes with torchrun's
environment (Gloo on loopback)."""
import os
import pathlib
import re
import socket
import subprocess

import pytest

from conftest import python_for_workers

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "python.md"]


def doc_blocks():
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        found += re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    return found


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BLOCKS = doc_blocks()


def test_the_documents_have_their_blocks():
    # README: the tour, FSDP2 in a Lightning Trainer (2 ranks); docs/python.md:
    # one process, DDP, FSDP2, FSDP1, post-hoc, Lightning
    assert len(BLOCKS) == 8


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
