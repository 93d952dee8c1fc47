// FSDP2's clip_grad_norm_ (fsdp/fsdp2/clip_grad_norm.h) against an independent reference:
// the same model on one rank, whole gradients, torch::nn::utils::clip_grad_norm_. Every rank
// trains on the whole batch, so FSDP's averaged gradients equal the reference's (up to the
// reduce-scatter's rounding) and unmanaged gradients are the same on every rank; what is
// checked is the norm over the shards, the clipped shards, and the all-reduces it costs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/comm_trace.h"
#include "fsdp/fsdp2/clip_grad_norm.h"
#include "fsdp/fsdp2/fsdp_param.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/fsdp2/test_models.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp2 {
namespace {

using fsdp::testing::Backend;
using testing::Batch;
using testing::InitDeterministic;
using testing::Net;
using testing::NetOptions;
using testing::TPNet;
using testing::UniqueParameters;

constexpr double kInf = std::numeric_limits<double>::infinity();
// f32: the gradients are averaged over ranks in another order than one rank's whole-batch mean (a few
// ulps, 2^-23, each), the norm raises them to p and sums their p-th powers per shard, then across
// ranks, errors of random sign growing like sqrt(n) ulps; 1e-5 (~80 ulps) covers both and is far below
// a missing or doubled shard's share of the norm.
constexpr double kTol = 1e-5;

// One forward + backward on the whole 12-row batch.
template <class Model>
void Backward(Model& model) {
  const at::Tensor x = Batch(0, 12, 3, 1), y = Batch(0, 12, 1, 2);
  torch::nn::functional::mse_loss(model(x), y).backward();
}

// Every traced group of a mesh once (a 1-D mesh's dim may be the world group itself).
struct Traces {
  std::vector<std::shared_ptr<comm::CommTrace>> traces;

