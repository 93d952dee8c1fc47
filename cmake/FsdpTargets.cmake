# Bazel-shaped target helpers; cmake/bazel_targets.cmake (generated from the BUILD.bazel
# files by tools/gen_cmake_targets.py) calls them once per Bazel C++ target.
#
#   fsdp_cc_library(//pkg:name SRCS .. HDRS .. DEPS .. [CUDA_SRCS ..] [NOCUDA_SRCS ..]
#                   [CUDA_DEPS ..] [TESTONLY] [ALWAYSLINK] [OPTION FSDP_BUILD_X] [INSTALL])
#   fsdp_cc_binary(//pkg:name SRCS .. DEPS .. [TESTONLY] [LINKOPTS ..] [OPTION FSDP_BUILD_X])
#   fsdp_cc_test(//pkg:name SIZE small|medium|large [TIMEOUT short|moderate|long|eternal]
#                SRCS .. DEPS .. [DATA ..] [ENV K=V ..] [ARGS ..] [SMOKE [SMOKE_FILTER -Suite.Case:..]])
#                (DATA may use globs: testdata/*.pt, as Bazel's glob())
#   fsdp_bazel_excluded(//pkg:name KIND cc_test REASON "...")
#   (each of the three also takes [PCH aten|none]: Bazel's torch_pch, see below)
#
# Arguments read like the BUILD.bazel entry they mirror: sources relative to the package
# directory, deps as Bazel labels (//comm, //comm:gloo, :sibling, @libtorch, @system//:absl,
# ...). ALWAYSLINK is Bazel's alwayslink (whole archive: e.g. test cases linked into several
# test binaries). CUDA_* / NOCUDA_* are the two branches of a `select` on //comm:with_cuda
# (FSDP_WITH_CUDA). OPTION: the target is defined only when that option is ON (else recorded
# as skipped). INSTALL: the library is in the CMake package (cmake/FsdpInstall.cmake; its HDRS
# install at their repository paths under include/). SMOKE: the test is in the smoke set
# (CTest label `smoke`); SMOKE_FILTER: the GoogleTest
# negative filter its smoke run uses (FSDP_CMAKE_SMOKE=ON only). Target names:
# //pkg:name -> pkg_name with '/' -> '_', and a package's
# default target (//comm == //comm:comm) is just the package: //comm -> comm,
# //comm:gloo -> comm_gloo, //fsdp/fsdp2 -> fsdp2,
# //fsdp/fsdp2:fsdp2_test -> fsdp2_fsdp2_test. Every target also has
# the alias libtorch_fsdp::<name>. Executables land in <build>/bin/<pkg>/<name> (as
# bazel-bin/<pkg>/<name>); a test's CTest name is its Bazel label.
#
# FSDP_CMAKE_SMOKE=ON: the default build (`all`) is the libraries, the binaries that are not
# testonly, and the SMOKE tests (with the testonly libraries they need); every other test and
# testonly target is EXCLUDE_FROM_ALL (still buildable by name). Every test is registered
# with CTest; `ctest -L smoke` runs the smoke set.
#
# If FSDP_SKIP is set (to a reason) when a helper runs, the target is recorded but not
# defined. Every call is recorded in a manifest that cmake/check_bazel_parity.py compares
# with the BUILD.bazel files.

set(FSDP_COPTS -Wall -Wno-unused-parameter -Wno-sign-compare -Wno-unknown-pragmas
    -Wno-missing-field-initializers)

