"""`shardema`, the command that `pip install .` puts on the PATH
(pyproject's console script; `python -m shardema` runs it too).

The commands are the C++ CLI's own (tools/), run inside shardema._C, which
`import shardema` loads after torch: no LibTorch search, no LD_LIBRARY_PATH.
Python adds only what torch's Python reads: a torch.distributed.checkpoint
(DCP) folder's EMA, which inspect lists and which export and reshard take
through a one-rank per-rank checkpoint in a temporary folder
(_dcp_folder.py), so every flag of export works on it unchanged.
"""
import os
import shutil
import sys
import tempfile
from typing import List, Optional, Sequence, Tuple


def _print(out: str, err: str) -> None:
    sys.stdout.write(out)
    sys.stdout.flush()
    sys.stderr.write(err)
    sys.stderr.flush()


def _run(args: Sequence[str]) -> Tuple[int, str, str]:
    from . import _C
    status, out, err = _C.run_command_line(list(args))
    return int(status), out, err


def _checkpoint_flag(args: List[str]) -> Optional[Tuple[int, str]]:
    """(index, folder) of export's --checkpoint value, as tools/flag_parser
    reads it: `--checkpoint DIR` or `--checkpoint=DIR`."""
    for i, arg in enumerate(args):
        if arg == "--checkpoint" and i + 1 < len(args) and not args[i + 1].startswith("--"):
            return i + 1, args[i + 1]
        if arg.startswith("--checkpoint="):
            return i, arg[len("--checkpoint="):]
    return None


def _inspect_dcp(folder: str) -> int:
    from ._dcp_folder import DcpEma
    ema = DcpEma(folder)
    schedules = ema.engine_checked().schedules  # reads every tensor; EMA.load_state_dict's checks
    progress, roles = ema.progress, ema.roles()
    from . import _C
    schedule = _C.DecaySchedule.from_json(progress["schedule"])
    data_files = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))
    where = f"under '{ema.key}'" if ema.key else "at the top level"
    print(f"DCP checkpoint {folder}: shardema EMA {where}, step {progress['step']}, "
          f"{len(ema.tensors)} tensors, {len(data_files)} .distcp files (torch's format, "
          "read by torch.distributed.checkpoint)")
    print(f"  schedule {schedule!r}")
    if len(schedules) > 1:  # as the C++ inspect of a checkpoint folder lists them
        print(f"  {len(schedules)} EMA profiles (export --profile P):")
        for p, each in enumerate(schedules):
            print(f"  profile {p} schedule {each!r}")
    print(f"  last decay {progress['last_decay']!r}, initialized "
          f"{str(progress['initialized']).lower()}")
    for name, (shape, dtype) in ema.tensors.items():
        # Other names and non-persistence as inspect of a per-rank checkpoint says them.
        also = f" also {' '.join(ema.aliases[name])}" if ema.aliases.get(name) else ""
        transient = " non-persistent (not exported)" if name in ema.non_persistent else ""
        print(f"  tensor {name} {roles[name]} {str(dtype).replace('torch.', '')} "
              f"[{', '.join(str(s) for s in shape)}]{also}{transient}")
    return 0


def _export_dcp(args: List[str], index: int, folder: str) -> int:
    """export with --checkpoint a DCP folder: the EMA written as a one-rank
    checkpoint beside the output (same file system), export run on it, the
    temporary folder's name put back as the DCP folder's in what it says."""
    from ._dcp_folder import DcpEma
    ema = DcpEma(folder).engine_checked()
    out = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--out"),
               next((a[len("--out="):] for a in args if a.startswith("--out=")), ""))
    beside = os.path.dirname(os.path.abspath(out)) if out else ""
    temporary = tempfile.mkdtemp(prefix=".shardema-dcp-",
                                 dir=beside if os.path.isdir(beside) else None)
    try:
        ema.save_checkpoint(temporary)
        del ema  # its memory, before export reads the files
        given = list(args)
        given[index] = ("--checkpoint=" if given[index].startswith("--checkpoint=") else "") + \
            temporary
        status, text, err = _run(["export"] + given)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    _print(text.replace(temporary, folder), err.replace(temporary, folder))
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        from ._dcp_folder import FolderError, is_dcp_folder
    except ImportError as error:  # the extension does not load with this torch
        sys.stderr.write(f"shardema: {error}\n")
        return 2
    command, rest = (args[0], args[1:]) if args else ("", [])
    try:
        if command == "inspect" and len(rest) == 1 and is_dcp_folder(rest[0]):
            return _inspect_dcp(rest[0])
        found = _checkpoint_flag(rest) if command == "export" else None
        if found is not None and "--help" not in rest and is_dcp_folder(found[1]):
            return _export_dcp(rest, *found)
    except FolderError as error:
        sys.stderr.write(f"shardema {command}: {error}\n")
        return 2
    status, out, err = _run(args)
    _print(out, err)
    return status


if __name__ == "__main__":
    sys.exit(main())