  Traces(const std::shared_ptr<comm::CommTrace>& world, const mesh::DeviceMesh& mesh) {
    traces.push_back(world);
    for (int d = 0; d < mesh.ndim(); ++d) {
      auto t = std::dynamic_pointer_cast<comm::CommTrace>(mesh.group(d));
      if (t && std::find(traces.begin(), traces.end(), t) == traces.end()) traces.push_back(t);
    }
  }
  void Clear() const {
    for (const auto& t : traces) t->clear();
  }
  // "all_reduce:SUM:2" per collective; everything that is not an all-reduce too.
  std::vector<std::string> Records() const {
    std::vector<std::string> out;
    for (const auto& t : traces) {
      for (const auto& r : t->records()) out.push_back(absl::StrCat(r.op, ":", r.reduce_op, ":", r.group_size));
    }
    return out;
  }
};

std::string ReduceOpName(double p) { return std::isinf(p) ? "MAX" : "SUM"; }

// Every parameter's gradient (this rank's shard for FSDP-managed ones) equals the
// reference's; returns the number compared.
int ExpectGradsMatch(torch::nn::Module& model, torch::nn::Module& ref, const std::string& label) {
  auto ref_params = ref.named_parameters();
  int compared = 0;
  for (const NamedParameter& np : NamedParameters(model)) {
    const at::Tensor* ref_param = ref_params.find(np.fqn);
    EXPECT_NE(ref_param, nullptr) << label << " " << np.fqn;
    if (ref_param == nullptr) continue;
    const at::Tensor got = np.fsdp_param ? np.fsdp_param->sharded_grad() : np.param.grad();
    if (!ref_param->grad().defined()) {
      EXPECT_FALSE(got.defined()) << label << " " << np.fqn;
      continue;
    }
    EXPECT_TRUE(got.defined()) << label << " " << np.fqn;
    if (!got.defined()) continue;
    const at::Tensor want = np.fsdp_param ? LocalShardOf(*np.fsdp_param, ref_param->grad()) : ref_param->grad();
    EXPECT_EQ(got.sizes(), want.sizes()) << label << " " << np.fqn;
    if (got.numel() > 0 && got.sizes() == want.sizes()) {
      const double scale = std::max(1e-3, want.abs().max().item<double>());
      EXPECT_LE((got - want).abs().max().item<double>(), kTol * scale) << label << " " << np.fqn;
    }
    ++compared;
  }
  return compared;
}

// Clips the FSDP model's and the reference's gradients (after one backward each) and compares
// the totals and the clipped gradients; the FSDP call must cost `all_reduces` (as
// "all_reduce:OP:group size" records, in order). Returns FSDP's total.
template <class Model>
double ClipAndCompare(Model& model, Net& ref, const Traces& traces, double max_norm, double p,
                      const std::vector<std::string>& all_reduces, const std::string& label,
                      std::optional<bool> foreach = std::nullopt) {
  Backward(ref);
  Backward(model);
  traces.Clear();
  const at::Tensor total = clip_grad_norm_(*model, max_norm, p, /*error_if_nonfinite=*/false, foreach);
  EXPECT_EQ(traces.Records(), all_reduces) << label;
  const double want = torch::nn::utils::clip_grad_norm_(UniqueParameters(*ref), max_norm, p);
  // The cases either clip hard or not at all.
  EXPECT_TRUE(want > 10 * max_norm || want < max_norm / 10) << label << ": total " << want;
  EXPECT_EQ(total.dim(), 0) << label;
  EXPECT_EQ(total.scalar_type(), at::kFloat) << label;
  EXPECT_NEAR(total.item<double>(), want, kTol * want) << label;
  EXPECT_GT(ExpectGradsMatch(*model, *ref, label), 0) << label;
  return total.item<double>();
}

// max_norm well below the models' gradient norms (clipping scales every gradient) and well
// above them (the clamped coefficient is 1: gradients unchanged).
constexpr double kClip = 1e-2, kNoClip = 1e3;

TEST(ClipGradNorm, FsdpUnevenShardsMatchSingleRank) {
  for (int w : {2, 3}) {
    for (double p : {1.0, 2.0, kInf, 3.0}) {
      for (double max_norm : {kClip, kNoClip}) {
        std::vector<double> totals(w);
        fsdp::testing::RunOnRanks(Backend::kThreaded, w, [&](const comm::ProcessGroupPtr& pg) {
          auto trace = std::make_shared<comm::CommTrace>(pg);
          auto mesh = mesh::DeviceMesh::Create(trace, {w});
          const Traces traces(trace, *mesh);
          Net ref, model;
          InitDeterministic(*ref);
          InitDeterministic(*model);
          for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = mesh});
          fully_shard(model.ptr(), {.mesh = mesh});
          const std::string label = absl::StrCat("w=", w, " p=", p, " max_norm=", max_norm, " rank ", pg->rank());
          totals[pg->rank()] = ClipAndCompare(model, ref, traces, max_norm, p,
                                              {absl::StrCat("all_reduce:", ReduceOpName(p), ":", w)}, label);
          // head.weight has one row: some ranks' shards are empty, and must count as 0.
          EXPECT_EQ(model->head->weight.grad().size(0), pg->rank() == 0 ? 1 : 0) << label;
        });
        // The same total on every rank, bitwise (it is one all-reduce's result).
        for (int r = 1; r < w; ++r) EXPECT_EQ(totals[r], totals[0]) << "w=" << w << " p=" << p;
      }
    }
  }
}

// Why this exists: LibTorch's own clip_grad_norm_ on the sharded parameters measures each
// rank's shards only, a different (smaller) norm on every rank, so every rank would clip by
// its own wrong factor; ours equals the single-rank norm.
TEST(ClipGradNorm, LibTorchsOwnClipOnShardsIsWrong) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Net ref, model;
    InitDeterministic(*ref);
    InitDeterministic(*model);
    for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = mesh});
    fully_shard(model.ptr(), {.mesh = mesh});
    Backward(ref);
    Backward(model);
    const double want = torch::nn::utils::clip_grad_norm_(UniqueParameters(*ref), kNoClip, 2.0);
    const double local = torch::nn::utils::clip_grad_norm_(UniqueParameters(*model), kNoClip, 2.0);
    EXPECT_LT(local, want * 0.99) << "rank " << pg->rank() << ": LibTorch's norm of the shards";
    const double ours = clip_grad_norm_(*model, kNoClip, 2.0).item<double>();
    EXPECT_NEAR(ours, want, kTol * want) << "rank " << pg->rank();
  });
}

