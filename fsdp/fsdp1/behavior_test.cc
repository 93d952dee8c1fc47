// FSDP1 runtime behaviour beside parity: storage freed on reshard, communication volume per
// step, sharded gradient accumulation across backwards, communication hooks, the rate
// limiter, the parameters() accessor, and error paths.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <compare>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/comm_trace.h"
#include "comm/fake_process_group.h"
#include "fsdp/common/storage.h"
#include "fsdp/fsdp1/test_models.h"
#include "mesh/device_mesh.h"
#include "testing/expect_error.h"
#include "testing/float_tolerance.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp1 {
namespace {

using fsdp::testing::Backend;
using testing::Batch;
using testing::InitDeterministic;
using testing::Net;

at::Tensor LocalLoss(Net& model, int step, int rank, int world) {
  const int64_t local = 12 / world;
  const at::Tensor x = Batch(step, 12, 3, 1), y = Batch(step, 12, 1, 2);
  return torch::nn::functional::mse_loss(model(x.narrow(0, rank * local, local)), y.narrow(0, rank * local, local));
}

at::Tensor FullLoss(Net& model, int step) {
  return torch::nn::functional::mse_loss(model(Batch(step, 12, 3, 1)), Batch(step, 12, 1, 2));
}

FullyShardedDataParallel WrapNested(Net& model, const FSDPOptions& opts) {
  for (auto& b : model->layers) wrap_fsdp(b.ptr(), opts);
  return wrap_fsdp(model.ptr(), opts);
}

TEST(Fsdp1Behavior, UnshardedStorageIsFreedAfterReshard) {
  for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP}) {
    for (bool orig : {false, true}) {
      fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
        Net model;
        InitDeterministic(*model);
        FullyShardedDataParallel root =
            WrapNested(model, {.process_group = pg, .sharding_strategy = strategy, .use_orig_params = orig});
        auto storage = [](FlatParamHandle* h) { return StorageNbytes(h->flat_param().full_param_padded); };
        at::Tensor loss = LocalLoss(model, 0, pg->rank(), 2);
        const std::string label = std::string(ToString(strategy)) + (orig ? " orig" : "");
        // After forward: FULL_SHARD frees the blocks (the root keeps its parameters for
        // backward); SHARD_GRAD_OP keeps everything.
        for (auto& b : model->layers) {
          FlatParamHandle* h = GetState(*b.ptr())->handle();
          if (strategy == ShardingStrategy::FULL_SHARD) {
            EXPECT_EQ(storage(h), 0) << label;
            if (!orig) {
              EXPECT_EQ(b->fc1->weight.numel(), 0) << label;
            }
          } else {
            EXPECT_GT(storage(h), 0) << label;
          }
        }
        EXPECT_GT(storage(root.handle()), 0) << label;
        loss.backward();
        for (FlatParamHandle* h : root.handles()) {
          EXPECT_EQ(storage(h), 0) << label;
          EXPECT_TRUE(h->is_sharded(h->flat_param().param)) << label;
          EXPECT_EQ(h->training_state(), HandleTrainingState::IDLE) << label;
        }
        // Between steps the originals hold no data (or, with use_orig_params, this rank's part).
        const at::Tensor w = model->layers[0]->fc1->weight;
        if (orig) {
          EXPECT_LE(w.numel(), 35) << label;
          EXPECT_EQ(w.dim(), 1) << label;
        } else {
          EXPECT_EQ(w.numel(), 0) << label;
        }
      });
    }
  }
}

