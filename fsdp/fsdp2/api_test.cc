// FSDP2 API beyond fully_shard itself (PyTorch 2.15's _fully_shard.py): fully_shard_tree
// (auto-wrap), run_fsdp_forward_method (register_fsdp_forward_method), set_all_reduce_hook,
// set_post_optim_event; when the post-backward runs (the gradient hooks that replace
// PyTorch's RegisterPostBackwardFunction node).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <set>
#include <string>
#include <thread>

#include "comm/comm_trace.h"
#include "device/stream.h"
#include "fsdp/fsdp2/auto_wrap.h"
#include "fsdp/fsdp2/fsdp_state.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/test_models.h"
#include "fsdp/fsdp2/testing_access.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp2 {
namespace {

using fsdp::testing::Backend;
using testing::BlockImpl;
using testing::InitDeterministic;
using testing::Net;
using testing::NetImpl;

// The FQNs of each group's parameters, per state (module-tree order).
std::vector<std::vector<std::string>> GroupFqns(torch::nn::Module& model) {
  std::vector<std::vector<std::string>> out;
  for (FSDPState* s : CollectStates(model)) {
    out.emplace_back();
    if (s->param_group() == nullptr) continue;
    for (const auto& p : s->param_group()->fsdp_params()) out.back().push_back(p->fqn());
    std::sort(out.back().begin(), out.back().end());
  }
  return out;
}

// ---- the post-backward trigger ------------------------------------------------------------

// The names of the autograd nodes reachable from `t`'s grad_fn.
std::multiset<std::string> NodeNames(const at::Tensor& t) {
  std::multiset<std::string> names;
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo;
  if (t.grad_fn()) todo.push_back(t.grad_fn().get());
  while (!todo.empty()) {
    torch::autograd::Node* n = todo.back();
    todo.pop_back();
    if (n == nullptr || !seen.insert(n).second) continue;
    names.insert(n->name());
    for (const auto& e : n->next_edges()) todo.push_back(e.function.get());
  }
  return names;
}

// A group whose parameters all require grad post-backwards from its parameters' gradient
// hooks (no node in the graph); a group with a frozen parameter still routes its inputs
// through the post-backward node (its weight is read after the last gradient arrived), and
// both train as one rank does.
TEST(PostBackwardTrigger, GradientHooksUnlessAParameterIsFrozen) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Net ref(2), model(2);
    InitDeterministic(*ref);
    InitDeterministic(*model);
    for (Net* net : {&ref, &model}) (*net)->layers[1]->fc1->weight.set_requires_grad(false);
    for (auto& block : model->layers) fully_shard(block.ptr(), {.mesh = mesh});
    fully_shard(model.ptr(), {.mesh = mesh});
    // The same batch on every rank: the averaged gradient is the one-rank gradient.
    const at::Tensor x = at::arange(12, at::kFloat).reshape({4, 3}) / 10;
    const at::Tensor out = model(x);
    // Block 1 (frozen fc1) has the node; block 0, whose input requires grad, does not; the
    // root's inputs need no gradient (its post-backward is the final callback's, as PyTorch).
    EXPECT_EQ(NodeNames(out).count("fsdp::PostBackwardNode"), 1u);
    out.sum().backward();
    ref(x).sum().backward();
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& p = item.value();
      const at::Tensor full = ref->named_parameters()[item.key()];
      if (!full.requires_grad()) {
        EXPECT_FALSE(p.grad().defined()) << item.key();
        continue;
      }
      ASSERT_TRUE(p.grad().defined()) << item.key();
      const int64_t rows = (full.size(0) + 1) / 2, begin = std::min<int64_t>(pg->rank() * rows, full.size(0));
      const at::Tensor expected = full.grad().narrow(0, begin, std::min(rows, full.size(0) - begin));
      // float32 gradients summed over the batch in another order (per rank, then reduce-scattered):
      // a few ulps (2^-23) of each, 1e-5 relative (~80 ulps) with 1e-6 absolute for elements near zero.
      EXPECT_TRUE(at::allclose(p.grad().narrow(0, 0, expected.size(0)), expected, 1e-5, 1e-6)) << item.key();
    }
  });
}

// The hooks live on the parameters, which may outlive their FSDP state: once the state is
// gone a backward through them runs no FSDP code (ASan would see a dangling state).
TEST(PostBackwardTrigger, ParametersOutlivingTheirStateBackwardWithoutIt) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    at::Tensor weight;
    {
      Net model(1);
      fully_shard(model->layers[0].ptr(), {.mesh = mesh});
      fully_shard(model.ptr(), {.mesh = mesh});
      model(at::randn({4, 3})).sum().backward();
      weight = model->layers[0]->fc1->weight;
    }
    weight.mutable_grad() = at::Tensor();
    (weight * 3).sum().backward();
    ASSERT_TRUE(weight.grad().defined());
    EXPECT_TRUE(at::equal(weight.grad(), at::full_like(weight, 3)));
  });
}