// HSDP: (Replicate, Shard) gradients reduce over the shard dim only.
TEST(ClipGradNorm, HsdpReducesOverTheShardDimOnly) {
  for (double p : {1.0, 2.0, kInf}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
      auto trace = std::make_shared<comm::CommTrace>(pg);
      auto mesh = mesh::DeviceMesh::Create(trace, {2, 2}, {"replicate", "shard"});
      const Traces traces(trace, *mesh);
      Net ref, model;
      InitDeterministic(*ref);
      InitDeterministic(*model);
      for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = mesh});
      fully_shard(model.ptr(), {.mesh = mesh});
      const std::string label = absl::StrCat("hsdp p=", p, " rank ", pg->rank());
      ClipAndCompare(model, ref, traces, kClip, p, {absl::StrCat("all_reduce:", ReduceOpName(p), ":2")}, label);
      auto shard_trace = std::dynamic_pointer_cast<comm::CommTrace>(mesh->group("shard"));
      ASSERT_NE(shard_trace, nullptr);
      EXPECT_EQ(shard_trace->records().size(), 1u) << label;
    });
  }
}

// FSDP over "dp" of a (dp=2, tp=2) mesh around tensor-parallel blocks (colwise fc1, rowwise
// fc2), as in parity_test.cc: the TP-sharded gradients ((StridedShard, Shard) placements)
// reduce over dp and tp, the rowwise bias (Shard, Replicate) and the plain layers over dp,
// which costs one all-reduce per mesh dim in all (testing::TPNet, parity_test.cc's model).

TEST(ClipGradNorm, FsdpPlusTensorParallelReducesOverBothDims) {
  for (double p : {1.0, 2.0, kInf}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
      auto trace = std::make_shared<comm::CommTrace>(pg);
      auto mesh = mesh::DeviceMesh::Create(trace, {2, 2}, {"dp", "tp"});
      auto dp = (*mesh)["dp"], tp = (*mesh)["tp"];
      const Traces traces(trace, *mesh);
      Net ref(NetOptions{.hidden = 8});  // even TP shards (see parity_test.cc)
      InitDeterministic(*ref);
      TPNet model(*ref, tp);
      for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = dp});
      fully_shard(model.ptr(), {.mesh = dp});
      for (const NamedParameter& np : NamedParameters(*model)) {
        ASSERT_NE(np.fsdp_param, nullptr) << np.fqn;
        if (np.fqn == "block0.fc1.weight") {
          EXPECT_EQ(dtensor::ToString(np.fsdp_param->sharding_spec().placements),
                    "(StridedShard(dim=0, sf=2), Shard(dim=0))");
        }
        if (np.fqn == "block0.fc2.bias") {
          EXPECT_EQ(dtensor::ToString(np.fsdp_param->sharding_spec().placements), "(Shard(dim=0), Replicate())");
        }
      }
      const std::string label = absl::StrCat("fsdp+tp p=", p, " rank ", pg->rank());
      // dp first: the first parameter (in.weight) is sharded over dp only.
      const std::string op = ReduceOpName(p);
      ClipAndCompare(model, ref, traces, kClip, p,
                     {absl::StrCat("all_reduce:", op, ":2"), absl::StrCat("all_reduce:", op, ":2")}, label);
      auto dp_trace = std::dynamic_pointer_cast<comm::CommTrace>(mesh->group("dp"));
      auto tp_trace = std::dynamic_pointer_cast<comm::CommTrace>(mesh->group("tp"));
      ASSERT_TRUE(dp_trace && tp_trace);
      EXPECT_EQ(dp_trace->records().size(), 1u) << label;
      EXPECT_EQ(tp_trace->records().size(), 1u) << label;
    });
  }
}

// A tensor-parallel model that no fully_shard manages (blocks of style-parallelized Linears, plain in /
// head / extra): the TP-sharded gradients reduce over tp, the replicated ones (in, head, extra,
// the rowwise biases) count once, so the total is one rank's; one all-reduce per clip.
TEST(ClipGradNorm, TensorParallelWithoutFsdpMatchesSingleRank) {
  for (double p : {1.0, 2.0, kInf}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
      auto trace = std::make_shared<comm::CommTrace>(pg);
      auto mesh = mesh::DeviceMesh::Create(trace, {2}, {"tp"});
      Net ref(NetOptions{.hidden = 8});
      InitDeterministic(*ref);
      TPNet model(*ref, mesh);
      Backward(ref);
      Backward(model);
      trace->clear();
      const std::string label = absl::StrCat("tp-only p=", p, " rank ", pg->rank());
      const at::Tensor total = clip_grad_norm_(*model, kClip, p);
      const double want = torch::nn::utils::clip_grad_norm_(UniqueParameters(*ref), kClip, p);
      EXPECT_NEAR(total.item<double>(), want, kTol * want) << label;
      std::vector<std::string> records;
      for (const auto& r : trace->records()) records.push_back(absl::StrCat(r.op, ":", r.reduce_op, ":", r.group_size));
      EXPECT_EQ(records, std::vector<std::string>{absl::StrCat("all_reduce:", ReduceOpName(p), ":2")}) << label;
      // Clipped by the same coefficient: a replicated gradient equals the reference's.
      const at::Tensor got = model->in->weight.grad(), expected = ref->in->weight.grad();
      EXPECT_LE((got - expected).abs().max().item<double>(), kTol * std::max(1e-3, expected.abs().max().item<double>()))
          << label;
    });
  }
}

