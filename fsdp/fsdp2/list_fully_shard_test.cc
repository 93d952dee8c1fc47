// fully_shard on a list of modules: ONE FSDP group over their parameters (PyTorch 2.15's
// fully_shard(list[nn.Module]), torch/distributed/fsdp/_fully_shard/_fully_shard.py, with the
// group hooks of _fsdp_state.py's _register_group_forward_hooks). Parity with single-rank
// training, one all-gather / reduce-scatter per group, any order of use within forward, an
// incomplete group completed by the forward root, and the error cases.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/comm_trace.h"
#include "fsdp/fsdp2/fsdp_state.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/test_models.h"
#include "fsdp/fsdp2/testing_access.h"
#include "mesh/device_mesh.h"
#include "testing/expect_error.h"
#include "testing/float_tolerance.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp2 {
namespace {

using fsdp::testing::Backend;
using testing::Batch;
using testing::InitDeterministic;
using HookedLinear = ::fsdp::Hooked<torch::nn::LinearImpl>;

// How forward uses the two grouped layers a and b (both 5 -> 5).
enum class Use {
  kAThenB,    // b(relu(a(h)))
  kBThenA,    // a(relu(b(h))): the group's first module is the second listed
  kSiblings,  // a(h) * b(h): both read h (an attention's q/k projections)
  kABA,       // a(relu(b(relu(a(h))))): a second, incomplete pass after a complete one
  kAOnly,     // b never runs: the group completes in the root's post-forward
};

const char* UseName(Use use) {
  switch (use) {
    case Use::kAThenB: return "a_then_b";
    case Use::kBThenA: return "b_then_a";
    case Use::kSiblings: return "siblings";
    case Use::kABA: return "a_b_a";
    case Use::kAOnly: return "a_only";
  }
  return "?";
}

// in: Linear(3, 5) and head: Linear(5, 3) stay in the root's group; a and b (hookable) are
// fully_shard'ed together. 5 rows shard unevenly on 2 and 3 ranks.
struct PairNetImpl : torch::nn::Module {
  explicit PairNetImpl(Use use)
      : in(register_module("in", torch::nn::Linear(3, 5))),
        a(register_module("a", HookedLinear(5, 5))),
        b(register_module("b", HookedLinear(5, 5))),
        head(register_module("head", torch::nn::Linear(5, 3))),
        use(use) {}
  at::Tensor forward(const at::Tensor& x) {
    const auto relu = [](const at::Tensor& t) { return at::relu(t); };
    at::Tensor h = relu(in(x));
    switch (use) {
      case Use::kAThenB: h = b(relu(a(h))); break;
      case Use::kBThenA: h = a(relu(b(h))); break;
      case Use::kSiblings: h = a(h) * b(h); break;
      case Use::kABA: h = a(relu(b(relu(a(h))))); break;
      case Use::kAOnly: h = a(h); break;
    }
    return head(h);
  }
  torch::nn::Linear in;
  HookedLinear a, b;
  torch::nn::Linear head;
  Use use;
};
using PairNet = ::fsdp::Hooked<PairNetImpl>;

// Elements of one all-gather's output for these shapes on w ranks: dim 0 padded to a
// multiple of w.
int64_t PaddedNumel(const std::vector<std::vector<int64_t>>& shapes, int64_t w) {
  int64_t total = 0;
  for (const auto& s : shapes) {
    int64_t rest = 1;
    for (size_t d = 1; d < s.size(); ++d) rest *= s[d];
    total += (s[0] + w - 1) / w * w * rest;
  }
  return total;
}

struct ListParityCase {
  Use use;
  bool reshard;
};

void RunListParity(const ListParityCase& c, const comm::ProcessGroupPtr& pg) {
  constexpr int kSteps = 4;
  const int w = pg->size(), me = pg->rank();
  auto trace = std::make_shared<comm::CommTrace>(pg);
  auto mesh = mesh::DeviceMesh::Create(trace, {w});
  PairNet ref(c.use), model(c.use);
  InitDeterministic(*ref);
  InitDeterministic(*model);
  std::vector<FSDPModule> group =
      fully_shard({model->a.ptr(), model->b.ptr()}, {.mesh = mesh, .reshard_after_forward = c.reshard});
  fully_shard(model.ptr(), {.mesh = mesh});
  ASSERT_EQ(group.size(), 2u);
  EXPECT_EQ(FSDPModuleTestAccess::state(group[0]), FSDPModuleTestAccess::state(group[1]));
  EXPECT_EQ(GetState(*model->a), GetState(*model->b));
  ASSERT_EQ(CollectStates(*model).size(), 2u);  // the root's and the list's, each once
  FSDPParamGroup* pair = FSDPModuleTestAccess::param_group(group[0]);
  ASSERT_NE(pair, nullptr);
  EXPECT_EQ(pair->fsdp_params().size(), 4u);  // a.weight, a.bias, b.weight, b.bias

  const int64_t pair_numel = PaddedNumel({{5, 5}, {5}, {5, 5}, {5}}, w);
  const int64_t a_numel = PaddedNumel({{5, 5}, {5}}, w);  // a reduce-scatter of a's gradients only
  const int64_t root_numel = PaddedNumel({{5, 3}, {5}, {3, 5}, {3}}, w);
  ASSERT_NE(pair_numel, root_numel);
  ASSERT_NE(a_numel, root_numel);
  // Per step: the root gathers once (not resharded after forward); the pair once in forward
  // and, resharded after forward, once more in backward, and reduces once. b unused
  // (kAOnly): b's parameters are still gathered, and only a's gradients are reduced (b has
  // none), as in PyTorch. kABA: the second pass (a again) re-opens the group (gathering
  // again if resharded); backward: the root's output unshards (the pre-backward the root's
  // forward registered when it completed the group), and the group post-backwards once
  // autograd has accumulated all four gradients (a.weight's two uses in one AccumulateGrad,
  // after both): one reduce-scatter, and no gather in between. (Deliberately one all-gather
  // fewer than PyTorch 2.15, whose post-backward hangs on each pass's inputs: the second
  // pass's runs first, finds no gradient yet and reshards, and b's output gathers again.)
  int pair_gathers_expected = c.reshard ? 2 : 1, pair_full_reduces = 1, a_only_reduces = 0;
  if (c.use == Use::kAOnly) pair_full_reduces = 0, a_only_reduces = 1;
  if (c.use == Use::kABA) pair_gathers_expected = c.reshard ? 3 : 1;
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  const int64_t local = 12 / w;
  for (int step = 0; step < kSteps; ++step) {
    const at::Tensor x = Batch(step, 12, 3, 1), y = Batch(step, 12, 3, 2);
    torch::nn::functional::mse_loss(ref(x), y).backward();
    ref_opt.step();
    ref_opt.zero_grad();

    trace->clear();
    at::Tensor loss =
        torch::nn::functional::mse_loss(model(x.narrow(0, me * local, local)), y.narrow(0, me * local, local));
    // After the forward the group is resharded iff reshard_after_forward, even when a module
    // of it ran last in an incomplete pass (kABA) or never (kAOnly): the root completed it.
    EXPECT_EQ(pair->is_sharded(), c.reshard) << "step " << step;
    EXPECT_TRUE(GetState(*model->a)->modules_to_run_forward().empty());
    loss.backward();
    opt.step();
    opt.zero_grad();

    int pair_gathers = 0, root_gathers = 0, pair_reduces = 0, a_reduces = 0, root_reduces = 0;
    for (const auto& r : trace->records()) {
      // In f32 elements (the all-gather moves bytes).
      const int64_t in = r.input_bytes / 4, out = r.output_bytes / 4;
      if (r.op == "all_gather_into_tensor") {
        pair_gathers += out == pair_numel;
        root_gathers += out == root_numel;
        EXPECT_TRUE(out == pair_numel || out == root_numel) << out;
      } else if (r.op == "reduce_scatter_tensor") {
        pair_reduces += in == pair_numel;
        a_reduces += in == a_numel;
        root_reduces += in == root_numel;
        EXPECT_TRUE(in == pair_numel || in == a_numel || in == root_numel) << in;
      }
    }
    EXPECT_EQ(root_gathers, 1);
    EXPECT_EQ(root_reduces, 1);
    EXPECT_EQ(pair_gathers, pair_gathers_expected) << "one all-gather for both modules";
    EXPECT_EQ(pair_reduces, pair_full_reduces) << "one reduce-scatter for both modules";
    EXPECT_EQ(a_reduces, a_only_reduces);
  }
  int checked = 0;
  auto ref_params = ref->named_parameters();
  for (FSDPState* s : CollectStates(*model)) {
    for (const auto& p : s->param_group()->fsdp_params()) {
      const at::Tensor full = p->ShardedDTensor().full_tensor();
      const at::Tensor expected = ref_params[p->fqn()];
      // Sliced vs whole-batch gradient sums through kSteps AdamW steps at lr 1e-2 (parameters of order 1).
      EXPECT_LE((full - expected).abs().max().item<double>(), fsdp::testing::AdamWParityTolerance(kSteps, /*lr=*/1e-2))
          << p->fqn() << " rank " << me;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 8);
  EXPECT_EQ(pair->module_fqn(), "a, b");  // PyTorch's _init_fqns joins the modules' names
}

TEST(ListFullyShard, OneGroupMatchesSingleRankTraining) {
  for (int w : {2, 3}) {
    for (Use use : {Use::kAThenB, Use::kBThenA, Use::kSiblings, Use::kABA, Use::kAOnly}) {
      for (bool reshard : {true, false}) {
        SCOPED_TRACE(absl::StrCat("w", w, "_", UseName(use), "_reshard", reshard));
        const ListParityCase c{use, reshard};
        fsdp::testing::RunOnRanks(Backend::kThreaded, w,
                                  [c](const comm::ProcessGroupPtr& pg) { RunListParity(c, pg); });
      }
    }
  }
}

TEST(ListFullyShard, HandlesSharedStateAndNestedListedModules) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    PairNet model(Use::kAThenB);
    std::vector<FSDPModule> group = fully_shard({model->a.ptr(), model->b.ptr()}, {.mesh = mesh});
    // Each listed module is an FSDP module of the one group (PyTorch: the same state).
    ASSERT_TRUE(AsFSDPModule(*model->a).has_value());
    EXPECT_EQ(FSDPModuleTestAccess::state(*AsFSDPModule(*model->b)), FSDPModuleTestAccess::state(group[0]));
    EXPECT_EQ(FSDPModuleTestAccess::state(group[1])->modules().size(), 2u);
    // A listed module nested in another listed one is managed through it (_get_root_modules):
    // one root, so the plain single-module hooks.
    testing::Net net;
    std::vector<FSDPModule> nested = fully_shard({net->layers[0].ptr(), net->layers[0]->fc1.ptr()}, {.mesh = mesh});
    ASSERT_EQ(nested.size(), 2u);
    EXPECT_EQ(FSDPModuleTestAccess::state(nested[0])->modules().size(), 1u);
    EXPECT_EQ(FSDPModuleTestAccess::param_group(nested[0])->fsdp_params().size(), 4u);
    EXPECT_FALSE(AsFSDPModule(*net->layers[0]->fc1).has_value());
  });
}

