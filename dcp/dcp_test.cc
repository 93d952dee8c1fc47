// //dcp: a model trained 3 AdamW steps on one mesh, saved, loaded on another (every pair of
// world sizes 1-4, HSDP 2x2, FSDP + TP 2x2 on both TP paths), trained 3 more steps, matches
// an uninterrupted single-rank run; the loaded state is bitwise the saved one. Also: the key
// names and dedup of the files, full and rank-0 saves, AsyncSave (bad checkpoints and Gloo
// processes: dcp_errors_test.cc; the shared training runs: dcp_test_trainees.h).
#include "dcp/dcp_test_trainees.h"

namespace fsdp::dcp {
namespace {

// Saves after kSteps on `from`, loads on `to` into a differently initialized model, checks
// the loaded state is the saved one bitwise, trains kSteps more and compares with the
// reference.
void SaveThenLoad(const Mesh& from, const Mesh& to, const SaveOptions& options = {}, bool async = false) {
  SCOPED_TRACE(absl::StrCat(from.Name(), " -> ", to.Name()));
  const std::string dir = NewDir(absl::StrCat("ckpt_", from.Name(), "_", to.Name()));
  const Reference ref = RunReference();
  FullState saved;
  fsdp::testing::RunOnRanks(Backend::kThreaded, from.world, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(from, pg, 11);
    const std::vector<double> losses = Train(t, 0, kSteps);
    for (int s = 0; s < kSteps; ++s) ExpectClose(losses[s], ref.losses[s], absl::StrCat("loss ", s));
    if (async) {
      AsyncSaveHandle h = AsyncSave(*t.module, t.opt.get(), dir, options);
      h.wait();
    } else {
      Save(*t.module, t.opt.get(), dir, options);
    }
    FullState full = GetFull(t);
    if (pg->rank() == 0) saved = std::move(full);
  });
  fsdp::testing::RunOnRanks(Backend::kThreaded, to.world, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(to, pg, 99);
    Load(*t.module, t.opt.get(), dir);
    ExpectSameState(GetFull(t), saved, "after Load");
    const std::vector<double> losses = Train(t, kSteps, kSteps);
    for (int s = 0; s < kSteps; ++s) ExpectClose(losses[s], ref.losses[kSteps + s], absl::StrCat("loss ", kSteps + s));
    const fsdp2::FullStateDict full = fsdp2::GetFullStateDict(*t.module);
    for (const auto& p : ref.params) {
      const at::Tensor* got = full.find(p.key());
      ASSERT_NE(got, nullptr) << p.key();
      const double scale = std::max(1.0, p.value().abs().max().item<double>());
      EXPECT_LE((*got - p.value()).abs().max().item<double>(), kTol * scale) << p.key() << " rank " << pg->rank();
    }
  });
}

TEST(DcpReshard, EveryPairOfWorldSizes) {
  for (int from = 1; from <= 4; ++from) {
    for (int to = 1; to <= 4; ++to) SaveThenLoad(W(from), W(to));
  }
}

TEST(DcpReshard, HsdpAndTensorParallelMeshes) {
  SaveThenLoad(W(4), kHsdp);
  SaveThenLoad(kHsdp, W(3));
  SaveThenLoad(kHsdp, kTp);
  SaveThenLoad(W(2), kTp);
  SaveThenLoad(kTp, W(1));
  SaveThenLoad(kTp, kHsdp);
  SaveThenLoad(kSpmd, W(3));
  SaveThenLoad(W(3), kSpmd);
}

// torchtitan's flattened param groups (SaveOptions::flatten_optimizer_state_dict): one entry
// per parameter and option, no FQN lists; they load on another mesh as the nested ones do.
TEST(DcpReshard, FlattenedParamGroups) {
  SaveThenLoad(W(2), W(3), {.flatten_optimizer_state_dict = true});
  const std::string dir = NewDir("flat_groups");
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    Train(t, 0, 1);
    Save(*t.module, t.opt.get(), dir, {.flatten_optimizer_state_dict = true});
  });
  std::set<std::string> keys;
  for (const auto& e : checkpoint::ReadMetadata(dir).entries) keys.insert(e.fqn);
  EXPECT_TRUE(keys.count("optim.param_groups.head.weight.lr")) << "flattened: one lr per parameter";
  EXPECT_TRUE(keys.count("optim.param_groups.block0.fc1.weight.betas"));
  for (const std::string& k : keys) EXPECT_FALSE(absl::EndsWith(k, ".params")) << k;
}