// in and extra are the root's ignored_params: whole gradients on every rank, counted once and
// not reduced, next to the sharded ones. Frozen parameters have no gradient: skipped.
// (Ignored parameters rather than an unsharded root: blocks that are roots of their own issue
// their reduce-scatters in an order that differs across ranks under the async CPU streams.)
TEST(ClipGradNorm, MixedManagedUnmanagedAndFrozenParameters) {
  for (double p : {1.0, 2.0, kInf}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
      auto trace = std::make_shared<comm::CommTrace>(pg);
      auto mesh = mesh::DeviceMesh::Create(trace, {3});
      const Traces traces(trace, *mesh);
      Net ref, model;
      InitDeterministic(*ref);
      InitDeterministic(*model);
      for (auto* m : {&ref, &model}) {
        (*m)->layers[0]->fc1->weight.set_requires_grad(false);
        (*m)->layers[0]->fc1->bias.set_requires_grad(false);
      }
      for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = mesh});
      fully_shard(model.ptr(), {.mesh = mesh, .ignored_params = {model->in->weight, model->in->bias, model->extra}});
      const std::string label = absl::StrCat("mixed p=", p, " rank ", pg->rank());
      ClipAndCompare(model, ref, traces, kClip, p, {absl::StrCat("all_reduce:", ReduceOpName(p), ":3")}, label);
      EXPECT_FALSE(model->layers[0]->fc1->weight.grad().defined());
      EXPECT_EQ(model->in->weight.grad().sizes(), ref->in->weight.sizes());  // whole
      EXPECT_EQ(model->extra.grad().sizes(), ref->extra.sizes());
    });
  }
}

// The overload over some of the root's parameters (one optimizer group): only they count and
// only they are clipped.
TEST(ClipGradNorm, ParameterSubset) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Net ref, model;
    InitDeterministic(*ref);
    InitDeterministic(*model);
    for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = mesh});
    fully_shard(model.ptr(), {.mesh = mesh});
    Backward(ref);
    Backward(model);
    // block1 (FSDP-managed) and extra, and the reference's same parameters.
    std::vector<at::Tensor> subset = model->layers[1]->parameters();
    subset.push_back(model->extra);
    subset.push_back(model->extra);  // listed twice: clipped once
    std::vector<at::Tensor> ref_subset = ref->layers[1]->parameters();
    ref_subset.push_back(ref->extra);
    const at::Tensor in_grad = model->in->weight.grad().clone();
    const at::Tensor total = clip_grad_norm_(*model, subset, kClip, 2.0);
    const double want = torch::nn::utils::clip_grad_norm_(ref_subset, kClip, 2.0);
    EXPECT_NEAR(total.item<double>(), want, kTol * want);
    EXPECT_TRUE(at::equal(model->in->weight.grad(), in_grad));  // not in the subset
    // The rest is unclipped on both sides.
    EXPECT_GT(ExpectGradsMatch(*model, *ref, absl::StrCat("subset rank ", pg->rank())), 0);
    // Not a parameter of the root.
    const at::Tensor stranger = at::ones({2}, at::requires_grad());
    EXPECT_ERROR_CONTAINS(clip_grad_norm_(*model, {model->extra, stranger}, 1.0),
                          "clip_grad_norm_: parameters[1] (shape [2]) is not a parameter of the root module");
    EXPECT_ERROR_CONTAINS(clip_grad_norm_(*model, {at::Tensor()}, 1.0),
                          "clip_grad_norm_: parameters[0] is an undefined tensor");
  });
}

// foreach unset, true and false: the same result (_foreach_norm / _foreach_mul_ vs one
// linalg.vector_norm / mul_ per gradient).
TEST(ClipGradNorm, ForeachModesAgree) {
  for (std::optional<bool> foreach : {std::optional<bool>(), std::optional<bool>(true), std::optional<bool>(false)}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
      auto trace = std::make_shared<comm::CommTrace>(pg);
      auto mesh = mesh::DeviceMesh::Create(trace, {2});
      const Traces traces(trace, *mesh);
      Net ref, model;
      InitDeterministic(*ref);
      InitDeterministic(*model);
      for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = mesh});
      fully_shard(model.ptr(), {.mesh = mesh});
      ClipAndCompare(model, ref, traces, kClip, 2.0, {"all_reduce:SUM:2"},
                     absl::StrCat("foreach=", foreach ? (*foreach ? "true" : "false") : "unset"), foreach);
    });
  }
}