// ---- fully_shard_tree --------------------------------------------------------------------

TEST(FullyShardTree, GroupsAndTrainingMatchTheHandWrittenLoopBitwise) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Net by_hand(3), by_tree(3);
    InitDeterministic(*by_hand);
    InitDeterministic(*by_tree);
    for (auto& block : by_hand->layers) fully_shard(block.ptr(), {.mesh = mesh});
    fully_shard(by_hand.ptr(), {.mesh = mesh});
    FSDPModule root = fully_shard_tree(by_tree.ptr(), WrapModuleTypes<BlockImpl>(), {.mesh = mesh});
    EXPECT_EQ(FSDPModuleTestAccess::state(root), GetState(*by_tree));

    torch::optim::AdamW opt_hand(by_hand->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt_tree(by_tree->parameters(), torch::optim::AdamWOptions(1e-2));
    testing::TrainSteps(by_hand, opt_hand, 0, 3, 2, pg->rank());
    testing::TrainSteps(by_tree, opt_tree, 0, 3, 2, pg->rank());
    // FQNs are set at lazy init (the first forward).
    const auto groups = GroupFqns(*by_tree);
    EXPECT_EQ(groups, GroupFqns(*by_hand));
    ASSERT_EQ(groups.size(), 4u);
    EXPECT_EQ(groups[0], (std::vector<std::string>{"extra", "head.bias", "head.weight", "in.bias", "in.weight"}));
    EXPECT_EQ(groups[1], (std::vector<std::string>{"block0.fc1.bias", "block0.fc1.weight", "block0.fc2.bias",
                                                   "block0.fc2.weight"}));
    const auto hand = by_hand->named_parameters(), tree = by_tree->named_parameters();
    for (const auto& item : hand) {
      EXPECT_TRUE(at::equal(item.value(), tree[item.key()])) << item.key() << " rank " << pg->rank();
    }
  });
}

struct OuterImpl : torch::nn::Module {
  OuterImpl() : net(register_module("net", Net(2))), proj(register_module("proj", torch::nn::Linear(3, 3))) {}
  at::Tensor forward(const at::Tensor& x) { return net(proj(x)); }
  Net net;
  torch::nn::Linear proj;
};
using Outer = Hooked<OuterImpl>;

TEST(FullyShardTree, WrapsChildrenBeforeParents) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Outer model;
    // Net and its blocks both selected: pre-order would give the blocks' parameters to net.
    fully_shard_tree(model.ptr(), WrapModuleTypes<NetImpl, BlockImpl>(), {.mesh = mesh});
    model(at::ones({2, 3})).sum().backward();
    const auto groups = GroupFqns(*model);
    ASSERT_EQ(groups.size(), 4u);  // root, net, net.block0, net.block1
    EXPECT_EQ(groups[0], (std::vector<std::string>{"proj.bias", "proj.weight"}));
    EXPECT_EQ(groups[1], (std::vector<std::string>{"net.extra", "net.head.bias", "net.head.weight", "net.in.bias",
                                                   "net.in.weight"}));
    EXPECT_EQ(groups[2].size(), 4u);
    EXPECT_EQ(groups[2][0], "net.block0.fc1.bias");
    EXPECT_EQ(groups[3][0], "net.block1.fc1.bias");
  });
}

TEST(FullyShardTree, KeepsModulesShardedByHandAndRejectsModulesWithoutHooks) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Net model(2);
    // Linear cannot run hooks: an error naming it, and nothing sharded.
    EXPECT_ERROR_CONTAINS(fully_shard_tree(model.ptr(), WrapModuleTypes<torch::nn::LinearImpl>(), {.mesh = mesh}),
                          "wrap selected 'in'");
    EXPECT_TRUE(CollectStates(*model).empty());
    EXPECT_ERROR_CONTAINS(fully_shard_tree(model.ptr(), nullptr, {.mesh = mesh}), "wrap (the predicate) is empty");
    // A block sharded by hand first (other options) is left as it is.
    FSDPModule block0 = fully_shard(model->layers[0].ptr(), {.mesh = mesh, .reshard_after_forward = false});
    fully_shard_tree(model.ptr(), WrapModuleTypes<BlockImpl>(), {.mesh = mesh});
    EXPECT_EQ(GetState(*model->layers[0]), FSDPModuleTestAccess::state(block0));
    EXPECT_FALSE(FSDPModuleTestAccess::param_group(block0)->post_forward_mesh_info().has_value());
    EXPECT_NE(GetState(*model->layers[1]), nullptr);
    EXPECT_EQ(CollectStates(*model).size(), 3u);
    EXPECT_ERROR_CONTAINS(fully_shard_tree(model.ptr(), WrapModuleTypes<BlockImpl>(), {.mesh = mesh}),
                          "already fully_shard'ed");
  });
}

