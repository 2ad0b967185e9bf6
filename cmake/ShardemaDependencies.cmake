# Every dependency comes from a Debian 12 package (scripts/install_deps.sh).
find_package(Torch REQUIRED)            # libtorch-dev 1.13 here, torch 2.x on GPU machines
find_package(nlohmann_json 3 REQUIRED)  # nlohmann-json3-dev: safetensors headers
find_package(Boost 1.74 REQUIRED)       # libboost-dev: header-only Asio
find_package(Threads REQUIRED)

# CUDA runtime: we only call the runtime API from .cpp files, so the toolkit's
# libraries are what we need; nvcc is located for the .cu parts of offload/.
set(SHARDEMA_CUDA_ENABLED OFF)
if(NOT SHARDEMA_WITH_CUDA STREQUAL "OFF")
  if(NOT CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDA_PATH} AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(SHARDEMA_CUDA_ENABLED ON)
    message(STATUS "shardema: CUDA toolkit ${CUDAToolkit_VERSION} found; CUDA engine enabled")
  elseif(SHARDEMA_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "SHARDEMA_WITH_CUDA=ON but no CUDA toolkit was found (set CUDAToolkit_ROOT)")
  else()
    message(STATUS "shardema: no CUDA toolkit; host engine only")
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
