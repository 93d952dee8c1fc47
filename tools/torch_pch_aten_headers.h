// The smaller precompiled LibTorch header: ATen without torch::nn / torch::optim, for targets
// whose sources need no more (tools/cc.bzl: torch_pch = "aten"; //tools:torch_pch_aten, CMake's
// fsdp_pch_aten). GCC instantiates the headers' inline code in every TU that includes them, so
// the full header (tools/torch_pch_headers.h) costs an empty TU 4.5 s and this one 1.6 s on 2
// cores; tools/pch_tiers.py finds each target's tier.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