# Precompiled LibTorch headers: ATen.h and torch::nn / torch::optim are most of a TU's compile
# time (figures: docs/development/building.md). Two are built, the tiers of Bazel's
# tools/cc.bzl: fsdp_pch (the full list, tools/torch_pch_headers.h; the default) and
# fsdp_pch_aten (ATen only,
# tools/torch_pch_aten_headers.h; targets with PCH aten). PCH none: no precompiled header (the
# sources include no LibTorch header). Every target reuses one of them, so all targets compile
# position-independent (one -fPIC setting for a PCH and its users). A target whose flags
# differ (e.g. FSDP_WITH_CUDA's defines) makes GCC ignore the PCH and read the headers as
# usual: slower, never wrong. ccache caches these compiles with
# CCACHE_SLOPPINESS=pch_defines,time_macros (tools/cmake_build.sh sets it).
option(FSDP_PRECOMPILED_HEADERS "Precompile the most used LibTorch headers once and reuse them in every target" ON)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)
function(_fsdp_pch_target target header)
  set(_anchor "${CMAKE_BINARY_DIR}/${target}.cc")
  if(NOT EXISTS "${_anchor}")
    file(WRITE "${_anchor}" "// Compiles the precompiled header (target ${target}).\n")
  endif()
  add_library(${target} OBJECT "${_anchor}")
  target_link_libraries(${target} PRIVATE fsdp_libtorch)
  target_compile_options(${target} PRIVATE ${FSDP_COPTS})
  target_precompile_headers(${target} PRIVATE "${PROJECT_SOURCE_DIR}/tools/${header}")
endfunction()
if(FSDP_PRECOMPILED_HEADERS)
  # The same lists as Bazel's //tools:torch_pch and //tools:torch_pch_aten (tools/cc.bzl).
  _fsdp_pch_target(fsdp_pch torch_pch_headers.h)
  _fsdp_pch_target(fsdp_pch_aten torch_pch_aten_headers.h)
endif()

# tier: the target's PCH argument (unset: the full header; aten; none).
function(_fsdp_use_pch target tier)
  if(NOT FSDP_PRECOMPILED_HEADERS OR tier STREQUAL "none")
    return()
  elseif(tier STREQUAL "aten")
    target_precompile_headers(${target} REUSE_FROM fsdp_pch_aten)
  elseif(tier STREQUAL "" OR tier STREQUAL "nn")
    target_precompile_headers(${target} REUSE_FROM fsdp_pch)
  else()
    message(FATAL_ERROR "${target}: PCH must be nn, aten or none, got '${tier}'")
  endif()
endfunction()

# Bazel's test timeouts: per size, unless the test sets `timeout`.
set(FSDP_TIMEOUT_small 60)
set(FSDP_TIMEOUT_medium 300)
set(FSDP_TIMEOUT_large 900)
set(FSDP_TIMEOUT_enormous 3600)
set(FSDP_TIMEOUT_short 60)
set(FSDP_TIMEOUT_moderate 300)
set(FSDP_TIMEOUT_long 900)
set(FSDP_TIMEOUT_eternal 3600)

function(_fsdp_split_label label pkg_out name_out)
  if(NOT label MATCHES "^//([^:]*)(:([^:]+))?$")
    message(FATAL_ERROR "not a Bazel label of this repository: '${label}'")
  endif()
  set(pkg "${CMAKE_MATCH_1}")
  set(name "${CMAKE_MATCH_3}")
  if(name STREQUAL "")
    get_filename_component(name "${pkg}" NAME)
  endif()
  set(${pkg_out} "${pkg}" PARENT_SCOPE)
  set(${name_out} "${name}" PARENT_SCOPE)
endfunction()

# The CMake target of a label of this repository: the package path with "_" for "/", then
# "_<name>" unless the name is the package's last component. fsdp/fsdp2 and fsdp/fsdp1 are
# fsdp2 and fsdp1 (not fsdp2).
function(fsdp_target_name label out)
  _fsdp_split_label("${label}" pkg name)
  get_filename_component(base "${pkg}" NAME)
  string(REGEX REPLACE "^fsdp/(fsdp[0-9])" "\\1" path "${pkg}")
  string(REPLACE "/" "_" target "${path}")
  if(NOT name STREQUAL base)
    set(target "${target}_${name}")
  endif()
  set(${out} "${target}" PARENT_SCOPE)
endfunction()

