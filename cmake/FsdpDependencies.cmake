# Third-party dependencies, as the Bazel repositories @libtorch, @system and @cuda provide
# them (third_party/*.BUILD). Defines the link targets cmake/FsdpTargets.cmake maps labels to:
#   fsdp_libtorch     @libtorch        torch_cpu + c10 from the pinned torch wheel
#   fsdp_c10_cuda     @libtorch//:c10_cuda (FSDP_WITH_CUDA only)
#   fsdp_absl, fsdp_absl_flags         @system//:absl, :absl_flags (Debian libabsl-dev)
#   fsdp_tomlplusplus                  @system//:tomlplusplus (Debian libtomlplusplus-dev)
#   GTest::gtest, GTest::gtest_main    @system//:gtest, :gtest_main (Debian libgtest-dev)
#   benchmark::benchmark               @system//:benchmark (FSDP_BUILD_BENCH only)
#   fsdp_cudart       @cuda//:cudart     the CUDA runtime (FSDP_WITH_CUDA only)
#   fsdp_torch_cuda   @libtorch//:torch_cuda  libtorch_cuda.so + the wheel's NCCL (FSDP_WITH_CUDA only)

# When this project is added with add_subdirectory(), the parent links our targets, whose
# link interfaces name these imported targets: make them visible everywhere.
set(CMAKE_FIND_PACKAGE_TARGETS_GLOBAL ON)

find_package(Threads REQUIRED)

# ---------------------------------------------------------------- CUDA (optional)
# The CUDA runtime from the toolkit; NCCL from the torch wheel's own dependencies (NCCL_ROOT,
# default third_party/torch_cuda_deps/nccl, the link `./x setup` makes): c10d's
# ProcessGroupNCCL must be compiled against the NCCL version libtorch_cuda.so was built with.
if(FSDP_WITH_CUDA)
  if(NOT CUDAToolkit_ROOT AND EXISTS "${FSDP_SOURCE_DIR}/third_party/cuda_root/bin/nvcc")
    set(CUDAToolkit_ROOT "${FSDP_SOURCE_DIR}/third_party/cuda_root")
  endif()
  find_package(CUDAToolkit REQUIRED)  # CMake's FindCUDAToolkit: CUDA::cudart
  if(NOT FSDP_TORCH_CUDA_DEPS AND EXISTS "${FSDP_SOURCE_DIR}/third_party/torch_cuda_deps/nccl/include/nccl.h")
    file(REAL_PATH "${FSDP_SOURCE_DIR}/third_party/torch_cuda_deps" FSDP_TORCH_CUDA_DEPS)
  endif()
  set(FSDP_TORCH_CUDA_DEPS "${FSDP_TORCH_CUDA_DEPS}" CACHE PATH
      "The torch wheel's CUDA dependencies: the nvidia directory of an install of torch with its dependencies")
  if(NOT EXISTS "${FSDP_TORCH_CUDA_DEPS}/nccl/include/nccl.h")
    message(FATAL_ERROR "FSDP_WITH_CUDA=ON needs the torch wheel's NCCL: set FSDP_TORCH_CUDA_DEPS to the nvidia "
                        "directory of an install of torch with its dependencies (found: '${FSDP_TORCH_CUDA_DEPS}')")
  endif()
  message(STATUS "FSDP_WITH_CUDA: CUDA ${CUDAToolkit_VERSION} (${CUDAToolkit_LIBRARY_DIR}), "
                 "the wheel's CUDA dependencies ${FSDP_TORCH_CUDA_DEPS}")
  add_library(fsdp_cudart INTERFACE)
  target_link_libraries(fsdp_cudart INTERFACE CUDA::cudart)
  # Every translation unit (Bazel's --config=cuda defines it only in the targets with CUDA-only
  # code, their local_defines, so that the rest keeps its cached compiles).
  add_compile_definitions(FSDP_WITH_CUDA=1)
endif()

