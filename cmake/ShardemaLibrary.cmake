# One definition of a shardema library: shardema_add_library(<target> <alias>)
# in a layer's folder builds src/*.cpp of that folder as <target>, with
# include/ as its public include root (the layering: a layer sees only the
# roots of the targets it links), the alias shardema::<alias>, our warnings,
# and the unity build below.
#
# Unity build: each library's sources are compiled in batches, so LibTorch's
# headers (most of a file's compile time) are parsed once a batch instead
# of once a file. CI builds the libraries three times (Release, ASan, TSan)
# on 2 cores. File-local names are kept unique within a library so that any
# batching compiles. -DSHARDEMA_UNITY_LIBRARIES=OFF for a faster
# edit-compile loop on one file.
option(SHARDEMA_UNITY_LIBRARIES "Compile each library's sources in batches (unity build)" ON)

function(shardema_add_library target alias)
  file(GLOB sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/src/*.cpp)
  add_library(${target} ${sources})
  add_library(shardema::${alias} ALIAS ${target})
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  shardema_set_warnings(${target})
  if(SHARDEMA_UNITY_LIBRARIES)
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 8)
  endif()
endfunction()
