// How dcp::Save / Load / AsyncSave find a model's adapter (dcp/adapter.h), in a binary that
// links the core and the FSDP2 adapter only (as an FSDP2-only program does): a plain module
// needs no adapter, an FSDP2 model finds its own, and an FSDP1 model, whose adapter is not
// linked, is a clear error naming the Bazel target to link, before anything is written.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <string>

#include "dcp/dcp.h"
#include "fsdp/common/test_models.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"
#include "testing/test_dir.h"

namespace fsdp::dcp {
namespace {

using fsdp::testing::Backend;

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

TEST(DcpAdapters, APlainModuleNeedsNoAdapter) {
  const std::string dir = fsdp::testing::NewTestPath("plain");
  torch::nn::Linear saved(3, 2), loaded(3, 2);
  torch::optim::AdamW opt(saved->parameters(), torch::optim::AdamWOptions(0.1));
  saved(at::ones({4, 3})).sum().backward();
  opt.step();
  Save(*saved, &opt, dir);
  torch::optim::AdamW opt2(loaded->parameters(), torch::optim::AdamWOptions(0.1));
  Load(*loaded, &opt2, dir);
  EXPECT_TRUE(at::equal(loaded->weight, saved->weight));
  EXPECT_TRUE(at::equal(loaded->bias, saved->bias));
  EXPECT_EQ(opt2.state().size(), 2u);
}

TEST(DcpAdapters, AnFsdp2ModelFindsItsAdapter) {
  const std::string dir = fsdp::testing::NewTestPath("fsdp2");
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    test_models::Net saved(test_models::NetOptions{}), loaded(test_models::NetOptions{});
    test_models::InitDeterministic(*saved, 3);
    test_models::InitDeterministic(*loaded, 4);
    fsdp2::fully_shard(saved.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {2})});
    fsdp2::fully_shard(loaded.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {2})});
    Save(*saved, nullptr, dir);
    Load(*loaded, nullptr, dir);
    const auto want = fsdp2::GetFullStateDict(*saved), got = fsdp2::GetFullStateDict(*loaded);
    for (const auto& item : want) EXPECT_TRUE(at::equal(got[item.key()], item.value())) << item.key();
  });
}

TEST(DcpAdapters, AModelWhoseAdapterIsNotLinkedIsAClearError) {
  const std::string dir = fsdp::testing::NewTestPath("fsdp1");
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    test_models::Net model(test_models::NetOptions{});
    fsdp1::FSDPOptions options;
    options.process_group = pg;
    fsdp1::wrap_fsdp(model.ptr(), options);
    const std::string link = ": this model is FSDP1 (wrap_fsdp): link //dcp:fsdp1";
    EXPECT_ERROR_CONTAINS(Save(*model, nullptr, dir), "dcp::Save" + link);
    EXPECT_ERROR_CONTAINS(AsyncSave(*model, nullptr, dir), "dcp::AsyncSave" + link);
    EXPECT_ERROR_CONTAINS(Load(*model, nullptr, dir), "dcp::Load" + link);
  });
  EXPECT_FALSE(Exists(dir)) << "a refused save wrote something";
}

}  // namespace
}  // namespace fsdp::dcp