# ---------------------------------------------------------------- LibTorch
# find_package(Torch) with the torch wheel's own TorchConfig.cmake. Default location: the
# link `./x setup` makes (third_party/torch_root); otherwise pass -DTorch_DIR=... or
# -DCMAKE_PREFIX_PATH="$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')".
if(NOT TARGET torch_cpu)
  if(NOT Torch_DIR AND EXISTS "${FSDP_SOURCE_DIR}/third_party/torch_root/share/cmake/Torch/TorchConfig.cmake")
    file(REAL_PATH "${FSDP_SOURCE_DIR}/third_party/torch_root/share/cmake/Torch" _fsdp_torch_dir)
    set(Torch_DIR "${_fsdp_torch_dir}" CACHE PATH "Directory of the torch wheel's TorchConfig.cmake")
  endif()
  # The pinned wheel is built with CUDA, so its Caffe2Config.cmake runs public/cuda.cmake,
  # which requires the CUDA toolkit (FATAL_ERROR without one; with one it enables the CUDA
  # language and probes nvcc). We link only torch_cpu + c10, as the Bazel build does: the
  # CUDA half of the wheel (libtorch_cuda.so, libc10_cuda.so) needs the CUDA runtime
  # libraries that `pip install --no-deps` leaves out. cuda.cmake starts with
  # `if(TARGET torch::cudart) return()` (its include guard), so an empty torch::cudart
  # skips the CUDA search and find_package(Torch) works on CPU-only machines too. Under
  # FSDP_WITH_CUDA it stands for CMake's CUDA::cudart (for c10_cuda, //device's CUDA path).
  if(NOT TARGET torch::cudart)
    add_library(torch::cudart INTERFACE IMPORTED GLOBAL)
    if(FSDP_WITH_CUDA)
      target_link_libraries(torch::cudart INTERFACE CUDA::cudart)
    endif()
  endif()
  # Kineto is linked into libtorch_cpu.so; TorchConfig looks for a separate libkineto and
  # warns "library kineto not found". Point it at where kineto is (TORCH_LIBRARIES, the only
  # user of it, is not linked here).
  if(Torch_DIR AND EXISTS "${Torch_DIR}/../../../lib/libtorch_cpu.so")
    get_filename_component(kineto_LIBRARY "${Torch_DIR}/../../../lib/libtorch_cpu.so" ABSOLUTE)
  endif()
  find_package(Torch REQUIRED CONFIG)
endif()
message(STATUS "LibTorch: ${TORCH_INSTALL_PREFIX} (torch_cpu + c10 only)")

add_library(fsdp_libtorch INTERFACE)
# torch_cpu carries include/ and USE_DISTRIBUTED / USE_C10D_GLOO; the C++ frontend
# (torch/torch.h, torch::nn, torch::optim) lives under include/torch/csrc/api/include. In the
# installed package, the LibTorch the consumer found: its `torch` target lists both
# directories (TorchConfig.cmake's TORCH_INCLUDE_DIRS); this build's path would not move.
target_include_directories(fsdp_libtorch SYSTEM INTERFACE
                           "$<BUILD_INTERFACE:${TORCH_INSTALL_PREFIX}/include/torch/csrc/api/include>"
                           "$<INSTALL_INTERFACE:$<TARGET_PROPERTY:torch,INTERFACE_INCLUDE_DIRECTORIES>>")
target_link_libraries(fsdp_libtorch INTERFACE torch_cpu c10 Threads::Threads)
target_compile_features(fsdp_libtorch INTERFACE cxx_std_20)
add_library(libtorch_fsdp::libtorch ALIAS fsdp_libtorch)