TEST(ClipGradNorm, Errors) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto trace = std::make_shared<comm::CommTrace>(pg);
    auto mesh = mesh::DeviceMesh::Create(trace, {2});
    const Traces traces(trace, *mesh);
    Net model;
    InitDeterministic(*model);
    for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = mesh});
    fully_shard(model.ptr(), {.mesh = mesh});

    // Before any backward: no gradients, a zero norm (the all-reduce still runs: which ones
    // run depends on the parameters, not on which ranks hold gradients).
    traces.Clear();
    const at::Tensor zero = clip_grad_norm_(*model, 1.0);
    EXPECT_EQ(zero.item<double>(), 0.0);
    EXPECT_EQ(traces.Records(), std::vector<std::string>{"all_reduce:SUM:2"});

    // Bad arguments are rejected before any collective.
    traces.Clear();
    EXPECT_ERROR_CONTAINS(clip_grad_norm_(*model, -1.0),
                          "clip_grad_norm_: max_norm must be >= 0 (inf: no clipping), got -1");
    EXPECT_ERROR_CONTAINS(clip_grad_norm_(*model, std::nan("")), "max_norm must be >= 0 (inf: no clipping), got nan");
    EXPECT_ERROR_CONTAINS(clip_grad_norm_(*model, 1.0, 0.0), "clip_grad_norm_: norm_type must be > 0 or inf, got 0");
    EXPECT_ERROR_CONTAINS(clip_grad_norm_(*model, 1.0, -kInf), "norm_type must be > 0 or inf, got -inf");
    EXPECT_ERROR_CONTAINS(clip_grad_norm_(*model, 1.0, std::nan("")), "norm_type must be > 0 or inf, got nan");
    EXPECT_TRUE(traces.Records().empty());

    // A non-finite gradient on one rank: the total is non-finite on every rank, so every rank
    // throws, before any gradient is scaled.
    Backward(model);
    if (pg->rank() == 1) model->layers[0]->fc2->weight.mutable_grad()[0][0] = std::nan("");
    std::vector<at::Tensor> before;
    for (const auto& p : model->parameters()) before.push_back(p.grad().clone());
    EXPECT_ERROR_CONTAINS(clip_grad_norm_(*model, kClip, 2.0, /*error_if_nonfinite=*/true),
                          "clip_grad_norm_: the total norm of order 2 for gradients from `parameters` is non-finite "
                          "(nan), so it cannot be clipped");
    // ... and names the parameter and the rank whose shard holds the NaN.
    EXPECT_ERROR_CONTAINS(
        clip_grad_norm_(*model, kClip, 2.0, /*error_if_nonfinite=*/true),
        "The first parameter with a non-finite gradient: 'block0.fc2.weight' (its shard) on rank(s) 1");
    const auto after = model->parameters();
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_TRUE(at::allclose(after[i].grad(), before[i], 0, 0, /*equal_nan=*/true)) << i;
    }
    // Without the check the non-finite norm scales every gradient (PyTorch's behavior).
    const at::Tensor nan_total = clip_grad_norm_(*model, kClip, 2.0);
    EXPECT_TRUE(std::isnan(nan_total.item<double>()));
    EXPECT_TRUE(model->in->weight.grad().isnan().all().item<bool>());

    // max_norm = inf measures without clipping.
    for (const auto& p : model->parameters()) p.mutable_grad() = at::ones_like(p);
    const at::Tensor measured = clip_grad_norm_(*model, kInf, 1.0);
    int64_t numel = 0;  // of the global parameters: every element's |1| once
    for (const NamedParameter& np : NamedParameters(*model)) {
      numel += np.fsdp_param ? c10::multiply_integers(np.fsdp_param->orig_size()) : np.param.numel();
    }
    EXPECT_EQ(measured.item<double>(), static_cast<double>(numel));
    for (const auto& p : model->parameters()) EXPECT_TRUE(at::equal(p.grad(), at::ones_like(p)));
  });
}

}  // namespace
}  // namespace fsdp::fsdp2
