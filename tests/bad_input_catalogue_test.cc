// The misuse catalogue: public-API calls with bad input across every package, each expected
// to raise a c10::Error whose message names the problem (never a crash, hang or silent
// result). Table-driven so the count is visible; package tests cover the same paths in
// context. Runs on 2 threaded ranks (cases that need a group get rank 0's view).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "comm/faulty_process_group.h"
#include "comm/init_process_group.h"
#include "comm/torchrun_env.h"
#include "dtensor/dtensor.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/fsdp2/test_models.h"
#include "optim_state/optim_state_dict.h"
#include "testing/multi_rank.h"

namespace fsdp {
namespace {

using dtensor::Placement;
using fsdp::Hooked;
using fsdp2::testing::Net;
using fsdp2::testing::NetOptions;

struct Case {
  std::string name;
  std::function<void()> call;
  std::string expected;  // substring of the message
};

struct LeafImpl : torch::nn::Module {
  LeafImpl() : fc(register_module("fc", torch::nn::Linear(4, 3))) {}
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
  torch::nn::Linear fc;
};
using Leaf = Hooked<LeafImpl>;

struct ScalarParamImpl : torch::nn::Module {
  ScalarParamImpl() { s = register_parameter("s", at::ones({})); }
  at::Tensor forward(const at::Tensor& x) { return x * s; }
  at::Tensor s;
};

std::optional<std::string> Env(const std::map<std::string, std::string>& vars, const std::string& name) {
  auto it = vars.find(name);
  if (it == vars.end()) return std::nullopt;
  return it->second;
}

std::string GarbageFile(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir ? dir : "/tmp") + "/" + name;
  std::ofstream(path) << "\x80\x02 not a pickle at all";
  return path;
}

std::vector<Case> Catalogue(const comm::ProcessGroupPtr& pg) {
  auto mesh = mesh::DeviceMesh::Create(pg, {2});
  auto env = [](std::map<std::string, std::string> vars) {
    return [vars] { comm::ReadTorchrunEnv([vars](const std::string& n) { return Env(vars, n); }); };
  };
  const std::map<std::string, std::string> good_env = {
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  auto with = [good_env](const std::string& k, const std::string& v) {
    auto e = good_env;
    if (v.empty())
      e.erase(k);
    else
      e[k] = v;
    return e;
  };
  std::vector<Case> c;
  // ---- comm
  c.push_back({"all_gather output too small", [pg] { pg->all_gather_into_tensor(at::empty({3}), at::ones({2})); },
               "all_gather_into_tensor"});
  c.push_back({"reduce_scatter input not divisible", [pg] { pg->reduce_scatter_tensor(at::empty({2}), at::ones({5})); },
               "reduce_scatter_tensor"});
  c.push_back({"broadcast root out of range", [pg] { pg->broadcast(at::ones({2}), 5); }, "root"});
  c.push_back({"all_to_all splits do not sum",
               [pg] {
                 pg->all_to_all_single(at::empty({4}), at::ones({4}), {1, 1}, {2, 2});
               },
               "split"});
  c.push_back({"non-contiguous tensor", [pg] { pg->all_reduce(at::ones({3, 4}).t()); }, "contiguous"});
  c.push_back({"subgroup ranks unsorted", [pg] { pg->new_subgroup({1, 0}); }, "sorted"});
  c.push_back({"torchrun: RANK missing", env(with("RANK", "")), "RANK is not set"});
  c.push_back({"torchrun: RANK >= WORLD_SIZE", env(with("RANK", "2")), "RANK (2) must be < WORLD_SIZE (2)"});
  c.push_back({"torchrun: MASTER_PORT not a number", env(with("MASTER_PORT", "http")),
               "MASTER_PORT must be an integer, got 'http'"});
  c.push_back({"init_process_group: unknown device", [] { comm::InitProcessGroupFromEnv("tpu"); },
               "device must be \"cpu\" (Gloo) or \"cuda\" (NCCL), got \"tpu\""});
  c.push_back({"faulty group without inner", [] { comm::FaultyProcessGroup(nullptr, {}); }, "inner group is null"});
  c.push_back({"fault index negative", [pg] { comm::FaultyProcessGroup(pg, {{.index = -1}}); },
               "fault index must be >= 0, got -1"});
  // ---- mesh
  c.push_back({"mesh shape does not match the group", [pg] { mesh::DeviceMesh::Create(pg, {3}); }, "mesh shape [3]"});
  c.push_back({"mesh dim name repeated",
               [pg] {
                 mesh::DeviceMesh::Create(pg, {1, 2}, {"a", "a"});
               },
               "dim name 'a' is repeated"});
  c.push_back({"mesh unknown dim name", [mesh] { (*mesh)["nope"]; }, "no dimension named 'nope'"});
  c.push_back({"mesh dim index out of range", [mesh] { mesh->size(3); }, "dim must be in [0, 1), got 3"});
  c.push_back({"flatten non-adjacent dims",
               [pg] {
                 auto m = mesh::DeviceMesh::Create(pg, {1, 2, 1}, {"a", "b", "c"});
                 m->flatten({"a", "c"}, "ac");
               },
               "flatten"});
  // ---- dtensor
  c.push_back(
      {"from_local with the wrong local shape",
       [mesh] { dtensor::DTensor::from_local(at::ones({3}), mesh, {Placement::Shard(0)}, std::vector<int64_t>{4}); },
       "from_local: local tensor of shape [3]"});
  c.push_back({"distribute_tensor to Partial",
               [mesh] { dtensor::distribute_tensor(at::ones({4}), mesh, {Placement::Partial()}); }, "Partial"});
  c.push_back(
      {"StridedShard split factor 0", [] { Placement::StridedShard(0, 0); }, "split_factor must be >= 1, got 0"});
  c.push_back({"shard dim out of range",
               [mesh] { dtensor::distribute_tensor(at::ones({4}), mesh, {Placement::Shard(2)}); }, "shard dim 2"});
  c.push_back({"redistribute to another mesh layout",
               [pg, mesh] {
                 auto d = dtensor::distribute_tensor(at::ones({4}), mesh, {Placement::Replicate()});
                 d.redistribute(mesh::DeviceMesh::Create(pg, {2, 1}, {"x", "y"}),
                                {Placement::Replicate(), Placement::Replicate()});
               },
               "redistribute"});
  c.push_back({"undefined DTensor full_tensor", [] { dtensor::DTensor().full_tensor(); }, "undefined DTensor"});
  // ---- FSDP2 fully_shard
  c.push_back({"fully_shard twice",
               [mesh] {
                 Leaf l;
                 fsdp2::fully_shard(l.ptr(), {.mesh = mesh});
                 fsdp2::fully_shard(l.ptr(), {.mesh = mesh});
               },
               "already fully_shard'ed"});
  c.push_back({"fully_shard a module without hooks",
               [mesh] { fsdp2::fully_shard(std::make_shared<LeafImpl>(), {.mesh = mesh}); },
               "cannot run forward hooks; construct it as fsdp::Hooked<"});
  c.push_back({"fully_shard without a mesh",
               [] {
                 Leaf l;
                 fsdp2::fully_shard(l.ptr(), {});
               },
               "options.mesh is null"});
  c.push_back({"fully_shard on a 3-D mesh",
               [pg] {
                 Leaf l;
                 fsdp2::fully_shard(l.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {1, 2, 1})});
               },
               "1D or 2D DeviceMesh"});
  c.push_back({"parameter on another device",
               [mesh] {
                 Leaf l;
                 fsdp2::fully_shard(l.ptr(), {.mesh = mesh, .device = c10::Device("meta")});
               },
               "already be moved to device meta"});
  c.push_back({"reshard_after_forward not a factor",
               [mesh] {
                 Leaf l;
                 fsdp2::fully_shard(l.ptr(), {.mesh = mesh, .reshard_after_forward = int64_t{3}});
               },
               "factor of 2, not 3"});
  c.push_back({"uneven shard on dim 1",
               [mesh] {
                 Leaf l;
                 fsdp2::FullyShardOptions o{.mesh = mesh};
                 o.shard_placement_fn = [](const at::Tensor&, const std::string&) { return std::optional<int64_t>(1); };
                 l->fc->weight.set_data(at::ones({3, 5}));
                 fsdp2::fully_shard(l.ptr(), o);
               },
               "uneven sharding on dim 1"});
  c.push_back({"0-D parameter", [mesh] { fsdp2::fully_shard(Hooked<ScalarParamImpl>().ptr(), {.mesh = mesh}); },
               "0-D parameters"});
  c.push_back({"HSDP mesh without dim names",
               [pg] {
                 Leaf l;
                 fsdp2::fully_shard(l.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {1, 2})});
               },
               "mesh_dim_names"});
  c.push_back({"weights tied across FSDP groups",
               [mesh] {
                 Net n;
                 n->register_module("reader", fsdp2::testing::TiedLinear(n->layers[0]->fc1->weight));
                 for (auto& b : n->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
                 fsdp2::fully_shard(n.ptr(), {.mesh = mesh});
               },
               "is the same tensor as 'block0.fc1.weight'"});
  c.push_back({"dp_mesh_dims with plain parameters",
               [pg] {
                 Leaf l;
                 fsdp2::fully_shard(l.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {2, 1}, {"dp", "tp"}),
                                              .dp_mesh_dims = fsdp2::DataParallelMeshDims{"dp"}});
               },
               "all parameters must be DTensors on the full SPMD mesh"});
  c.push_back({"gradient divide factor 0",
               [mesh] {
                 Leaf l;
                 fsdp2::fully_shard(l.ptr(), {.mesh = mesh}).set_gradient_divide_factor(0);
               },
               "factor must be > 0, got 0"});
  // ---- FSDP2 state dicts
  auto sharded_net = [mesh] {
    auto n = std::make_shared<Net>(NetOptions{});
    for (auto& b : (*n)->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(n->ptr(), {.mesh = mesh});
    return n;
  };
  c.push_back({"full state dict with a missing key",
               [sharded_net] {
                 auto n = sharded_net();
                 auto sd = fsdp2::GetFullStateDict(**n);
                 sd.erase("head.bias");
                 fsdp2::LoadFullStateDict(**n, sd);
               },
               "Missing key(s) in state_dict: head.bias."});
  c.push_back({"full state dict with an extra key",
               [sharded_net] {
                 auto n = sharded_net();
                 auto sd = fsdp2::GetFullStateDict(**n);
                 sd.insert("ghost", at::ones({1}));
                 fsdp2::LoadFullStateDict(**n, sd);
               },
               "Unexpected key(s) in state_dict: ghost."});
  c.push_back({"full state dict with a wrong shape",
               [sharded_net] {
                 auto n = sharded_net();
                 auto sd = fsdp2::GetFullStateDict(**n);
                 sd["in.bias"] = at::ones({7});
                 fsdp2::LoadFullStateDict(**n, sd);
               },
               "size mismatch for in.bias: copying a param with shape [7]"});
  c.push_back({"sharded state dict with a plain tensor for a DTensor",
               [sharded_net] {
                 auto n = sharded_net();
                 fsdp2::ShardedStateDict sd = fsdp2::GetShardedStateDict(**n);
                 sd.dtensors.erase("extra");
                 sd.tensors.insert("extra", at::zeros({6}));
                 fsdp2::LoadShardedStateDict(**n, sd);
               },
               "extra is sharded by FSDP and needs a DTensor"});
  c.push_back({"sharded checkpoint of another world size",
               [pg, sharded_net] {
                 auto n = sharded_net();
                 fsdp2::ShardedStateDict sd = fsdp2::GetShardedStateDict(**n);
                 auto one = mesh::DeviceMesh::Create(pg, {2, 1}, {"r", "s"});
                 sd.dtensors["in.bias"] =
                     dtensor::distribute_tensor(at::zeros({5}), one, {Placement::Replicate(), Placement::Shard(0)});
                 fsdp2::LoadShardedStateDict(**n, sd);
               },
               "(load a full state dict to change the world size)"});
  c.push_back({"state dict file that does not exist", [] { fsdp2::LoadFullStateDictFile("/nonexistent/model.pt"); },
               "cannot open '/nonexistent/model.pt'"});
  c.push_back({"state dict file that is not a pickle",
               [] { fsdp2::LoadFullStateDictFile(GarbageFile("garbage_model.pt")); }, ""});
  // ---- optimizer state
  auto adamw_state = [] {
    auto n = std::make_shared<Net>(NetOptions{});
    optim_state::NamedParams named;
    for (const auto& item : (*n)->named_parameters()) named.emplace_back(item.key(), item.value());
    auto opt = std::make_shared<torch::optim::AdamW>((*n)->parameters(), torch::optim::AdamWOptions(1e-3));
    fsdp2::testing::TrainSteps(*n, *opt, 0, 1, 1, 0);
    return std::make_tuple(n, named, opt, optim_state::GetOptimStateDict(*opt, named));
  };
  c.push_back({"optimizer state for another optimizer type",
               [adamw_state] {
                 auto [n, named, opt, sd] = adamw_state();
                 torch::optim::SGD sgd((*n)->parameters(), 0.1);
                 optim_state::SetOptimStateDict(sgd, named, sd);
               },
               "the optimizer state is for AdamW but the optimizer is SGD"});
  c.push_back({"optimizer state for another model",
               [adamw_state] {
                 auto [n, named, opt, sd] = adamw_state();
                 Net other(NetOptions{.blocks = 1});
                 optim_state::NamedParams other_named;
                 for (const auto& item : other->named_parameters()) other_named.emplace_back(item.key(), item.value());
                 torch::optim::AdamW other_opt(other->parameters(), torch::optim::AdamWOptions(1e-3));
                 optim_state::SetOptimStateDict(other_opt, other_named, sd);
               },
               "param group 0 of the optimizer state holds"});
  c.push_back({"optimizer state with a wrong shape",
               [adamw_state] {
                 auto [n, named, opt, sd] = adamw_state();
                 sd.state.at("head.weight").at("exp_avg") = at::zeros({9});
                 optim_state::SetOptimStateDict(*opt, named, sd);
               },
               "optimizer state 'exp_avg' of 'head.weight' has shape [9]"});
  c.push_back({"optimizer state naming a missing parameter",
               [adamw_state] {
                 auto [n, named, opt, sd] = adamw_state();
                 sd.state["ghost.weight"] = sd.state.at("in.weight");
                 optim_state::SetOptimStateDict(*opt, named, sd);
               },
               "'ghost.weight', which is not a parameter of the optimizer"});
  c.push_back({"optimizer parameters missing from the names",
               [adamw_state] {
                 auto [n, named, opt, sd] = adamw_state();
                 optim_state::GetOptimStateDict(*opt, {});
               },
               "is not among the named parameters"});
  c.push_back({"optimizer state file that is not a pickle",
               [] { optim_state::LoadOptimStateDict(GarbageFile("garbage_optim.pt")); }, ""});
  return c;
}

TEST(BadInputCatalogue, EveryMisuseGetsAClearError) {
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    const std::vector<Case> cases = Catalogue(pg);
    int clear = 0;
    for (const Case& c : cases) {
      try {
        c.call();
        ADD_FAILURE() << c.name << ": did not throw";
      } catch (const c10::Error& e) {
        const bool ok = absl::StrContains(e.what_without_backtrace(), c.expected);
        EXPECT_TRUE(ok) << c.name << ": " << e.what_without_backtrace() << "\nexpected: " << c.expected;
        clear += ok;
      }
    }
    EXPECT_GE(cases.size(), 40u);
    if (pg->rank() == 0) {
      std::printf("bad-input catalogue: %d of %zu misuse cases raise a clear error\n", clear, cases.size());
    }
  });
}

}  // namespace
}  // namespace fsdp