TEST(DcpReshard, FullAndRankZeroSaves) {
  SaveThenLoad(W(3), W(2), {.kind = StateDictKind::kFull});
  SaveThenLoad(kHsdp, W(3), {.kind = StateDictKind::kFull});
  SaveThenLoad(W(4), W(3), {.kind = StateDictKind::kFullRank0});
  SaveThenLoad(kTp, W(2), {.kind = StateDictKind::kFullRank0});
}

TEST(DcpReshard, AsyncSaves) {
  SaveThenLoad(W(3), W(4), {}, /*async=*/true);
  SaveThenLoad(kTp, W(3), {}, /*async=*/true);
  SaveThenLoad(W(2), W(3), {.kind = StateDictKind::kFull}, /*async=*/true);
}

// Uneven FSDP + TP (fsdp/fsdp2/parity_test.cc's layouts: colwise Linear(9, 18) and
// Linear(9, 27), rowwise Linear(9, 5) on dp 2 x tp 2): each rank writes the boxes it really
// holds, and one rank reads back the original weights.
struct LinearsImpl : torch::nn::Module {
  LinearsImpl(const std::vector<torch::nn::Linear>& plain, const mesh::DeviceMeshPtr& tp) {
    const tensor_parallel::ParallelStylePtr styles[] = {
        tensor_parallel::ColwiseParallel(), tensor_parallel::ColwiseParallel(), tensor_parallel::RowwiseParallel()};
    for (size_t i = 0; i < plain.size(); ++i) {
      const std::string name = absl::StrCat("l", i);
      if (tp) {
        register_module(name, fsdp2::testing::ParallelLinear(plain[i], tp, styles[i]));
      } else {
        register_module(name, CloneLinear(plain[i]));
      }
    }
  }
  at::Tensor forward(const at::Tensor& x) { return x; }
};
using Linears = fsdp::Hooked<LinearsImpl>;

std::vector<torch::nn::Linear> UnevenLinears(double scale) {
  std::vector<torch::nn::Linear> plain = {torch::nn::Linear(9, 18), torch::nn::Linear(9, 27), torch::nn::Linear(9, 5)};
  at::NoGradGuard no_grad;
  for (auto& l : plain) {  // row r holds r * 100 + column: a misplaced box would show
    const int64_t out = l->weight.size(0), in = l->weight.size(1);
    l->weight.copy_((at::arange(out, at::kFloat).unsqueeze(1) * 100 + at::arange(in, at::kFloat)) * scale);
    l->bias.copy_(at::arange(out, at::kFloat) * scale);
  }
  return plain;
}

TEST(DcpReshard, UnevenTensorParallelShardsRoundTrip) {
  const std::string dir = NewDir("uneven_tp");
  const std::vector<torch::nn::Linear> plain = UnevenLinears(1.0);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2, 2}, {"dp", "tp"});
    Linears model(plain, (*mesh)["tp"]);
    fsdp2::fully_shard(model.ptr(), {.mesh = (*mesh)["dp"]});
    Save(*model, nullptr, dir);
  });
  for (int world : {1, 3}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
      Linears model(UnevenLinears(-3.0), nullptr);
      fsdp2::fully_shard(model.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {world})});
      Load(*model, nullptr, dir);
      const fsdp2::FullStateDict full = fsdp2::GetFullStateDict(*model);
      for (size_t i = 0; i < plain.size(); ++i) {
        EXPECT_TRUE(at::equal(*full.find(absl::StrCat("l", i, ".weight")), plain[i]->weight)) << i;
        EXPECT_TRUE(at::equal(*full.find(absl::StrCat("l", i, ".bias")), plain[i]->bias)) << i;
      }
    });
  }
}

// ------------------------------------------------------------------- the files themselves
std::vector<std::string> Keys(const checkpoint::DcpMetadata& md) {
  std::vector<std::string> keys;
  for (const auto& e : md.entries) keys.push_back(e.fqn);
  std::sort(keys.begin(), keys.end());
  return keys;
}

