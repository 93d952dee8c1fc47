// The parallel styles, parallelize_module and loss parallel against real PyTorch 2.15: the
// corpus testing/golden/gen_tensor_parallel.py writes (`./x golden`) with the same models,
// parameters, inputs and output gradients; every rank's output, input gradient, the full
// parameter gradients and the collectives of forward and backward must match. One test per
// corpus case (--gtest_filter='Corpus/TensorParallelGolden.MatchesPyTorch/colwise_linear_W2'). Then
// the errors a plan can raise.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "comm/comm_trace.h"
#include "distributed_parameters/distributed_parameters.h"
#include "dtensor/dtensor.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "tensor_parallel/local_annotation.h"
#include "tensor_parallel/loss_parallel.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"
#include "testing/expect_error.h"
#include "testing/golden_file.h"
#include "testing/multi_rank.h"

namespace fsdp::tensor_parallel {

using ::fsdp::distributed_parameters::DistributedParameterSpecs;
using ::fsdp::dtensor::DTensor;
using ::fsdp::dtensor::DTensorSpec;
using ::fsdp::dtensor::Placement;
using ::fsdp::dtensor::PlacementKind;
using ::fsdp::dtensor::Placements;
namespace {

using Linear = ::fsdp::Hooked<torch::nn::LinearImpl>;
using Embedding = ::fsdp::Hooked<torch::nn::EmbeddingImpl>;
using LayerNorm = ::fsdp::Hooked<torch::nn::LayerNormImpl>;
using ::fsdp::testing::GoldenFields;
using ::fsdp::testing::GoldenInt;
using ::fsdp::testing::GoldenInts;
using ::fsdp::testing::GoldenNums;
using ::fsdp::testing::Mismatches;

// ------------------------------------------------------------------ the models

struct FFNImpl : torch::nn::Module {
  FFNImpl()
      : w1(register_module("w1", Linear(4, 6))),
        w2(register_module("w2", Linear(4, 6))),
        w3(register_module("w3", Linear(6, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return w3(at::silu(w1(x)) * w2(x)); }
  Linear w1, w2, w3;
};
using FFN = ::fsdp::Hooked<FFNImpl>;

struct SPBlockImpl : torch::nn::Module {
  SPBlockImpl()
      : norm(register_module("norm", LayerNorm(torch::nn::LayerNormOptions({4})))),
        ffn(register_module("ffn", FFN())) {}
  at::Tensor forward(const at::Tensor& x) { return x + ffn(norm(x)); }
  LayerNorm norm;
  FFN ffn;
};

struct StackImpl : torch::nn::Module {
  StackImpl() : layers(register_module("layers", torch::nn::ModuleList())) {
    for (int i = 0; i < 2; ++i) {
      typed.push_back(FFN());
      layers->push_back(typed.back());
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : typed) x = x + layer(x);
    return x;
  }
  torch::nn::ModuleList layers;
  std::vector<FFN> typed;
};

struct Model {
  std::shared_ptr<torch::nn::Module> root;
  std::function<at::Tensor(const at::Tensor&)> forward;
};

template <class Holder>
Model Wrap(Holder h) {
  return Model{h.ptr(), [h](const at::Tensor& x) mutable { return h(x); }};
}

// gen_tensor_parallel.py make_model: the same module tree, names and parameter rule.
Model MakeModel(const std::string& name) {
  const std::vector<std::string> parts = absl::StrSplit(name, '_');
  Model m;
  if (parts[0] == "linear" && parts[1] == "nobias") {
    m = Wrap(Linear(torch::nn::LinearOptions(GoldenInt(parts[2]), GoldenInt(parts[3])).bias(false)));
  } else if (parts[0] == "linear") {
    m = Wrap(Linear(GoldenInt(parts[1]), GoldenInt(parts[2])));
  } else if (parts[0] == "embedding") {
    m = Wrap(Embedding(GoldenInt(parts[1]), GoldenInt(parts[2])));
  } else if (parts[0] == "layernorm") {
    m = Wrap(LayerNorm(torch::nn::LayerNormOptions({GoldenInt(parts[1])})));
  } else if (name == "ffn") {
    m = Wrap(FFN());
  } else if (name == "sp_block") {
    m = Wrap(torch::nn::ModuleHolder<SPBlockImpl>(std::make_shared<SPBlockImpl>()));
  } else if (name == "stack") {
    m = Wrap(torch::nn::ModuleHolder<StackImpl>(std::make_shared<StackImpl>()));
  } else {
    throw std::runtime_error("unknown model " + name);
  }
  m.root->to(at::kDouble);
  at::NoGradGuard no_grad;
  for (auto& item : m.root->named_parameters()) {
    const int64_t n = item.value().numel();
    const at::Tensor rule =
        ((at::arange(n, at::kLong) * 7 + static_cast<int64_t>(item.key().size())).remainder(13) - 6).to(at::kDouble) /
        8;
    item.value().copy_(rule.view(item.value().sizes()));
  }
  return m;
}

// ------------------------------------------------------------------ plan tokens

std::optional<Placement> ParseLayout(const std::string& token) {
  if (token == "-") return std::nullopt;
  if (token == "R") return Placement::Replicate();
  if (absl::StartsWith(token, "S(") && absl::EndsWith(token, ")")) {
    return Placement::Shard(GoldenInt(token.substr(2, token.size() - 3)));
  }
  if (token == "P(sum)") return Placement::Partial();
  throw std::runtime_error("unknown layout " + token);
}

std::vector<std::optional<Placement>> ParseLayouts(const std::string& token) {
  std::vector<std::optional<Placement>> out;
  for (absl::string_view t : absl::StrSplit(token, ',')) out.push_back(ParseLayout(std::string(t)));
  return out;
}

ParallelStylePtr ParseStyle(const std::string& token) {
  const std::vector<std::string> a = absl::StrSplit(token, ':');
  const auto flag = [&](size_t i) { return a.at(i) == "1"; };
  if (a[0] == "colwise" || a[0] == "rowwise") {
    LinearStyleOptions o{ParseLayout(a.at(1)), ParseLayout(a.at(2)), flag(3)};
    return a[0] == "colwise" ? ColwiseParallel(o) : RowwiseParallel(o);
  }
  if (a[0] == "sequence") return SequenceParallel({GoldenInt(a.at(1)), flag(2)});
  if (a[0] == "input") return PrepareModuleInput({ParseLayouts(a.at(1)), ParseLayouts(a.at(2)), flag(3)});
  if (a[0] == "output") return PrepareModuleOutput({ParseLayouts(a.at(1)), ParseLayouts(a.at(2)), flag(3)});
  if (a[0] == "inout") {
    return PrepareModuleInputOutput(
        {ParseLayouts(a.at(1)), ParseLayouts(a.at(2)), flag(3), ParseLayouts(a.at(4)), ParseLayouts(a.at(5)), flag(6)});
  }
  throw std::runtime_error("unknown style " + token);
}

// ------------------------------------------------------------------ the corpus

struct RankValues {
  std::vector<int64_t> shape;
  std::vector<double> values;
};

struct Case {
  std::string name;  // the test's: gen_tensor_parallel.py's case name and the world size
  std::string title;
  int world = 0;
  bool is_loss = false;
  // style cases
  std::string model;
  bool integer_input = false;
  ParallelizePlan plan;
  std::vector<RankValues> in, outgrad, out, ingrad;
  struct ParamGrad {
    std::string fqn, placement;
    RankValues full;
  };
  std::vector<ParamGrad> pgrads;
  // loss cases
  int64_t n = 0, classes = 0, ignore_index = -100;
  LossReduction reduction = LossReduction::kMean;
  std::vector<int64_t> target;
  RankValues value;
  // both
  std::map<std::string, int64_t> forward_comms, backward_comms;
};

std::map<std::string, int64_t> ParseComms(const std::string& field) {
  std::map<std::string, int64_t> out;
  if (field == "-") return out;
  for (absl::string_view kv : absl::StrSplit(field, ',')) {
    const std::vector<std::string> p = absl::StrSplit(kv, '=');
    out[p.at(0)] = GoldenInt(p.at(1));
  }
  return out;
}

RankValues Values(const GoldenFields& f, size_t at) { return {GoldenInts(f.at(at)), GoldenNums(f.at(at + 1))}; }

std::vector<Case> ReadCorpus() {
  std::vector<Case> cases;
  for (const GoldenFields& f : ::fsdp::testing::ReadGoldenFile("tensor_parallel/testdata/golden_tensor_parallel.txt")) {
    const std::string& kind = f.at(0);
    if (kind == "case") {
      Case c;
      c.name = absl::StrCat(f.at(1), "_W", f.at(2));
      c.title = absl::StrCat(f.at(1), " (W=", f.at(2), ")");
      c.world = static_cast<int>(GoldenInt(f.at(2)));
      c.model = f.at(3);
      c.integer_input = f.at(4) == "i";
      cases.push_back(std::move(c));
      continue;
    }
    if (kind == "loss") {
      Case c;
      c.is_loss = true;
      c.title = absl::StrCat("loss ", absl::StrJoin(f.begin() + 1, f.end(), " "));
      // loss_W2_n6_classes10_mean_ignore_m100: world, rows, classes, reduction, ignore_index.
      c.name = absl::StrCat("loss_W", f.at(1), "_n", f.at(2), "_classes", f.at(3), "_", f.at(4), "_ignore_",
                            absl::StartsWith(f.at(5), "-") ? "m" + f.at(5).substr(1) : f.at(5));
      c.world = static_cast<int>(GoldenInt(f.at(1)));
      c.n = GoldenInt(f.at(2));
      c.classes = GoldenInt(f.at(3));
      c.reduction = f.at(4) == "mean"  ? LossReduction::kMean
                    : f.at(4) == "sum" ? LossReduction::kSum
                                       : LossReduction::kNone;
      c.ignore_index = GoldenInt(f.at(5));
      cases.push_back(std::move(c));
      continue;
    }
    if (cases.empty()) throw std::runtime_error("record before the first case: " + kind);
    Case& c = cases.back();
    if (kind == "plan") {
      c.plan.emplace_back(f.at(1) == "-" ? "" : f.at(1), ParseStyle(f.at(2)));
    } else if (kind == "in" || kind == "outgrad" || kind == "out" || kind == "ingrad") {
      auto& list = kind == "in" ? c.in : kind == "outgrad" ? c.outgrad : kind == "out" ? c.out : c.ingrad;
      list.push_back(Values(f, 2));
    } else if (kind == "pgrad") {
      c.pgrads.push_back({f.at(1), f.at(2), Values(f, 3)});
    } else if (kind == "comms") {
      (f.at(1) == "forward" ? c.forward_comms : c.backward_comms) = ParseComms(f.at(2));
    } else if (kind == "target") {
      c.target = GoldenInts(f.at(1));
    } else if (kind == "value") {
      c.value = Values(f, 1);
    } else {
      throw std::runtime_error("unexpected record " + kind);
    }
  }
  return cases;
}

// ------------------------------------------------------------------ comparing

// float64 throughout. A value is a sum of at most a few dozen products of order-1 numbers
// (the models are 4-10 wide), summed in an order that differs between ATen's kernels,
// PyTorch's DTensor decompositions and the ranks' reduction: each order's rounding error
// is at most (terms) * eps(double) * (sum of magnitudes) ~ 50 * 2.2e-16 * 100 = 1.1e-12.
constexpr double kTolerance = 1e-11;

std::string Compare(const at::Tensor& ours, const RankValues& want) {
  const at::Tensor got = ours.detach().to(at::kDouble).contiguous();
  if (got.sizes().vec() != want.shape) {
    return absl::StrCat("shape [", absl::StrJoin(got.sizes(), ","), "] vs PyTorch's [", absl::StrJoin(want.shape, ","),
                        "]");
  }
  const double* g = got.data_ptr<double>();
  for (size_t i = 0; i < want.values.size(); ++i) {
    if (!(std::abs(g[i] - want.values[i]) <= kTolerance * std::max(1.0, std::abs(want.values[i])))) {
      return absl::StrCat("element ", i, ": ", g[i], " vs PyTorch's ", want.values[i]);
    }
  }
  return "";
}

at::Tensor Tensor(const RankValues& v, bool integer) {
  at::Tensor t = at::tensor(at::ArrayRef<double>(v.values), at::kDouble).view(v.shape).clone();
  return integer ? t.to(at::kLong) : t;
}

std::string CommText(const std::map<std::string, int64_t>& comms) {
  std::vector<std::string> parts;
  for (const auto& [kind, n] : comms) {
    if (n != 0) parts.push_back(absl::StrCat(kind, "=", n));
  }
  return parts.empty() ? "-" : absl::StrJoin(parts, ",");
}

std::map<std::string, int64_t> Counts(const comm::CommTrace& trace) {
  std::map<std::string, int64_t> counts;
  for (const auto& r : trace.records()) {
    const std::string kind = r.op == "all_gather_into_tensor"  ? "all_gather"
                             : r.op == "reduce_scatter_tensor" ? "reduce_scatter"
                                                               : r.op;
    ++counts[kind];
  }
  return counts;
}

class CaseRun {
 public:
  CaseRun(const Case& c, const comm::ProcessGroupPtr& pg, Mismatches& bad)
      : c_(c), rank_(pg->rank()), trace_(std::make_shared<comm::CommTrace>(pg)), bad_(bad) {
    mesh_ = mesh::DeviceMesh::Create(trace_, {c.world});
  }

  void Check(const std::string& what, const std::string& problem) {
    if (!problem.empty()) bad_.Add(what, absl::StrCat(c_.title, " rank ", rank_, ": ", problem));
  }

  void CheckComms(const std::string& phase, const std::map<std::string, int64_t>& ours,
                  const std::map<std::string, int64_t>& theirs) {
    if (CommText(ours) != CommText(theirs)) {
      Check(phase + " collectives", absl::StrCat("ours ", CommText(ours), ", PyTorch's ", CommText(theirs)));
    }
  }

  void RunStyleCase() {
    Model model = MakeModel(c_.model);
    parallelize_module(*model.root, mesh_, c_.plan);
    at::Tensor x = Tensor(c_.in.at(rank_), c_.integer_input);
    if (!c_.integer_input) x.requires_grad_();
    trace_->clear();
    at::Tensor y = model.forward(x);
    const auto forward = Counts(*trace_);
    trace_->clear();
    y.backward(Tensor(c_.outgrad.at(rank_), false));
    auto backward = Counts(*trace_);
    CheckComms("forward", forward, c_.forward_comms);
    // PyTorch leaves a Partial parameter gradient to be reduced later (optimizer, clip,
    // FSDP); ours is reduced as it accumulates (tensor_parallel/parallel_style.h).
    auto expected_backward = c_.backward_comms;
    for (const auto& p : c_.pgrads) expected_backward["all_reduce"] += p.placement == "P(sum)" ? 1 : 0;
    CheckComms("backward", backward, expected_backward);
    Check("output", Compare(y, c_.out.at(rank_)));
    if (!c_.integer_input) Check("input gradient", Compare(x.grad(), c_.ingrad.at(rank_)));
    const auto specs = DistributedParameterSpecs(*model.root);
    const auto params = model.root->named_parameters();
    for (const auto& p : c_.pgrads) {
      const at::Tensor* param = params.find(p.fqn);
      if (param == nullptr || !param->grad().defined()) {
        Check("parameter gradient", p.fqn + ": missing");
        continue;
      }
      const auto spec = specs.find(param->unsafeGetTensorImpl());
      if (spec == specs.end()) {
        Check("parameter layout", p.fqn + ": no DTensor spec");
        continue;
      }
      const at::Tensor full = DTensor::FromSpec(param->grad(), spec->second).full_tensor();
      Check("parameter gradient", [&] {
        const std::string problem = Compare(full, p.full);
        return problem.empty() ? problem : p.fqn + ": " + problem;
      }());
    }
  }

  void RunLossCase() {
    at::Tensor local = Tensor(c_.in.at(rank_), false).requires_grad_();
    const DTensor logits =
        DTensor::from_local(local, mesh_, {Placement::Shard(1)}, std::vector<int64_t>{c_.n, c_.classes});
    const at::Tensor target = at::tensor(c_.target, at::kLong);
    trace_->clear();
    at::Tensor loss = loss_parallel_cross_entropy(logits, target, {c_.reduction, c_.ignore_index});
    const auto forward = Counts(*trace_);
    trace_->clear();
    loss.sum().backward();
    CheckComms("forward", forward, c_.forward_comms);
    CheckComms("backward", Counts(*trace_), c_.backward_comms);
    Check("loss", Compare(loss, c_.value));
    Check("logits gradient", Compare(local.grad(), c_.ingrad.at(rank_)));
  }

 private:
  const Case& c_;
  const int rank_;
  std::shared_ptr<comm::CommTrace> trace_;
  mesh::DeviceMeshPtr mesh_;
  Mismatches& bad_;
};

// One corpus case: a style (or plan) case or a loss-parallel case on its own threaded world.
class TensorParallelGolden : public ::testing::TestWithParam<::fsdp::testing::GoldenCase<Case>> {};

TEST_P(TensorParallelGolden, MatchesPyTorch) {
  ASSERT_GOLDEN_CASE_LOADED();
  const Case& c = *GetParam();
  ASSERT_EQ(static_cast<int>(c.in.size()), c.world) << c.title;
  Mismatches bad;
  ::fsdp::testing::RunOnRanks(::fsdp::testing::Backend::kThreaded, c.world, [&](const comm::ProcessGroupPtr& pg) {
    CaseRun run(c, pg, bad);
    c.is_loss ? run.RunLossCase() : run.RunStyleCase();
  });
  EXPECT_EQ(bad.total(), 0) << c.title << " differs from PyTorch:\n" << bad.Report();
}

INSTANTIATE_TEST_SUITE_P(
    Corpus, TensorParallelGolden,
    ::testing::ValuesIn(::fsdp::testing::GoldenCases<Case>("tensor_parallel/testdata/golden_tensor_parallel.txt", 20,
                                                           ReadCorpus, [](const Case& c) { return c.name; })),
    ::fsdp::testing::GoldenCaseName());

// ------------------------------------------------------------------ errors

TEST(TensorParallelPlan, FnMatchFollowsPython) {
  EXPECT_TRUE(FnMatch("*", "w1"));
  EXPECT_TRUE(FnMatch("w[12]", "w2"));
  EXPECT_FALSE(FnMatch("w[12]", "w3"));
  EXPECT_TRUE(FnMatch("w[!12]", "w3"));
  EXPECT_TRUE(FnMatch("q_pro?", "q_proj"));
  EXPECT_FALSE(FnMatch("q_proj", "q_proj2"));
  EXPECT_TRUE(FnMatch("[a-c]x", "bx"));
  EXPECT_TRUE(FnMatch("[x", "[x"));  // an unclosed set is a literal '['
  EXPECT_TRUE(FnMatch("", ""));
  EXPECT_FALSE(FnMatch("", "a"));
}

TEST(TensorParallelPlan, BadPlansNameTheKeyOrModule) {
  ::fsdp::testing::RunOnRanks(::fsdp::testing::Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Model stack = MakeModel("stack");
    EXPECT_EQ(MatchModulePath(*stack.root, "layers.*.w[12]"),
              (std::vector<std::string>{"layers.0.w1", "layers.0.w2", "layers.1.w1", "layers.1.w2"}));
    const at::Tensor before = stack.root->named_parameters()["layers.0.w1.weight"].clone();
    // Nothing applies when a later key fails: the first entry would otherwise have sharded.
    EXPECT_ERROR_CONTAINS(
        parallelize_module(*stack.root, mesh,
                           {{"layers.*.w1", ColwiseParallel()}, {"layers.*.q_proj", ColwiseParallel()}}),
        "plan key 'layers.*.q_proj' matches no submodule");
    EXPECT_TRUE(at::equal(stack.root->named_parameters()["layers.0.w1.weight"], before));
    EXPECT_ERROR_CONTAINS(parallelize_module(*stack.root, mesh, {{"layers", ColwiseParallel()}}),
                          "ColwiseParallel currently only supports torch::nn::Linear and torch::nn::Embedding; module "
                          "'layers'");
    // A plain (not hooked) Linear cannot run the style's hooks.
    torch::nn::Linear plain(4, 6);
    EXPECT_ERROR_CONTAINS(parallelize_module(*plain, mesh, ColwiseParallel()), "runs no forward hooks");
    auto mesh2d = mesh::DeviceMesh::Create(pg, {1, 2}, {"dp", "tp"});
    EXPECT_ERROR_CONTAINS(parallelize_module(*stack.root, mesh2d, {{"layers.0.w1", ColwiseParallel()}}),
                          "only a 1-D DeviceMesh");
    Model linear = MakeModel("linear_4_6");
    parallelize_module(*linear.root, mesh, ColwiseParallel());
    EXPECT_ERROR_CONTAINS(parallelize_module(*linear.root, mesh, RowwiseParallel()),
                          "already has its parameters distributed");
    EXPECT_ERROR_CONTAINS(PrepareModuleInput({{Placement::Shard(1)}, {}}),
                          "input_layouts and desired_input_layouts should have same length");
    Model ffn = MakeModel("ffn");
    parallelize_module(*ffn.root, mesh,
                       {{"", PrepareModuleInput({{Placement::Shard(1), Placement::Shard(1)},
                                                 {Placement::Replicate(), Placement::Replicate()}})}});
    EXPECT_ERROR_CONTAINS(ffn.forward(at::ones({2, 2, 4}, at::kDouble)),
                          "module '' got 1 tensor inputs but input_layouts (Shard(dim=1), Shard(dim=1)) has 2");
  });
}

TEST(TensorParallelPlan, LossParallelRejectsBadArguments) {
  ::fsdp::testing::RunOnRanks(::fsdp::testing::Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    const DTensor logits = DTensor::from_local(at::zeros({3, 2}), mesh, {Placement::Shard(1)});
    EXPECT_ERROR_CONTAINS(loss_parallel_cross_entropy(logits, at::tensor({0, 5, 1}, at::kLong)),
                          "class indices outside [0, 4)");
    EXPECT_ERROR_CONTAINS(loss_parallel_cross_entropy(logits, at::tensor({0, 1}, at::kLong)), "target has shape [2]");
    EXPECT_ERROR_CONTAINS(loss_parallel_cross_entropy(logits, at::zeros({3})), "must be an int64 tensor");
    const DTensor rows = DTensor::from_local(at::zeros({3, 4}), mesh, {Placement::Shard(0)});
    EXPECT_ERROR_CONTAINS(loss_parallel_cross_entropy(rows, at::tensor({0, 1, 2, 3, 0, 1}, at::kLong)),
                          "requires exactly one mesh dim to shard tensor dimension 1");
    // ignore_index entries may hold any value.
    const at::Tensor loss = loss_parallel_cross_entropy(logits, at::tensor({0, -100, 3}, at::kLong));
    EXPECT_NEAR(loss.item<double>(), std::log(4.0), 1e-6);
  });
}

TEST(TensorParallelPlan, DTensorOutputsCarryTheirLayout) {
  ::fsdp::testing::RunOnRanks(::fsdp::testing::Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Model lm_head = MakeModel("linear_nobias_4_10");
    parallelize_module(*lm_head.root, mesh, ColwiseParallel({.use_local_output = false}));
    const at::Tensor logits = lm_head.forward(at::ones({3, 4}, at::kDouble));
    const std::optional<DTensor> d = AsDTensor(logits);
    ASSERT_TRUE(d.has_value());
    EXPECT_EQ(d->sizes(), (std::vector<int64_t>{3, 10}));
    EXPECT_EQ(d->placements(), (Placements{Placement::Shard(1)}));
    EXPECT_FALSE(AsDTensor(logits * 2).has_value());  // a new tensor is a plain tensor
  });
}

}  // namespace
}  // namespace fsdp::tensor_parallel
