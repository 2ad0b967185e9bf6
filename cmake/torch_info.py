"""What the build needs to know of a Python's torch, one key=value per line
(cmake/ShardemaTorch.cmake reads it; one import of torch per configure).

Under pip's build isolation (pip install .) the interpreter is the one of
the environment being installed into, but its site-packages are hidden;
the torch there is the one the extension will run with, so it is looked
for there too."""
import sys
import sysconfig

try:
    import torch
except ImportError:
    sys.path.append(sysconfig.get_paths()["purelib"])
    try:
        import torch
    except ImportError:
        print("error=no torch in " + sys.executable + "'s environment")
        sys.exit(0)
import torch.utils

print("version=" + torch.__version__)
print("python=%d.%d" % sys.version_info[:2])
print("cmake_prefix_path=" + torch.utils.cmake_prefix_path)
print("cuda=" + (torch.version.cuda or ""))
# pybind11's ABI key, as torch up to 2.8 published it (cmake/ShardemaPython.cmake).
for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
    value = getattr(torch._C, "_PYBIND11_" + name, None)
    if value is not None:
        print(f"pybind11_{name.lower()}={value}")