TEST(DcpFiles, KeysAreTorchDistributedCheckpointsAndReplicasAreWrittenOnce) {
  const std::string dir = NewDir("layout"), hsdp = NewDir("layout_hsdp"), tp = NewDir("layout_tp");
  std::vector<std::string> params;
  for (const Mesh& m : {W(2), kHsdp, kTp}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, m.world, [&](const comm::ProcessGroupPtr& pg) {
      Trainee t = Build(m, pg, 11);
      Train(t, 0, 1);
      Save(*t.module, t.opt.get(), m.layout == Layout::k1D ? dir : m.layout == Layout::kHsdp ? hsdp : tp);
      if (pg->rank() == 0 && m.layout == Layout::k1D) {
        for (const auto& p : t.module->named_parameters()) params.push_back(p.key());
      }
    });
  }
  // Exactly the keys Python's dcp.save({"model": get_model_state_dict(m), "optim":
  // get_optimizer_state_dict(m, o)}) writes for this model and AdamW (PyTorch 2.15).
  std::vector<std::string> want = {"model.scale"};
  for (const std::string& p : params) {
    want.push_back("model." + p);
    for (const char* s : {".exp_avg", ".exp_avg_sq", ".step"}) want.push_back("optim.state." + p + s);
  }
  for (const char* o : {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                        "differentiable", "fused", "decoupled_weight_decay", "params"}) {
    want.push_back(absl::StrCat("optim.param_groups.0.", o));
  }
  std::sort(want.begin(), want.end());
  const checkpoint::DcpMetadata md = checkpoint::ReadMetadata(dir);
  EXPECT_EQ(Keys(md), want);
  EXPECT_EQ(Keys(checkpoint::ReadMetadata(hsdp)), want);
  EXPECT_EQ(Keys(checkpoint::ReadMetadata(tp)), want);
  const checkpoint::DcpEntry* lr = md.Find("optim.param_groups.0.lr");
  ASSERT_NE(lr, nullptr);
  EXPECT_TRUE(lr->is_bytes);
  EXPECT_EQ(lr->object_path, (std::vector<checkpoint::DcpPathElement>{std::string("optim"), std::string("param_groups"),
                                                                      int64_t{0}, std::string("lr")}));
  const checkpoint::DcpEntry* w = md.Find("model.block0.fc1.weight");
  EXPECT_EQ(w->object_path, (std::vector<checkpoint::DcpPathElement>{std::string("model"), "block0.fc1.weight"}));
  ASSERT_EQ(w->chunks.size(), 2u);  // rows [0, 4) by rank 0, [4, 8) by rank 1
  EXPECT_EQ(w->chunks[1].offsets, (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(w->chunks[1].storage.relative_path, "__1_0.distcp");
  const checkpoint::DcpEntry* step = md.Find("optim.state.in.weight.step");
  EXPECT_EQ(step->size, std::vector<int64_t>{});
  EXPECT_EQ(step->properties.dtype, at::kFloat);
  EXPECT_EQ(step->chunks.size(), 1u);
  EXPECT_EQ(md.Find("model.scale")->chunks.size(), 1u);

  // HSDP 2x2: the two replicas of each shard are written once; replicated values once.
  const checkpoint::DcpMetadata h = checkpoint::ReadMetadata(hsdp);
  EXPECT_EQ(h.Find("model.block0.fc1.weight")->chunks.size(), 2u);
  EXPECT_EQ(h.Find("optim.state.head.weight.exp_avg")->chunks.size(), 1u);  // 1 row: one shard holds it
  EXPECT_EQ(h.Find("model.scale")->chunks.size(), 1u);
  // DCP's dedup balances: the replicated items do not all land on rank 0.
  std::set<std::string> files;
  for (const auto& e : h.entries) {
    for (const auto& c : e.chunks) files.insert(c.storage.relative_path);
  }
  EXPECT_EQ(files.size(), 4u);
  // FSDP + TP: colwise fc1 [8, 5] is TP-chunked into rows [0, 4) / [4, 8), each FSDP-chunked
  // in two: four row chunks of 2; rowwise fc2 [5, 8]: TP columns [0, 4) / [4, 8), FSDP rows
  // [0, 3) / [3, 5): four boxes.
  const checkpoint::DcpMetadata t = checkpoint::ReadMetadata(tp);
  const checkpoint::DcpEntry* fc1 = t.Find("model.block0.fc1.weight");
  ASSERT_EQ(fc1->chunks.size(), 4u);
  for (const auto& c : fc1->chunks) EXPECT_EQ(c.sizes, (std::vector<int64_t>{2, 5}));
  const checkpoint::DcpEntry* fc2 = t.Find("optim.state.block1.fc2.weight.exp_avg_sq");
  ASSERT_EQ(fc2->chunks.size(), 4u);
}

TEST(DcpPlan, DedupKeepsEachKeyOnceOnTheLeastLoadedRank) {
  using internal::PlannedItem;
  // Rank 0 holds a big unique chunk first, so the shared items go to rank 1, then alternate.
  const std::vector<std::vector<PlannedItem>> plans = {
      {{"big", 100, false}, {"a", 8, false}, {"b", 0, true}, {"c", 8, false}},
      {{"a", 8, false}, {"b", 0, true}, {"c", 8, false}, {"d", 4, false}},
  };
  const auto keep = internal::DedupSavePlans(plans);
  EXPECT_EQ(keep[0], (std::vector<bool>{true, false, false, false}));
  EXPECT_EQ(keep[1], (std::vector<bool>{true, true, true, true}));
  EXPECT_EQ(internal::DecodePlan(internal::EncodePlan(plans[1]), "p")[3].key, "d");
  std::vector<char> bad = internal::EncodePlan(plans[1]);
  bad.resize(bad.size() - 3);
  EXPECT_ERROR_CONTAINS(internal::DecodePlan(bad, "rank 1's plan"), "rank 1's plan is not a valid save plan");
}

// An async save whose model changes right after the call equals a synchronous save taken
// before the change: the same metadata (chunks, byte ranges) and the same file bytes.
TEST(DcpFiles, AsyncSaveEqualsSynchronousSave) {
  const std::string sync_dir = NewDir("sync"), async_dir = NewDir("async");
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(3), pg, 11);
    Train(t, 0, 2);
    Save(*t.module, t.opt.get(), sync_dir);
    AsyncSaveHandle h = AsyncSave(*t.module, t.opt.get(), async_dir);
    Train(t, 2, 1);  // changes parameters and optimizer state while the files are written
    h.wait();
    EXPECT_TRUE(h.done());
    h.wait();  // again: the same outcome
  });
  checkpoint::DcpMetadata a = checkpoint::ReadMetadata(async_dir), s = checkpoint::ReadMetadata(sync_dir);
  EXPECT_EQ(a.entries, s.entries);
  for (int r = 0; r < 3; ++r) {
    const std::string name = checkpoint::DcpDataFileName(r);
    EXPECT_EQ(checkpoint::ReadFile(async_dir + "/" + name, "test"), checkpoint::ReadFile(sync_dir + "/" + name, "test"))
        << name;
  }
}