// One FULL_SHARD step: per block handle 2 all-gathers (forward, backward) and 1
// reduce-scatter of the padded flat size; the root (not resharded after forward) 1 + 1.
// SHARD_GRAD_OP: 1 all-gather per handle. Nothing else is communicated.
TEST(Fsdp1Behavior, CommunicationVolumePerStep) {
  for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [strategy](const comm::ProcessGroupPtr& world) {
      auto trace = std::make_shared<comm::CommTrace>(world);
      Net model;
      InitDeterministic(*model);
      FullyShardedDataParallel root = WrapNested(model, {.process_group = trace, .sharding_strategy = strategy});
      ASSERT_TRUE(root.is_root());  // lazy init sets the padded sizes
      // Blocks: 5*7+7 + 7*5+5 = 82 -> padded 84; root: 3*5+5 + 5+1 + 6 = 32.
      ASSERT_EQ(root.handle()->flat_param().padded_unsharded_size, std::vector<int64_t>{32});
      for (auto& b : model->layers) {
        ASSERT_EQ(GetState(*b.ptr())->handle()->flat_param().padded_unsharded_size, std::vector<int64_t>{84});
      }
      for (int step = 0; step < 2; ++step) {
        trace->clear();
        LocalLoss(model, step, world->rank(), 4).backward();
        std::map<int64_t, int> all_gathers, reduce_scatters;
        for (const comm::CollectiveRecord& r : trace->records()) {
          if (r.op == "all_gather_into_tensor") {
            ++all_gathers[r.output_numel];
          } else if (r.op == "reduce_scatter_tensor") {
            ++reduce_scatters[r.input_numel];
          } else {
            ADD_FAILURE() << "unexpected collective " << r.op;
          }
        }
        const int block_gathers = strategy == ShardingStrategy::FULL_SHARD ? 2 : 1;
        EXPECT_EQ(all_gathers, (std::map<int64_t, int>{{32, 1}, {84, 2 * block_gathers}})) << ToString(strategy);
        EXPECT_EQ(reduce_scatters, (std::map<int64_t, int>{{32, 1}, {84, 2}})) << ToString(strategy);
        const int64_t gathered = (32 + 84 * 2 * block_gathers) * 4;  // f32 bytes
        EXPECT_EQ(trace->total_output_bytes("all_gather_into_tensor"), gathered);
      }
    });
  }
}

// Communication per training step for every strategy against a closed form from the flat
// sizes: N_h = the numel of handle h's parameters (each block's own; the root's: the rest,
// counted from the plain model before wrapping), P_h = ceil(N_h / S) * S for shard group size
// S, 4 bytes per f32 element. Records are (op, group size, input bytes, output bytes):
//   FULL_SHARD (S = 4):    block: 2 x AG (P/4 -> P), 1 x RS (P -> P/4); root: 1 AG, 1 RS
//                          (the root is not resharded after forward);
//   SHARD_GRAD_OP (S = 4): every handle 1 AG + 1 RS;
//   NO_SHARD (4 ranks):    every handle 1 all_reduce of its unpadded flat gradient (N), nothing else;
//   HYBRID_SHARD (2 x 2):  over the shard group (S = 2) as FULL_SHARD, plus over the replica
//                          group (2 ranks) 1 all_reduce of the sharded gradient (P / 2) per handle.
struct Collective {
  std::string op;
  int group = 0;
  int64_t in_bytes = 0, out_bytes = 0;
  auto operator<=>(const Collective&) const = default;
};
using CollectiveCounts = std::map<Collective, int>;

CollectiveCounts Count(const comm::CommTrace& trace) {
  CollectiveCounts counts;
  for (const comm::CollectiveRecord& r : trace.records()) {
    ++counts[{r.op, r.group_size, r.input_bytes, r.output_bytes}];
  }
  return counts;
}

std::string Describe(const CollectiveCounts& counts) {
  std::string out;
  for (const auto& [c, n] : counts) {
    out += absl::StrCat(n, " x ", c.op, " (group ", c.group, ", ", c.in_bytes, " -> ", c.out_bytes, " B)\n");
  }
  return out;
}

int64_t NumelOf(const std::vector<at::Tensor>& params) {
  int64_t n = 0;
  for (const at::Tensor& p : params) n += p.numel();
  return n;
}

