"""The installed package as a user meets it: run from outside the source
tree (scripts/package_test.sh), it checks that shardema comes from
site-packages, then runs two processes of DDP over Gloo with an EMA,
exports it, saves and loads it, and compares the exported values with a
float64 EMA of the weights each step. Exit status 0 when all holds.

`python_smoke.py OUT` keeps what it wrote in OUT (ema.safetensors, the
per-rank checkpoint/, and a DCP checkpoint dcp/ of one process's model and
EMA with its export dcp_ema.safetensors), for the
installed `shardema` command to read; `python_smoke.py --compare OUT` then
checks that command's exports (from_checkpoint.safetensors,
from_dcp.safetensors) against the EMAs' own, tensor by tensor."""
import json
import os
import pathlib
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DECAY = 0.9
STEPS = 6


def read_float32_safetensors(path: str) -> dict:
    """The format by hand (8-byte header length, JSON header, raw data): no
    shardema code, and this venv holds only torch."""
    raw = pathlib.Path(path).read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        assert entry["dtype"] == "F32", (name, entry["dtype"])
        begin, end = entry["data_offsets"]
        data = bytearray(raw[8 + length + begin:8 + length + end])
        tensors[name] = torch.frombuffer(data, dtype=torch.float32).reshape(entry["shape"])
    return tensors


def rank_main(rank: int, world: int, port: int, out: str) -> None:
    import shardema
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY))
    assert ema.layout == "replicated" and ema.world_size == world
    reference = None
    torch.manual_seed(1 + rank)
    for _ in range(STEPS):
        model(torch.randn(4, 8)).square().mean().backward()
        ema.fence()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        now = {n: p.detach().double().clone() for n, p in model.module.named_parameters()}
        reference = now if reference is None else \
            {n: DECAY * reference[n] + (1 - DECAY) * now[n] for n in now}
    ema.export_weights(os.path.join(out, "ema.safetensors"))
    ema.save_checkpoint(os.path.join(out, "checkpoint"))
    before = ema.full_state_dict()
    ema.load_checkpoint(os.path.join(out, "checkpoint"))
    after = ema.full_state_dict()
    if rank == 0:
        exported = read_float32_safetensors(os.path.join(out, "ema.safetensors"))
        for name, want in reference.items():
            torch.testing.assert_close(exported[name].double(), want, rtol=1e-6, atol=1e-7)
            assert torch.equal(before[name], after[name]), name
    dist.destroy_process_group()


def dcp_save(out: str) -> None:
    """One process's EMA in a DCP checkpoint (out/dcp) and its own export
    (out/dcp_ema.safetensors). One process: DCP's multi-rank save gathers
    its plan through numpy, which this venv lacks on purpose."""
    import shardema
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(2)
    model = torch.nn.Linear(8, 5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY))
    for _ in range(STEPS):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
    ema.export_weights(os.path.join(out, "dcp_ema.safetensors"))
    dcp.save({"model": model.state_dict(), "ema": ema.state_dict()},
             checkpoint_id=os.path.join(out, "dcp"), no_dist=True)


def compare(out: str) -> int:
    """The installed command's exports against the EMA's own."""
    for made, own in (("from_checkpoint.safetensors", "ema.safetensors"),
                      ("from_dcp.safetensors", "dcp_ema.safetensors")):
        want = read_float32_safetensors(os.path.join(out, own))
        got = read_float32_safetensors(os.path.join(out, made))
        assert list(got) == list(want), (made, list(got), list(want))
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (made, name)
    print(f"python smoke: the shardema command's exports of {out}'s checkpoint/ and dcp/ equal "
          "export_weights' file")
    return 0


def main(keep: str = "") -> int:
    import shardema
    here = pathlib.Path(shardema.__file__).resolve()
    assert "site-packages" in here.parts, f"shardema imported from {here}, not an install"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if keep:
        os.makedirs(keep, exist_ok=True)
    with tempfile.TemporaryDirectory() as temporary:
        out = keep or temporary
        mp.spawn(rank_main, args=(2, port, out), nprocs=2, join=True)
        dcp_save(out)
    print(f"python smoke: shardema {here.parent} with torch {torch.__version__}: "
          "import, 2-process DDP update, export, save and load passed")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        sys.exit(compare(sys.argv[2]))
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
