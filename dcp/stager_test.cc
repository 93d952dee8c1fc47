// The staging buffers of async saves (dcp/stager.h): reused across saves, each save a
// snapshot; async staging after the save returns and before the wait; reused plans; and on a
// GPU, CUDA parameters staged into pinned buffers on a side stream.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "dcp/dcp_test_trainees.h"
#include "dcp/dict_state_testing.h"
#include "dcp/stager.h"
#include "device/stream.h"

namespace fsdp::dcp {
namespace {

// The parameters' values each rank-0 save holds, loaded back.
std::vector<at::Tensor> LoadedParameters(const std::string& dir) {
  std::vector<at::Tensor> loaded;
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 99);
    Load(*t.module, t.opt.get(), dir);
    if (pg->rank() == 0) {
      for (const at::Tensor& p : t.module->parameters()) loaded.push_back(p.detach().clone());
    }
  });
  return loaded;
}

// Reused staging buffers (dcp/stager.h): allocated once, each save a snapshot of the moment it
// was called although training changes the model while the previous save may still write.
TEST(Stager, ReusesItsBuffersAndEachSaveHoldsItsOwnSnapshot) {
  const std::string root = NewDir("stager");
  std::vector<std::vector<at::Tensor>> saved(3);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    auto stager = std::make_shared<Stager>(StagerOptions{.pin_memory = false});
    SaveOptions options;
    options.stager = stager;
    std::vector<AsyncSaveHandle> handles;
    for (int i = 0; i < 3; ++i) {
      Train(t, i, 1);
      if (pg->rank() == 0) {
        for (const at::Tensor& p : t.module->parameters()) saved[i].push_back(p.detach().clone());
      }
      handles.push_back(AsyncSave(*t.module, t.opt.get(), root + "/save" + std::to_string(i), options));
    }
    for (AsyncSaveHandle& h : handles) h.wait();
    EXPECT_EQ(stager->allocations(), 1);
    EXPECT_GT(stager->staged_bytes(), 0);
    EXPECT_FALSE(stager->pinned());  // asked not to (and no CUDA here)
  });
  for (int i = 0; i < 3; ++i) {
    const std::vector<at::Tensor> params = LoadedParameters(root + "/save" + std::to_string(i));
    ASSERT_EQ(params.size(), saved[i].size());
    for (size_t p = 0; p < params.size(); ++p) EXPECT_TRUE(at::equal(params[p], saved[i][p])) << "save " << i;
  }
}

// Async staging (PyTorch's use_async_staging, torchtitan's async_with_pinned_mem): the copy
// into the buffers runs on the staging stream after AsyncSave returned. Each rank's stream is
// held shut by a gate, so the save provably returns before its copy, and the copy provably
// runs after what the host does next: with WaitForStaging first the checkpoint holds the
// values at the save; changing the parameters before it (what the optimizer step would do
// without maybe_wait_for_staging) changes the checkpoint. A copy that fails (a stream whose
// earlier work failed) fails WaitForStaging and the save on every rank.
TEST(Stager, AsyncStagingCopiesAfterTheSaveReturnsAndBeforeTheWait) {
  const std::string root = NewDir("stager_async");
  std::vector<at::Tensor> at_save, changed;
  for (const bool wait_first : {true, false}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
      Trainee t = Build(W(2), pg, 11);
      Train(t, 0, 1);
      const device::StreamPtr stream =
          device::NewAsyncCpuStream("test staging", comm::kDefaultTimeout, std::chrono::microseconds(0));
      std::promise<void> open;
      std::shared_future<void> gate = open.get_future().share();
      stream->Launch([gate] { gate.wait(); });
      auto stager =
          std::make_shared<Stager>(StagerOptions{.pin_memory = false, .async_staging = true, .stream = stream});
      SaveOptions options;
      options.stager = stager;
      if (pg->rank() == 0 && wait_first) {
        for (const at::Tensor& p : t.module->parameters()) at_save.push_back(p.detach().clone());
      }
      AsyncSaveHandle handle =
          AsyncSave(*t.module, t.opt.get(), root + (wait_first ? "/waited" : "/not_waited"), options);
      EXPECT_FALSE(handle.done());  // its writer waits for the copy behind the gate
      if (wait_first) {
        open.set_value();
        stager->WaitForStaging();
      }
      {
        torch::NoGradGuard no_grad;
        for (const at::Tensor& p : t.module->parameters()) p.add_(1.0);
      }
      if (pg->rank() == 0 && !wait_first) {
        for (const at::Tensor& p : t.module->parameters()) changed.push_back(p.detach().clone());
      }
      if (!wait_first) open.set_value();
      handle.wait();
    });
  }
  const std::vector<at::Tensor> waited = LoadedParameters(root + "/waited");
  const std::vector<at::Tensor> not_waited = LoadedParameters(root + "/not_waited");
  ASSERT_EQ(waited.size(), at_save.size());
  ASSERT_EQ(not_waited.size(), changed.size());
  for (size_t i = 0; i < waited.size(); ++i) {
    EXPECT_TRUE(at::equal(waited[i], at_save[i])) << i;
    EXPECT_TRUE(at::equal(not_waited[i], changed[i])) << i;
  }

  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    const device::StreamPtr stream =
        device::NewAsyncCpuStream("test staging", comm::kDefaultTimeout, std::chrono::microseconds(0));
    if (pg->rank() == 0) stream->Launch([] { TORCH_CHECK(false, "injected staging failure"); });
    auto stager = std::make_shared<Stager>(StagerOptions{.pin_memory = false, .async_staging = true, .stream = stream});
    SaveOptions options;
    options.stager = stager;
    AsyncSaveHandle handle = AsyncSave(*t.module, t.opt.get(), root + "/failed", options);
    if (pg->rank() == 0) EXPECT_ERROR_CONTAINS(stager->WaitForStaging(), "injected staging failure");
    EXPECT_ERROR_CONTAINS(handle.wait(), "injected staging failure");
  });
}