TEST(Fsdp1Behavior, CommunicationVolumePerStepForEveryStrategy) {
  constexpr int64_t kF32 = 4;
  for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD,
                        ShardingStrategy::HYBRID_SHARD}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [strategy](const comm::ProcessGroupPtr& world) {
      const std::string label = ToString(strategy);
      const bool hybrid = strategy == ShardingStrategy::HYBRID_SHARD;
      Net model(3);
      InitDeterministic(*model);
      std::vector<int64_t> numels;  // per handle, root first
      int64_t in_blocks = 0;
      for (auto& b : model->layers) {
        numels.push_back(NumelOf(b->parameters()));
        in_blocks += numels.back();
      }
      numels.insert(numels.begin(), NumelOf(model->parameters()) - in_blocks);
      // Hybrid: shard groups {0, 1}, {2, 3}; replica groups {0, 2}, {1, 3}; each traced.
      std::shared_ptr<comm::CommTrace> shard_trace, replica_trace;
      if (hybrid) {
        auto row0 = world->new_subgroup({0, 1}), row1 = world->new_subgroup({2, 3});
        auto col0 = world->new_subgroup({0, 2}), col1 = world->new_subgroup({1, 3});
        shard_trace = std::make_shared<comm::CommTrace>(world->rank() < 2 ? row0 : row1);
        replica_trace = std::make_shared<comm::CommTrace>(world->rank() % 2 == 0 ? col0 : col1);
      } else {
        shard_trace = std::make_shared<comm::CommTrace>(world);
      }
      FSDPOptions opts{.process_group = shard_trace, .sharding_strategy = strategy};
      if (hybrid) opts.inter_node_group = replica_trace;
      FullyShardedDataParallel root = WrapNested(model, opts);
      torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-2));

      const int s = hybrid ? 2 : 4;
      CollectiveCounts want_shard, want_replica;
      for (size_t h = 0; h < numels.size(); ++h) {
        const int64_t n = numels[h], padded = (n + s - 1) / s * s;
        const bool is_root = h == 0;
        const Collective ag{"all_gather_into_tensor", s, padded / s * kF32, padded * kF32};
        const Collective rs{"reduce_scatter_tensor", s, padded * kF32, padded / s * kF32};
        switch (strategy) {
          case ShardingStrategy::FULL_SHARD:
          case ShardingStrategy::HYBRID_SHARD:
            want_shard[ag] += is_root ? 1 : 2;
            ++want_shard[rs];
            if (hybrid) ++want_replica[{"all_reduce", 2, padded / s * kF32, padded / s * kF32}];
            break;
          case ShardingStrategy::SHARD_GRAD_OP:
            ++want_shard[ag];
            ++want_shard[rs];
            break;
          default:  // NO_SHARD
            ++want_shard[{"all_reduce", 4, n * kF32, n * kF32}];
        }
      }
      for (int step = 0; step < 2; ++step) {
        shard_trace->clear();
        if (replica_trace) replica_trace->clear();
        LocalLoss(model, step, world->rank(), 4).backward();
        opt.step();
        opt.zero_grad();
        const CollectiveCounts got = Count(*shard_trace);
        EXPECT_EQ(got, want_shard) << label << " step " << step << " got:\n"
                                   << Describe(got) << "want:\n"
                                   << Describe(want_shard);
        if (replica_trace) {
          const CollectiveCounts got_replica = Count(*replica_trace);
          EXPECT_EQ(got_replica, want_replica) << label << " step " << step << " got:\n"
                                               << Describe(got_replica) << "want:\n"
                                               << Describe(want_replica);
        }
      }
    });
  }
}

// The order of collectives in one backward: with backward prefetch the next block's
// all-gather is issued before the current block's reduce-scatter; without, after it.
TEST(Fsdp1Behavior, BackwardPrefetchOrder) {
  for (std::optional<BackwardPrefetch> prefetch :
       {std::optional<BackwardPrefetch>(BackwardPrefetch::BACKWARD_PRE),
        std::optional<BackwardPrefetch>(BackwardPrefetch::BACKWARD_POST), std::optional<BackwardPrefetch>()}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [prefetch](const comm::ProcessGroupPtr& world) {
      auto trace = std::make_shared<comm::CommTrace>(world);
      Net model;
      InitDeterministic(*model);
      WrapNested(model, {.process_group = trace, .backward_prefetch = prefetch});
      at::Tensor loss = LocalLoss(model, 0, world->rank(), 2);
      trace->clear();
      loss.backward();
      std::vector<std::string> ops;
      for (const comm::CollectiveRecord& r : trace->records()) {
        ops.push_back((r.op == "all_gather_into_tensor" ? "AG" : "RS") +
                      std::to_string(r.output_numel + r.input_numel));
      }
      // Blocks: 82 elements padded to 82 (W=2): AG 41 -> 82, RS 82 -> 41; root 32: RS 32 -> 16.
      const std::vector<std::string> with_prefetch = {"AG123", "AG123", "RS123", "RS123", "RS48"};
      const std::vector<std::string> without = {"AG123", "RS123", "AG123", "RS123", "RS48"};
      EXPECT_EQ(ops, prefetch ? with_prefetch : without) << (prefetch ? ToString(*prefetch) : "none");
    });
  }
}

