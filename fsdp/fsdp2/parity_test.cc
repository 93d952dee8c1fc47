// FSDP2 parity: N AdamW steps with fully_shard on W ranks equal N steps of the same model on
// one rank (the reference runs on every rank without FSDP, on the whole batch). The
// nccl_processes cases train on GPU cuda:rank (model, inputs and reference); they skip,
// saying why, without a CUDA build, without W GPUs or without LibTorch's CUDA backend. The
// training loop, the comparison and its tolerances are the parity harness's
// (fsdp/common/parity_harness.h), shared with FSDP1; this file keeps FSDP2's configurations.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include <map>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "comm/comm_trace.h"
#include "fsdp/common/parity_harness.h"
#include "fsdp/fsdp2/fsdp_state.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/fsdp2/test_models.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"
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

struct Config {
  std::string name;
  std::variant<bool, int64_t> reshard_after_forward = true;
  bool hsdp = false;
  int micro_batches = 1;  // > 1: accumulate without sync, then sync on the last
  bool freeze_first_fc1 = false;
  bool use_block_twice = false;
  bool explicit_prefetch = false;
  bool offload = false;
  bool bf16 = false;
  bool tie = false;
  std::optional<c10::ScalarType> reduce_dtype;
  std::optional<c10::ScalarType> output_dtype;
  bool replicate = false;
  bool unshard_async_op = false;  // FSDPModule::set_unshard_async_op on the root (recursive)
  // Manual backward finalization (a pipeline stage's way): every microbatch's backward without
  // sync or reshard, then finalize_backward() with sync on: one reduction per step.
  bool manual_finalization = false;
  int steps = 4;
};

// Every FSDP parameter of `model` by name, gathered from its shards (collective).
std::map<std::string, at::Tensor> FullParams(torch::nn::Module& model) {
  std::map<std::string, at::Tensor> full;
  for (FSDPState* s : CollectStates(model)) {
    if (!s->param_group()) continue;
    for (const auto& p : s->param_group()->fsdp_params()) full[p->fqn()] = p->ShardedDTensor().full_tensor();
  }
  return full;
}

constexpr int kSteps = 4;

// Bytes of parameter storage FSDP holds on this rank (sharded storage + all-gather outputs).
int64_t FsdpOwnedBytes(torch::nn::Module& model) {
  int64_t bytes = 0;
  for (FSDPState* s : CollectStates(model)) {
    if (!s->param_group()) continue;
    for (const auto& p : s->param_group()->fsdp_params()) {
      bytes += static_cast<int64_t>(p->sharded_param_data().storage().nbytes());
      if (p->all_gather_output().defined()) bytes += static_cast<int64_t>(p->all_gather_output().storage().nbytes());
    }
  }
  return bytes;
}

