// Periodic checkpoints: Stateful objects (a training loop's state) saved and loaded beside the model,
// the per-rank write hook, and finding the latest complete checkpoint while skipping the ones
// a dead rank left without `.metadata`.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dcp/checkpoint_dirs.h"
#include "dcp/dcp_test_trainees.h"
#include "dcp/dict_state_testing.h"
#include "dcp/state_items.h"

namespace fsdp::dcp {
namespace {

c10::impl::GenericDict Nested(std::vector<std::pair<c10::IValue, c10::IValue>> items) {
  c10::impl::GenericDict d(c10::AnyType::get(), c10::AnyType::get());
  for (auto& [k, v] : items) d.insert(std::move(k), std::move(v));
  return d;
}

StateDict TrainState(int64_t step, int64_t epoch, const std::string& name, at::Tensor rng, double lr) {
  StateDict s;
  s.emplace("step", at::tensor({step}));
  s.emplace("epoch", epoch);
  s.emplace("name", name);
  c10::impl::GenericList lrs(c10::AnyType::get());
  lrs.push_back(lr);
  lrs.push_back(lr / 2);
  s.emplace("lrs", lrs);  // a list of numbers: one bytes entry
  c10::impl::GenericList tensors(c10::AnyType::get());
  tensors.push_back(rng);
  tensors.push_back(at::tensor({epoch}));
  // Int keys are written with str() as Python's; a list with tensors is entered.
  s.emplace("nested", Nested({{int64_t{3}, tensors}, {"tuple", c10::ivalue::Tuple::create({epoch, name})}}));
  return s;
}

TEST(DcpStateful, FlattenedAsPythonsDcpSavedOnceAndLoadedAtAnotherWorldSize) {
  const std::string dir = NewDir("stateful");
  std::vector<std::vector<std::string>> written(3);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(3), pg, 11);
    Train(t, 0, 1);
    DictState train(TrainState(17, 2, "run-7", at::arange(4, at::kFloat), 0.5));
    SaveOptions options;
    options.stateful = {{"train", &train}};
    options.on_rank_file_written = [&, rank = pg->rank()](const std::string& file) {
      written[rank].push_back(file);
      struct stat st;
      EXPECT_EQ(::stat(file.c_str(), &st), 0) << file << " is not on disk when the hook runs";
      EXPECT_NE(::stat((dir + "/.metadata").c_str(), &st), 0) << "metadata before every rank wrote";
    };
    AsyncSave(*t.module, t.opt.get(), dir, options).wait();
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(written[r], std::vector<std::string>{absl::StrCat(dir, "/__", r, "_0.distcp")});
  // Written once (one chunk per tensor key), under Python's flattened keys and object paths.
  const checkpoint::DcpMetadata md = checkpoint::ReadMetadata(dir);
  using Path = std::vector<checkpoint::DcpPathElement>;
  const std::vector<std::tuple<std::string, bool, Path>> expected = {
      {"train.step", false, {std::string("train"), std::string("step")}},
      {"train.epoch", true, {std::string("train"), std::string("epoch")}},
      {"train.name", true, {std::string("train"), std::string("name")}},
      {"train.lrs", true, {std::string("train"), std::string("lrs")}},
      {"train.nested.3.0", false, {std::string("train"), std::string("nested"), std::string("3"), int64_t{0}}},
      {"train.nested.3.1", false, {std::string("train"), std::string("nested"), std::string("3"), int64_t{1}}},
      {"train.nested.tuple", true, {std::string("train"), std::string("nested"), std::string("tuple")}},
  };
  for (const auto& [key, is_bytes, path] : expected) {
    const checkpoint::DcpEntry* e = md.Find(key);
    ASSERT_NE(e, nullptr) << key;
    EXPECT_EQ(e->is_bytes, is_bytes) << key;
    if (!is_bytes) {
      EXPECT_EQ(e->chunks.size(), 1u) << key;
    }
    EXPECT_EQ(e->object_path, path) << key;
  }

  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 99);
    // The template: the same structure, other values; the rng as double (cast on load).
    DictState train(TrainState(0, 0, "", at::zeros({4}, at::kDouble), 0.0));
    LoadOptions options;
    options.stateful = {{"train", &train}};
    Load(*t.module, t.opt.get(), dir, options);
    EXPECT_EQ(train.loads, 1);
    EXPECT_EQ(train.state.at("step").toTensor().item<int64_t>(), 17);
    EXPECT_EQ(train.state.at("epoch").toInt(), 2);
    EXPECT_EQ(train.state.at("name").toStringRef(), "run-7");
    EXPECT_EQ(train.state.at("lrs").toListRef().at(1).toDouble(), 0.25);
    const c10::impl::GenericDict nested = train.state.at("nested").toGenericDict();
    const c10::IValue tensors = nested.at(int64_t{3});
    EXPECT_TRUE(at::equal(tensors.toListRef().at(0).toTensor(), at::arange(4, at::kDouble)));
    EXPECT_EQ(tensors.toListRef().at(1).toTensor().item<int64_t>(), 2);
    EXPECT_EQ(nested.at("tuple").toTupleRef().elements().at(1).toStringRef(), "run-7");