// Two synchronized backwards without an optimizer step accumulate sharded gradients.
TEST(Fsdp1Behavior, ShardedGradientsAccumulateAcrossBackwards) {
  for (bool orig : {false, true}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [orig](const comm::ProcessGroupPtr& pg) {
      Net ref, model;
      InitDeterministic(*ref);
      InitDeterministic(*model);
      FullyShardedDataParallel root = WrapNested(model, {.process_group = pg, .use_orig_params = orig});
      torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 2; ++step) {
        for (int k = 0; k < 2; ++k) {
          FullLoss(ref, 10 * step + k).backward();
          LocalLoss(model, 10 * step + k, pg->rank(), 2).backward();
        }
        ref_opt.step();
        ref_opt.zero_grad();
        opt.step();
        opt.zero_grad();
      }
      // Sliced vs whole-batch gradient sums through 2 AdamW steps at lr 1e-2.
      testing::ExpectParamsMatch(root, *ref, fsdp::testing::AdamWParityTolerance(2, /*lr=*/1e-2),
                                 orig ? "orig" : "flat");
    });
  }
}

TEST(Fsdp1Behavior, CommHookReplacesTheReduction) {
  for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::NO_SHARD}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [strategy](const comm::ProcessGroupPtr& pg) {
      Net ref, model;
      InitDeterministic(*ref);
      InitDeterministic(*model);
      FullyShardedDataParallel root = WrapNested(model, {.process_group = pg, .sharding_strategy = strategy});
      int calls = 0;
      // Mean via AVG (the default path pre/post-divides a SUM); counts its calls.
      root.register_comm_hook(
          [&calls](const comm::ProcessGroupPtr& group, const at::Tensor& grad, const at::Tensor& output) {
            ++calls;
            if (output.defined()) {
              group->reduce_scatter_tensor(output, grad, comm::ReduceOp::Avg())->wait();
            } else {
              group->all_reduce(grad, comm::ReduceOp::Avg())->wait();
            }
          });
      EXPECT_ERROR_CONTAINS(root.register_comm_hook([](auto&, auto&, auto&) {}),
                            "A communication hook is already registered");
      torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 2; ++step) {
        FullLoss(ref, step).backward();
        LocalLoss(model, step, pg->rank(), 2).backward();
        ref_opt.step();
        ref_opt.zero_grad();
        opt.step();
        opt.zero_grad();
      }
      EXPECT_EQ(calls, 2 * 3);  // per backward, once per handle
      // Sliced vs whole-batch gradient sums (the hook's AVG) through 2 AdamW steps at lr 1e-2.
      testing::ExpectParamsMatch(root, *ref, fsdp::testing::AdamWParityTolerance(2, /*lr=*/1e-2), ToString(strategy));
    });
  }
}

TEST(Fsdp1Behavior, LimitAllGathersRateLimits) {
  for (bool limit : {true, false}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [limit](const comm::ProcessGroupPtr& pg) {
      Net model(3);
      InitDeterministic(*model);
      WrapNested(model, {.process_group = pg, .limit_all_gathers = limit});
      FullyShardedDataParallel root(GetState(*model.ptr()));
      LocalLoss(model, 0, pg->rank(), 2).backward();
      const FreeEventQueue& q = root.state()->runtime_ctx().free_event_queue;
      if (limit) {
        // Forward frees block0, block1, then unsharding block2 waits for block0's free.
        EXPECT_GT(q.num_synchronized(), 0);
      } else {
        EXPECT_EQ(q.num_synchronized(), 0);
        EXPECT_EQ(q.size(), 0u);
      }
    });
  }
}