// LoadOptions::layout: a checkpoint that keeps the model's tensors under other names and with
// other rows loads as if it were written in those: block0 and block1 swapped, every tensor's
// rows reversed, and head.weight ([1, 5]) row 3 of block0.fc1.weight ([8, 5]). Saved on 3
// ranks, loaded on 2 (uneven row shards) and on FSDP + TP 2x2 (several row boxes per rank).
TEST(DcpLayout, NamesAndRowsOfAnotherProgramsCheckpoint) {
  const std::string dir = NewDir("layout");
  FullState saved;
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(3), pg, 11);
    Train(t, 0, kSteps);
    Save(*t.module, t.opt.get(), dir);
    FullState full = GetFull(t);
    if (pg->rank() == 0) saved = std::move(full);
  });
  const auto swapped = [](std::string fqn) {
    if (absl::StartsWith(fqn, "block0.")) return fqn.replace(5, 1, "1");
    if (absl::StartsWith(fqn, "block1.")) return fqn.replace(5, 1, "0");
    return fqn;
  };
  const auto stored = [&](const std::string& fqn) -> StoredTensor {
    if (fqn == "head.weight") return {"block0.fc1.weight", {3}};
    const at::Tensor* t = saved.model.find(fqn);
    std::vector<int64_t> reversed(t->size(0));
    for (size_t k = 0; k < reversed.size(); ++k) reversed[k] = t->size(0) - 1 - static_cast<int64_t>(k);
    return {swapped(fqn), reversed};
  };
  // What each tensor must hold: `full`'s (saved) tensor read through `stored`.
  const auto expected = [&](const std::string& fqn, const at::Tensor& full_of_stored) {
    const std::vector<int64_t> rows = stored(fqn).rows;
    return full_of_stored.index_select(0, at::tensor(rows, at::kLong));
  };
  const StoredLayout layout{.model = stored, .optimizer = stored};
  for (const Mesh& to : {W(2), kTp}) {
    SCOPED_TRACE(to.Name());
    fsdp::testing::RunOnRanks(Backend::kThreaded, to.world, [&](const comm::ProcessGroupPtr& pg) {
      Trainee t = Build(to, pg, 99);
      Load(*t.module, t.opt.get(), dir, {.layout = layout});
      const FullState got = GetFull(t);
      if (pg->rank() != 0) return;
      for (const auto& item : got.model) {
        if (item.key() == "scale") continue;  // a buffer: 1-D, reversed too
        const std::string from = stored(item.key()).fqn;
        EXPECT_TRUE(at::equal(item.value(), expected(item.key(), *saved.model.find(from)))) << item.key();
        const auto& state = got.optim.state.at(item.key());
        const auto& saved_state = saved.optim.state.at(from);
        for (const char* name : {"exp_avg", "exp_avg_sq"}) {
          EXPECT_TRUE(at::equal(std::get<at::Tensor>(state.at(name)),
                                expected(item.key(), std::get<at::Tensor>(saved_state.at(name)))))
              << item.key() << "." << name;
        }
        EXPECT_EQ(std::get<int64_t>(state.at("step")), kSteps) << item.key();
      }
      EXPECT_TRUE(at::equal(*got.model.find("scale"), saved.model.find("scale")->flip(0)));
    });
  }
  // A layout whose rows do not fit is an error naming the key, before anything changes.
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 99);
    const auto row = [](int64_t r) {
      return [r](const std::string& fqn) -> StoredTensor {
        return fqn == "head.weight" ? StoredTensor{"block0.fc1.weight", {r}} : StoredTensor{fqn, {}};
      };
    };
    EXPECT_ERROR_CONTAINS(Load(*t.module, nullptr, dir, {.layout = {.model = row(8)}}),
                          "from row 8 of 'model.block0.fc1.weight' in the checkpoint");
    const auto two_rows = [](const std::string& fqn) -> StoredTensor {
      return fqn == "head.weight" ? StoredTensor{"block0.fc1.weight", {0, 1}} : StoredTensor{fqn, {}};
    };
    EXPECT_ERROR_CONTAINS(Load(*t.module, nullptr, dir, {.layout = {.model = two_rows}}),
                          "the model's 'head.weight' of size [1, 5] is read from 2 of its rows");
    EXPECT_ERROR_CONTAINS(Load(*t.module, nullptr, dir, {.layout = {.model_prefix = "weights."}}),
                          "lacks 14 of the model's 14 keys: 'weights.extra', 'weights.in.weight'");
  });
}

