# LibTorch, and the Python whose torch it is.
#
# shardema is built against the LibTorch inside one torch wheel: its headers,
# libraries and share/cmake/Torch. requirements.lock pins it and
# scripts/install_deps.sh installs it into .venv/. Where that LibTorch comes
# from, first match wins:
#   1. Torch_DIR, given by the user (a torch of their own; pass
#      Python3_EXECUTABLE too for the extension and the Python tests);
#   2. pip install . (scikit-build-core): the torch of the Python building
#      the wheel;
#   3. the project's venv: $ENV{SHARDEMA_VENV}, else <repo>/.venv.
# Sets SHARDEMA_TORCH_PYTHON (the interpreter whose torch this LibTorch is,
# when one is known) and SHARDEMA_TORCH_LIBRARY_DIR.
set(SHARDEMA_MIN_TORCH_VERSION 2.6)

function(_shardema_torch_prefix python out)
  execute_process(COMMAND ${python} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
                  OUTPUT_VARIABLE prefix ERROR_VARIABLE error RESULT_VARIABLE failed
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(failed)
    set(${out} "" PARENT_SCOPE)
  else()
    set(${out} "${prefix}" PARENT_SCOPE)
  endif()
endfunction()

set(SHARDEMA_TORCH_PYTHON "")
if(DEFINED ENV{SHARDEMA_VENV} AND NOT "$ENV{SHARDEMA_VENV}" STREQUAL "")
  set(_shardema_venv "$ENV{SHARDEMA_VENV}")
else()
  set(_shardema_venv "${PROJECT_SOURCE_DIR}/.venv")
endif()

if(Torch_DIR)
  if(Python3_EXECUTABLE)
    set(SHARDEMA_TORCH_PYTHON "${Python3_EXECUTABLE}")
  endif()
elseif(SKBUILD AND Python3_EXECUTABLE)
  _shardema_torch_prefix(${Python3_EXECUTABLE} _shardema_prefix)
  if(NOT _shardema_prefix)
    message(FATAL_ERROR
      "shardema: ${Python3_EXECUTABLE} cannot import torch. shardema._C is built against "
      "the torch it will run with, which pip's build isolation hides: install torch first, "
      "then: pip install --no-build-isolation .")
  endif()
  set(Torch_DIR "${_shardema_prefix}/Torch" CACHE PATH "LibTorch's CMake package" FORCE)
  set(SHARDEMA_TORCH_PYTHON "${Python3_EXECUTABLE}")
elseif(EXISTS "${_shardema_venv}/bin/python")
  _shardema_torch_prefix("${_shardema_venv}/bin/python" _shardema_prefix)
  if(NOT _shardema_prefix)
    message(FATAL_ERROR "shardema: ${_shardema_venv}/bin/python cannot import torch; "
                        "run scripts/install_deps.sh (it installs requirements.lock there)")
  endif()
  set(Torch_DIR "${_shardema_prefix}/Torch" CACHE PATH "LibTorch's CMake package" FORCE)
  set(SHARDEMA_TORCH_PYTHON "${_shardema_venv}/bin/python")
  if(NOT Python3_EXECUTABLE)
    set(Python3_EXECUTABLE "${SHARDEMA_TORCH_PYTHON}" CACHE FILEPATH "Python of the extension")
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
    "(python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' prints <...>/share/cmake)")
endif()
if(Torch_VERSION VERSION_LESS SHARDEMA_MIN_TORCH_VERSION)
  message(FATAL_ERROR "shardema: LibTorch ${Torch_VERSION} at ${Torch_DIR} is older than "
                      "${SHARDEMA_MIN_TORCH_VERSION}, the oldest supported (README: Platform)")
endif()
get_filename_component(SHARDEMA_TORCH_LIBRARY_DIR "${TORCH_LIBRARY}" DIRECTORY)
message(STATUS "shardema: LibTorch ${Torch_VERSION} from ${SHARDEMA_TORCH_LIBRARY_DIR}")
