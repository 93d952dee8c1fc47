// //dcp: a model trained 3 AdamW steps on one mesh, saved, loaded on another (every pair of
// world sizes 1-4, HSDP 2x2, FSDP + TP 2x2 on both TP paths), trained 3 more steps, matches
// an uninterrupted single-rank run; the loaded state is bitwise the saved one. Also: the key
// names and dedup of the files, full and rank-0 saves, AsyncSave, bad checkpoints, and one
// case on Gloo processes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/dcp_storage.h"
#include "checkpoint/file_io.h"
#include "dcp/dcp.h"
#include "dcp/plan.h"
#include "dtensor/tensor_parallel.h"
#include "fsdp/per_param/state_dict.h"
#include "fsdp/per_param/test_models.h"
#include "optim_state/fsdp2_optim_state.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::dcp {
namespace {

using fsdp::testing::Backend;
using per_param::FullyShardOptions;
using per_param::testing::Batch;
using per_param::testing::InitDeterministic;
using per_param::testing::Net;
using per_param::testing::NetOptions;

std::string NewDir(const std::string& name) {
  static int counter = 0;
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name, "_", getpid(), "_", counter++);
}

// ----------------------------------------------------------------------- TP models
// As fsdp/per_param/parity_test.cc: blocks with a colwise fc1 and a rowwise fc2 on "tp";
// `spmd` set: their specs live on the whole (dp, tp) mesh (the dp_mesh_dims path).
struct SpmdLinearImpl : dtensor::TensorParallelLinearImpl {
  SpmdLinearImpl(const torch::nn::Linear& linear, mesh::DeviceMeshPtr spmd, dtensor::TensorParallelStyle style)
      : TensorParallelLinearImpl(linear, (*spmd)["tp"], style), spmd_(std::move(spmd)) {}
  std::vector<std::pair<std::string, dtensor::DTensorSpec>> named_parameter_specs() const override {
    auto specs = TensorParallelLinearImpl::named_parameter_specs();
    for (auto& [name, spec] : specs) {
      spec = dtensor::DTensorSpec::Make(spmd_, {dtensor::Placement::Replicate(), spec.placements[0]}, spec.shape,
                                        spec.dtype);
    }
    return specs;
  }
  mesh::DeviceMeshPtr spmd_;
};

dtensor::TensorParallelLinear Parallel(const torch::nn::Linear& l, const mesh::DeviceMeshPtr& tp,
                                       const mesh::DeviceMeshPtr& spmd, dtensor::TensorParallelStyle style) {
  if (!spmd) return ParallelizeLinear(l, tp, style);
  std::shared_ptr<dtensor::TensorParallelLinearImpl> impl = std::make_shared<SpmdLinearImpl>(l, spmd, style);
  return dtensor::TensorParallelLinear(impl);
}

struct TPBlockImpl : torch::nn::Module {
  TPBlockImpl(const per_param::testing::BlockImpl& plain, const mesh::DeviceMeshPtr& tp,
              const mesh::DeviceMeshPtr& spmd)
      : fc1(register_module("fc1", Parallel(plain.fc1, tp, spmd, dtensor::TensorParallelStyle::kColwise))),
        fc2(register_module("fc2", Parallel(plain.fc2, tp, spmd, dtensor::TensorParallelStyle::kRowwise))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::nn::functional::relu(fc1(x))); }
  dtensor::TensorParallelLinear fc1, fc2;
};
using TPBlock = per_param::FullySharded<TPBlockImpl>;

torch::nn::Linear CloneLinear(const torch::nn::Linear& l) {
  return torch::nn::Linear(std::dynamic_pointer_cast<torch::nn::LinearImpl>(l->clone()));
}

