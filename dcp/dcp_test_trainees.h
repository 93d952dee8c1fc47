// The training runs the //dcp tests share: a Net (or its TP variant) on a 1-D, HSDP, FSDP + TP
// or SPMD mesh with AdamW, its single-rank reference, and bitwise state comparisons.
// Test-only; included by each source of //dcp:dcp_test (internal linkage: one copy per
// test source).
#ifndef FSDP_DCP_DCP_TEST_TRAINEES_H_
#define FSDP_DCP_DCP_TEST_TRAINEES_H_

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
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/fsdp2/test_models.h"
#include "optim_state/fsdp2_optim_state.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"
#include "testing/test_dir.h"

namespace fsdp::dcp {
namespace {

using fsdp::testing::Backend;
using fsdp2::FullyShardOptions;
using fsdp2::testing::Batch;
using fsdp2::testing::InitDeterministic;
using fsdp2::testing::Net;
using fsdp2::testing::NetOptions;

inline std::string NewDir(const std::string& name) { return fsdp::testing::NewTestPath(name); }

// ----------------------------------------------------------------------- TP models
// fsdp2::testing::TPNet (fsdp/fsdp2/test_models.h): blocks with a colwise fc1 and a
// rowwise fc2 on "tp"; `spmd` set: their specs live on the whole (dp, tp) mesh (the
// dp_mesh_dims path).
using fsdp2::testing::CloneLinear;
using fsdp2::testing::TPNet;

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
inline Mesh W(int world) { return {Layout::k1D, world}; }
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
inline Trainee Build(const Mesh& m, const comm::ProcessGroupPtr& pg, uint64_t seed, NetOptions net = kNet) {
  Trainee t;
  t.world = pg;
  Net plain(net);
  InitDeterministic(*plain, seed);
  const at::Tensor scale = at::arange(4, at::kFloat) + static_cast<double>(seed);
  if (m.layout == Layout::k1D || m.layout == Layout::kHsdp) {
    plain->register_buffer("scale", scale);
    auto mesh = m.layout == Layout::k1D ? mesh::DeviceMesh::Create(pg, {m.world})
                                        : mesh::DeviceMesh::Create(pg, {2, 2}, {"replicate", "shard"});
    for (auto& b : plain->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(plain.ptr(), {.mesh = mesh});
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
    if (spmd) block = FullyShardOptions{.mesh = mesh, .dp_mesh_dims = fsdp2::DataParallelMeshDims{"dp"}};
    for (auto& b : model->layers) fsdp2::fully_shard(b.ptr(), block);
    fsdp2::fully_shard(model.ptr(), {.mesh = (*mesh)["dp"]});
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
inline std::vector<double> Train(Trainee& t, int first, int steps) {
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
inline Reference RunReference() {
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
// rounding over a few AdamW steps (as fsdp/fsdp2/parity_test.cc), not bitwise: a few float32 ulps
// (2^-23) of a step per step; 1e-6 is 8 ulps at scale 1, far below one step (lr).
constexpr double kTol = 1e-6;

inline void ExpectClose(double got, double want, const std::string& what) {
  EXPECT_LE(std::abs(got - want), kTol * std::max(1.0, std::abs(want))) << what << ": " << got << " vs " << want;
}

// The model's full state (parameters, buffer, optimizer state), collective.
struct FullState {
  fsdp2::FullStateDict model;
  optim_state::OptimStateDict optim;
};
inline FullState GetFull(Trainee& t) {
  return {fsdp2::GetFullStateDict(*t.module), optim_state::GetFullOptimStateDict(*t.module, *t.opt)};
}

inline void ExpectSameState(const FullState& got, const FullState& want, const std::string& what) {
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

}  // namespace
}  // namespace fsdp::dcp

#endif  // FSDP_DCP_DCP_TEST_TRAINEES_H_
