// Hugging Face checkpoints of sharded models (dcp/hf.h): a directory of bf16 safetensors
// written straight from a reference Net loads into FSDP2 on 1-D, HSDP, FSDP + TP and SPMD
// meshes and into FSDP1 at W=3 (tied weights; several boxes of a tensor per rank) as
// tensor.to(float32) of the reference, bitwise; the export of those models is, file by file,
// the bytes safetensors writes for the reference converted to bf16 (AsyncSaveHuggingFace: as
// they were at the call); missing, unexpected and mis-shaped keys fail every rank before
// anything changes. (The model 8x a rank's allowance is in large_model_test.cc.)
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/file_io.h"
#include "checkpoint/hf_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "dcp/dcp_test_trainees.h"
#include "dcp/hf.h"
#include "fsdp/common/test_models.h"
#include "fsdp/fsdp1/fsdp_state.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp1/state_dict.h"
#include "testing/allocation_counter.h"

namespace fsdp::dcp {
namespace {

// The reference's tensors as a Hugging Face directory of two bf16 files and an index, written
// with the safetensors writer alone (not the code under test).
checkpoint::TensorDict HfReference(const torch::nn::Module& reference, const std::string& dir) {
  checkpoint::TensorDict all, first, second;
  std::string weight_map;
  size_t i = 0;
  std::vector<const void*> seen;  // a tied tensor once, under its first name
  for (const auto& p : reference.named_parameters()) {
    const void* impl = p.value().unsafeGetTensorImpl();
    if (std::find(seen.begin(), seen.end(), impl) != seen.end()) continue;
    seen.push_back(impl);
    all.insert(p.key(), p.value().detach().to(at::kBFloat16));
  }
  for (const auto& b : reference.named_buffers()) all.insert(b.key(), b.value().detach().clone());
  for (const auto& item : all) {
    const bool in_first = i++ % 2 == 0;
    (in_first ? first : second).insert(item.key(), item.value());
    absl::StrAppend(&weight_map, weight_map.empty() ? "" : ", ", "\"", item.key(), "\": \"",
                    in_first ? "a.safetensors" : "b.safetensors", "\"");
  }
  std::filesystem::create_directories(dir);
  checkpoint::SaveSafetensors(checkpoint::JoinPath(dir, "a.safetensors"), first, {{{"format", "pt"}}});
  checkpoint::SaveSafetensors(checkpoint::JoinPath(dir, "b.safetensors"), second, {{{"format", "pt"}}});
  const std::string index = absl::StrCat("{\"metadata\": {}, \"weight_map\": {", weight_map, "}}");
  checkpoint::WriteFileAtomically(checkpoint::JoinPath(dir, checkpoint::kHfIndexFile),
                                  std::vector<char>(index.begin(), index.end()), "test");
  return all;
}

// What an export with dtype bf16 holds: floating-point tensors converted.
checkpoint::TensorDict AsBf16(const checkpoint::TensorDict& d) {
  checkpoint::TensorDict out;
  for (const auto& item : d) {
    out.insert(item.key(),
               at::isFloatingType(item.value().scalar_type()) ? item.value().to(at::kBFloat16) : item.value());
  }
  return out;
}

// Every file of an export, read whole, against `want` (key -> tensor): same keys, bitwise.
void ExpectExportEquals(const std::string& dir, const checkpoint::TensorDict& want, const std::string& what) {
  const checkpoint::HfCheckpointReader reader(dir);
  ASSERT_EQ(reader.tensors().size(), want.size()) << what;
  for (const auto& item : want) {
    const checkpoint::HfTensor* t = reader.Find(item.key());
    ASSERT_NE(t, nullptr) << what << ": " << item.key();
    at::Tensor got = at::empty(t->size, t->dtype);
    reader.ReadInto(item.key(), std::vector<int64_t>(t->size.size(), 0), got);
    EXPECT_TRUE(at::equal(got, item.value())) << what << ": " << item.key();
  }
  for (const auto& f : reader.files()) {
    ASSERT_TRUE(f->metadata().has_value()) << f->source();
    EXPECT_EQ(f->metadata()->at("format"), "pt") << f->source();
  }
}

TEST(HuggingFace, LoadsIntoEveryFsdp2MeshAndExportsTheReferenceBytes) {
  Net reference(kNet);
  InitDeterministic(*reference, 11);
  reference->register_buffer("scale", at::arange(4, at::kFloat) + 11.0);
  const std::string in = NewDir("hf_in");
  const checkpoint::TensorDict stored = HfReference(*reference, in);
  for (const Mesh& m : {W(3), kHsdp, kTp, kSpmd}) {
    const std::string out = NewDir("hf_out_" + m.Name());
    fsdp::testing::RunOnRanks(Backend::kThreaded, m.world, [&](const comm::ProcessGroupPtr& pg) {
      Trainee t = Build(m, pg, /*seed=*/5);  // other values, and the buffer 5 + arange
      LoadHuggingFace(*t.module, in);
      const FullState got = GetFull(t);
      for (const auto& item : stored) {
        const at::Tensor* g = got.model.find(item.key());
        ASSERT_NE(g, nullptr) << m.Name() << " " << item.key();
        EXPECT_EQ(g->scalar_type(), at::kFloat) << m.Name() << " " << item.key();
        EXPECT_TRUE(at::equal(*g, item.value().to(at::kFloat))) << m.Name() << " " << item.key();
      }
      const HfSaveOptions options{.dtype = at::kBFloat16, .max_shard_size = 200, .keep_sharded = false};
      if (m.layout != Layout::kHsdp) {
        SaveHuggingFace(*t.module, out, options);
        return;
      }
      // Async: the export holds the values at the call, whatever training does meanwhile.
      AsyncSaveHandle handle = AsyncSaveHuggingFace(*t.module, out, options);
      {
        at::NoGradGuard no_grad;
        for (auto& p : t.module->parameters()) p.fill_(7.0);
      }
      handle.wait();
    });
    ExpectExportEquals(out, AsBf16(stored), m.Name());
    EXPECT_FALSE(std::filesystem::exists(checkpoint::JoinPath(out, checkpoint::kHfShardedDir))) << m.Name();
    EXPECT_GT(checkpoint::HfCheckpointReader(out).files().size(), 2u) << m.Name() << ": max_shard_size splits";
  }
}

TEST(HuggingFace, Fsdp1WithTiedWeightsLoadsAndSavesOneCopyOfATiedTensor) {
  test_models::Net reference(test_models::NetOptions{.tie = true});
  test_models::InitDeterministic(*reference, 21);
  // A tied tensor is stored once, under its first name (save_pretrained drops the tied copy).
  const std::string in = NewDir("hf_fsdp1_in");
  const checkpoint::TensorDict stored = HfReference(*reference, in);
  std::vector<std::string> names;
  for (const auto& p : reference->named_parameters()) names.push_back(p.key());
  ASSERT_GT(names.size(), stored.size()) << "the Net ties a weight";
  const std::string out = NewDir("hf_fsdp1_out"), sharded_only = NewDir("hf_fsdp1_sharded");
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    test_models::Net model(test_models::NetOptions{.tie = true});
    test_models::InitDeterministic(*model, 3);
    fsdp1::FSDPOptions options;
    options.process_group = pg;
    options.auto_wrap_policy = fsdp1::ModuleTypeWrapPolicy<test_models::BlockImpl>();
    fsdp1::wrap_fsdp(model.ptr(), options);
    LoadHuggingFace(*model, in);
    const auto full = fsdp1::GetFullStateDict(fsdp1::FullyShardedDataParallel(fsdp1::GetState(*model)));
    for (const std::string& name : names) {
      const at::Tensor* g = full.find(name);
      ASSERT_NE(g, nullptr) << name;
      // The tied name reads the tensor stored under the first name.
      const at::Tensor* want = stored.find(name);
      if (want == nullptr) continue;
      EXPECT_TRUE(at::equal(*g, want->to(at::kFloat))) << name;
    }
    SaveHuggingFace(*model, out, {.dtype = at::kBFloat16});
    SaveHuggingFace(*model, sharded_only, {.consolidate = false});
  });
  ExpectExportEquals(out, AsBf16(stored), "FSDP1 W=3");
  // FSDP1's flat shards end inside rows at W=3: a rank holds several boxes of one tensor, and
  // its second ones go to shard index rank + 1 + W (PyTorch's layout has one box per key).
  EXPECT_TRUE(std::filesystem::exists(checkpoint::JoinPath(
      checkpoint::JoinPath(sharded_only, checkpoint::kHfShardedDir), checkpoint::HfFileName(1, 1, 4))));
  // Without consolidation: only per-rank files, which read back as the fp32 tensors.
  EXPECT_FALSE(std::filesystem::exists(checkpoint::JoinPath(sharded_only, checkpoint::kHfIndexFile)));
  checkpoint::TensorDict fp32;
  for (const auto& item : stored) fp32.insert(item.key(), item.value().to(at::kFloat));
  ExpectExportEquals(checkpoint::JoinPath(sharded_only, checkpoint::kHfShardedDir), fp32, "per-rank files");
  // And they consolidate alone, in one process.
  const std::string consolidated = NewDir("hf_fsdp1_consolidated");
  ConsolidateHuggingFace(checkpoint::JoinPath(sharded_only, checkpoint::kHfShardedDir), consolidated,
                         {.dtype = at::kBFloat16});
  ExpectExportEquals(consolidated, AsBf16(stored), "ConsolidateHuggingFace");
}