// SaveOptions::stored_fqn: the checkpoint keeps the model's tensors and optimizer state under
// other names (block0 and block1 swapped); a load through the same names (StoredLayout, also the
// nested param groups' FQN lists) gives back the saved state on another mesh, a load without it
// reads block1's saved tensors into block0. Two FQNs given one name are an error.
TEST(DcpLayout, SaveUnderStoredNames) {
  const std::string dir = NewDir("stored_fqn");
  const auto swapped = [](std::string fqn) {
    if (absl::StartsWith(fqn, "block0.")) return fqn.replace(5, 1, "1");
    if (absl::StartsWith(fqn, "block1.")) return fqn.replace(5, 1, "0");
    return fqn;
  };
  FullState saved;
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(3), pg, 11);
    Train(t, 0, kSteps);
    Save(*t.module, t.opt.get(), dir, {.stored_fqn = swapped});
    FullState full = GetFull(t);
    if (pg->rank() == 0) saved = std::move(full);
    EXPECT_ERROR_CONTAINS(
        Save(*t.module, nullptr, NewDir("stored_fqn_bad"),
             {.stored_fqn = [](const std::string& fqn) { return fqn == "extra" ? "head.weight" : fqn; }}),
        "dcp: SaveOptions::stored_fqn gives both 'extra' and 'head.weight' the name 'head.weight'");
  });
  const auto stored = [&](const std::string& fqn) { return StoredTensor{swapped(fqn), {}}; };
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 99);
    Load(*t.module, t.opt.get(), dir, {.layout = {.model = stored, .optimizer = stored}});
    const FullState got = GetFull(t);
    if (pg->rank() == 0) ExpectSameState(got, saved, "loaded through the stored names");
    Trainee plain = Build(W(2), pg, 99);
    Load(*plain.module, nullptr, dir);
    const fsdp2::FullStateDict swapped_model = fsdp2::GetFullStateDict(*plain.module);
    if (pg->rank() != 0) return;
    for (const auto& item : swapped_model) {
      EXPECT_TRUE(at::equal(item.value(), *saved.model.find(swapped(item.key())))) << item.key();
    }
  });
}

}  // namespace
}  // namespace fsdp::dcp