// NetImpl's parameter names and forward, with TP blocks.
struct TPNetImpl : torch::nn::Module {
  TPNetImpl(const per_param::testing::NetImpl& plain, const mesh::DeviceMeshPtr& tp, const mesh::DeviceMeshPtr& spmd)
      : in(register_module("in", CloneLinear(plain.in))), head(register_module("head", CloneLinear(plain.head))) {
    for (size_t i = 0; i < plain.layers.size(); ++i) {
      layers.push_back(register_module(absl::StrCat("block", i), TPBlock(*plain.layers[i], tp, spmd)));
    }
    extra = register_parameter("extra", plain.extra.detach().clone());
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    for (auto& b : layers) h = b(h);
    return head(h) + extra.sum();
  }
  torch::nn::Linear in, head;
  std::vector<TPBlock> layers;
  at::Tensor extra;
};
using TPNet = per_param::FullySharded<TPNetImpl>;

// ------------------------------------------------------------------- the training runs
enum class Layout { k1D, kHsdp, kTp, kSpmd };
struct Mesh {
  Layout layout = Layout::k1D;
  int world = 1;
  std::string Name() const {
    switch (layout) {
      case Layout::k1D: return absl::StrCat("W", world);
      case Layout::kHsdp: return "HSDP2x2";
      case Layout::kTp: return "TP2x2";
      case Layout::kSpmd: return "SPMD-TP2x2";
    }
    return "?";
  }
};
Mesh W(int world) { return {Layout::k1D, world}; }
constexpr Mesh kHsdp{Layout::kHsdp, 4}, kTp{Layout::kTp, 4}, kSpmd{Layout::kSpmd, 4};

constexpr double kLr = 1e-2;
constexpr int kSteps = 3;            // before and after the checkpoint
const NetOptions kNet{.hidden = 8};  // even TP shards (README: uneven FSDP + TP)

struct Trainee {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::unique_ptr<torch::optim::AdamW> opt;
  comm::ProcessGroupPtr world;
  int data_world = 1, data_rank = 0;
};

// A Net (weights from `seed`, plus a buffer "scale") laid out on `m`, with AdamW.
Trainee Build(const Mesh& m, const comm::ProcessGroupPtr& pg, uint64_t seed, NetOptions net = kNet) {
  Trainee t;
  t.world = pg;
  Net plain(net);
  InitDeterministic(*plain, seed);
  const at::Tensor scale = at::arange(4, at::kFloat) + static_cast<double>(seed);
  if (m.layout == Layout::k1D || m.layout == Layout::kHsdp) {
    plain->register_buffer("scale", scale);
    auto mesh = m.layout == Layout::k1D ? mesh::DeviceMesh::Create(pg, {m.world})
                                        : mesh::DeviceMesh::Create(pg, {2, 2}, {"replicate", "shard"});
    for (auto& b : plain->layers) per_param::fully_shard(b.ptr(), {.mesh = mesh});
    per_param::fully_shard(plain.ptr(), {.mesh = mesh});
    t.module = plain.ptr();
    t.forward = [plain](const at::Tensor& x) mutable { return plain(x); };
    t.data_world = m.world;
    t.data_rank = pg->rank();
  } else {
    auto mesh = mesh::DeviceMesh::Create(pg, {2, 2}, {"dp", "tp"});
    const bool spmd = m.layout == Layout::kSpmd;
    TPNet model(*plain, (*mesh)["tp"], spmd ? mesh : nullptr);
    model->register_buffer("scale", scale);
    FullyShardOptions block{.mesh = (*mesh)["dp"]};
    if (spmd) block = FullyShardOptions{.mesh = mesh, .dp_mesh_dims = per_param::DataParallelMeshDims{"dp"}};
    for (auto& b : model->layers) per_param::fully_shard(b.ptr(), block);
    per_param::fully_shard(model.ptr(), {.mesh = (*mesh)["dp"]});
    t.module = model.ptr();
    t.forward = [model](const at::Tensor& x) mutable { return model(x); };
    t.data_world = 2;
    t.data_rank = static_cast<int>(mesh->coordinate()[0]);
  }
  t.opt = std::make_unique<torch::optim::AdamW>(t.module->parameters(), torch::optim::AdamWOptions(kLr));
  return t;
}