TEST(HuggingFace, KeyMismatchesFailEveryRankBeforeAnythingChanges) {
  Net reference(kNet);
  InitDeterministic(*reference, 11);
  reference->register_buffer("scale", at::arange(4, at::kFloat));
  const std::string in = NewDir("hf_keys");
  HfReference(*reference, in);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 5);
    const FullState before = GetFull(t);
    // Renamed keys: every model key missing, every checkpoint key unexpected, listed.
    EXPECT_ERROR_CONTAINS(LoadHuggingFace(*t.module, in, {.key_of = [](const std::string& f) { return "x." + f; }}),
                          "are missing");
    EXPECT_ERROR_CONTAINS(LoadHuggingFace(*t.module, in, {.key_of = [](const std::string& f) { return "x." + f; }}),
                          "are unexpected (no model tensor has that key)");
    // Two names for one key.
    EXPECT_ERROR_CONTAINS(LoadHuggingFace(*t.module, in, {.key_of = [](const std::string&) { return "k"; }}),
                          "key_of gives 'k' for both");
    const FullState after = GetFull(t);
    ExpectSameState(after, before, "after failed loads");
    // allow_partial_load: a mapping that finds only the buffer loads it and keeps the rest.
    LoadHuggingFace(
        *t.module, in,
        {.key_of = [](const std::string& f) { return f == "scale" ? f : "x." + f; }, .allow_partial_load = true});
    const FullState partial = GetFull(t);
    EXPECT_TRUE(at::equal(*partial.model.find("scale"), at::arange(4, at::kFloat)));
    for (const auto& item : before.model) {
      if (item.key() != "scale") {
        EXPECT_TRUE(at::equal(*partial.model.find(item.key()), item.value())) << item.key();
      }
    }
  });
  // Another model's shapes: an error naming both, on every rank.
  Net wide(NetOptions{.hidden = 16});
  InitDeterministic(*wide, 1);
  wide->register_buffer("scale", at::arange(4, at::kFloat));
  const std::string other = NewDir("hf_shapes");
  HfReference(*wide, other);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 5);
    EXPECT_ERROR_CONTAINS(LoadHuggingFace(*t.module, other), "in the checkpoint and");
  });
}

}  // namespace
}  // namespace fsdp::dcp