# CMake link items for Bazel deps (labels relative to package `pkg`).
function(_fsdp_link_items pkg out)
  set(items "")
  foreach(dep IN LISTS ARGN)
    if(dep MATCHES "^:")
      set(dep "//${pkg}${dep}")
    endif()
    if(dep MATCHES "^//")
      fsdp_target_name("${dep}" t)
      list(APPEND items "${t}")
    elseif(dep STREQUAL "@libtorch" OR dep STREQUAL "@libtorch//:libtorch")
      list(APPEND items fsdp_libtorch)
    elseif(dep STREQUAL "@libtorch//:c10_cuda")
      list(APPEND items fsdp_c10_cuda)
    elseif(dep STREQUAL "@system//:absl")
      list(APPEND items fsdp_absl)
    elseif(dep STREQUAL "@system//:absl_flags")
      list(APPEND items fsdp_absl_flags)
    elseif(dep STREQUAL "@system//:tomlplusplus")
      list(APPEND items fsdp_tomlplusplus)
    elseif(dep STREQUAL "@system//:gtest")
      list(APPEND items GTest::gtest Threads::Threads)
    elseif(dep STREQUAL "@system//:gtest_main")
      list(APPEND items GTest::gtest_main GTest::gtest Threads::Threads)
    elseif(dep STREQUAL "@system//:benchmark")
      list(APPEND items benchmark::benchmark)
    elseif(dep STREQUAL "@system//:benchmark_main")
      list(APPEND items benchmark::benchmark_main)
    elseif(dep STREQUAL "@system//:gloo_headers")
      # Debian's libgloo-dev headers are on the default include path.
    elseif(dep STREQUAL "@cuda//:cudart")
      list(APPEND items fsdp_cudart)
    elseif(dep STREQUAL "@libtorch//:torch_cuda")
      list(APPEND items fsdp_torch_cuda)
    else()
      message(FATAL_ERROR "no CMake mapping for the Bazel dep '${dep}' (cmake/FsdpTargets.cmake)")
    endif()
  endforeach()
  set(${out} "${items}" PARENT_SCOPE)
endfunction()

function(_fsdp_join out)
  string(REPLACE ";" "," joined "${ARGN}")
  set(${out} "${joined}" PARENT_SCOPE)
endfunction()

# One manifest line: label|kind|status|srcs|cuda_srcs|deps|cuda_deps|linkopts|size|data|env|args
# (lists comma-separated; kind carries "+alwayslink", size "+<timeout>").
function(_fsdp_record label kind status)
  cmake_parse_arguments(R "" "SIZE" "SRCS;CUDA_SRCS;DEPS;CUDA_DEPS;LINKOPTS;DATA;ENV;ARGS" ${ARGN})
  set(fields "${label}" "${kind}" "${status}")
  foreach(l R_SRCS R_CUDA_SRCS R_DEPS R_CUDA_DEPS R_LINKOPTS R_SIZE R_DATA R_ENV R_ARGS)
    _fsdp_join(j ${${l}})
    string(REPLACE "|" "/" j "${j}")
    list(APPEND fields "${j}")
  endforeach()
  string(REPLACE ";" "|" line "${fields}")
  set_property(GLOBAL APPEND PROPERTY FSDP_BAZEL_MANIFEST "${line}")
endfunction()

function(fsdp_write_manifest path)
  get_property(lines GLOBAL PROPERTY FSDP_BAZEL_MANIFEST)
  string(REPLACE ";" "\n" text "${lines}")
  file(WRITE "${path}" "${text}\n")
endfunction()

function(_fsdp_paths pkg out)
  set(paths "")
  foreach(f IN LISTS ARGN)
    list(APPEND paths "${FSDP_SOURCE_DIR}/${pkg}/${f}")
  endforeach()
  set(${out} "${paths}" PARENT_SCOPE)
endfunction()