// `device`: where the model, its inputs and the reference live (the rank's GPU for NCCL).
void RunParity(const Config& cfg, const comm::ProcessGroupPtr& world, c10::Device device) {
  const int w = world->size(), me = world->rank();
  const NetOptions net{.use_block_twice = cfg.use_block_twice, .tie = cfg.tie};
  Net ref(net), model(net);
  parity::InitPair(ref, model, device);
  if (cfg.freeze_first_fc1) {
    for (auto* m : {&ref, &model}) {
      (*m)->layers[0]->fc1->weight.set_requires_grad(false);
      (*m)->layers[0]->fc1->bias.set_requires_grad(false);
    }
  }
  mesh::DeviceMeshPtr mesh = cfg.hsdp ? mesh::DeviceMesh::Create(world, {2, w / 2}, {"replicate", "shard"})
                                      : mesh::DeviceMesh::Create(world, {w});
  FullyShardOptions opts;
  opts.mesh = mesh;
  opts.reshard_after_forward = cfg.reshard_after_forward;
  opts.offload_policy.offload_to_cpu = cfg.offload;
  if (cfg.bf16) opts.mp_policy.param_dtype = at::kBFloat16;
  opts.mp_policy.reduce_dtype = cfg.reduce_dtype;
  opts.replicate = cfg.replicate;
  opts.device = device;
  std::vector<FSDPModule> blocks;
  for (auto& b : model->layers) blocks.push_back(fully_shard(b.ptr(), opts));
  // Only the root casts its output (blocks' f32 outputs would meet the root's bf16 head).
  opts.mp_policy.output_dtype = cfg.output_dtype;
  FSDPModule root = fully_shard(model.ptr(), opts);
  if (cfg.unshard_async_op) {
    root.set_unshard_async_op(true);
    for (FSDPState* s : CollectStates(*model)) {
      if (s->param_group()) {
        EXPECT_TRUE(s->param_group()->unshard_async_op) << "set_unshard_async_op recurses";
      }
    }
  }
  if (cfg.explicit_prefetch) {
    blocks[0].set_modules_to_forward_prefetch({blocks[1]});
    blocks[1].set_modules_to_backward_prefetch({blocks[0]});
  }
  int64_t baseline_bytes = -1;
  parity::Trainee trainee{.params = testing::UniqueParameters(*model)};
  trainee.micro_batch = [&](const at::Tensor& x, const at::Tensor& y, bool sync) {
    if (!cfg.manual_finalization) {
      root.set_requires_gradient_sync(sync);
      torch::nn::functional::mse_loss(model(x), y).backward();
      return;
    }
    root.set_manual_backward_finalization(true);
    root.set_requires_gradient_sync(false);
    root.set_reshard_after_backward(false);
    torch::nn::functional::mse_loss(model(x), y).backward();
    if (!sync) return;
    root.set_requires_gradient_sync(true);
    root.set_reshard_after_backward(true);
    root.finalize_backward();
    root.set_manual_backward_finalization(false);
  };
  trainee.after_step = [&](int step) {
    if (cfg.manual_finalization) {
      EXPECT_ERROR_CONTAINS(blocks[0].set_manual_backward_finalization(true), "must be called on the root");
      EXPECT_ERROR_CONTAINS(blocks[0].finalize_backward(), "must be called on the root");
    }
    // No leak: between steps FSDP holds the same parameter storage every time (shards only;
    // every all-gather output freed).
    const int64_t bytes = FsdpOwnedBytes(*model);
    if (baseline_bytes < 0) baseline_bytes = bytes;
    EXPECT_EQ(bytes, baseline_bytes) << cfg.name << " step " << step << " rank " << me;
  };
  parity::Train({.world = w, .rank = me, .device = device, .steps = cfg.steps, .micro_batches = cfg.micro_batches}, ref,
                trainee);
  // parity::ParamTolerance's argument (float32: two summation orders of the gradients through
  // cfg.steps AdamW steps; bf16 parameters: three whole steps, below the cfg.steps = 4 a run
  // can move).
  parity::ExpectParamsMatch(FullParams(*model), *ref, parity::ParamTolerance(cfg.steps, cfg.bf16),
                            absl::StrCat(cfg.name, " rank ", me));
  if (cfg.output_dtype) {
    EXPECT_EQ(model(Batch(0, 2, 3, 1).to(device)).scalar_type(), *cfg.output_dtype);
  }
}

using ParityCase = parity::Case<Config>;

class ParityTest : public ::testing::TestWithParam<ParityCase> {};

TEST_P(ParityTest, TrainingEqualsSingleRank) { parity::RunCase<Config>(GetParam(), RunParity); }