if(FSDP_WITH_CUDA)
  add_library(fsdp_c10_cuda INTERFACE)
  target_link_libraries(fsdp_c10_cuda INTERFACE c10_cuda fsdp_libtorch CUDA::cudart)
  # @libtorch//:torch_cuda: libtorch_cuda.so with c10d's ProcessGroupNCCL, the wheel's nccl.h
  # and the NCCL version the wheel pins (comm/nccl_process_group.cc static_asserts it).
  # libtorch_cuda.so finds its CUDA libraries through a DT_RPATH relative to its own
  # directory, which here has no nvidia/ beside it: executables get a DT_RPATH (not
  # DT_RUNPATH, which would not serve libtorch_cuda.so's dependencies) to the wheel's dirs.
  set(_fsdp_nccl_code "")
  file(GLOB _fsdp_torch_meta "${TORCH_INSTALL_PREFIX}/../torch-*.dist-info/METADATA")
  foreach(meta IN LISTS _fsdp_torch_meta)
    file(STRINGS "${meta}" _fsdp_nccl_pin REGEX "^Requires-Dist: nvidia-nccl-cu[0-9]+==")
    if(_fsdp_nccl_pin MATCHES "==([0-9]+)\\.([0-9]+)\\.([0-9]+)")
      math(EXPR _fsdp_nccl_code "${CMAKE_MATCH_1} * 10000 + ${CMAKE_MATCH_2} * 100 + ${CMAKE_MATCH_3}")
    endif()
  endforeach()
  add_library(fsdp_torch_cuda INTERFACE)
  target_link_libraries(fsdp_torch_cuda INTERFACE "${TORCH_INSTALL_PREFIX}/lib/libtorch_cuda.so" fsdp_c10_cuda)
  target_include_directories(fsdp_torch_cuda SYSTEM BEFORE INTERFACE "${FSDP_TORCH_CUDA_DEPS}/nccl/include")
  target_compile_definitions(fsdp_torch_cuda INTERFACE USE_C10D_NCCL)
  if(_fsdp_nccl_code)
    target_compile_definitions(fsdp_torch_cuda INTERFACE FSDP_TORCH_NCCL_VERSION_CODE=${_fsdp_nccl_code})
  endif()
  set(_fsdp_cuda_rpath "${TORCH_INSTALL_PREFIX}/lib")
  foreach(d nccl cu13 cudnn cusparselt nvshmem)
    string(APPEND _fsdp_cuda_rpath ":${FSDP_TORCH_CUDA_DEPS}/${d}/lib")
  endforeach()
  target_link_options(fsdp_torch_cuda INTERFACE "LINKER:--disable-new-dtags" "LINKER:-rpath,${_fsdp_cuda_rpath}"
                      "LINKER:-rpath-link,${_fsdp_cuda_rpath}")
endif()

# ---------------------------------------------------------------- Debian packages
# gloo headers (c10d's ProcessGroupGloo.hpp includes them; the wheel does not ship them; the
# gloo code itself is inside libtorch_cpu.so) come from libgloo-dev in /usr/include.
if(NOT EXISTS "/usr/include/gloo/config.h")
  find_path(GLOO_INCLUDE_DIR gloo/config.h)
  if(NOT GLOO_INCLUDE_DIR)
    message(FATAL_ERROR "gloo headers not found (Debian: apt-get install libgloo-dev)")
  endif()
  target_include_directories(fsdp_libtorch SYSTEM INTERFACE "${GLOO_INCLUDE_DIR}")
endif()

find_package(absl REQUIRED CONFIG)
add_library(fsdp_absl INTERFACE)
target_link_libraries(fsdp_absl INTERFACE absl::strings absl::str_format absl::synchronization
                      absl::time absl::flat_hash_map absl::flat_hash_set absl::hash absl::base)
add_library(fsdp_absl_flags INTERFACE)
target_link_libraries(fsdp_absl_flags INTERFACE absl::flags absl::flags_parse absl::flags_usage
                      absl::flags_reflection fsdp_absl)

find_package(tomlplusplus REQUIRED CONFIG)
add_library(fsdp_tomlplusplus INTERFACE)
target_link_libraries(fsdp_tomlplusplus INTERFACE tomlplusplus::tomlplusplus)
target_compile_definitions(fsdp_tomlplusplus INTERFACE TOML_HEADER_ONLY=0 TOML_SHARED_LIB=1)

if(FSDP_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(FSDP_BUILD_BENCH)
  find_package(benchmark REQUIRED CONFIG)
endif()