# Sources, headers and deps of the configuration being built (FSDP_WITH_CUDA or not).
macro(_fsdp_common_args kind)
  cmake_parse_arguments(ARG "TESTONLY;ALWAYSLINK;SMOKE;INSTALL" "SIZE;TIMEOUT;KIND;REASON;OPTION;PCH;SMOKE_FILTER"
                        "SRCS;HDRS;DEPS;CUDA_SRCS;NOCUDA_SRCS;CUDA_DEPS;LINKOPTS;DATA;ENV;ARGS;TAGS" ${ARGN})
  _fsdp_split_label("${label}" pkg name)
  fsdp_target_name("${label}" target)
  set(_kind ${kind})
  if(ARG_ALWAYSLINK)
    set(_kind "${kind}+alwayslink")
  endif()
  # DATA globs (Bazel's glob()) expand to the files they match now.
  set(_data "")
  foreach(_d IN LISTS ARG_DATA)
    if(_d MATCHES "[*?]")
      file(GLOB _matched RELATIVE "${FSDP_SOURCE_DIR}/${pkg}" "${FSDP_SOURCE_DIR}/${pkg}/${_d}")
      list(APPEND _data ${_matched})
    else()
      list(APPEND _data "${_d}")
    endif()
  endforeach()
  set(ARG_DATA ${_data})
  set(_size_field "${ARG_SIZE}")
  if(ARG_TIMEOUT)
    set(_size_field "${ARG_SIZE}+${ARG_TIMEOUT}")
  endif()
  set(_all_default ${ARG_SRCS} ${ARG_NOCUDA_SRCS} ${ARG_HDRS})
  set(_all_cuda ${ARG_SRCS} ${ARG_CUDA_SRCS} ${ARG_HDRS})
  set(_deps_cuda ${ARG_DEPS} ${ARG_CUDA_DEPS})
  if(FSDP_WITH_CUDA)
    set(_srcs ${ARG_SRCS} ${ARG_CUDA_SRCS})
    set(_deps ${_deps_cuda})
  else()
    set(_srcs ${ARG_SRCS} ${ARG_NOCUDA_SRCS})
    set(_deps ${ARG_DEPS})
  endif()
  set(_status built)
  if(DEFINED FSDP_SKIP AND NOT FSDP_SKIP STREQUAL "")
    set(_status "skipped: ${FSDP_SKIP}")
  elseif(ARG_OPTION AND NOT ${ARG_OPTION})
    set(_status "skipped: ${ARG_OPTION}=OFF")
  elseif((ARG_TESTONLY OR "${kind}" STREQUAL "cc_test") AND NOT FSDP_BUILD_TESTS)
    set(_status "skipped: FSDP_BUILD_TESTS=OFF")
  endif()
  _fsdp_record("${label}" ${_kind} "${_status}" SRCS ${_all_default} CUDA_SRCS ${_all_cuda}
               DEPS ${ARG_DEPS} CUDA_DEPS ${_deps_cuda} LINKOPTS ${ARG_LINKOPTS} SIZE ${_size_field}
               DATA ${ARG_DATA} ENV ${ARG_ENV} ARGS ${ARG_ARGS})
  # Built targets need their files (an error, but configuration goes on so that the parity
  # check at the end can name what changed in the BUILD files); skipped ones are only
  # compared with the BUILD files.
  if(_status STREQUAL "built")
    foreach(_f IN LISTS _srcs ARG_HDRS ARG_DATA)
      if(NOT EXISTS "${FSDP_SOURCE_DIR}/${pkg}/${_f}")
        message(SEND_ERROR "${label}: ${pkg}/${_f} does not exist")
        set(_status "missing files")
      endif()
    endforeach()
  endif()
  # FSDP_CMAKE_SMOKE: what the default build leaves out (built when something needs it).
  set(_exclude_from_all OFF)
  if(FSDP_CMAKE_SMOKE AND (ARG_TESTONLY OR ("${kind}" STREQUAL "cc_test" AND NOT ARG_SMOKE)))
    set(_exclude_from_all ON)
  endif()
  _fsdp_paths("${pkg}" _src_paths ${_srcs})
  _fsdp_paths("${pkg}" _hdr_paths ${ARG_HDRS})
  _fsdp_link_items("${pkg}" _link ${_deps})
endmacro()