std::vector<ParityCase> Cases() {
  std::vector<ParityCase> cases;
  for (Backend b : {Backend::kThreaded, Backend::kGlooThreads}) {
    for (int w : {1, 2, 3, 4}) cases.push_back({b, w, Config{"default"}});
  }
  auto add = [&](Config cfg, int w = 4) { cases.push_back({Backend::kThreaded, w, std::move(cfg)}); };
  add(Config{.name = "no_reshard", .reshard_after_forward = false});
  add(Config{.name = "reshard_to_2", .reshard_after_forward = int64_t{2}});
  add(Config{.name = "hsdp", .hsdp = true});
  add(Config{.name = "grad_accumulation", .micro_batches = 4});
  add(Config{.name = "hsdp_grad_accumulation", .hsdp = true, .micro_batches = 3});
  add(Config{.name = "manual_finalization", .micro_batches = 3, .manual_finalization = true});
  add(Config{.name = "manual_finalization_one_microbatch", .manual_finalization = true}, 2);
  add(Config{.name = "frozen", .freeze_first_fc1 = true}, 3);
  add(Config{.name = "block_used_twice", .use_block_twice = true}, 3);
  add(Config{.name = "explicit_prefetch", .explicit_prefetch = true});
  add(Config{.name = "cpu_offload", .offload = true}, 3);
  add(Config{.name = "bf16", .bf16 = true}, 2);
  add(Config{.name = "tied_weights", .tie = true}, 3);
  add(
      Config{
          .name = "bf16_reduce_f32_output_f32", .bf16 = true, .reduce_dtype = at::kFloat, .output_dtype = at::kFloat},
      4);
  add(Config{.name = "bf16_reduce_bf16", .bf16 = true, .reduce_dtype = at::kBFloat16}, 3);
  add(Config{.name = "bf16_reduce_f32_accumulation", .micro_batches = 3, .bf16 = true, .reduce_dtype = at::kFloat}, 2);
  add(Config{.name = "replicate", .replicate = true}, 3);
  add(Config{.name = "replicate_grad_accumulation", .micro_batches = 2, .replicate = true}, 2);
  cases.push_back({Backend::kGlooThreads, 4, Config{.name = "hsdp", .hsdp = true}});
  cases.push_back({Backend::kGlooProcesses, 3, Config{"default"}});
  // Implicit all-gathers left in flight on the CPU (async_op=True) instead of finished when
  // issued (PyTorch's async_op=False on Gloo, the default).
  cases.push_back({Backend::kGlooThreads, 4, Config{.name = "unshard_async_op", .unshard_async_op = true}});
  cases.push_back({Backend::kGlooProcesses, 2, Config{.name = "unshard_async_op", .unshard_async_op = true}});
  // A c10d::ProcessGroupGloo built by hand and wrapped (comm::WrapC10dBackend): what a user
  // who already holds a c10d backend passes in; HSDP splits it through the backend's split().
  cases.push_back({Backend::kC10dGlooThreads, 3, Config{"default"}});
  cases.push_back({Backend::kC10dGlooThreads, 4, Config{.name = "hsdp", .hsdp = true}});
  cases.push_back({Backend::kC10dGlooProcesses, 2, Config{"default"}});
  cases.push_back(
      {Backend::kGlooProcesses, 4, Config{.name = "hsdp_reshard_false", .reshard_after_forward = false, .hsdp = true}});
  // CUDA + NCCL, rank r on cuda:r (skipped where that cannot run; see the file comment).
  // w1 runs on any one-GPU host; the others need 2 or 4 GPUs.
  cases.push_back({Backend::kNcclProcesses, 1, Config{"default"}});
  cases.push_back({Backend::kNcclProcesses, 2, Config{"default"}});
  cases.push_back({Backend::kNcclProcesses, 2, Config{.name = "no_reshard", .reshard_after_forward = false}});
  cases.push_back({Backend::kNcclProcesses, 2, Config{.name = "bf16", .bf16 = true}});
  cases.push_back({Backend::kNcclProcesses, 4, Config{.name = "hsdp", .hsdp = true}});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fsdp2, ParityTest, ::testing::ValuesIn(Cases()), parity::CaseName<Config>);

// Soak: random combinations of world size, HSDP, reshard_after_forward (bool / int), explicit
// prefetch, micro-batch accumulation, block reuse and tied weights, each trained 6 steps with
// parity checked and the per-step storage level checked (RunParity). Seeded: reproducible.
TEST(Soak, RandomConfigurationsKeepParityAndDoNotLeak) {
  std::mt19937 rng(20261123);
  auto coin = [&] { return std::uniform_int_distribution<int>(0, 1)(rng) == 1; };
  for (int i = 0; i < 24; ++i) {
    const int w = std::uniform_int_distribution<int>(1, 4)(rng);
    Config cfg{.name = absl::StrCat("soak", i)};
    cfg.steps = 6;
    cfg.hsdp = w == 4 && coin();
    const int64_t shard = cfg.hsdp ? 2 : w;
    const int reshard = std::uniform_int_distribution<int>(0, 2)(rng);
    if (reshard == 1) cfg.reshard_after_forward = false;
    if (reshard == 2 && shard == 4) cfg.reshard_after_forward = int64_t{2};
    cfg.explicit_prefetch = coin();
    cfg.micro_batches = std::uniform_int_distribution<int>(1, 3)(rng);
    cfg.use_block_twice = coin();
    cfg.tie = coin();
    absl::StrAppend(&cfg.name, "_w", w, cfg.hsdp ? "_hsdp" : "", "_reshard", reshard,
                    cfg.explicit_prefetch ? "_prefetch" : "", "_mb", cfg.micro_batches,
                    cfg.use_block_twice ? "_twice" : "", cfg.tie ? "_tied" : "");
    SCOPED_TRACE(cfg.name);
    fsdp::testing::RunOnRanks(Backend::kThreaded, w,
                              [cfg](const comm::ProcessGroupPtr& pg) { RunParity(cfg, pg, c10::Device(c10::kCPU)); });
  }
}

