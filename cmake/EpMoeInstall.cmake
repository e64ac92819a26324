# Installation: headers, library, pkg-config file and CMake package.
include(CMakePackageConfigHelpers)

install(TARGETS ep_moe EXPORT ep_moeTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ep_moe DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

# pkg-config: paths relative to the .pc file so a staged or moved install works.
file(RELATIVE_PATH EP_MOE_PC_TO_PREFIX
  "/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/")
string(REGEX REPLACE "/$" "" EP_MOE_PC_TO_PREFIX "${EP_MOE_PC_TO_PREFIX}")
configure_file(${PROJECT_SOURCE_DIR}/ep_moe.pc.in ${PROJECT_BINARY_DIR}/ep_moe.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/ep_moe.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

set(EP_MOE_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/ep_moe)
install(EXPORT ep_moeTargets NAMESPACE ep_moe:: DESTINATION ${EP_MOE_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ep_moeConfig.cmake.in
  ${PROJECT_BINARY_DIR}/ep_moeConfig.cmake INSTALL_DESTINATION ${EP_MOE_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/ep_moeConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/ep_moeConfig.cmake ${PROJECT_BINARY_DIR}/ep_moeConfigVersion.cmake
  DESTINATION ${EP_MOE_CMAKE_DIR})