TEST(Fsdp1Behavior, ParametersAreWhatTheOptimizerNeeds) {
  auto pg = comm::CreateFakeProcessGroup(0, 2);
  for (bool orig : {false, true}) {
    Net model;
    FullyShardedDataParallel root = WrapNested(model, {.process_group = pg, .use_orig_params = orig});
    const std::vector<at::Tensor> params = root.parameters();
    if (orig) {
      ASSERT_EQ(params.size(), model->parameters().size());
      EXPECT_TRUE(params[0].is_same(model->extra));  // the root's handle first, its own first
    } else {
      ASSERT_EQ(params.size(), 3u);
      EXPECT_TRUE(params[0].is_same(root.handle()->flat_param().param));
    }
    EXPECT_EQ(root.handles().size(), 3u);
  }
}

// FSDPOptions::use_full_prec_in_eval (PyTorch's FSDP_USE_FULL_PREC_IN_EVAL): an eval-mode
// forward under bf16 mixed precision computes in full precision only when it is set.
TEST(Fsdp1Behavior, UseFullPrecInEvalOption) {
  auto pg = comm::CreateFakeProcessGroup(0, 2);
  for (bool full_prec_in_eval : {false, true}) {
    Net model;
    InitDeterministic(*model);
    FullyShardedDataParallel root = WrapNested(model, {.process_group = pg,
                                                       .mixed_precision = MixedPrecision{.param_dtype = at::kBFloat16},
                                                       .use_full_prec_in_eval = full_prec_in_eval});
    const at::Tensor x = Batch(0, 4, 3, 1);
    EXPECT_EQ(model(x).scalar_type(), at::kBFloat16) << "training forwards always use param_dtype";
    model->eval();
    at::NoGradGuard no_grad;
    EXPECT_EQ(model(x).scalar_type(), full_prec_in_eval ? at::kFloat : at::kBFloat16)
        << "use_full_prec_in_eval=" << full_prec_in_eval;
  }
}