// Steps [first, first + steps): each data-parallel rank its rows of the 12-row batch. Returns
// the global losses (mean over the world of the local ones = the full batch's loss).
std::vector<double> Train(Trainee& t, int first, int steps) {
  std::vector<double> losses;
  const int64_t rows = 12 / t.data_world;
  for (int step = first; step < first + steps; ++step) {
    const at::Tensor x = Batch(step, 12, 3, 1).narrow(0, t.data_rank * rows, rows);
    const at::Tensor y = Batch(step, 12, 1, 2).narrow(0, t.data_rank * rows, rows);
    const at::Tensor loss = torch::nn::functional::mse_loss(t.forward(x), y);
    loss.backward();
    t.opt->step();
    t.opt->zero_grad();
    at::Tensor sum = loss.detach().clone().reshape({1});
    t.world->all_reduce(sum)->wait();
    losses.push_back(sum.item<double>() / t.world->size());
  }
  return losses;
}

// The uninterrupted single-rank run: 2 * kSteps steps of the plain Net from seed 11.
struct Reference {
  std::vector<double> losses;
  torch::OrderedDict<std::string, at::Tensor> params;
};
Reference RunReference() {
  Net ref(kNet);
  InitDeterministic(*ref, 11);
  torch::optim::AdamW opt(ref->parameters(), torch::optim::AdamWOptions(kLr));
  Reference r;
  for (int step = 0; step < 2 * kSteps; ++step) {
    const at::Tensor loss = torch::nn::functional::mse_loss(ref(Batch(step, 12, 3, 1)), Batch(step, 12, 1, 2));
    loss.backward();
    opt.step();
    opt.zero_grad();
    r.losses.push_back(loss.item<double>());
  }
  for (const auto& p : ref->named_parameters()) r.params.insert(p.key(), p.value().detach().clone());
  return r;
}

// FSDP on W ranks vs one rank: the reductions add in another order, so agreement is to f32
// rounding over a few AdamW steps (as fsdp/per_param/parity_test.cc), not bitwise.
constexpr double kTol = 1e-6;

void ExpectClose(double got, double want, const std::string& what) {
  EXPECT_LE(std::abs(got - want), kTol * std::max(1.0, std::abs(want))) << what << ": " << got << " vs " << want;
}

// The model's full state (parameters, buffer, optimizer state), collective.
struct FullState {
  per_param::FullStateDict model;
  optim_state::OptimStateDict optim;
};
FullState GetFull(Trainee& t) {
  return {per_param::GetFullStateDict(*t.module), optim_state::GetFullOptimStateDict(*t.module, *t.opt)};
}

void ExpectSameState(const FullState& got, const FullState& want, const std::string& what) {
  ASSERT_EQ(got.model.size(), want.model.size()) << what;
  for (const auto& item : want.model) {
    const at::Tensor* g = got.model.find(item.key());
    ASSERT_NE(g, nullptr) << what << " " << item.key();
    EXPECT_TRUE(at::equal(*g, item.value())) << what << " " << item.key();
  }
  ASSERT_EQ(got.optim.state.size(), want.optim.state.size()) << what;
  for (const auto& [fqn, state] : want.optim.state) {
    ASSERT_EQ(got.optim.state.count(fqn), 1u) << what << " " << fqn;
    const auto& g = got.optim.state.at(fqn);
    ASSERT_EQ(g.size(), state.size()) << what << " " << fqn;
    for (const auto& [name, value] : state) {
      const auto& v = g.at(name);
      if (const at::Tensor* t = std::get_if<at::Tensor>(&value)) {
        EXPECT_TRUE(at::equal(std::get<at::Tensor>(v), *t)) << what << " " << fqn << "." << name;
      } else if (const int64_t* i = std::get_if<int64_t>(&value)) {
        ASSERT_TRUE(std::holds_alternative<int64_t>(v)) << what << " " << fqn << "." << name;
        EXPECT_EQ(std::get<int64_t>(v), *i) << what << " " << fqn << "." << name;
      }
    }
  }
  ASSERT_EQ(got.optim.param_groups.size(), 1u);
  EXPECT_EQ(got.optim.param_groups[0].options.at("lr").toDouble(), kLr);
}

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
    const per_param::FullStateDict full = per_param::GetFullStateDict(*t.module);
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

