include(CMakePackageConfigHelpers)
set(SHARDEMA_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/shardema")

install(TARGETS shardema_core shardema_shard shardema_offload shardema
        EXPORT shardemaTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# Every floor's headers are installed, detail/ included: lib's public
# headers include the floors' public ones, and those their floor's.
foreach(part core shard offload lib)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${part}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endforeach()
if(TARGET shardema_cli)
  # The installed CLI finds LibTorch (and the CUDA runtime, libpython: every
  # linked library outside the system folders) through its RUNPATH, so it
  # starts without LD_LIBRARY_PATH (tests/install/run_install_test.sh).
  set_target_properties(shardema_cli PROPERTIES INSTALL_RPATH "${SHARDEMA_TORCH_LIBRARY_DIR}"
                                                INSTALL_RPATH_USE_LINK_PATH ON)
  install(TARGETS shardema_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(EXPORT shardemaTargets NAMESPACE shardema:: DESTINATION ${SHARDEMA_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/shardemaConfig.cmake.in
  ${PROJECT_BINARY_DIR}/shardemaConfig.cmake INSTALL_DESTINATION ${SHARDEMA_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/shardemaConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/shardemaConfig.cmake ${PROJECT_BINARY_DIR}/shardemaConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/shardemaTorchLinkDirs.cmake
        DESTINATION ${SHARDEMA_CMAKE_DIR})
