// What //dcp's interop tests with the peer PyTorch (interop_test.cc with FSDP2,
// fsdp1_interop_test.cc with FSDP1) share with each other and with their scripts
// (dcp/testdata/fsdp2_interop.py holds the Python counterparts): the sin / cos weights and
// data, the data-parallel training loop, the reference file of full values under DCP keys,
// the comparison with Python's results, and running the script.
#ifndef FSDP_DCP_INTEROP_COMMON_H_
#define FSDP_DCP_INTEROP_COMMON_H_

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/tensor_dict_file.h"
#include "comm/process_group.h"
#include "optim_state/optim_state_dict.h"
#include "testing/peer_python.h"

namespace fsdp::dcp::interop {

constexpr int64_t kBatch = 12;

// The scripts' init_weights: parameter k is sin(0.7 * i + k) * 0.3 over its elements.
inline void InitWeights(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : m.parameters()) {
    p.copy_((at::sin(at::arange(p.numel(), at::kFloat) * 0.7 + k++) * 0.3).reshape(p.sizes()));
  }
}

// The scripts' batch(step): 12 rows of 4 inputs, 2 targets.
inline std::pair<at::Tensor, at::Tensor> MakeBatch(int step) {
  return {at::sin(at::arange(kBatch * 4, at::kFloat) * 0.1 + step).reshape({kBatch, 4}),
          at::cos(at::arange(kBatch * 2, at::kFloat) * 0.05 + 0.5 * step).reshape({kBatch, 2})};
}

// The scripts' train(): rank r takes rows [r * rows, (r + 1) * rows) of each step's batch
// (kBatch divides by 2 and 3, so the mean of the ranks' losses is the whole batch's); returns
// each step's mean loss over the ranks.
template <class Model>
std::vector<double> Train(Model& model, torch::optim::Optimizer& opt, const comm::ProcessGroupPtr& pg, int first,
                          int steps) {
  const int64_t rows = kBatch / pg->size(), r = pg->rank();
  std::vector<double> losses;
  for (int step = first; step < first + steps; ++step) {
    auto [x, y] = MakeBatch(step);
    const at::Tensor loss =
        torch::nn::functional::mse_loss(model(x.narrow(0, r * rows, rows)), y.narrow(0, r * rows, rows));
    loss.backward();
    opt.step();
    opt.zero_grad();
    at::Tensor total = loss.detach().clone().reshape({1});
    pg->all_reduce(total)->wait();
    losses.push_back(total.item<double>() / pg->size());
  }
  return losses;
}

inline std::string NewDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name, "_", getpid());
}

// The reference a script's `load` mode compares with: every full value under its flattened
// DCP key ("model.<fqn>", "optim.state.<fqn>.<name>", "optim.param_groups.0.lr"), for a
// torch.save-format file.
inline checkpoint::TensorDict DcpKeyedReference(const checkpoint::TensorDict& model,
                                                const optim_state::OptimStateDict& optim, double lr) {
  checkpoint::TensorDict out;
  for (const auto& item : model) out.insert("model." + item.key(), item.value());
  for (const auto& [fqn, state] : optim.state) {
    for (const auto& [name, value] : state) {
      const std::string key = absl::StrCat("optim.state.", fqn, ".", name);
      if (const auto* tensor = std::get_if<at::Tensor>(&value)) {
        out.insert(key, *tensor);
      } else {  // step: PyTorch's 0-d float32 tensor
        out.insert(key, at::scalar_tensor(static_cast<double>(std::get<int64_t>(value)), at::kFloat));
      }
    }
  }
  out.insert("optim.param_groups.0.lr", at::scalar_tensor(lr, at::kDouble));
  return out;
}

// Our losses of steps 5-9 and final full parameters against a script's `train` output
// ({"losses": float64[5], "<fqn>": tensor}): every one of Python's `num_params` parameters
// within `tol` (relative to max(1, |value|)).
inline void ExpectMatchesPython(const std::vector<double>& losses, const checkpoint::TensorDict& full,
                                const checkpoint::TensorDict& expected, int num_params, double tol) {
  const at::Tensor* want_losses = expected.find("losses");
  ASSERT_NE(want_losses, nullptr);
  ASSERT_EQ(static_cast<int64_t>(losses.size()), want_losses->numel());
  for (size_t s = 0; s < losses.size(); ++s) {
    const double want = (*want_losses)[s].item<double>();
    EXPECT_LE(std::abs(losses[s] - want), tol * std::max(1.0, std::abs(want)))
        << "step " << 5 + s << ": " << losses[s] << " vs Python's " << want;
  }
  int checked = 0;
  for (const auto& item : expected) {
    if (item.key() == "losses") continue;
    const at::Tensor* got = full.find(item.key());
    ASSERT_NE(got, nullptr) << item.key();
    const double scale = std::max(1.0, item.value().abs().max().item<double>());
    EXPECT_LE((*got - item.value()).abs().max().item<double>(), tol * scale) << item.key();
    ++checked;
  }
  EXPECT_EQ(checked, num_params);
}

// Runs a script once more when a Python rank died of a signal inside the peer runtime's own
// C++ (seen twice in some 60 runs, under load: "terminate called without an active
// exception", torch.multiprocessing reporting SIGABRT), never when the script's checks failed
// ("FAIL:"). The first attempt's output goes to stderr.
inline int RunScript(const std::string& command, std::string* output) {
  int status = fsdp::testing::RunCommand(command, output);
  if (status != 0 && absl::StrContains(*output, "terminated with signal") && !absl::StrContains(*output, "FAIL:")) {
    std::cerr << "the peer PyTorch crashed; running the script again. Its output:\n" << *output << "\n";
    output->clear();
    status = fsdp::testing::RunCommand(command, output);
  }
  return status;
}

}  // namespace fsdp::dcp::interop

#endif  // FSDP_DCP_INTEROP_COMMON_H_