TEST(Fsdp1Behavior, ErrorPaths) {
  auto pg = comm::CreateFakeProcessGroup(0, 2);
  {
    Net model;
    FullyShardedDataParallel root = WrapNested(model, {.process_group = pg});
    EXPECT_ERROR_CONTAINS(wrap_fsdp(model.ptr(), {.process_group = pg}), "is already wrapped with FSDP");
    EXPECT_ERROR_CONTAINS(wrap_fsdp(model->in.ptr(), {.process_group = pg}),
                          "wrap_fsdp: torch::nn::LinearImpl cannot run forward hooks; construct it as "
                          "fsdp::Hooked<torch::nn::LinearImpl>");
    FullyShardedDataParallel block(GetState(*model->layers[0].ptr()));
    ASSERT_TRUE(root.is_root());  // lazy init: a state asked first would become a root
    EXPECT_FALSE(block.is_root());
    EXPECT_ERROR_CONTAINS((void)block.no_sync(),
                          "`no_sync()` should only be called on the root FSDP instance, not on block0");
    EXPECT_ERROR_CONTAINS(root.clip_grad_norm(-1), "max_norm must be finite and >= 0, got -1");
    EXPECT_ERROR_CONTAINS(root.clip_grad_norm(1, 0), "norm_type must be > 0 (or inf), got 0");
    EXPECT_ERROR_CONTAINS(block.register_comm_hook([](auto&, auto&, auto&) {}), "should only be called on the root");
    EXPECT_ERROR_CONTAINS(FullyShardedDataParallel().parameters(), "FullyShardedDataParallel: empty handle");
  }
  {
    Net model;
    EXPECT_ERROR_CONTAINS(wrap_fsdp(model.ptr(), {.process_group = pg, .device = c10::Device(c10::kMeta)}),
                          "wrap_fsdp: expects parameter 'extra' on device meta but got cpu");
    EXPECT_ERROR_CONTAINS(wrap_fsdp(model.ptr(), {}), "options.process_group (or device_mesh) is null");
    EXPECT_ERROR_CONTAINS(wrap_fsdp(nullptr, {.process_group = pg}), "wrap_fsdp: module is null");
    EXPECT_ERROR_CONTAINS(
        wrap_fsdp(model.ptr(), {.process_group = pg, .sharding_strategy = ShardingStrategy::HYBRID_SHARD}),
        "HYBRID_SHARD needs options.inter_node_group");
    EXPECT_ERROR_CONTAINS(wrap_fsdp(model.ptr(), {.process_group = pg, .inter_node_group = pg}),
                          "inter_node_group is only for hybrid strategies, but sharding_strategy is FULL_SHARD");
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    EXPECT_ERROR_CONTAINS(wrap_fsdp(model.ptr(), {.process_group = pg, .device_mesh = mesh}),
                          "cannot pass both process_group and device_mesh");
    EXPECT_ERROR_CONTAINS(
        wrap_fsdp(model.ptr(), {.device_mesh = mesh, .sharding_strategy = ShardingStrategy::HYBRID_SHARD_ZERO2}),
        "_HYBRID_SHARD_ZERO2 expects device_mesh to have ndim=2");
    EXPECT_ERROR_CONTAINS(ModuleWrapPolicy(nullptr), "ModuleWrapPolicy: predicate is empty");
    // Auto-wrapping a tree that already has FSDP modules.
    wrap_fsdp(model->layers[1].ptr(), {.process_group = pg});
    EXPECT_ERROR_CONTAINS(
        wrap_fsdp(model.ptr(), {.process_group = pg, .auto_wrap_policy = ModuleTypeWrapPolicy<testing::BlockImpl>()}),
        "FSDP auto wrapping requires modules to not already have FSDP applied but found block1");
  }
  {
    // Weights tied across FSDP modules.
    Net model;
    model->head->register_parameter("tied", model->layers[0]->fc1->weight);
    wrap_fsdp(model->layers[0].ptr(), {.process_group = pg});
    EXPECT_ERROR_CONTAINS(wrap_fsdp(model.ptr(), {.process_group = pg}),
                          "parameter 'head.tied' is the same tensor as a parameter of 'block0', which is already "
                          "wrapped with FSDP. Tied parameters must belong to one FSDP module");
  }
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& world) {
    {
      // Options that must agree across the tree are checked at lazy init.
      Net model;
      wrap_fsdp(model->layers[0].ptr(), {.process_group = world, .use_orig_params = true});
      wrap_fsdp(model->layers[1].ptr(), {.process_group = world});
      FullyShardedDataParallel root = wrap_fsdp(model.ptr(), {.process_group = world});
      EXPECT_ERROR_CONTAINS(root.is_root(), "Expects one homogeneous value for use_orig_params but got {false, true}");
    }
    {
      // The first forward must go through the root.
      Net model;
      FullyShardedDataParallel root = WrapNested(model, {.process_group = world});
      model->layers[0](at::ones({2, 5}));
      EXPECT_ERROR_CONTAINS(root.is_root(),
                            "Non-root FSDP instance's `_is_root` should not have been set yet or should have been set "
                            "to `False` (block0 ran forward as an FSDP root before its ancestor <root>)");
    }
    {
      // Communication hooks do not support hybrid strategies.
      auto mesh = mesh::DeviceMesh::Create(world, {1, 2}, {"replicate", "shard"});
      Net model;
      FullyShardedDataParallel root =
          wrap_fsdp(model.ptr(), {.device_mesh = mesh, .sharding_strategy = ShardingStrategy::HYBRID_SHARD});
      EXPECT_ERROR_CONTAINS(root.register_comm_hook([](auto&, auto&, auto&) {}),
                            "Communication hook is not supported for hybrid strategies: HYBRID_SHARD");
    }
  });
}

// The non-finite sentinel (FSDPOptions::detect_nonfinite_grads): an Inf in rank 0's input
// makes rank 0's unreduced gradients non-finite from the input layer on; both ranks' backward
// fails with one line naming the first such parameter in module order (the root's `in`), the
// rank and the step; the clean step before it passes.
TEST(Fsdp1Behavior, NonfiniteSentinelNamesTheParameterTheRankAndTheStep) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Net model;
    InitDeterministic(*model);
    WrapNested(model, {.process_group = pg, .detect_nonfinite_grads = true});
    const at::Tensor x = Batch(0, 4, 3, 1);
    model(x).sum().backward();  // step 1: finite
    at::Tensor bad = x.clone();
    if (pg->rank() == 0) bad[0][0] = std::numeric_limits<float>::infinity();
    EXPECT_ERROR_CONTAINS(model(bad).sum().backward(),
                          "'in.weight' held NaN or Inf in its unreduced gradient on rank(s) 0 at backward step 2");
  });
}

}  // namespace
}  // namespace fsdp::fsdp1
