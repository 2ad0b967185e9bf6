# Finds what the extension module shardema._C needs: a Python interpreter
# whose torch is the LibTorch we build against, its development files, the
# pybind11 headers and libtorch_python. Sets SHARDEMA_PYTHON_ENABLED, and
# SHARDEMA_PYTHON_MISSING (why not) when it is off.
#
# The interpreter: Python3_EXECUTABLE when given; otherwise the first of
# `python3` on PATH and /usr/bin/python3 that imports a torch of the same
# major.minor version as LibTorch. On Debian the python3 first on PATH is
# often a pyenv one without torch, while Debian's own /usr/bin/python3 has
# python3-torch, the same build as libtorch-dev.
set(SHARDEMA_PYTHON_ENABLED OFF)
set(SHARDEMA_PYTHON_MISSING "")

string(REGEX MATCH "^[0-9]+\\.[0-9]+" _shardema_torch_mm "${Torch_VERSION}")

function(_shardema_python_torch_version python out)
  execute_process(COMMAND ${python} -c "import torch; print(torch.__version__)"
                  RESULT_VARIABLE failed OUTPUT_VARIABLE version ERROR_QUIET
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(failed)
    set(${out} "" PARENT_SCOPE)
  else()
    set(${out} "${version}" PARENT_SCOPE)
  endif()
endfunction()

if(Python3_EXECUTABLE)
  set(_shardema_candidates ${Python3_EXECUTABLE})
else()
  find_program(_shardema_path_python NAMES python3 NO_CACHE)
  set(_shardema_candidates ${_shardema_path_python} /usr/bin/python3)
endif()
set(_shardema_python "")
foreach(candidate IN LISTS _shardema_candidates)
  if(NOT EXISTS "${candidate}")
    continue()
  endif()
  _shardema_python_torch_version(${candidate} version)
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" mm "${version}")
  if(mm AND mm STREQUAL _shardema_torch_mm)
    set(_shardema_python ${candidate})
    set(SHARDEMA_PYTHON_TORCH_VERSION ${version})
    break()
  endif()
endforeach()

if(NOT _shardema_python)
  set(SHARDEMA_PYTHON_MISSING
      "no Python among '${_shardema_candidates}' imports torch ${_shardema_torch_mm} (LibTorch's version)")
  return()
endif()

set(Python3_EXECUTABLE ${_shardema_python} CACHE FILEPATH "Python of the extension" FORCE)
find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
if(NOT Python3_Development.Module_FOUND)
  set(SHARDEMA_PYTHON_MISSING "no Python development headers for ${_shardema_python} (apt-get install python3-dev)")
  return()
endif()

# pybind11: the copy torch ships in its include folder when it has one (pip
# wheels), so that our module and torch share pybind11's internals (type
# casts of torch's own classes such as ProcessGroup go through them);
# otherwise the system's (Debian's pybind11-dev, which Debian's torch was
# built with), or the pybind11 package of the environment.
execute_process(COMMAND ${_shardema_python} -c "import pybind11; print(pybind11.get_include())"
                OUTPUT_VARIABLE _shardema_pybind_hint ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
find_path(SHARDEMA_PYBIND11_INCLUDE_DIR pybind11/pybind11.h
          HINTS ${TORCH_INCLUDE_DIRS} ${_shardema_pybind_hint})
if(NOT SHARDEMA_PYBIND11_INCLUDE_DIR)
  set(SHARDEMA_PYTHON_MISSING "no pybind11 headers (apt-get install pybind11-dev, or pip install pybind11)")
  return()
endif()

find_library(SHARDEMA_TORCH_PYTHON_LIBRARY torch_python
             HINTS "${TORCH_INSTALL_PREFIX}/lib" ${TORCH_INSTALL_PREFIX}/lib/x86_64-linux-gnu)
if(NOT SHARDEMA_TORCH_PYTHON_LIBRARY)
  set(SHARDEMA_PYTHON_MISSING "no libtorch_python next to LibTorch (${TORCH_INSTALL_PREFIX})")
  return()
endif()

set(SHARDEMA_PYTHON_ENABLED ON)