    // A missing key or another shape is an error naming it, and nothing is loaded.
    StateDict more = TrainState(0, 0, "", at::zeros({4}), 0.0);
    more.emplace("seed", int64_t{1});
    DictState missing(more);
    options.stateful = {{"train", &missing}};
    EXPECT_ERROR_CONTAINS(Load(*t.module, t.opt.get(), dir, options),
                          "dcp::Load: the checkpoint '" + dir + "' has no entry 'train.seed'");
    EXPECT_EQ(missing.loads, 0);
    DictState wrong_shape(TrainState(0, 0, "", at::zeros({5}), 0.0));
    options.stateful = {{"train", &wrong_shape}};
    EXPECT_ERROR_CONTAINS(Load(*t.module, t.opt.get(), dir, options),
                          "'train.nested.3.0' in the checkpoint '" + dir +
                              "' has size [4], but stateful 'train.nested.3.0' has size [5]");
    StateDict as_tensor = TrainState(0, 0, "", at::zeros({4}), 0.0);
    as_tensor.insert_or_assign("step", int64_t{0});
    DictState wrong_kind(as_tensor);
    options.stateful = {{"train", &wrong_kind}};
    EXPECT_ERROR_CONTAINS(Load(*t.module, t.opt.get(), dir, options),
                          "is a tensor, but stateful 'train.step' is a Int");
  });
}

TEST(DcpStateful, BadNamesAndValuesAreNamed) {
  DictState ok(TrainState(1, 1, "a", at::zeros({1}), 0.1));
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "is empty or contains '.'"},
      {"a.b", "is empty or contains '.'"},
      {"model", "would collide with the model's or optimizer's entries"},
      {"optim", "would collide"},
  };
  std::vector<StateDict> dicts;
  for (const auto& [name, message] : cases) {
    EXPECT_ERROR_CONTAINS(internal::FlattenStateful({{name, &ok}}, dicts, "dcp::Save"),
                          "dcp::Save: stateful name '" + name + "' " + message);
  }
  EXPECT_ERROR_CONTAINS(internal::FlattenStateful({{"a", &ok}, {"a", &ok}}, dicts, "dcp::Save"),
                        "stateful name 'a' appears twice");
  EXPECT_ERROR_CONTAINS(internal::FlattenStateful({{"a", nullptr}}, dicts, "dcp::Save"), "stateful 'a' is null");
  StateDict undefined;
  undefined.emplace("t", at::Tensor());
  DictState bad_tensor(undefined);
  EXPECT_ERROR_CONTAINS(internal::FlattenStateful({{"a", &bad_tensor}}, dicts, "dcp::Save"),
                        "stateful 'a.t' is an undefined tensor");
  StateDict tuple_of_tensor;
  tuple_of_tensor.emplace("x", Nested({{"t", c10::ivalue::Tuple::create({at::zeros({1})})}}));
  DictState bad_tuple(tuple_of_tensor);
  EXPECT_ERROR_CONTAINS(internal::FlattenStateful({{"a", &bad_tuple}}, dicts, "dcp::Save"),
                        "stateful 'a.x.t' is a Tuple (or holds one), which a checkpoint cannot store");
  StateDict float_key;
  float_key.emplace("x", Nested({{1.5, int64_t{1}}}));
  DictState bad_key(float_key);
  EXPECT_ERROR_CONTAINS(internal::FlattenStateful({{"a", &bad_key}}, dicts, "dcp::Save"),
                        "stateful 'a.x' has a dict key of type Double");
}

// A rank whose hook throws (as one that dies there) leaves the checkpoint without
// `.metadata`; the scan skips it and finds the previous complete one.
TEST(ScanCheckpoints, TheLatestCompleteOneWinsAndIncompleteOnesAreReported) {
  const std::string root = NewDir("periodic");
  EXPECT_EQ(ScanCheckpoints(root).latest_step, -1);  // no root yet: nothing
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    for (int64_t step : {5, 10}) Save(*t.module, t.opt.get(), StepCheckpointDir(root, step));
    SaveOptions dies;
    dies.on_rank_file_written = [rank = pg->rank()](const std::string&) {
      TORCH_CHECK(rank != 1, "rank 1 died while saving");
    };
    EXPECT_ERROR_CONTAINS(Save(*t.module, t.opt.get(), StepCheckpointDir(root, 15), dies), "rank 1 died while saving");
  });
  std::filesystem::create_directories(root + "/step-20");  // a save that wrote nothing yet
  std::filesystem::create_directories(root + "/step-x");   // not ours: ignored
  std::filesystem::create_directories(root + "/step-25");
  std::ofstream(root + "/step-25/.metadata") << "not a pickle";

  const CheckpointScan scan = ScanCheckpoints(root);
  EXPECT_EQ(scan.latest_step, 10);
  EXPECT_EQ(scan.latest_dir, root + "/step-10");
  ASSERT_EQ(scan.incomplete.size(), 3u);
  EXPECT_EQ(scan.incomplete[0].dir, root + "/step-15");
  EXPECT_EQ(scan.incomplete[0].reason, "no .metadata (the save did not finish)");
  EXPECT_EQ(scan.incomplete[1].step, 20);
  EXPECT_TRUE(absl::StartsWith(scan.incomplete[2].reason, "invalid .metadata: ")) << scan.incomplete[2].reason;
  // The latest complete checkpoint loads.
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 99);
    Load(*t.module, t.opt.get(), scan.latest_dir);
  });
  EXPECT_ERROR_CONTAINS(StepCheckpointDir(root, -1), "StepCheckpointDir: step must be >= 0, got -1");
}

}  // namespace
}  // namespace fsdp::dcp
