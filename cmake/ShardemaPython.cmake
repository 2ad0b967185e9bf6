# Whether the extension module shardema._C can be built: the Python whose
# torch is the LibTorch we build against (SHARDEMA_TORCH_PYTHON, from
# cmake/ShardemaTorch.cmake, whose Python3 development files
# ShardemaDependencies found), the pybind11 headers torch ships, and
# libtorch_python. Sets SHARDEMA_PYTHON_ENABLED, and SHARDEMA_PYTHON_MISSING
# (why not) when it is off.
#
# pybind11's internals are shared with torch's (type casts of torch's own
# classes, ProcessGroup and DTensor's local tensors, go through them) when
# both use the same pybind11 ABI key. torch up to 2.8 published the parts of
# its key (torch._C._PYBIND11_COMPILER_TYPE, _STDLIB, _BUILD_ABI) and its
# extension builder passes them as macros; we do too when torch has them
# (SHARDEMA_PYBIND11_ABI_DEFINITIONS). From pybind11 3 (torch 2.9 on) the
# key is derived from the compiler and the C++ library alone
# (PYBIND11_PLATFORM_ABI_ID) and torch no longer publishes them.
# tests/python/test_torch_objects.py checks that a ProcessGroup crosses.
set(SHARDEMA_PYTHON_ENABLED OFF)
set(SHARDEMA_PYTHON_MISSING "")
set(SHARDEMA_PYTHON_TORCH_VERSION "${SHARDEMA_TORCH_VERSION}")

get_filename_component(_shardema_python_torch "${SHARDEMA_TORCH_INFO_cmake_prefix_path}/Torch" REALPATH)
get_filename_component(_shardema_linked_torch "${Torch_DIR}" REALPATH)
if(NOT _shardema_python_torch STREQUAL _shardema_linked_torch)
  set(SHARDEMA_PYTHON_MISSING "the torch of ${SHARDEMA_TORCH_PYTHON} (${_shardema_python_torch}) "
                              "is not the LibTorch built against (${_shardema_linked_torch})")
  return()
endif()
find_path(SHARDEMA_PYBIND11_INCLUDE_DIR pybind11/pybind11.h HINTS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
if(NOT SHARDEMA_PYBIND11_INCLUDE_DIR)
  set(SHARDEMA_PYTHON_MISSING "LibTorch's include folder has no pybind11 headers")
  return()
endif()
find_library(SHARDEMA_TORCH_PYTHON_LIBRARY torch_python HINTS "${SHARDEMA_TORCH_LIBRARY_DIR}"
             NO_DEFAULT_PATH)
if(NOT SHARDEMA_TORCH_PYTHON_LIBRARY)
  set(SHARDEMA_PYTHON_MISSING "no libtorch_python next to LibTorch (${SHARDEMA_TORCH_LIBRARY_DIR})")
  return()
endif()
set(SHARDEMA_PYTHON_ENABLED ON)
