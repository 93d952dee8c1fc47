// A model 8x larger than what one rank may allocate: each rank's CPU allocations are capped
// at 1/8 of the model's parameter bytes (testing::ScopedAllocationCounter::set_limit, so an
// allocation past it throws as an out-of-memory would). The model is built on the meta device
// block by block, fully_shard'ed over 32 threaded ranks, initialized one module at a time
// (InitMetaParameters), trained one SGD step, saved as a DCP checkpoint, and reloaded into a
// model built the same way at another world size (16), whose shards must equal the
// single-rank reference after the same step. And a float32 Hugging Face checkpoint of the
// same size loads into a bfloat16 meta-device model at W=8 and exports (dcp/hf.h).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/dcp_storage.h"
#include "checkpoint/file_io.h"
#include "checkpoint/hf_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "dcp/dcp.h"
#include "dcp/hf.h"
#include "fsdp/common/test_models.h"
#include "fsdp/fsdp2/fsdp_param.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/meta_init.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/meta/meta.h"
#include "testing/allocation_counter.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::dcp {
namespace {

using fsdp::testing::Backend;
using fsdp::testing::ScopedAllocationCounter;

constexpr int64_t kDim = 256;
constexpr int64_t kBlocks = 64;
constexpr uint64_t kSeed = 3;
constexpr double kLargeModelLr = 0.01;
constexpr int64_t kParamBytes = kBlocks * (kDim * kDim + kDim) * 4;
constexpr int64_t kRankLimit = kParamBytes / 8;
constexpr int kSaveWorld = 32;
// Rank 0 is DCP's coordinator: while it writes `.metadata` it holds every rank's fragment of
// it (about 380 B per stored chunk as gathered; 2 tensors x kBlocks x kSaveWorld chunks here),
// as PyTorch's coordinator holds every rank's SavePlan. That grows with the number of chunks,
// not with the model's bytes: with this test's tiny 4 KB shards it is ~10% of the model.
constexpr int64_t kCoordinatorBytes = 2 * kBlocks * kSaveWorld * 400;

struct ResidualImpl : torch::nn::Module {
  ResidualImpl() : fc(register_module("fc", torch::nn::Linear(kDim, kDim))) {}
  at::Tensor forward(const at::Tensor& x) { return x + at::tanh(fc(x)); }
  torch::nn::Linear fc;
};
using Residual = fsdp::Hooked<ResidualImpl>;

struct StackImpl : torch::nn::Module {
  // Each block is moved to the meta device as soon as it is built (meta = true), so building
  // never holds more than one block.
  explicit StackImpl(bool meta) {
    for (int64_t i = 0; i < kBlocks; ++i) {
      blocks.push_back(register_module(absl::StrCat("b", i), meta ? MakeOnMeta<Residual>() : Residual()));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = b(x);
    return x;
  }
  std::vector<Residual> blocks;
};
using Stack = fsdp::Hooked<StackImpl>;

Stack ShardedMetaStack(const comm::ProcessGroupPtr& pg) {
  Stack model(/*meta=*/true);
  auto mesh = mesh::DeviceMesh::Create(pg, {pg->size()});
  for (auto& b : model->blocks) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
  fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
  return model;
}

// Rank r's input row of the global batch of `world` rows.
at::Tensor InputRow(int rank, int world) { return test_models::Batch(0, world, kDim, 7).narrow(0, rank, 1); }

// The largest difference between this rank's shards and the reference's rows of them (no
// rank gathers a whole tensor).
double MaxShardDifference(torch::nn::Module& model, const torch::nn::Module& reference) {
  const auto want = reference.named_parameters();
  double diff = 0;
  for (const fsdp2::NamedParameter& p : fsdp2::NamedParameters(model)) {
    TORCH_CHECK(p.fsdp_param != nullptr, p.fqn, " is not sharded");
    const at::Tensor expected = fsdp2::LocalShardOf(*p.fsdp_param, want[p.fqn]);
    TORCH_CHECK(p.param.sizes() == expected.sizes(), p.fqn, ": ", p.param.sizes(), " vs ", expected.sizes());
    if (p.param.numel() > 0) diff = std::max(diff, (p.param - expected).abs().max().item<double>());
  }
  return diff;
}

// GPT-like small weights: 128 residual layers stay well conditioned.
std::function<void(torch::nn::Module&)> Init() { return test_models::SeededModuleInit(kSeed, 0.02); }

std::string CheckpointDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/large_model_dcp_", getpid());
}

TEST(LargeModel, TheAllocationLimitThrowsLikeAnOutOfMemory) {
  ScopedAllocationCounter counter;
  counter.set_limit(1000);
  at::Tensor small = at::empty({100}, at::kFloat);
  EXPECT_ERROR_CONTAINS(at::empty({1000}, at::kFloat), "would exceed this thread's limit of 1000 bytes");
  EXPECT_LE(counter.peak(), 1000);
}

TEST(LargeModel, TheModelDoesNotFitARankWithoutTheMetaDevice) {
  ScopedAllocationCounter counter;
  counter.set_limit(kRankLimit);
  EXPECT_ERROR_CONTAINS(Stack(/*meta=*/false), "would exceed this thread's limit");
  EXPECT_LE(counter.peak(), kRankLimit);
}

TEST(LargeModel, EightTimesARanksMemoryBuildsTrainsSavesAndReloadsAtAnotherWorldSize) {
  // 16: a load reads in place (the shards + one read block), so 1/16 of the model fits the
  // 1/8 limit (an all-or-nothing load, staging every shard, would hold 2/16: the limit).
  constexpr int kLoadWorld = 16;
  // The single-rank reference (unlimited): the same init, one SGD step on the whole batch.
  Stack reference(/*meta=*/false);
  test_models::InitEveryModule(*reference, Init());
  {
    torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(kLargeModelLr));
    reference(test_models::Batch(0, kSaveWorld, kDim, 7)).mean().backward();
    opt.step();
  }
  const std::string dir = CheckpointDir();
  ScopedAllocationCounter::Install();  // before the rank threads allocate
  std::vector<int64_t> peaks(kSaveWorld, 0);
  std::vector<double> step_diff(kSaveWorld, 0);