TEST(FsdpTpParity, TwoByTwoMeshEqualsSingleRank) {
  struct Case {
    Backend backend;
    bool spmd;
  };
  for (Case c : {Case{Backend::kThreaded, false}, Case{Backend::kGlooThreads, false}, Case{Backend::kThreaded, true}}) {
    fsdp::testing::RunOnRanks(c.backend, 4, [c](const comm::ProcessGroupPtr& pg) {
      auto mesh = mesh::DeviceMesh::Create(pg, {2, 2}, {"dp", "tp"});
      auto dp = (*mesh)["dp"], tp = (*mesh)["tp"];
      Net ref(NetOptions{.hidden = 8});  // even TP shards: see the README on uneven FSDP + TP
      InitDeterministic(*ref);
      TPNet model(*ref, tp, c.spmd ? mesh : nullptr);
      FullyShardOptions block_opts{.mesh = dp};
      if (c.spmd) block_opts = FullyShardOptions{.mesh = mesh, .dp_mesh_dims = DataParallelMeshDims{"dp"}};
      for (auto& b : model->layers) fully_shard(b.ptr(), block_opts);
      fully_shard(model.ptr(), {.mesh = dp});
      const auto spec = CollectStates(*model)[1]->param_group()->fsdp_params()[0]->sharding_spec();
      EXPECT_EQ(dtensor::ToString(spec.placements), "(StridedShard(dim=0, sf=2), Shard(dim=0))");
      EXPECT_TRUE(dtensor::SameMesh(*spec.mesh, *mesh));
      // The dp ranks split each batch; the tp ranks of one dp rank share its rows.
      parity::Train({.world = 2, .rank = static_cast<int>(mesh->coordinate()[0]), .steps = kSteps}, ref,
                    {.params = model->parameters(), .micro_batch = [&](const at::Tensor& x, const at::Tensor& y, bool) {
                       torch::nn::functional::mse_loss(model(x), y).backward();
                     }});
      // Sliced vs whole-batch gradient sums through kSteps AdamW steps (parity::ParamTolerance's
      // float32 argument).
      parity::ExpectParamsMatch(FullParams(*model), *ref, parity::ParamTolerance(kSteps, /*bf16_params=*/false),
                                absl::StrCat(c.spmd ? "spmd" : "fsdp+tp", " rank ", pg->rank()));
    });
  }
}

