// The LibTorch headers precompiled once per build configuration and force-included in every
// C++ target that depends on LibTorch: by Bazel (tools/cc.bzl, target //tools:torch_pch) and
// by CMake (cmake/FsdpTargets.cmake, target fsdp_pch). They cost ~4-8 s of each ~8-12 s
// compile on 2 cores; keep the list to headers most TUs include anyway.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
