#!/usr/bin/env python3
"""What bench/gpu/run.sh records about a machine before anything can
throw, and its libstdc++ check. Reads and prints only; loads torch (and,
for `module`, shardema) and nothing else.

    fingerprint.py toolchain CXX   the interpreter, its environment, the
                                   libraries mapped after `import torch`,
                                   and CXX's libstdc++ beside the process's
    fingerprint.py module          the libraries mapped after
                                   `import torch; import shardema`
    fingerprint.py libstdcxx CXX   exit 4 with one line when CXX's libstdc++
                                   is newer (a higher GLIBCXX_3.4.N) than the
                                   one `import torch` loads; else exit 0
"""
import os
import re
import subprocess
import sys
import sysconfig

GLIBCXX = re.compile(rb"GLIBCXX_3\.4\.(\d+)")


def mapped_libraries():
    """Every shared object mapped into this process, resolved, in load order."""
    seen = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and ".so" in fields[5]:
                path = os.path.realpath(fields[5].strip())
                if path not in seen:
                    seen.append(path)
    return seen


def newest_glibcxx(path):
    """The highest N of the GLIBCXX_3.4.N version names a library defines."""
    try:
        with open(path, "rb") as f:
            found = [int(n) for n in GLIBCXX.findall(f.read())]
    except OSError:
        return None
    return max(found) if found else None


def kind_of(path):
    """ELF shared object, static archive, or linker script (and what it names)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as error:
        return f"unreadable ({error.strerror})", path
    if head.startswith(b"\x7fELF"):
        return "ELF shared object", path
    if head.startswith(b"!<arch>"):
        return "static archive", path
    text = head.decode("latin-1")
    named = re.findall(r"(/\S+libstdc\+\+\.so[.\d]*)", text)
    target = os.path.realpath(named[0]) if named else path
    return f"linker script naming {named[0] if named else '?'}", target


def compiler_libstdcxx(cxx):
    """(what -print-file-name gives, its realpath, its kind, the ELF it leads to)."""
    given = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True,
                           text=True, timeout=60).stdout.strip()
    real = os.path.realpath(given)
    kind, elf = kind_of(real)
    return given, real, kind, elf


def process_libstdcxx():
    import torch  # noqa: F401 - what a shardema process loads before shardema
    for path in mapped_libraries():
        if os.path.basename(path).startswith("libstdc++.so"):
            return path
    return None


def toolchain(cxx):
    print(f"python: {sys.executable}\nsys.version: {sys.version}")
    for key in ("CC", "CXX", "LDSHARED", "LIBDIR", "LDLIBRARY", "SOABI"):
        print(f"sysconfig {key}: {sysconfig.get_config_var(key)}")
    print("environment (LD_*, TORCH_*, CUDA_*, CXX, CC, PATH):")
    for key in sorted(os.environ):
        if key.startswith(("LD_", "TORCH_", "CUDA_")) or key in ("CXX", "CC", "PATH"):
            print(f"  {key}={os.environ[key]}")
    given, real, kind, elf = compiler_libstdcxx(cxx)
    print(f"compiler {cxx}: libstdc++ {given} -> {real}: {kind}; GLIBCXX_3.4.{newest_glibcxx(elf)}")
    loaded = process_libstdcxx()
    import torch
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, device available "
          f"{torch.cuda.is_available()}) from {os.path.dirname(torch.__file__)}")
    print(f"process libstdc++ after import torch: {loaded}; "
          f"GLIBCXX_3.4.{newest_glibcxx(loaded) if loaded else None}")
    print("libraries mapped after import torch:")
    for path in mapped_libraries():
        print(f"  {path}")


def module():
    import torch  # noqa: F401
    import shardema
    print(f"shardema from {os.path.dirname(shardema.__file__)}; _C {shardema._C.__file__}; "
          f"built with torch {shardema._C.built_with_torch}")
    print("libraries mapped after import torch; import shardema:")
    for path in mapped_libraries():
        print(f"  {path}")


def libstdcxx(cxx):
    _, real, _, elf = compiler_libstdcxx(cxx)
    compiler = newest_glibcxx(elf)
    loaded = process_libstdcxx()
    process = newest_glibcxx(loaded) if loaded else None
    if compiler is not None and process is not None and compiler > process:
        print(f"run.sh: STOP: {cxx} builds against libstdc++ {real} (GLIBCXX_3.4.{compiler}), "
              f"newer than the {loaded} (GLIBCXX_3.4.{process}) Python loads with torch: the "
              "module could need symbols the process lacks; build with a compiler whose "
              "libstdc++ is not newer (CXX=/usr/bin/g++)")
        return 4
    print(f"libstdc++: the compiler's GLIBCXX_3.4.{compiler} is not newer than the process's "
          f"GLIBCXX_3.4.{process} ({loaded})")
    return 0


def main(argv):
    if argv[:1] == ["toolchain"] and len(argv) == 2:
        toolchain(argv[1])
        return 0
    if argv == ["module"]:
        module()
        return 0
    if argv[:1] == ["libstdcxx"] and len(argv) == 2:
        return libstdcxx(argv[1])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
