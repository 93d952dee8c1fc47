// //dcp with PyTorch's own FSDP2 (the peer PyTorch 2.15, FSDP_PEER_PYTHON; skipped with the
// reason without it), through dcp/testdata/fsdp2_interop.py:
//  * our fully_shard at W=4 saves model + AdamW; Python's fully_shard at W=2 dcp.loads it
//    with get/set_model_state_dict and get/set_optimizer_state_dict, and every full tensor
//    equals what C++ wrote with SaveFullStateDict; the .metadata keys equal Python's own;
//  * Python's FSDP2 trains 5 steps at W=2 and dcp.saves, then 5 more; we load at W=3, train
//    the same 5 steps on the same data and match Python's losses and parameters.
//  * both ways, a training loop's step rides along as extra state ("train.step" here,
//    {"train": {"step": t}} in Python).
// The model (InteropNet) and data are sin / cos formulas, the same on both sides.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dcp/dcp.h"
#include "dcp/dict_state_testing.h"
#include "dcp/hf.h"
#include "dcp/interop_common.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "optim_state/fsdp2_optim_state.h"
#include "testing/multi_rank.h"
#include "testing/peer_python.h"

namespace fsdp::dcp {
namespace {

using fsdp::testing::Backend;
using fsdp::testing::PeerPython;
using interop::DcpKeyedReference;  // the helpers shared with fsdp1_interop_test.cc
using interop::ExpectMatchesPython;
using interop::InitWeights;
using interop::NewDir;
using interop::RunScript;
using interop::Train;

// dcp/testdata/fsdp2_interop.py's InteropNet, with the same FQNs.
struct InteropNetImpl : torch::nn::Module {
  InteropNetImpl()
      : fc0(register_module("fc0", Hooked<torch::nn::LinearImpl>(4, 8))),
        fc1(register_module("fc1", Hooked<torch::nn::LinearImpl>(8, 8))),
        fc2(register_module("fc2", Hooked<torch::nn::LinearImpl>(8, 2))),
        scale(register_buffer("scale", at::tensor({1.0f, 0.5f}))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(at::relu(fc1(at::relu(fc0(x))))) * scale; }
  Hooked<torch::nn::LinearImpl> fc0, fc1, fc2;
  at::Tensor scale;
};
using InteropNet = Hooked<InteropNetImpl>;

struct Trainee {
  InteropNet model;
  std::unique_ptr<torch::optim::AdamW> opt;
};

Trainee Build(const comm::ProcessGroupPtr& pg, double lr) {
  Trainee t{InteropNet(), nullptr};
  InitWeights(*t.model);
  auto mesh = mesh::DeviceMesh::Create(pg, {pg->size()});
  fsdp2::fully_shard(t.model->fc0.ptr(), {.mesh = mesh});
  fsdp2::fully_shard(t.model->fc1.ptr(), {.mesh = mesh});
  fsdp2::fully_shard(t.model.ptr(), {.mesh = mesh});
  t.opt = std::make_unique<torch::optim::AdamW>(t.model->parameters(), torch::optim::AdamWOptions(lr));
  return t;
}

constexpr char kScript[] = "dcp/testdata/fsdp2_interop.py";

// fsdp2_interop.py's train_state(step): every kind of leaf, nested.
StateDict TrainState(int64_t step) {
  StateDict s;
  s.emplace("step", at::scalar_tensor(step, at::kLong));  // torch.tensor(step): 0-d
  s.emplace("epoch", step);
  s.emplace("name", "python " + std::to_string(step));
  c10::impl::GenericList lrs(c10::FloatType::get());
  lrs.push_back(0.1 * static_cast<double>(step));
  s.emplace("lrs", lrs);
  s.emplace("done", step > 0);
  c10::impl::GenericDict loader(c10::StringType::get(), c10::AnyType::get());
  loader.insert("windows", 10 * step);
  c10::impl::GenericList rng(c10::TensorType::get());
  rng.push_back(at::arange(3, at::kFloat) * static_cast<double>(step));
  loader.insert("rng", rng);
  s.emplace("loader", loader);
  return s;
}

constexpr double kLr = 1e-2;

TEST(DcpInterop, SavedByOurFsdp2AtFourLoadsIntoPytorchFsdp2AtTwo) {
  std::string why_not;
  const std::string python = PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const std::string dir = NewDir("cpp_w4"), ref = dir + "_ref.pt";
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(pg, kLr);
    Train(t.model, *t.opt, pg, 0, 3);
    // Python reads it into {"train": {"step": t, "epoch": 0, ...}} (fsdp2_interop.py's TRAIN).
    DictState train(TrainState(3));
    SaveOptions options;
    options.stateful = {{"train", &train}};
    Save(*t.model, t.opt.get(), dir, options);
    // The reference: every full value under its flattened DCP key, as a torch.save file.
    const fsdp2::FullStateDict model = fsdp2::GetFullStateDict(*t.model);
    const optim_state::OptimStateDict optim = optim_state::GetFullOptimStateDict(*t.model, *t.opt);
    if (pg->rank() == 0) fsdp2::SaveFullStateDict(DcpKeyedReference(model, optim, kLr), ref);
  });
  std::string output;
  const int status = RunScript(absl::StrCat(python, " ", kScript, " load ", dir, " ", ref), &output);
  EXPECT_EQ(status, 0) << output;
  EXPECT_TRUE(absl::StrContains(output, "OK")) << output;
}