function(fsdp_cc_library label)
  _fsdp_common_args(cc_library ${ARGN})
  if(NOT _status STREQUAL "built")
    return()
  endif()
  set(_compiled ${_src_paths})
  list(FILTER _compiled INCLUDE REGEX "\\.(cc|cpp|c)$")
  if(_compiled AND ARG_ALWAYSLINK)
    # alwayslink: the archive is linked whole (its objects register test cases or other
    # static initializers nothing references). ${target} wraps ${target}_archive.
    add_library(${target}_archive STATIC ${_src_paths} ${_hdr_paths})
    target_include_directories(${target}_archive PUBLIC "$<BUILD_INTERFACE:${FSDP_SOURCE_DIR}>")
    target_link_libraries(${target}_archive PUBLIC ${_link})
    target_compile_options(${target}_archive PRIVATE ${FSDP_COPTS})
    _fsdp_use_pch(${target}_archive "${ARG_PCH}")
    set_target_properties(${target}_archive PROPERTIES POSITION_INDEPENDENT_CODE ON
                          EXCLUDE_FROM_ALL ${_exclude_from_all})
    add_library(${target} INTERFACE)
    # The installed package names the archive LibtorchFsdp::<name>_archive (CMake does not
    # rewrite a target name inside $<LINK_LIBRARY:...> when it exports).
    target_link_libraries(${target} INTERFACE
                          "$<BUILD_INTERFACE:$<LINK_LIBRARY:WHOLE_ARCHIVE,${target}_archive>>"
                          "$<INSTALL_INTERFACE:$<LINK_LIBRARY:WHOLE_ARCHIVE,LibtorchFsdp::${target}_archive>>")
  elseif(_compiled)
    add_library(${target} ${_src_paths} ${_hdr_paths})
    target_include_directories(${target} PUBLIC "$<BUILD_INTERFACE:${FSDP_SOURCE_DIR}>")
    target_link_libraries(${target} PUBLIC ${_link})
    target_compile_options(${target} PRIVATE ${FSDP_COPTS})
    _fsdp_use_pch(${target} "${ARG_PCH}")
    set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON
                          EXCLUDE_FROM_ALL ${_exclude_from_all})
  else()
    # Header-only, as a Bazel cc_library without compiled sources.
    add_library(${target} INTERFACE)
    target_include_directories(${target} INTERFACE "$<BUILD_INTERFACE:${FSDP_SOURCE_DIR}>")
    target_link_libraries(${target} INTERFACE ${_link})
  endif()
  add_library(libtorch_fsdp::${target} ALIAS ${target})
  if(ARG_INSTALL AND FSDP_INSTALL)
    set_property(GLOBAL APPEND PROPERTY FSDP_INSTALL_TARGETS ${target})
    if(ARG_ALWAYSLINK AND _compiled)
      set_property(GLOBAL APPEND PROPERTY FSDP_INSTALL_TARGETS ${target}_archive)
    endif()
    foreach(_h IN LISTS ARG_HDRS)
      get_filename_component(_dir "${pkg}/${_h}" DIRECTORY)
      install(FILES "${FSDP_SOURCE_DIR}/${pkg}/${_h}" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/${_dir}")
    endforeach()
  endif()
endfunction()

function(_fsdp_executable)
  if(NOT _src_paths)
    # A Bazel test / binary may consist of its deps alone (e.g. alwayslink test cases +
    # gtest_main); CMake wants at least one source.
    set(_empty "${CMAKE_BINARY_DIR}/fsdp_empty.cc")
    if(NOT EXISTS "${_empty}")
      file(WRITE "${_empty}" "// Executables whose code is all in their deps.\n")
    endif()
    set(_src_paths "${_empty}")
  endif()
  add_executable(${target} ${_src_paths} ${_hdr_paths})
  target_include_directories(${target} PRIVATE "${FSDP_SOURCE_DIR}")
  target_link_libraries(${target} PRIVATE ${_link} ${ARG_LINKOPTS})
  # -fPIC like the libraries (CMake would compile executables with -fPIE, and GCC rejects a
  # PCH built with the other setting); the objects still link into a PIE.
  target_compile_options(${target} PRIVATE ${FSDP_COPTS} -fPIC)
  _fsdp_use_pch(${target} "${ARG_PCH}")
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE OFF OUTPUT_NAME "${name}"
                        RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/bin/${pkg}"
                        EXCLUDE_FROM_ALL ${_exclude_from_all})
endfunction()