// dp_mesh_dims naming several dims (torchtitan's dp_shard x cp): FSDP over them flattened,
// on 8 ranks with tp 2 (FSDP), a replicate dim (HSDP) or no shard dims (DDP). The flattened
// data-parallel ranks each take a slice of the batch (what cp's sequence slices are to a
// token-wise model), so training equals one rank's on the whole batch (the root: FSDP over
// all data-parallel dims flattened).
TEST(FsdpTpParity, SpmdMeshFlattensSeveralDataParallelDims) {
  struct Case {
    std::vector<int64_t> shape;
    std::vector<std::string> names;
    DataParallelMeshDims dims;
    std::vector<std::string> dp_names;  // the data-parallel dims, in mesh order
    const char* placements;             // of block 0's fc1.weight
    const char* spec_mesh;
  };
  const Case cases[] = {
      {{2, 2, 2},
       {"dp_shard", "cp", "tp"},
       {.shard = {"dp_shard", "cp"}},
       {"dp_shard", "cp"},
       "(StridedShard(dim=0, sf=2), Shard(dim=0))",
       "(dp_shard_cp=4, tp=2)"},
      {{2, 2, 2, 1},
       {"dp_replicate", "dp_shard", "cp", "tp"},
       {.shard = {"dp_shard", "cp"}, .replicate = "dp_replicate"},
       {"dp_replicate", "dp_shard", "cp"},
       "(Replicate(), Shard(dim=0), Shard(dim=0))",
       "(dp_replicate=2, dp_shard_cp=4, tp=1)"},
      {{2, 2, 2},
       {"dp_shard", "cp", "tp"},
       {.replicate = {"dp_shard", "cp"}},
       {"dp_shard", "cp"},
       "(Replicate(), Replicate(), Shard(dim=0))",
       "(dp_shard=2, cp=2, tp=2)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec_mesh);
    fsdp::testing::RunOnRanks(Backend::kThreaded, 8, [&c](const comm::ProcessGroupPtr& pg) {
      auto mesh = mesh::DeviceMesh::Create(pg, c.shape, c.names);
      auto dp = mesh->slice(c.dp_names)->flatten(c.dp_names, "dp");
      Net ref(NetOptions{.hidden = 8});
      InitDeterministic(*ref);
      TPNet model(*ref, (*mesh)["tp"], mesh);
      for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = mesh, .dp_mesh_dims = c.dims});
      fully_shard(model.ptr(), {.mesh = dp});
      const auto& fc1 = CollectStates(*model)[1]->param_group()->fsdp_params()[0];
      EXPECT_EQ(dtensor::ToString(fc1->sharding_spec().placements), c.placements);
      EXPECT_NE(fc1->sharding_spec().mesh->ToString().find(c.spec_mesh), std::string::npos)
          << fc1->sharding_spec().mesh->ToString();
      // HSDP's two replicas see the same slices (their mean is each one's).
      parity::Train({.world = 4, .rank = static_cast<int>(dp->local_rank(0) % 4), .steps = kSteps}, ref,
                    {.params = model->parameters(), .micro_batch = [&](const at::Tensor& x, const at::Tensor& y, bool) {
                       torch::nn::functional::mse_loss(model(x), y).backward();
                     }});
      // Sliced vs whole-batch gradient sums through kSteps AdamW steps (parity::ParamTolerance's
      // float32 argument).
      parity::ExpectParamsMatch(FullParams(*model), *ref, parity::ParamTolerance(kSteps, /*bf16_params=*/false),
                                absl::StrCat(c.spec_mesh, " rank ", pg->rank()));
    });
  }
}

// The uneven FSDP + TP layouts: colwise Linear(9, 18) and Linear(9, 27) and a
// rowwise Linear(9, 5) on dp 2 x tp 2. PyTorch 2.15's _StridedShard (torch.chunk into sf
// pieces, then each over dp) describes FSDP's chunk of each TP shard exactly, so the full
// tensors are the original weights (the older N * sf piece rule permuted rows 9..14).
struct UnevenTPImpl : torch::nn::Module {
  UnevenTPImpl(const std::vector<torch::nn::Linear>& plain, const mesh::DeviceMeshPtr& tp) {
    const tensor_parallel::ParallelStylePtr styles[] = {
        tensor_parallel::ColwiseParallel(), tensor_parallel::ColwiseParallel(), tensor_parallel::RowwiseParallel()};
    for (size_t i = 0; i < plain.size(); ++i) {
      layers.push_back(register_module(absl::StrCat("l", i), testing::ParallelLinear(plain[i], tp, styles[i])));
    }
  }
  at::Tensor forward(const at::Tensor& x) { return x; }
  std::vector<testing::HookedLinear> layers;
};
using UnevenTP = Hooked<UnevenTPImpl>;