  fsdp::testing::RunOnRanks(Backend::kThreaded, kSaveWorld, [&](const comm::ProcessGroupPtr& pg) {
    ScopedAllocationCounter counter;
    counter.set_limit(pg->rank() == 0 ? kRankLimit + kCoordinatorBytes : kRankLimit);
    Stack model = ShardedMetaStack(pg);
    fsdp2::InitMetaParameters(*model, Init());
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLargeModelLr));
    model(InputRow(pg->rank(), kSaveWorld)).mean().backward();
    opt.step();
    opt.zero_grad();
    step_diff[pg->rank()] = MaxShardDifference(*model, *reference);
    Save(*model, &opt, dir);
    peaks[pg->rank()] = counter.peak();
  });
  // One step of sliced vs whole-batch gradient sums: a few float32 ulps (2^-23); 1e-6 is 8 ulps at scale 1.
  for (int r = 0; r < kSaveWorld; ++r) EXPECT_LT(step_diff[r], 1e-6) << "after the step, rank " << r;
  std::cout << "parameters " << kParamBytes << " B, per-rank limit " << kRankLimit << " B (rank 0: +"
            << kCoordinatorBytes << "), peak at W=" << kSaveWorld << " (build, init, step, save): rank 0 " << peaks[0]
            << " B, others " << *std::max_element(peaks.begin() + 1, peaks.end()) << " B\n";

  std::vector<double> load_diff(kLoadWorld, 0);
  fsdp::testing::RunOnRanks(Backend::kThreaded, kLoadWorld, [&](const comm::ProcessGroupPtr& pg) {
    ScopedAllocationCounter counter;
    counter.set_limit(kRankLimit);
    Stack model = ShardedMetaStack(pg);
    Load(*model, nullptr, dir);
    load_diff[pg->rank()] = MaxShardDifference(*model, *reference);
    // It runs (forward only: a step's gradients would not fit at this world size).
    at::NoGradGuard no_grad;
    EXPECT_EQ(model(InputRow(pg->rank(), kLoadWorld)).sizes().vec(), (std::vector<int64_t>{1, kDim}));
    peaks[pg->rank()] = counter.peak();
  });
  for (int r = 0; r < kLoadWorld; ++r) EXPECT_LT(load_diff[r], 1e-6) << "after the load, rank " << r;
  std::cout << "peak at W=" << kLoadWorld
            << " (build, load, forward): " << *std::max_element(peaks.begin(), peaks.begin() + kLoadWorld) << " B\n";
}

// A load reads straight into the shards and the optimizer's state: beyond them it holds one
// read block. LoadOptions::all_or_nothing stages the whole local state first.
TEST(LargeModel, ALoadInPlaceHoldsOneReadBlockBeyondTheState) {
  constexpr int kWorld = 4;
  constexpr int64_t kLocalState = 2 * kParamBytes / kWorld;  // parameters + SGD momentum
  const std::string dir = CheckpointDir() + "_in_place";
  ScopedAllocationCounter::Install();
  for (bool all_or_nothing : {false, true}) {
    std::vector<int64_t> peaks(kWorld, 0);
    fsdp::testing::RunOnRanks(Backend::kThreaded, kWorld, [&](const comm::ProcessGroupPtr& pg) {
      Stack model = ShardedMetaStack(pg);
      fsdp2::InitMetaParameters(*model, Init());
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLargeModelLr).momentum(0.9));
      model(InputRow(pg->rank(), kWorld)).mean().backward();
      opt.step();
      opt.zero_grad();
      if (!all_or_nothing) Save(*model, &opt, dir);
      ScopedAllocationCounter counter;
      Load(*model, &opt, dir, {.all_or_nothing = all_or_nothing});
      peaks[pg->rank()] = counter.peak();
    });
    const int64_t peak = *std::max_element(peaks.begin(), peaks.end());
    std::cout << (all_or_nothing ? "all or nothing" : "in place") << ": load peak " << peak << " B, local state "
              << kLocalState << " B\n";
    if (all_or_nothing) {
      EXPECT_GE(peak, kLocalState);
    } else {
      EXPECT_LE(peak, checkpoint::DcpReader::kBlockBytes + 64 * 1024);
    }
  }
}