// Uneven FSDP + TP (fsdp/per_param/parity_test.cc's layouts: colwise Linear(9, 18) and
// Linear(9, 27), rowwise Linear(9, 5) on dp 2 x tp 2): each rank writes the boxes it really
// holds, and one rank reads back the original weights.
struct LinearsImpl : torch::nn::Module {
  LinearsImpl(const std::vector<torch::nn::Linear>& plain, const mesh::DeviceMeshPtr& tp) {
    const dtensor::TensorParallelStyle styles[] = {dtensor::TensorParallelStyle::kColwise,
                                                   dtensor::TensorParallelStyle::kColwise,
                                                   dtensor::TensorParallelStyle::kRowwise};
    for (size_t i = 0; i < plain.size(); ++i) {
      const std::string name = absl::StrCat("l", i);
      if (tp) {
        register_module(name, ParallelizeLinear(plain[i], tp, styles[i]));
      } else {
        register_module(name, CloneLinear(plain[i]));
      }
    }
  }
  at::Tensor forward(const at::Tensor& x) { return x; }
};
using Linears = per_param::FullySharded<LinearsImpl>;

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
    per_param::fully_shard(model.ptr(), {.mesh = (*mesh)["dp"]});
    Save(*model, nullptr, dir);
  });
  for (int world : {1, 3}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
      Linears model(UnevenLinears(-3.0), nullptr);
      per_param::fully_shard(model.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {world})});
      Load(*model, nullptr, dir);
      const per_param::FullStateDict full = per_param::GetFullStateDict(*model);
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

// ------------------------------------------------------------------------ bad inputs
TEST(DcpErrors, BadCheckpointsAreClearErrorsAndChangeNothing) {
  const std::string good = NewDir("good"), other = NewDir("other"), small = NewDir("small"), empty = NewDir("empty"),
                    model_only = NewDir("model_only");
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    Train(t, 0, 1);
    Save(*t.module, t.opt.get(), good);
    Save(*t.module, nullptr, model_only);
    Trainee one_block = Build(W(2), pg, 11, NetOptions{.blocks = 1, .hidden = 8});
    Save(*one_block.module, one_block.opt.get(), small);
    Hooked<torch::nn::LinearImpl> linear(4, 4);
    per_param::fully_shard(linear.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {2})});
    Save(*linear, nullptr, other);

    Trainee target = Build(W(2), pg, 99, NetOptions{.hidden = 9});
    const per_param::FullStateDict before = per_param::GetFullStateDict(*target.module);
    EXPECT_ERROR_CONTAINS(Load(*target.module, target.opt.get(), empty),
                          "dcp::Load: '" + empty + "' holds no complete checkpoint: ReadMetadata: cannot open '" +
                              empty + "/.metadata' for reading");
    EXPECT_ERROR_CONTAINS(Load(*target.module, target.opt.get(), good),
                          "dcp::Load: 'model.block0.fc1.weight' in the checkpoint '" + good +
                              "' has size [8, 5], but the model's 'block0.fc1.weight' has size [9, 5]");
    Trainee two = Build(W(2), pg, 99);
    EXPECT_ERROR_CONTAINS(Load(*two.module, two.opt.get(), small),
                          "dcp::Load: the checkpoint '" + small +
                              "' lacks 4 of the model's 14 keys: 'model.block1.fc1.weight', 'model.block1.fc1.bias'");
    EXPECT_ERROR_CONTAINS(
        Load(*two.module, two.opt.get(), other),
        "dcp::Load: the checkpoint '" + other + "' lacks 14 of the model's 14 keys: 'model.extra', 'model.in.weight'");
    EXPECT_ERROR_CONTAINS(Load(*two.module, two.opt.get(), model_only),
                          "dcp::Load: the checkpoint '" + model_only +
                              "' has no optimizer state (no entry 'optim.param_groups.0.params')");
    const per_param::FullStateDict after = per_param::GetFullStateDict(*target.module);
    for (const auto& item : before) EXPECT_TRUE(at::equal(*after.find(item.key()), item.value())) << item.key();
    EXPECT_EQ(two.opt->state().size(), 0u);  // nothing loaded

    // Partial loads take what is there; a model-only checkpoint loads without the optimizer.
    Load(*two.module, nullptr, small, {.allow_partial_load = true});
    Load(*two.module, nullptr, model_only);
  });
  // A chunk file gone: the rank that needs it names it, every rank fails.
  ASSERT_EQ(std::remove((good + "/__1_0.distcp").c_str()), 0);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 99);
    EXPECT_ERROR_CONTAINS(Load(*t.module, t.opt.get(), good), "__1_0.distcp");
  });
}

