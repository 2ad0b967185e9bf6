"""shardema._C as the dynamic loader sees it (readelf / nm of the built
module, and of the CLI where it is built): it exports only its init
function (python/module_exports.map), its RUNPATH names no folder that does
not exist (torch's MKL config once added /lib/intel64:/lib/intel64_win:
/lib/win-x64), and neither it, the CLI nor the static libraries a C++ user
links (SHARDEMA_ARCHIVES, from ctest) call a std::filesystem function
(shardema/core/file_system.h says why)."""
import importlib.util
import os
import pathlib
import subprocess

import pytest


def module_path():
    spec = importlib.util.find_spec("shardema")
    found = sorted(pathlib.Path(spec.origin).parent.glob("_C.*.so"))
    assert len(found) == 1, found
    return found[0]


def tool(*args):
    return subprocess.run(list(args), capture_output=True, text=True, check=True).stdout


def binaries():
    out = [module_path()]
    if os.environ.get("SHARDEMA_CLI"):
        out.append(pathlib.Path(os.environ["SHARDEMA_CLI"]))
    return out


def test_the_module_exports_only_its_init_function():
    exported = [line.split()[-1] for line in
                tool("nm", "-D", "--defined-only", str(module_path())).splitlines() if line.strip()]
    assert exported == ["PyInit__C"]


@pytest.mark.parametrize("binary", binaries(), ids=lambda p: p.name)
def test_the_runpath_names_only_folders_that_exist(binary):
    dynamic = tool("readelf", "-d", str(binary))
    paths = [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines()
             if "(RUNPATH)" in line or "(RPATH)" in line]
    folders = [f for p in paths for f in p.split(":") if f]
    missing = [f for f in folders if not os.path.isdir(f.replace("$ORIGIN", str(binary.parent)))]
    assert not missing, f"{binary.name}'s RUNPATH names folders that do not exist: {missing}"


def archives():
    return [pathlib.Path(p) for p in os.environ.get("SHARDEMA_ARCHIVES", "").split(":") if p]


@pytest.mark.parametrize("binary", binaries() + archives(), ids=lambda p: p.name)
def test_no_std_filesystem_function_is_called(binary):
    # A module or program lists its imports; an archive, each member's
    # undefined symbols.
    dynamic = ["-D"] if binary.suffix != ".a" else []
    undefined = tool("nm", *dynamic, "--undefined-only", str(binary))
    assert any(line.split()[:1] == ["U"] for line in undefined.splitlines())  # the imports
    filesystem = sorted({line.split()[-1] for line in undefined.splitlines()
                         if "St10filesystem" in line})
    assert not filesystem, f"{binary.name} calls std::filesystem: {filesystem[:5]}"
