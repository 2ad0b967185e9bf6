# LibTorch, and the Python whose torch it is.
#
# shardema is built against the LibTorch inside one torch wheel: its headers,
# libraries and share/cmake/Torch. requirements.lock pins it and
# scripts/install_deps.sh installs it into .venv/. Where that LibTorch comes
# from, first match wins:
#   1. Torch_DIR, given by the user (a torch of their own; pass
#      Python3_EXECUTABLE too: the Python whose torch it is);
#   2. pip install . (scikit-build-core): the torch of the environment being
#      installed into;
#   3. the project's venv: $ENV{SHARDEMA_VENV}, else <repo>/.venv.
# Sets SHARDEMA_TORCH_PYTHON (that Python), SHARDEMA_TORCH_VERSION,
# SHARDEMA_TORCH_CUDA_VERSION ("" for a CPU build),
# SHARDEMA_PYBIND11_ABI_DEFINITIONS and SHARDEMA_TORCH_LIBRARY_DIR.
# 2.7 is the first PyPI torch built with the C++11 ABI, which Debian's
# GoogleTest and Google Benchmark use; only 2.11.0 is tested.
set(SHARDEMA_MIN_TORCH_VERSION 2.7)

# _shardema_torch_info(<python>): SHARDEMA_TORCH_INFO_<key> for each line of
# cmake/torch_info.py, in the caller's scope.
function(_shardema_torch_info python)
  execute_process(COMMAND ${python} ${CMAKE_CURRENT_LIST_DIR}/torch_info.py
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE failed
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(failed)
    set(SHARDEMA_TORCH_INFO_error "${python} failed to run cmake/torch_info.py: ${err}" PARENT_SCOPE)
    return()
  endif()
  string(REPLACE "\n" ";" lines "${out}")
  foreach(line IN LISTS lines)
    if(line MATCHES "^([a-z0-9_]+)=(.*)$")
      set(SHARDEMA_TORCH_INFO_${CMAKE_MATCH_1} "${CMAKE_MATCH_2}" PARENT_SCOPE)
    endif()
  endforeach()
endfunction()

if(DEFINED ENV{SHARDEMA_VENV} AND NOT "$ENV{SHARDEMA_VENV}" STREQUAL "")
  set(_shardema_venv "$ENV{SHARDEMA_VENV}")
else()
  set(_shardema_venv "${PROJECT_SOURCE_DIR}/.venv")
endif()
set(SHARDEMA_TORCH_PYTHON "")
if(Torch_DIR OR (NOT SKBUILD AND NOT EXISTS "${_shardema_venv}/bin/python"))
  set(SHARDEMA_TORCH_PYTHON "${Python3_EXECUTABLE}")
elseif(SKBUILD)
  set(SHARDEMA_TORCH_PYTHON "${Python3_EXECUTABLE}")
else()
  set(SHARDEMA_TORCH_PYTHON "${_shardema_venv}/bin/python")
  if(NOT Python3_EXECUTABLE)
    set(Python3_EXECUTABLE "${SHARDEMA_TORCH_PYTHON}" CACHE FILEPATH "The Python of LibTorch")
  endif()
endif()

if(SHARDEMA_TORCH_PYTHON)
  _shardema_torch_info(${SHARDEMA_TORCH_PYTHON})
  if(SHARDEMA_TORCH_INFO_error)
    message(FATAL_ERROR "shardema: ${SHARDEMA_TORCH_INFO_error}; run scripts/install_deps.sh "
                        "(the pinned torch in .venv/), or install torch in that environment")
  endif()
  if(NOT Torch_DIR)
    set(Torch_DIR "${SHARDEMA_TORCH_INFO_cmake_prefix_path}/Torch" CACHE PATH
        "LibTorch's CMake package" FORCE)
  endif()
endif()
set(SHARDEMA_TORCH_VERSION "${SHARDEMA_TORCH_INFO_version}")
set(SHARDEMA_TORCH_CUDA_VERSION "${SHARDEMA_TORCH_INFO_cuda}")
set(SHARDEMA_PYBIND11_ABI_DEFINITIONS "")
foreach(part compiler_type stdlib build_abi)
  if(DEFINED SHARDEMA_TORCH_INFO_pybind11_${part})
    string(TOUPPER ${part} upper)
    list(APPEND SHARDEMA_PYBIND11_ABI_DEFINITIONS
         "PYBIND11_${upper}=\"${SHARDEMA_TORCH_INFO_pybind11_${part}}\"")
  endif()
endforeach()

# A CUDA build of torch (PyPI's is one) makes its CMake package look for a
# CUDA toolkit of its own major version and link that toolkit's cudart: with
# none, or another major version, torch's own config fails or links a second
# libcudart beside the wheel's. Said here in one line, before torch's config.
if(SHARDEMA_TORCH_INFO_cuda)
  if(NOT CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDA_PATH} AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  string(REGEX MATCH "^[0-9]+" _shardema_wheel_cuda_major "${SHARDEMA_TORCH_INFO_cuda}")
  if(NOT CUDAToolkit_FOUND OR NOT CUDAToolkit_VERSION_MAJOR STREQUAL _shardema_wheel_cuda_major)
    set(_shardema_found_toolkit "none")
    if(CUDAToolkit_FOUND)
      set(_shardema_found_toolkit "${CUDAToolkit_VERSION} at ${CUDAToolkit_BIN_DIR}")
    endif()
    message(FATAL_ERROR
      "shardema: torch ${SHARDEMA_TORCH_INFO_version} is a CUDA ${SHARDEMA_TORCH_INFO_cuda} build, "
      "whose CMake package needs a CUDA ${_shardema_wheel_cuda_major}.x toolkit (nvcc, cudart; "
      "found: ${_shardema_found_toolkit}). Install one (CUDAToolkit_ROOT names "
      "it), or build against a CPU build of torch (pip install torch --index-url "
      "https://download.pytorch.org/whl/cpu)")
  endif()
endif()

# torch's CUDA build asks for the GPU architectures of .cu files; we have
# none (the CUDA engine calls the runtime from .cpp files), so the list only
# has to be valid: 9.0 is the lent H200's.
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "9.0" CACHE STRING "GPU architectures for torch's CUDA flags")
endif()
find_package(Torch QUIET)
if(NOT Torch_FOUND)
  message(FATAL_ERROR
    "shardema: no LibTorch found. Run scripts/install_deps.sh (a venv with the pinned torch "
    "in .venv/, which this build finds by itself), or pass -DTorch_DIR=<torch>/share/cmake/Torch "
    "and -DPython3_EXECUTABLE=<the python of that torch>")
endif()
if(Torch_VERSION VERSION_LESS SHARDEMA_MIN_TORCH_VERSION)
  message(FATAL_ERROR "shardema: LibTorch ${Torch_VERSION} at ${Torch_DIR} is older than "
                      "${SHARDEMA_MIN_TORCH_VERSION}, the oldest supported (README: Platform)")
endif()
include(${CMAKE_CURRENT_LIST_DIR}/shardemaTorchLinkDirs.cmake)
get_filename_component(SHARDEMA_TORCH_LIBRARY_DIR "${TORCH_LIBRARY}" DIRECTORY)
message(STATUS "shardema: LibTorch ${Torch_VERSION} from ${SHARDEMA_TORCH_LIBRARY_DIR}")
