# Finds what the extension module shardema._C needs: the Python whose torch
# is the LibTorch we build against (SHARDEMA_TORCH_PYTHON, from
# cmake/ShardemaTorch.cmake), its development files, the pybind11 headers
# torch ships, libtorch_python, and the pybind11 ABI settings torch was built
# with. Sets SHARDEMA_PYTHON_ENABLED, and SHARDEMA_PYTHON_MISSING (why not)
# when it is off.
set(SHARDEMA_PYTHON_ENABLED OFF)
set(SHARDEMA_PYTHON_MISSING "")

if(NOT SHARDEMA_TORCH_PYTHON)
  set(SHARDEMA_PYTHON_MISSING "the Python of this LibTorch is unknown (pass -DPython3_EXECUTABLE)")
  return()
endif()
execute_process(COMMAND ${SHARDEMA_TORCH_PYTHON} -c
  "import torch, torch.utils; print(torch.__version__); print(torch.utils.cmake_prefix_path)"
  RESULT_VARIABLE failed OUTPUT_VARIABLE lines ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
string(REPLACE "\n" ";" lines "${lines}")
list(LENGTH lines count)
if(failed OR NOT count EQUAL 2)
  set(SHARDEMA_PYTHON_MISSING "${SHARDEMA_TORCH_PYTHON} cannot import torch")
  return()
endif()
list(GET lines 0 SHARDEMA_PYTHON_TORCH_VERSION)
list(GET lines 1 prefix)
get_filename_component(prefix_real "${prefix}/Torch" REALPATH)
get_filename_component(torch_dir_real "${Torch_DIR}" REALPATH)
if(NOT prefix_real STREQUAL torch_dir_real)
  set(SHARDEMA_PYTHON_MISSING
      "the torch of ${SHARDEMA_TORCH_PYTHON} (${prefix_real}) is not the LibTorch built against (${torch_dir_real})")
  return()
endif()

# pybind11: the copy torch ships in its include folder, so that our module
# and torch share pybind11's internals (type casts of torch's own classes,
# such as ProcessGroup and DTensor's local tensors, go through them).
find_path(SHARDEMA_PYBIND11_INCLUDE_DIR pybind11/pybind11.h HINTS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
if(NOT SHARDEMA_PYBIND11_INCLUDE_DIR)
  set(SHARDEMA_PYTHON_MISSING "LibTorch's include folder has no pybind11 headers")
  return()
endif()

# The ABI key of pybind11's internals must be torch's. torch up to 2.8
# published the parts it was built with (torch._C._PYBIND11_COMPILER_TYPE,
# _STDLIB, _BUILD_ABI), and its extension builder passes them as macros;
# from pybind11 3 (torch 2.9 on) the key is derived from the compiler and
# the C++ library alone (PYBIND11_PLATFORM_ABI_ID) and torch no longer
# publishes them. We pass them when torch has them; tests/python's
# test_torch_objects checks that a ProcessGroup and a DTensor cross.
execute_process(COMMAND ${SHARDEMA_TORCH_PYTHON} -c
  "import torch
for n in ('COMPILER_TYPE', 'STDLIB', 'BUILD_ABI'):
    v = getattr(torch._C, '_PYBIND11_' + n, None)
    if v is not None: print(f'PYBIND11_{n}=\"{v}\"')"
  OUTPUT_VARIABLE abi_lines ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
string(REPLACE "\n" ";" SHARDEMA_PYBIND11_ABI_DEFINITIONS "${abi_lines}")

find_library(SHARDEMA_TORCH_PYTHON_LIBRARY torch_python HINTS "${SHARDEMA_TORCH_LIBRARY_DIR}"
             NO_DEFAULT_PATH)
if(NOT SHARDEMA_TORCH_PYTHON_LIBRARY)
  set(SHARDEMA_PYTHON_MISSING "no libtorch_python next to LibTorch (${SHARDEMA_TORCH_LIBRARY_DIR})")
  return()
endif()

set(SHARDEMA_PYTHON_ENABLED ON)