function(fsdp_cc_binary label)
  _fsdp_common_args(cc_binary ${ARGN})
  if(NOT _status STREQUAL "built")
    return()
  endif()
  _fsdp_executable()
  # INSTALL: a program of the package (tools/gen_cmake_targets.py, INSTALLED_PROGRAMS), to bin/.
  if(ARG_INSTALL AND FSDP_INSTALL)
    set_property(GLOBAL APPEND PROPERTY FSDP_INSTALL_TARGETS ${target})
  endif()
endfunction()

function(fsdp_cc_test label)
  _fsdp_common_args(cc_test ${ARGN})
  if(NOT _status STREQUAL "built")
    return()
  endif()
  _fsdp_executable()
  if(NOT ARG_SIZE)
    set(ARG_SIZE medium)
  endif()
  # Bazel gives every test a private TEST_TMPDIR; tests write checkpoints there.
  set(tmp "${CMAKE_BINARY_DIR}/testtmp/${target}")
  file(MAKE_DIRECTORY "${tmp}")
  # "$(rootpath :bin)" args arrive as FSDP_TARGET_FILE:<label> (tools/gen_cmake_targets.py).
  set(args "")
  foreach(_a IN LISTS ARG_ARGS)
    if(_a MATCHES "^FSDP_TARGET_FILE:(.*)$")
      fsdp_target_name("${CMAKE_MATCH_1}" _t)
      list(APPEND args "$<TARGET_FILE:${_t}>")
    else()
      list(APPEND args "${_a}")
    endif()
  endforeach()
  # SMOKE_FILTER: the cases the smoke run leaves out (tools/gen_cmake_targets.py's
  # SMOKE_GTEST_FILTERS); a full build (FSDP_CMAKE_SMOKE=OFF) runs every case.
  if(FSDP_CMAKE_SMOKE AND ARG_SMOKE_FILTER)
    list(APPEND args "--gtest_filter=${ARG_SMOKE_FILTER}")
  endif()
  add_test(NAME "${label}" COMMAND ${target} ${args})
  # ENV mirrors the target's `env`; FSDP_TEST_ENV is for every test (Bazel's --test_env).
  # GoogleTest's XML per test (named as the label, //pkg:name -> pkg_name.xml), from which
  # tools/test_summary.py --ctest counts test cases as it does for Bazel's test.xml.
  string(REGEX REPLACE "^//" "" xml_name "${label}")
  string(REGEX REPLACE "[/:]" "_" xml_name "${xml_name}")
  set(env "TEST_TMPDIR=${tmp}" "GTEST_OUTPUT=xml:${CMAKE_BINARY_DIR}/test-xml/${xml_name}.xml"
      ${FSDP_TEST_ENV} ${ARG_ENV})
  set(timeout ${FSDP_TIMEOUT_${ARG_SIZE}})
  if(ARG_TIMEOUT)
    set(timeout ${FSDP_TIMEOUT_${ARG_TIMEOUT}})
  endif()
  # TAGS: the Bazel test's tags (float_parity: `ctest -L float_parity`).
  set(labels "${ARG_SIZE}" ${ARG_TAGS})
  if(ARG_SMOKE)
    list(APPEND labels smoke)
  endif()
  set_tests_properties("${label}" PROPERTIES TIMEOUT ${timeout} LABELS "${labels}")
  set_property(TEST "${label}" PROPERTY ENVIRONMENT ${env})
  if(ARG_DATA)
    # Bazel runs a test in its runfiles tree, laid out as the source tree: data files are
    # read at their workspace-relative paths. The source tree is that layout.
    set_property(TEST "${label}" PROPERTY WORKING_DIRECTORY "${FSDP_SOURCE_DIR}")
  endif()
endfunction()

# A Bazel target CMake deliberately does not build; the reason is printed at configure time.
function(fsdp_bazel_excluded label)
  cmake_parse_arguments(ARG "" "KIND;REASON" "" ${ARGN})
  if(NOT ARG_REASON)
    message(FATAL_ERROR "fsdp_bazel_excluded(${label}) needs a REASON")
  endif()
  _fsdp_record("${label}" ${ARG_KIND} "excluded: ${ARG_REASON}")
  message(STATUS "not built by CMake: ${label}: ${ARG_REASON}")
endfunction()