// A rank that cannot write its file (its name is taken by a directory) fails the save on
// every rank, synchronously or from wait(), and no `.metadata` appears.
TEST(DcpErrors, AFailedWriteFailsEveryRankAndLeavesNoMetadata) {
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "AsyncSave" : "Save");
    const std::string dir = NewDir("unwritable");
    ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
    ASSERT_EQ(::mkdir((dir + "/__1_0.distcp").c_str(), 0755), 0);
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
      Trainee t = Build(W(2), pg, 11);
      const std::string want = pg->rank() == 1 ? "WriteRankData: cannot rename '" + dir + "/__1_0.distcp.tmp."
                                               : std::string(async ? "dcp::AsyncSave" : "dcp::Save") +
                                                     ": rank 1 failed: WriteRankData: cannot rename";
      if (async) {
        AsyncSaveHandle h = AsyncSave(*t.module, t.opt.get(), dir);
        EXPECT_ERROR_CONTAINS(h.wait(), want);
        EXPECT_ERROR_CONTAINS(h.wait(), want);  // the same outcome again
      } else {
        EXPECT_ERROR_CONTAINS(Save(*t.module, t.opt.get(), dir), want);
      }
    });
    struct stat st {};
    EXPECT_NE(::stat((dir + "/.metadata").c_str(), &st), 0) << "an incomplete checkpoint has metadata";
  }
  // A failed AsyncSave whose handle is dropped without wait() says so on stderr.
  const std::string dir = NewDir("unwritable_unwaited");
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((dir + "/__1_0.distcp").c_str(), 0755), 0);
  ::testing::internal::CaptureStderr();
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    AsyncSave(*t.module, t.opt.get(), dir);  // the handle dies here, unwaited
  });
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(absl::StrContains(err, "dcp::AsyncSave failed and its handle was destroyed without wait()")) << err;
}

// ----------------------------------------------------------------- Gloo processes
// Two processes save asynchronously (the writer threads agree over a Gloo subgroup), three
// load and finish the run.
TEST(DcpGlooProcesses, SaveOnTwoProcessesLoadOnThree) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/dcp_gloo_processes_ckpt");
  fsdp::testing::RunOnRanks(Backend::kGlooProcesses, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    Train(t, 0, kSteps);
    AsyncSaveHandle h = AsyncSave(*t.module, t.opt.get(), dir);
    h.wait();
  });
  fsdp::testing::RunOnRanks(Backend::kGlooProcesses, 3, [&](const comm::ProcessGroupPtr& pg) {
    const Reference ref = RunReference();
    Trainee t = Build(W(3), pg, 99);
    Load(*t.module, t.opt.get(), dir);
    const std::vector<double> losses = Train(t, kSteps, kSteps);
    for (int s = 0; s < kSteps; ++s) ExpectClose(losses[s], ref.losses[kSteps + s], absl::StrCat("loss ", s));
  });
}

}  // namespace
}  // namespace fsdp::dcp
