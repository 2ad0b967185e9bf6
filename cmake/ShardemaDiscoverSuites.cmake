# Script mode (cmake -P), run after a test executable is built: lists its
# GoogleTest suites and writes a ctest file with one entry per suite,
# `<Suite>.*`, running that suite's TESTs in one process.
# Why not one entry per TEST (gtest_discover_tests): every process start
# loads LibTorch, ~0.9 s of CPU in Release and ~1.9 s under ASan (measured),
# and with ~420 TESTs that start was most of CI's test time.
# Inputs: EXE, OUT (the ctest file), LABELS (comma separated), TIMEOUT,
# WORKING_DIR.
execute_process(COMMAND "${EXE}" --gtest_list_tests
                OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE status
                TIMEOUT 120)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "${EXE} --gtest_list_tests failed (${status}):\n${listing}${errors}")
endif()
string(REPLACE "," ";" labels "${LABELS}")
string(REPLACE "\n" ";" lines "${listing}")
set(script "")
foreach(line IN LISTS lines)
  # Suites start in column 0 ("Suite." or "Prefix/Suite/0.  # TypeParam = ...");
  # their TESTs are indented.
  if(line MATCHES "^([^ #][^ ]*\\.)")
    set(suite "${CMAKE_MATCH_1}")
    string(APPEND script
      "add_test([==[${suite}*]==] [==[${EXE}]==] [==[--gtest_filter=${suite}*]==])\n"
      "set_tests_properties([==[${suite}*]==] PROPERTIES LABELS [==[${labels}]==]"
      " TIMEOUT ${TIMEOUT} WORKING_DIRECTORY [==[${WORKING_DIR}]==])\n")
  endif()
endforeach()
if(script STREQUAL "")
  message(FATAL_ERROR "${EXE} lists no GoogleTest suite:\n${listing}")
endif()
file(WRITE "${OUT}" "${script}")