// A stager reuses the last save's plan and fragment only while nothing changed on any rank: a
// value whose encoding grows (the fragment changes), then the optimizer joining (the plan
// changes), each async save's metadata equals a synchronous save's of the same state, and the
// value loads back.
TEST(Stager, ReusedPlansFollowChangesOfTheState) {
  const std::string root = NewDir("stager_plans");
  const std::vector<std::string> notes = {"a", "a", std::string(300, 'b'), std::string(300, 'b')};
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    Train(t, 0, 1);
    auto stager = std::make_shared<Stager>(StagerOptions{.pin_memory = false});
    for (size_t i = 0; i < notes.size(); ++i) {
      DictState state({{"note", notes[i]}, {"rank_count", int64_t{pg->size()}}});
      SaveOptions options;
      options.stateful = {{"extra", &state}};
      const torch::optim::Optimizer* optimizer = i < 3 ? nullptr : t.opt.get();
      const std::string dir = root + "/async" + std::to_string(i), sync = root + "/sync" + std::to_string(i);
      Save(*t.module, optimizer, sync, options);
      options.stager = stager;
      AsyncSave(*t.module, optimizer, dir, options).wait();
      if (pg->rank() == 0) {
        EXPECT_EQ(checkpoint::ReadMetadata(dir).entries, checkpoint::ReadMetadata(sync).entries) << "save " << i;
      }
      DictState probe({{"note", std::string()}, {"rank_count", int64_t{0}}});
      Load(*t.module, nullptr, dir, {.stateful = {{"extra", &probe}}});
      EXPECT_EQ(probe.state.at("note").toStringRef(), notes[i]) << "save " << i;
    }
  });
}

// On a GPU (torchtitan's async_with_pinned_mem there): a model's CUDA parameters staged into
// pinned buffers by a copy on a side stream. The parameters change on the current stream just
// before the save (the staging stream must wait for that work) and again after
// WaitForStaging (the copy must be done): the checkpoint holds exactly the values between.
TEST(Stager, CudaParametersStageIntoPinnedBuffersOnASideStream) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA device (a --config=cuda or FSDP_WITH_CUDA build on a GPU host)";
  const std::string dir = NewDir("stager_cuda");
  const c10::Device cuda(c10::kCUDA, 0);
  torch::nn::Linear model(torch::nn::LinearOptions(256, 512));
  model->to(cuda);
  auto stager = std::make_shared<Stager>(StagerOptions{.pin_memory = true, .async_staging = true});
  SaveOptions options;
  options.stager = stager;
  std::vector<at::Tensor> at_save;
  {
    torch::NoGradGuard no_grad;
    for (const at::Tensor& p : model->parameters()) p.mul_(3.0).add_(1.0);  // queued on the current stream
    for (const at::Tensor& p : model->parameters()) at_save.push_back(p.cpu().clone());
  }
  AsyncSaveHandle handle = AsyncSave(*model, nullptr, dir, options);
  EXPECT_TRUE(stager->pinned());
  stager->WaitForStaging();
  {
    torch::NoGradGuard no_grad;
    for (const at::Tensor& p : model->parameters()) p.zero_();
  }
  handle.wait();
  torch::nn::Linear loaded(torch::nn::LinearOptions(256, 512));
  Load(*loaded, nullptr, dir);
  const std::vector<at::Tensor> params = loaded->parameters();
  ASSERT_EQ(params.size(), at_save.size());
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], at_save[i])) << i;
}

}  // namespace
}  // namespace fsdp::dcp
