# LibTorch comes from the pinned torch wheel (cmake/ShardemaTorch.cmake); every
# other dependency from a Debian 12 package (scripts/install_deps.sh).
# A missing one stops the configure with one line naming the package
# (pip install . prints it as the reason the build failed).
include(ShardemaTorch)

# shardema_require(<package> <version> <Debian package>)
macro(shardema_require package version debian)
  find_package(${package} ${version} QUIET)
  if(NOT ${package}_FOUND)
    message(FATAL_ERROR "shardema needs ${package} ${version} or newer: apt-get install ${debian} "
                        "(scripts/install_deps.sh installs every build dependency)")
  endif()
endmacro()
shardema_require(nlohmann_json 3 nlohmann-json3-dev)  # safetensors headers
shardema_require(Boost 1.74 libboost-dev)             # header-only Asio
find_package(Threads REQUIRED)

# The Python whose torch this LibTorch is: its headers for shard/'s Gloo
# seam and the extension, its shared libpython for the C++ programs that
# make a Gloo group (shard/src/gloo_backend.h).
if(NOT SHARDEMA_TORCH_PYTHON)
  message(FATAL_ERROR "shardema: the Python of this LibTorch is unknown: pass "
                      "-DPython3_EXECUTABLE=<the python whose torch is ${Torch_DIR}>")
endif()
find_package(Python3 COMPONENTS Interpreter Development.Module OPTIONAL_COMPONENTS Development.Embed)
if(NOT Python3_Development.Module_FOUND)
  message(FATAL_ERROR "shardema: no Python headers for ${Python3_EXECUTABLE} (apt-get install python3-dev)")
endif()
if(NOT "${Python3_VERSION_MAJOR}.${Python3_VERSION_MINOR}" STREQUAL SHARDEMA_TORCH_INFO_python)
  message(FATAL_ERROR "shardema: CMake found Python ${Python3_VERSION} (${Python3_EXECUTABLE}) "
                      "but torch is in a Python ${SHARDEMA_TORCH_INFO_python} "
                      "(${SHARDEMA_TORCH_PYTHON}): pass -DPython3_EXECUTABLE=${SHARDEMA_TORCH_PYTHON}")
endif()
set(SHARDEMA_LIBPYTHON "")
if(Python3_Development.Embed_FOUND)
  set(SHARDEMA_LIBPYTHON ${Python3_LIBRARIES})
elseif(NOT SKBUILD)
  message(FATAL_ERROR "shardema: no shared libpython for ${Python3_EXECUTABLE}: C++ programs "
                      "embed it to make Gloo groups (apt-get install libpython3-dev)")
endif()

# CUDA runtime: the engine calls the runtime API from .cpp files, so the
# toolkit's headers and cudart are what it needs. PyPI's torch is a CUDA
# build carrying its own runtime (nvidia-cuda-runtime): one process must not
# load two major versions of libcudart, and the engine hands c10's streams to
# the runtime it links. With a CUDA torch, cmake/ShardemaTorch.cmake has
# already required a toolkit of the wheel's major version (13 here); the
# same major version is one libcudart.so.N (SONAME), loaded once, whichever
# copy the loader finds first. With a CPU torch and no toolkit, AUTO builds
# the host engine only; ON stops.
set(SHARDEMA_CUDA_ENABLED OFF)
if(NOT SHARDEMA_WITH_CUDA STREQUAL "OFF")
  if(NOT CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDA_PATH} AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  set(_shardema_cuda_refusal "")
  if(NOT CUDAToolkit_FOUND)
    set(_shardema_cuda_refusal "no CUDA toolkit was found (set CUDAToolkit_ROOT)")
  endif()
  if(NOT _shardema_cuda_refusal)
    set(SHARDEMA_CUDA_ENABLED ON)
    message(STATUS "shardema: CUDA toolkit ${CUDAToolkit_VERSION}, torch's CUDA "
                   "'${SHARDEMA_TORCH_CUDA_VERSION}': CUDA engine enabled")
  elseif(SHARDEMA_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "SHARDEMA_WITH_CUDA=ON but ${_shardema_cuda_refusal}")
  else()
    message(STATUS "shardema: host engine only: ${_shardema_cuda_refusal}")
  endif()
endif()

# xxhash (libxxhash-dev): XXH64 checksums of checkpoint files. Found as a
# plain library path rather than an imported target: shardema_core is static,
# so its private dependencies travel in the exported package as
# $<LINK_ONLY:path>, which a consumer can link without finding xxhash itself.
find_path(SHARDEMA_XXHASH_INCLUDE_DIR xxhash.h)
find_library(SHARDEMA_XXHASH_LIBRARY NAMES xxhash)
if(NOT SHARDEMA_XXHASH_INCLUDE_DIR OR NOT SHARDEMA_XXHASH_LIBRARY)
  message(FATAL_ERROR "shardema: xxhash not found (apt-get install libxxhash-dev)")
endif()
