// The LibTorch headers precompiled once per build configuration and force-included in every
// C++ target that depends on LibTorch: by Bazel (tools/cc.bzl, target //tools:torch_pch) and
// by CMake (cmake/FsdpTargets.cmake, target fsdp_pch). They are most of a TU's compile time
// (docs/development/building.md); keep the list to headers most TUs include anyway.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
