# The CMake package LibtorchFsdp: `cmake --install <build> --prefix <dir>` installs
#   <dir>/include/<pkg>/...h           the headers at their repository paths ("fsdp/fsdp2/fully_shard.h")
#   <dir>/lib/lib<name>.a              the libraries (static, as built)
#   <dir>/lib/cmake/LibtorchFsdp/      LibtorchFsdpConfig.cmake, its version file and the exported targets
# for another project:
#   find_package(Torch REQUIRED)                  (optional: the package finds it otherwise)
#   find_package(LibtorchFsdp CONFIG REQUIRED)    (<dir> in CMAKE_PREFIX_PATH)
#   target_link_libraries(app PRIVATE LibtorchFsdp::fsdp2)
# What is installed: the libraries tools/gen_cmake_targets.py marks INSTALL (Bazel's public,
# non-testonly libraries and the libraries they link); no tests, testonly libraries, bench or
# fuzz. Target names are add_subdirectory's: libtorch_fsdp::<name> is LibtorchFsdp::<name>.
# `cmake --build <build> --target fsdp_package` builds what is installed and nothing else.
# examples/consumer_cmake is a project that uses the package (tools/cmake_package_check.sh).
include(CMakePackageConfigHelpers)

set(FSDP_PACKAGE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/LibtorchFsdp")
get_property(_fsdp_installed GLOBAL PROPERTY FSDP_INSTALL_TARGETS)

# The stand-ins for third-party libraries that the libraries link (cmake/FsdpDependencies.cmake),
# exported as LibtorchFsdp::libtorch, ::absl, ...: their properties name Torch's, absl's and
# CUDA's targets, which LibtorchFsdpConfig.cmake finds before it loads the targets.
set(_fsdp_dependency_targets fsdp_libtorch fsdp_absl fsdp_absl_flags fsdp_tomlplusplus)
if(FSDP_WITH_CUDA)
  list(APPEND _fsdp_dependency_targets fsdp_cudart fsdp_c10_cuda fsdp_torch_cuda)
endif()
foreach(_t IN LISTS _fsdp_dependency_targets)
  string(REGEX REPLACE "^fsdp_" "" _name "${_t}")
  set_target_properties(${_t} PROPERTIES EXPORT_NAME "${_name}")
endforeach()

install(TARGETS ${_fsdp_installed} ${_fsdp_dependency_targets}
        EXPORT LibtorchFsdpTargets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}"
        INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(EXPORT LibtorchFsdpTargets NAMESPACE LibtorchFsdp:: FILE LibtorchFsdpTargets.cmake
        DESTINATION "${FSDP_PACKAGE_DIR}")

# What LibtorchFsdpConfig.cmake needs to know of this build.
set(FSDP_PACKAGE_TORCH_DIR "${Torch_DIR}")  # a hint: the consumer's CMAKE_PREFIX_PATH / Torch_DIR go first
set(FSDP_PACKAGE_WITH_CUDA "${FSDP_WITH_CUDA}")
configure_package_config_file("${FSDP_SOURCE_DIR}/cmake/LibtorchFsdpConfig.cmake.in"
                              "${CMAKE_BINARY_DIR}/package/LibtorchFsdpConfig.cmake"
                              INSTALL_DESTINATION "${FSDP_PACKAGE_DIR}")
# No release numbering yet (project() says 0.1.0): any other minor version is incompatible.
write_basic_package_version_file("${CMAKE_BINARY_DIR}/package/LibtorchFsdpConfigVersion.cmake"
                                 VERSION "${PROJECT_VERSION}" COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_BINARY_DIR}/package/LibtorchFsdpConfig.cmake"
              "${CMAKE_BINARY_DIR}/package/LibtorchFsdpConfigVersion.cmake"
        DESTINATION "${FSDP_PACKAGE_DIR}")

add_custom_target(fsdp_package)
add_dependencies(fsdp_package ${_fsdp_installed})
