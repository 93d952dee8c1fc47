// Shared by the parity tests against PyTorch itself (//tests/peer:pytorch_parity_test: its
// FSDP2 and FSDP1 files; the peer Python is testing/peer_python.h's): the
// exchange files with the peer scripts (tests/peer/fsdp{1,2}_peer.py) and the comparison of
// the trained results.
//
// One comparison: the C++ side writes the initial full parameters of the shared test model
// (fsdp/common/test_models.h) and kSteps global batches (test_models::Batch, the batches
// TrainSteps uses) to a file, the peer script trains PyTorch's FSDP on them on W processes and
// writes the full parameters and AdamW state by FQN; the C++ side trains its own FSDP on W
// Gloo ranks and compares.
#ifndef FSDP_TESTS_PEER_PEER_PARITY_H_
#define FSDP_TESTS_PEER_PEER_PARITY_H_

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <string>

#include "checkpoint/tensor_dict_file.h"
#include "optim_state/optim_state_dict.h"

namespace fsdp::peer {

inline constexpr int kSteps = 10;
inline constexpr double kLr = 1e-2;

using TensorDict = checkpoint::TensorDict;

// Runs `python tests/peer/<script> --world W --input in.pt --output out.pt <extra_args>` with
// `init`'s parameters (before any sharding) and kSteps batches as input; returns what the
// script wrote. A script that fails twice in a row fails the calling test (and returns an
// empty dict).
TensorDict RunPeer(const std::string& python, const std::string& script, int world, const torch::nn::Module& init,
                   const std::string& extra_args = "");

// Every parameter of `params` and its AdamW state in `optim` (exp_avg, exp_avg_sq, step)
// equals the peer's within AdamWParityTolerance(kSteps, kLr) x max(1, |peer value|)
// (testing/float_tolerance.h); exactly `expected_params` compared.
void ExpectMatchesPeer(const TensorDict& params, const optim_state::OptimStateDict& optim, const TensorDict& theirs,
                       int expected_params, const std::string& label);

}  // namespace fsdp::peer

#endif  // FSDP_TESTS_PEER_PEER_PARITY_H_