// A float32 Hugging Face checkpoint 8x a rank's allowance, loaded for bfloat16 training at
// W=8 into a meta-device model (each rank's shards: half the allowance), then exported in
// Hugging Face's layout: each rank holds its shards plus bounded blocks, never a whole tensor
// (the largest, a 256 KB weight, is 1/8 of the allowance; the model 8x).
TEST(LargeModel, AHuggingFaceCheckpointEightTimesARanksMemoryLoadsAndExportsAtEight) {
  constexpr int kWorld = 8;
  Stack reference(/*meta=*/false);
  test_models::InitEveryModule(*reference, Init());
  const std::string in = CheckpointDir() + "_hf_in", out = CheckpointDir() + "_hf_out";
  {  // four files and an index, written with the safetensors writer alone
    std::filesystem::create_directories(in);
    std::vector<checkpoint::TensorDict> files(4);
    std::string weight_map;
    size_t i = 0;
    for (const auto& p : reference->named_parameters()) {
      const size_t f = i++ * files.size() / (2 * kBlocks);
      files[f].insert(p.key(), p.value().detach());
      absl::StrAppend(&weight_map, weight_map.empty() ? "" : ", ", "\"", p.key(), "\": \"part", f, ".safetensors\"");
    }
    for (size_t f = 0; f < files.size(); ++f) {
      checkpoint::SaveSafetensors(absl::StrCat(in, "/part", f, ".safetensors"), files[f]);
    }
    const std::string index = absl::StrCat("{\"weight_map\": {", weight_map, "}}");
    checkpoint::WriteFileAtomically(absl::StrCat(in, "/", checkpoint::kHfIndexFile),
                                    std::vector<char>(index.begin(), index.end()), "test");
  }
  ScopedAllocationCounter::Install();
  std::vector<int64_t> peaks(kWorld, 0);
  std::vector<int> mismatches(kWorld, 0);
  fsdp::testing::RunOnRanks(Backend::kThreaded, kWorld, [&](const comm::ProcessGroupPtr& pg) {
    ScopedAllocationCounter counter;
    counter.set_limit(kRankLimit);
    Stack model(/*meta=*/true);
    model->to(at::kBFloat16);
    auto mesh = mesh::DeviceMesh::Create(pg, {pg->size()});
    for (auto& b : model->blocks) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
    LoadHuggingFace(*model, in);
    const auto want = reference->named_parameters();
    for (const fsdp2::NamedParameter& p : fsdp2::NamedParameters(*model)) {
      const at::Tensor expected = fsdp2::LocalShardOf(*p.fsdp_param, want[p.fqn]).to(at::kBFloat16);
      if (!at::equal(p.param, expected)) ++mismatches[pg->rank()];
    }
    SaveHuggingFace(*model, out, {.max_shard_size = kParamBytes / 8});
    peaks[pg->rank()] = counter.peak();
  });
  for (int r = 0; r < kWorld; ++r)
    EXPECT_EQ(mismatches[r], 0) << "rank " << r << " loaded shards unlike tensor.to(bf16)";
  std::cout << "Hugging Face checkpoint " << kParamBytes << " B (float32), per-rank limit " << kRankLimit
            << " B, peak at W=" << kWorld << " (build, load, export): " << *std::max_element(peaks.begin(), peaks.end())
            << " B\n";
  // The export: bfloat16, as the model holds it, every tensor equal to the reference's.
  const checkpoint::HfCheckpointReader exported(out);
  EXPECT_GE(exported.files().size(), 4u);
  for (const auto& p : reference->named_parameters()) {
    const checkpoint::HfTensor* t = exported.Find(p.key());
    ASSERT_NE(t, nullptr) << p.key();
    at::Tensor got = at::empty(t->size, t->dtype);
    exported.ReadInto(p.key(), std::vector<int64_t>(t->size.size(), 0), got);
    EXPECT_TRUE(at::equal(got, p.value().to(at::kBFloat16))) << p.key();
  }
}

}  // namespace
}  // namespace fsdp::dcp