// ---- run_fsdp_forward_method -------------------------------------------------------------

struct CoderImpl : torch::nn::Module {
  CoderImpl()
      : enc(register_module("enc", torch::nn::Linear(5, 3))), dec(register_module("dec", torch::nn::Linear(3, 5))) {}
  at::Tensor forward(const at::Tensor& x) { return dec(enc(x)); }
  // A second entry point that reads the root's own parameters directly.
  at::Tensor encode(const at::Tensor& x) { return at::linear(x, enc->weight, enc->bias).tanh() * 2; }
  torch::nn::Linear enc, dec;
};
using Coder = Hooked<CoderImpl>;

TEST(RunFsdpForwardMethod, UnshardsForTheMethodReshardsAfterAndReducesGradients) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto trace = std::make_shared<comm::CommTrace>(pg);
    auto mesh = mesh::DeviceMesh::Create(trace, {2});
    Coder model, ref;
    InitDeterministic(*model);
    InitDeterministic(*ref);
    FSDPModule fsdp = fully_shard(model.ptr(), {.mesh = mesh, .reshard_after_forward = true});
    torch::optim::SGD opt(model->parameters(), 0.1);
    torch::optim::SGD ref_opt(ref->parameters(), 0.1);
    const at::Tensor x = testing::Batch(0, 4, 5, 3);
    for (int step = 0; step < 2; ++step) {
      trace->clear();
      at::Tensor y = run_fsdp_forward_method<at::Tensor>(
          fsdp, [&](const at::Tensor& in) { return model->encode(in); }, x);
      const at::Tensor expected = ref->encode(x);
      // Same x, same gathered parameters, up to the previous SGD step's rounding (lr 0.1 times a few
      // float32 ulps of the gradient): 1e-6, 8 ulps at scale 1, far below one step (0.1 * |g|).
      EXPECT_TRUE(at::allclose(y, expected, 1e-6, 1e-6)) << "step " << step;
      // Resharded after the method (reshard_after_forward = true).
      EXPECT_TRUE(FSDPModuleTestAccess::param_group(fsdp)->is_sharded());
      EXPECT_LT(model->enc->weight.size(0), 3) << "holds its shard";
      y.sum().backward();
      expected.sum().backward();
      // The backward all-gathered again and reduce-scattered the gradients.
      int gathers = 0, scatters = 0;
      for (const auto& r : trace->records()) {
        gathers += r.op == "all_gather_into_tensor";
        scatters += r.op == "reduce_scatter_tensor";
      }
      EXPECT_EQ(gathers, 2);
      EXPECT_EQ(scatters, 1);
      opt.step();
      ref_opt.step();
      opt.zero_grad();
      ref_opt.zero_grad();
    }
    // 2 SGD steps at lr 0.1 of gradients that differ by a few float32 ulps (their summation order):
    // 1e-6, 8 ulps at scale 1, as above.
    for (const auto& p : FSDPModuleTestAccess::param_group(fsdp)->fsdp_params()) {
      EXPECT_TRUE(at::allclose(p->ShardedDTensor().full_tensor(), ref->named_parameters()[p->fqn()], 1e-6, 1e-6))
          << p->fqn();
    }
    // forward still works next to it.
    EXPECT_TRUE(at::allclose(model(x), ref(x), 1e-6, 1e-6));
  });
}

TEST(RunFsdpForwardMethod, WithoutFsdpJustCallsTheMethod) {
  Coder model;
  const at::Tensor x = at::ones({2, 5});
  at::Tensor y = run_fsdp_forward_method<at::Tensor>(
      *model, [&](const at::Tensor& in) { return model->encode(in); }, x);
  EXPECT_TRUE(at::equal(y, model->encode(x)));
  EXPECT_FALSE(AsFSDPModule(*model).has_value());
  EXPECT_ERROR_CONTAINS(FSDPModule().forward_hook(), "FSDPModule");
}

// ---- set_all_reduce_hook -----------------------------------------------------------------

// Rank-dependent data so that every reduction matters.
void Step(Net& model, int rank) { model(testing::Batch(rank, 4, 3, 5)).pow(2).sum().backward(); }

std::vector<at::Tensor> LocalGrads(Net& model) {
  std::vector<at::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return grads;
}

