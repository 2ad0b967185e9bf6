"""bench/gpu/fingerprint.py, which bench/gpu/run.sh runs before building on
a GPU machine: its libstdc++ stop against compilers whose libstdc++ is
newer and older than the one `import torch` loads here (a stand-in compiler
answering -print-file-name, as g++ does), and the toolchain record."""
import os
import pathlib
import re
import stat
import subprocess

from conftest import python_for_workers

FINGERPRINT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu" / "fingerprint.py"


def loaded_glibcxx():
    """The newest GLIBCXX_3.4.N of the libstdc++ this interpreter maps with torch."""
    code = ("import torch, re, os\n"
            "paths = {l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++.so' in l}\n"
            "print(max(int(n) for p in paths for n in "
            "re.findall(rb'GLIBCXX_3\\.4\\.(\\d+)', open(p, 'rb').read())))")
    return int(subprocess.run([python_for_workers(), "-c", code], capture_output=True, text=True,
                              check=True, timeout=120).stdout)


def compiler_with(tmp_path, glibcxx):
    """A `compiler` whose libstdc++ (a file defining GLIBCXX_3.4.glibcxx) is
    what -print-file-name=libstdc++.so names."""
    library = tmp_path / "libstdc++.so"
    library.write_bytes(b"\x7fELF" + b"\0" * 60 + b"GLIBCXX_3.4.1\0GLIBCXX_3.4.%d\0" % glibcxx)
    compiler = tmp_path / "g++"
    compiler.write_text(f"#!/bin/sh\necho {library}\n")
    compiler.chmod(compiler.stat().st_mode | stat.S_IEXEC)
    return str(compiler)


def run(*args):
    return subprocess.run([python_for_workers(), str(FINGERPRINT), *args], capture_output=True,
                          text=True, timeout=120)


def test_a_compiler_with_a_newer_libstdcxx_stops_the_run(tmp_path):
    newer = loaded_glibcxx() + 1
    result = run("libstdcxx", compiler_with(tmp_path, newer))
    assert result.returncode == 4, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run.sh: STOP: ")
    assert f"GLIBCXX_3.4.{newer}" in lines[0] and "CXX=/usr/bin/g++" in lines[0]


def test_a_compiler_with_the_same_or_an_older_libstdcxx_goes_on(tmp_path):
    for glibcxx in (loaded_glibcxx(), 20):
        folder = tmp_path / str(glibcxx)
        folder.mkdir()
        result = run("libstdcxx", compiler_with(folder, glibcxx))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "is not newer" in result.stdout


def test_the_toolchain_record_names_what_run_sh_archives(tmp_path):
    result = run("toolchain", compiler_with(tmp_path, 30))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"^sys\.version: 3\.\d+", out, re.M)
    assert re.search(r"^sysconfig CC: ", out, re.M)
    assert "ELF shared object; GLIBCXX_3.4.30" in out
    assert re.search(r"^process libstdc\+\+ after import torch: /\S+libstdc\+\+\.so", out, re.M)
    assert re.search(r"^  \S+/libtorch_cpu\.so$", out, re.M)  # a library mapped after import torch
    env = dict(os.environ, TORCH_SHOW_CPP_STACKTRACES="1", LD_BIND_NOW="1")
    with_env = subprocess.run([python_for_workers(), str(FINGERPRINT), "toolchain",
                               compiler_with(tmp_path, 30)], capture_output=True, text=True,
                              timeout=120, env=env).stdout
    assert "  TORCH_SHOW_CPP_STACKTRACES=1" in with_env and "  LD_BIND_NOW=1" in with_env
