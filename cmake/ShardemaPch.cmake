# One precompiled header of <ATen/ATen.h> and GoogleTest, shared (REUSE_FROM)
# by the executables whose files mostly include <ATen/ATen.h>: the heavier
# test suites, readme_tests, the demo, gather_bench and update_bench.
# Measured (GCC 12, Release): parsing <ATen/ATen.h> is ~7 s, three quarters
# of such a file (-ftime-report), and the PCH takes a test file from 9.5 s
# to 5.3 s. But loading the ~280 MB PCH costs a file that includes only c10
# or ATen/core/Tensor.h more than it saves (1.2 s -> 5.6 s of CPU for
# atomic_file.cpp), and no library file includes <ATen/ATen.h> but six, so
# the libraries, the CLI and the lighter suites go without.
# The PCH is built inside each build directory with that directory's flags
# (sanitizers, build type), and CMake adds -Winvalid-pch, so a PCH that does
# not match is reported, not silently parsed again. GCC refuses a PCH built
# with another -fpic setting: this one is -fPIE, for executables only.
# With ccache, set CCACHE_SLOPPINESS=pch_defines,time_macros (scripts/common.sh
# does), or ccache does not cache the files that use a PCH.
option(SHARDEMA_PCH "Precompile <ATen/ATen.h> and GoogleTest for the heavier executables" ON)

# shardema_use_pch(<executable target>)
function(shardema_use_pch target)
  if(NOT SHARDEMA_PCH)
    return()
  endif()
  if(NOT TARGET shardema_pch_executable)
    _shardema_add_pch_owner(shardema_pch_executable)
  endif()
  target_precompile_headers(${target} REUSE_FROM shardema_pch_executable)
endfunction()

# The owner of the PCH: an object library of one empty source, so building
# the PCH never waits for a link. Its flags are an executable's: the same
# directory options and torch usage requirements, -fPIE rather than the
# -fPIC an object library gets.
function(_shardema_add_pch_owner owner)
  set(source ${PROJECT_BINARY_DIR}/${owner}.cpp)
  if(NOT EXISTS ${source})
    file(WRITE ${source} "// Owner of a precompiled header (cmake/ShardemaPch.cmake).\n")
  endif()
  add_library(${owner} OBJECT ${source})
  target_link_libraries(${owner} PRIVATE torch)
  set_target_properties(${owner} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
  target_compile_options(${owner} PRIVATE ${CMAKE_CXX_COMPILE_OPTIONS_PIE})
  set(headers <ATen/ATen.h> <c10/util/Exception.h>)
  if(SHARDEMA_BUILD_TESTS)
    find_package(GTest QUIET)
    if(TARGET GTest::gtest)
      target_link_libraries(${owner} PRIVATE GTest::gtest)
      list(APPEND headers <gtest/gtest.h>)
    endif()
  endif()
  target_precompile_headers(${owner} PRIVATE ${headers})
endfunction()