TEST(SetAllReduceHook, HsdpHookRunsOnTheAllReducedOutputBeforeAccumulation) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2, 2}, {"replicate", "shard"});
    Net plain(2), hooked(2);
    InitDeterministic(*plain);
    InitDeterministic(*hooked);
    for (Net* m : {&plain, &hooked}) {
      for (auto& block : (*m)->layers) fully_shard(block.ptr(), {.mesh = mesh});
      fully_shard(m->ptr(), {.mesh = mesh});
    }
    std::atomic<int> calls{0};
    std::vector<FSDPModule> handles{*AsFSDPModule(*hooked)};
    for (auto& block : hooked->layers) handles.push_back(*AsFSDPModule(*block));
    for (FSDPModule& h : handles) {
      h.set_all_reduce_hook([&calls](const at::Tensor& reduced) {
        ++calls;
        reduced.mul_(3);
      });
    }
    Step(plain, pg->rank());
    Step(hooked, pg->rank());
    EXPECT_EQ(calls.load(), 3);
    const auto a = LocalGrads(plain), b = LocalGrads(hooked);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i] * 3, b[i])) << i;
    // Partial accumulation skips the all-reduce and the hook; the synced step runs it once.
    hooked->zero_grad();
    handles[0].set_requires_all_reduce(false);  // recursive: every group
    Step(hooked, pg->rank());
    EXPECT_EQ(calls.load(), 3);
    handles[0].set_requires_all_reduce(true);
    Step(hooked, pg->rank());
    EXPECT_EQ(calls.load(), 6);
    // An empty hook removes it.
    for (FSDPModule& h : handles) h.set_all_reduce_hook(nullptr);
    Step(hooked, pg->rank());
    EXPECT_EQ(calls.load(), 6);
  });
}

TEST(SetAllReduceHook, FsdpWithAHookAllReducingOverReplicasMatchesNativeHsdp) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2, 2}, {"replicate", "shard"});
    Net native(2), custom(2);
    InitDeterministic(*native);
    InitDeterministic(*custom);
    for (auto& block : native->layers) fully_shard(block.ptr(), {.mesh = mesh});
    fully_shard(native.ptr(), {.mesh = mesh});
    // The user's own HSDP (PyTorch's documented use): FSDP over the shard dim only, the
    // replicate all-reduce in the hook.
    const comm::ProcessGroupPtr replicate = mesh->group("replicate");
    auto hook = [replicate](const at::Tensor& reduced) {
      replicate->all_reduce(reduced)->wait();
      reduced.div_(replicate->size());
    };
    for (auto& block : custom->layers) fully_shard(block.ptr(), {.mesh = (*mesh)["shard"]}).set_all_reduce_hook(hook);
    fully_shard(custom.ptr(), {.mesh = (*mesh)["shard"]}).set_all_reduce_hook(hook);
    Step(native, pg->rank());
    Step(custom, pg->rank());
    const auto a = LocalGrads(native), b = LocalGrads(custom);
    ASSERT_EQ(a.size(), b.size());
    // The same gradients averaged by two reduction orders (native all-reduce vs the hook's sum then
    // divide): a few float32 ulps each; 1e-5 relative (~80 ulps), 1e-6 absolute near zero.
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::allclose(a[i], b[i], 1e-5, 1e-6)) << i;
  });
}

// ---- set_post_optim_event ----------------------------------------------------------------

TEST(SetPostOptimEvent, TheRootWaitsForTheEventOnceAndDropsIt) {
  for (bool after_first_forward : {false, true}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [after_first_forward](const comm::ProcessGroupPtr& pg) {
      auto mesh = mesh::DeviceMesh::Create(pg, {2});
      Net model(1);
      InitDeterministic(*model);
      fully_shard(model->layers[0].ptr(), {.mesh = mesh});
      // The root reshards too, so that the next forward all-gathers it.
      FSDPModule root = fully_shard(model.ptr(), {.mesh = mesh, .reshard_after_forward = true});
      const at::Tensor x = at::ones({2, 3});
      if (after_first_forward) model(x);  // streams exist: the all-gather streams wait
      // An "optimizer step" on the user's own asynchronous stream, late: it zeroes every
      // shard. The forward must see its result.
      auto pool = device::StreamPool::Create(c10::Device(c10::kCPU), {.cpu_mode = device::CpuStreamMode::kAsync,
                                                                      .cpu_task_delay = std::chrono::milliseconds(30)});
      device::StreamPtr optim = pool->NewStream("optim");
      std::vector<at::Tensor> params = model->parameters();
      optim->Launch([params] {
        at::NoGradGuard no_grad;
        for (const auto& p : params) p.zero_();
      });
      root.set_post_optim_event(optim->RecordEvent());
      const at::Tensor y = model(x);
      EXPECT_TRUE(at::equal(y, at::zeros_like(y))) << "after_first_forward " << after_first_forward;
      EXPECT_EQ(FSDPModuleTestAccess::state(root)->state_ctx().post_optim_event, nullptr) << "used once";
      optim->Synchronize();
    });
  }
}

}  // namespace
}  // namespace fsdp::fsdp2