TEST(FsdpTpParity, UnevenTensorParallelShardsRoundTripBitwise) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2, 2}, {"dp", "tp"});
    auto dp = (*mesh)["dp"], tp = (*mesh)["tp"];
    const auto make_plain = [](double scale) {
      std::vector<torch::nn::Linear> plain = {torch::nn::Linear(9, 18), torch::nn::Linear(9, 27),
                                              torch::nn::Linear(9, 5)};
      at::NoGradGuard no_grad;
      for (auto& l : plain) {  // row r holds r * 100 + column: a permutation would show
        const int64_t out = l->weight.size(0), in = l->weight.size(1);
        l->weight.copy_((at::arange(out, at::kFloat).unsqueeze(1) * 100 + at::arange(in, at::kFloat)) * scale);
        l->bias.copy_(at::arange(out, at::kFloat) * scale);
      }
      return plain;
    };
    const auto plain = make_plain(1.0);
    UnevenTP model(plain, tp);
    fully_shard(model.ptr(), {.mesh = dp});
    model(at::ones({1}));  // lazy init names the parameters (FSDPParam::fqn)
    const auto& params = CollectStates(*model)[0]->param_group()->fsdp_params();
    EXPECT_EQ(dtensor::ToString(params[0]->sharding_spec().placements), "(StridedShard(dim=0, sf=2), Shard(dim=0))");
    const FullStateDict full = GetFullStateDict(*model);
    for (size_t i = 0; i < plain.size(); ++i) {
      const std::string w = absl::StrCat("l", i, ".weight"), b = absl::StrCat("l", i, ".bias");
      ASSERT_NE(full.find(w), nullptr) << w;
      EXPECT_TRUE(at::equal(*full.find(w), plain[i]->weight)) << w << " on rank " << pg->rank();
      EXPECT_TRUE(at::equal(*full.find(b), plain[i]->bias)) << b << " on rank " << pg->rank();
    }
    for (const auto& p : params) {
      ASSERT_NE(full.find(p->fqn()), nullptr) << p->fqn();
      EXPECT_TRUE(at::equal(p->ShardedDTensor().full_tensor(), *full.find(p->fqn()))) << p->fqn();
    }
    // Load the full state dict into a differently initialized model: bitwise the same.
    UnevenTP other(make_plain(-3.0), tp);
    fully_shard(other.ptr(), {.mesh = dp});
    LoadFullStateDict(*other, full);
    const FullStateDict again = GetFullStateDict(*other);
    for (const auto& item : full) EXPECT_TRUE(at::equal(*again.find(item.key()), item.value())) << item.key();
  });
}

// Sequence parallel blocks planned with parallelize_module on mesh["tp"] of a (dp, tp)
// mesh, then fully_shard per block and on the root over mesh["dp"] (torchtitan's 2-D
// recipe): AdamW steps equal one rank's training of the unsharded model.
using HLinear = Hooked<torch::nn::LinearImpl>;
using HLayerNorm = Hooked<torch::nn::LayerNormImpl>;

struct SeqFFNImpl : torch::nn::Module {
  SeqFFNImpl()
      : w1(register_module("w1", HLinear(8, 16))),
        w2(register_module("w2", HLinear(8, 16))),
        w3(register_module("w3", HLinear(16, 8))) {}
  at::Tensor forward(const at::Tensor& x) { return w3(at::silu(w1(x)) * w2(x)); }
  HLinear w1, w2, w3;
};

struct SeqBlockImpl : torch::nn::Module {
  SeqBlockImpl()
      : norm(register_module("norm", HLayerNorm(torch::nn::LayerNormOptions({8})))),
        ffn(register_module("ffn", Hooked<SeqFFNImpl>())) {}
  at::Tensor forward(const at::Tensor& x) { return x + ffn(norm(x)); }
  HLayerNorm norm;
  Hooked<SeqFFNImpl> ffn;
};
using SeqBlock = Hooked<SeqBlockImpl>;

