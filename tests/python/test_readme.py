"""Every ```python block of README.md and docs/python.md runs as a test,
each in a fresh folder, as a user would paste it: the FSDP2 blocks on two
processes with a real fully_shard model (one in a Lightning Trainer with
ModelParallelStrategy), the Lightning block in a real Trainer. A leading
"# ranks: N" comment starts a block on N processes with torchrun's
environment (Gloo on loopback)."""
import pathlib
import re

import pytest

import rank_launch
from conftest import python_for_workers

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "python.md"]


def doc_blocks():
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        found += re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    return found


BLOCKS = doc_blocks()


def test_the_documents_have_their_blocks():
    # README: the tour, FSDP2 in a Lightning Trainer (2 ranks); docs/python.md:
    # one process, LoRA (trainable_only), several profiles, Hugging Face
    # export, DDP, FSDP2, FSDP1, DeepSpeed ZeRO-3, post-hoc, Lightning
    assert len(BLOCKS) == 12


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    block = BLOCKS[index]
    folder = tmp_path / "block"
    folder.mkdir()
    script = folder / f"block{index + 1}.py"
    script.write_text(block)
    world = int(re.search(r"^# ranks: (\d+)", block, flags=re.M).group(1)) \
        if re.search(r"^# ranks: (\d+)", block, flags=re.M) else 1
    # The ranks' output beside the block's folder, which holds only what it writes.
    ranks = rank_launch.run_ranks(lambda rank, port: [python_for_workers(), str(script)], world,
                                  tmp_path / "ranks", timeout=240, torchrun=world > 1,
                                  cwd=folder, what=f"README block {index + 1}")
    for rank, code in enumerate(ranks.codes):
        assert code == 0, f"README block {index + 1}, rank {rank}:\n" + \
            (ranks.out / f"output{rank}.txt").read_text(errors="replace")