TEST(DcpInterop, SavedByPytorchFsdp2AtTwoContinuesHereAtThree) {
  std::string why_not;
  const std::string python = PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const std::string dir = NewDir("py_w2"), out = dir + "_after.pt";
  std::string output;
  const int status = RunScript(absl::StrCat(python, " ", kScript, " train ", dir, " ", out), &output);
  ASSERT_EQ(status, 0) << output;
  ASSERT_TRUE(absl::StrContains(output, "SAVED")) << output;
  const fsdp2::FullStateDict expected = fsdp2::LoadFullStateDictFile(out);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(pg, /*lr=*/0.5);  // the checkpoint's lr (1e-2) must replace it
    {
      at::NoGradGuard no_grad;
      for (auto& p : t.model->parameters()) p.zero_();
    }
    LoadOptions options;
    DictState train(TrainState(-1));
    options.stateful = {{"train", &train}};
    Load(*t.model, t.opt.get(), dir, options);
    // What Python's Stateful returned (fsdp2_interop.py's TRAIN at step 5).
    EXPECT_EQ(train.loads, 1);
    EXPECT_EQ(train.state.at("step").toTensor().item<int64_t>(), 5);
    EXPECT_EQ(train.state.at("epoch").toInt(), 5);
    EXPECT_EQ(train.state.at("name").toStringRef(), "python 5");
    EXPECT_EQ(train.state.at("lrs").toListRef().at(0).toDouble(), 0.5);
    EXPECT_TRUE(train.state.at("done").toBool());
    const c10::impl::GenericDict loader = train.state.at("loader").toGenericDict();
    EXPECT_EQ(loader.at("windows").toInt(), 50);
    EXPECT_EQ(train.state.at("step").toTensor().dim(), 0);
    EXPECT_TRUE(at::equal(loader.at("rng").toListRef().at(0).toTensor(), at::arange(3, at::kFloat) * 5));
    const std::vector<double> losses = Train(t.model, *t.opt, pg, 5, 5);
    // f32 rounding of another row split and AdamW's formulas (lerp vs mul + add) over 5 steps: a
    // few float32 ulps (2^-23) of a step per step; 1e-5 (~80 ulps at scale 1) is 1000x below a step (lr 1e-2).
    ExpectMatchesPython(losses, fsdp2::GetFullStateDict(*t.model), expected, 6, /*tol=*/1e-5);
  });
}

// Hugging Face checkpoints (dcp/hf.h) with PyTorch's HuggingFaceStorageReader / Writer,
// safetensors and huggingface_hub (dcp/testdata/hf_interop.py).
constexpr char kHfScript[] = "dcp/testdata/hf_interop.py";

// The peer Python when it has safetensors and huggingface_hub (transformers' dependencies),
// else "" with the reason.
std::string HfPeerPython(std::string* why_not) {
  const std::string python = PeerPython(why_not);
  if (python.empty()) return python;
  std::string output;
  if (fsdp::testing::RunCommand(absl::StrCat(python, " -c 'import safetensors, huggingface_hub'"), &output) != 0) {
    *why_not = absl::StrCat("safetensors or huggingface_hub is not importable by ", python,
                            " (./x setup installs transformers, which brings both): ", output);
    return "";
  }
  return python;
}

TEST(HfInterop, OurExportIsWhatSafetensorsAndHuggingFaceHubWriteAndPytorchReadsIt) {
  std::string why_not;
  const std::string python = HfPeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const std::string f32 = NewDir("hf_export_f32"), bf16 = NewDir("hf_export_bf16");
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(pg, kLr);
    SaveHuggingFace(*t.model, f32, {.max_shard_size = 200});
    SaveHuggingFace(*t.model, bf16, {.dtype = at::kBFloat16, .max_shard_size = 100});
  });
  for (const auto& [dir, args] : {std::pair{f32, "200 float32"}, std::pair{bf16, "100 bfloat16"}}) {
    std::string output;
    const int status = RunScript(absl::StrCat(python, " ", kHfScript, " check ", dir, " ", args), &output);
    EXPECT_EQ(status, 0) << output;
    EXPECT_TRUE(absl::StrContains(output, "OK")) << output;
  }
}

TEST(HfInterop, PytorchsHuggingFaceWriterAtTwoLoadsHereAtThree) {
  std::string why_not;
  const std::string python = HfPeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const std::string dir = NewDir("hf_from_pytorch"), again = NewDir("hf_consolidated_here");
  std::string output;
  const int status = RunScript(absl::StrCat(python, " ", kHfScript, " save ", dir), &output);
  ASSERT_EQ(status, 0) << output;
  ASSERT_TRUE(absl::StrContains(output, "SAVED")) << output;
  InteropNet reference;
  InitWeights(*reference);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    // PyTorch's consolidated files, its per-rank files, and those consolidated here.
    ConsolidateHuggingFace(dir + "/sharded", again, {}, pg);
    for (const std::string& from : {dir, dir + "/sharded", again}) {
      Trainee t = Build(pg, kLr);
      {
        at::NoGradGuard no_grad;
        for (auto& p : t.model->parameters()) p.zero_();
      }
      LoadHuggingFace(*t.model, from);
      const fsdp2::FullStateDict full = fsdp2::GetFullStateDict(*t.model);
      for (const auto& p : reference->named_parameters()) {
        EXPECT_TRUE(at::equal(full[p.key()], p.value())) << from << ": " << p.key();
      }
    }
  });
}

}  // namespace
}  // namespace fsdp::dcp