struct SeqNetImpl : torch::nn::Module {
  SeqNetImpl() : norm(register_module("norm", HLayerNorm(torch::nn::LayerNormOptions({8})))) {
    for (int i = 0; i < 2; ++i) blocks.push_back(register_module(absl::StrCat("block", i), SeqBlock()));
    at::NoGradGuard no_grad;
    int k = 0;
    for (auto& p : parameters()) {  // the same values on every rank and in the reference
      p.copy_(at::sin(at::arange(p.numel(), at::kFloat) * 0.37 + (++k)).view(p.sizes()) * 0.5);
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = b(x);
    return norm(x);
  }
  std::vector<SeqBlock> blocks;
  HLayerNorm norm;
};
using SeqNet = Hooked<SeqNetImpl>;

TEST(FsdpTpParity, SequenceParallelPlanWithFullyShardEqualsOneRank) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2, 2}, {"dp", "tp"});
    auto dp = (*mesh)["dp"], tp = (*mesh)["tp"];
    SeqNet ref, model;
    using dtensor::Placement;
    tensor_parallel::parallelize_module(
        *model, tp,
        {{"block*.norm", tensor_parallel::SequenceParallel()},
         {"block*.ffn", tensor_parallel::PrepareModuleInput({{Placement::Shard(1)}, {Placement::Replicate()}})},
         {"block*.ffn.w[12]", tensor_parallel::ColwiseParallel()},
         {"block*.ffn.w3", tensor_parallel::RowwiseParallel({.output_layouts = Placement::Shard(1)})},
         {"norm", tensor_parallel::SequenceParallel({.use_local_output = true})}});
    for (auto& b : model->blocks) fully_shard(b.ptr(), {.mesh = dp});
    fully_shard(model.ptr(), {.mesh = dp});
    torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(parity::kLr));
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(parity::kLr));
    const int64_t d = mesh->coordinate()[0], t = mesh->coordinate()[1];
    for (int step = 0; step < kSteps; ++step) {
      // [batch 4, sequence 6, 8]: dp rank d takes batch half d, tp rank t sequence half t.
      const at::Tensor x = at::cos(at::arange(4 * 6 * 8, at::kFloat) * 0.11 + step).view({4, 6, 8});
      // The reference's loss is the mean over the dp halves of each half's sum of squares
      // (FSDP averages the dp gradients); each rank's loss is its own slice's part.
      ref_opt.zero_grad();
      (ref(x).pow(2).sum() / 2).backward();
      ref_opt.step();
      opt.zero_grad();
      model(x.chunk(2, 0)[d].chunk(2, 1)[t].contiguous()).pow(2).sum().backward();
      opt.step();
    }
    // Gradient sums in other orders (sequence slices, tp reductions) through kSteps AdamW
    // steps (parity::ParamTolerance's float32 argument).
    parity::ExpectParamsMatch(FullParams(*model), *ref, parity::ParamTolerance(kSteps, /*bf16_params=*/false),
                              absl::StrCat("sequence parallel + fsdp rank ", pg->rank()));
  });
}

TEST(FsdpTpParity, SpmdMeshErrors) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2, 2}, {"dp", "tp"});
    const FullyShardOptions spmd{.mesh = mesh, .dp_mesh_dims = DataParallelMeshDims{"dp"}};
    Net plain(NetOptions{.hidden = 8});
    EXPECT_ERROR_CONTAINS(fully_shard(plain->layers[0].ptr(), spmd),
                          "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh");
    TPNet partial_on_dp(*plain, (*mesh)["tp"], mesh, dtensor::Placement::Partial());
    EXPECT_ERROR_CONTAINS(fully_shard(partial_on_dp->layers[0].ptr(), spmd),
                          "Expected Replicate() on DP shard dim 'dp' (index 0) but got Partial(SUM)");
    TPNet other_mesh(*plain, (*mesh)["tp"], mesh::DeviceMesh::Create(pg, {2, 2}, {"a", "tp"}));
    EXPECT_ERROR_CONTAINS(fully_shard(other_mesh->layers[0].ptr(), spmd),
                          "Expected param's DTensor mesh to be the same mesh passed to fully_shard");
    TPNet on_mesh(*plain, (*mesh)["tp"], mesh);
    const auto shard_with = [&](DataParallelMeshDims dims) {
      fully_shard(on_mesh->layers[1].ptr(), {.mesh = mesh, .dp_mesh_dims = std::move(dims)});
    };
    EXPECT_ERROR_CONTAINS(shard_with({}), "At least one of shard or replicate must be set in dp_mesh_dims");
    EXPECT_ERROR_CONTAINS(shard_with({.shard = {"dp", "cp"}}),
                          "Mesh dim name 'cp' (dp_mesh_dims.shard) not found in mesh.mesh_dim_names (dp, tp)");
    EXPECT_ERROR_CONTAINS(shard_with({.shard = {"tp", "dp"}}),
                          "dp_mesh_dims.shard (tp, dp) must name distinct mesh dims in the mesh's order (dp, tp)");
    EXPECT_ERROR_CONTAINS(shard_with({.shard = "dp", .replicate = "tp"}),
                          "the dp replicate dims (tp) must come before the dp shard dims (dp)");
  });
}

}  // namespace
}  // namespace fsdp::fsdp2