// A Hooked holder of an SPMD tensor-parallel Linear: its parameters are DTensors on `spmd`
// (Replicate on dp), what fully_shard with dp_mesh_dims expects.
struct SpmdHolderImpl : torch::nn::Module {
  explicit SpmdHolderImpl(const mesh::DeviceMeshPtr& spmd)
      : l(register_module("l", testing::ParallelLinear(torch::nn::Linear(4, 4), (*spmd)["tp"],
                                                       tensor_parallel::ColwiseParallel(), spmd))) {}
  at::Tensor forward(const at::Tensor& x) { return l(x); }
  testing::HookedLinear l;
};
using SpmdHolder = ::fsdp::Hooked<SpmdHolderImpl>;

TEST(ListFullyShard, Errors) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    const FullyShardOptions opts{.mesh = mesh};
    // PyTorch: IndexError (modules[0] of an empty tuple).
    EXPECT_ERROR_CONTAINS(fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{}, opts),
                          "fully_shard: modules must not be empty (got an empty list)");
    {
      PairNet m(Use::kAThenB);
      EXPECT_ERROR_CONTAINS(fully_shard({m->a.ptr(), nullptr}, opts), "fully_shard: modules[1] is null");
      // PyTorch: "fully_shard has already been applied to the following module".
      EXPECT_ERROR_CONTAINS(fully_shard({m->a.ptr(), m->b.ptr(), m->a.ptr()}, opts),
                            "is the same module as modules[0]; list each module once");
      EXPECT_ERROR_CONTAINS(fully_shard({m->a.ptr(), m->in.ptr()}, opts),
                            "fully_shard: modules[1] (torch::nn::LinearImpl) cannot run forward hooks");
      EXPECT_FALSE(AsFSDPModule(*m->a).has_value()) << "a failed call attaches nothing";
    }
    {
      PairNet m(Use::kAThenB);
      fully_shard(m->b.ptr(), opts);
      EXPECT_ERROR_CONTAINS(fully_shard({m->a.ptr(), m->b.ptr()}, opts), "modules[1] (");
      EXPECT_ERROR_CONTAINS(fully_shard({m->a.ptr(), m->b.ptr()}, opts), ") is already fully_shard'ed");
    }
    {
      PairNet m(Use::kAThenB);
      fully_shard({m->a.ptr(), m->b.ptr()}, opts);
      EXPECT_ERROR_CONTAINS(fully_shard(m->a.ptr(), opts), "is already fully_shard'ed");
      EXPECT_ERROR_CONTAINS(fully_shard({m->b.ptr()}, opts), "modules[0] (");
      // No fully_shard'ed parent: the group would be the root (PyTorch's _lazy_init
      // RuntimeError). Nothing ran yet, so the model is usable once the parent is sharded.
      EXPECT_ERROR_CONTAINS(m(at::ones({2, 3})), "FSDP requires a single root module but got 2 modules");
      fully_shard(m.ptr(), opts);
      m(at::ones({2, 3})).sum().backward();
    }
  });
}

// PyTorch checks each parameter's DTensor mesh against the mesh given with dp_mesh_dims
// (_fsdp_param.py _init_sharding_spec_spmd: "different mesh objects"); a list whose second
// module lives on another mesh fails there, and nothing is attached (as in PyTorch, where the
// modules keep their classes).
TEST(ListFullyShard, MismatchedMeshInAListFails) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2, 2}, {"dp", "tp"});
    auto other = mesh::DeviceMesh::Create(pg, {2, 2}, {"a", "tp"});
    const FullyShardOptions spmd{.mesh = mesh, .dp_mesh_dims = DataParallelMeshDims{"dp"}};
    SpmdHolder good(mesh), bad(other);
    EXPECT_ERROR_CONTAINS(fully_shard({good.ptr(), bad.ptr()}, spmd),
                          "Expected param's DTensor mesh to be the same mesh passed to fully_shard");
    EXPECT_FALSE(AsFSDPModule(*good).has_value());
    EXPECT_FALSE(AsFSDPModule(*bad).has_value());
    SpmdHolder good2(mesh);
    EXPECT_EQ(FSDPModuleTestAccess::param_group(fully_shard({good.ptr(), good2.ptr()}, spmd)[0])->fsdp_params().size(),
              4u);
  });
}

}  // namespace
}  // namespace fsdp::fsdp2
