// SummonFullParams (PyTorch's summon_full_params, torch/distributed/fsdp/_unshard_param_utils.py)
// and FSDPOptions::sync_module_states (torch/distributed/fsdp/_init_utils.py,
// _sync_module_params_and_buffers), checked against an independent single-rank model built
// with the same init: world sizes 2 and 3 (uneven shards), every non-hybrid strategy, with
// and without use_orig_params, root-only and nested wrapping.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/fsdp1/summon_full_params.h"
#include "fsdp/fsdp1/test_models.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp1 {
namespace {

using fsdp::testing::Backend;
using testing::Batch;
using testing::InitDeterministic;
using testing::Net;

constexpr ShardingStrategy kStrategies[] = {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP,
                                            ShardingStrategy::NO_SHARD};

FullyShardedDataParallel Wrap(Net& model, const FSDPOptions& opts, bool nested) {
  if (nested) {
    for (auto& b : model->layers) wrap_fsdp(b.ptr(), opts);
  }
  return wrap_fsdp(model.ptr(), opts);
}

std::string Label(int world, ShardingStrategy s, bool orig, bool nested) {
  return absl::StrCat("world ", world, " ", ToString(s), orig ? " orig" : "", nested ? " nested" : "");
}

// Every parameter of `model` (by name) has the shape and value of `ref`'s.
void ExpectFullParamsEqual(Net& model, Net& ref, const std::string& label) {
  const auto ref_params = ref->named_parameters();
  int checked = 0;
  for (const auto& item : model->named_parameters()) {
    const at::Tensor& expected = ref_params[item.key()];
    ASSERT_EQ(item.value().sizes(), expected.sizes()) << label << " " << item.key();
    EXPECT_TRUE(at::equal(item.value(), expected)) << label << " " << item.key();
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(ref_params.size())) << label;
}

void ExpectSameOutput(Net& model, Net& ref, const std::string& label) {
  at::NoGradGuard no_grad;
  const at::Tensor x = Batch(5, 12, 3, 1);
  // Parameters that agree to a few float32 ulps (sliced vs whole-batch training) through a forward:
  // 1e-5 relative (~80 ulps of 2^-23), 1e-6 absolute near zero.
  EXPECT_TRUE(at::allclose(model(x), ref(x), 1e-5, 1e-6)) << label;
}

void Edit(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.mul_(0.5).add_(0.25);
}

void ExpectAllSharded(FullyShardedDataParallel& root, const std::string& label) {
  for (FlatParamHandle* h : root.handles()) {
    EXPECT_EQ(h->training_state(), HandleTrainingState::IDLE) << label;
    if (h->uses_sharded_strategy()) {
      EXPECT_TRUE(h->is_sharded(h->flat_param().param)) << label;
    }
  }
  for (FSDPState* s : CollectStates(root.module())) EXPECT_EQ(s->training_state(), FSDPTrainingState::IDLE) << label;
}

TEST(Fsdp1SummonFullParams, FullValuesInScopeMatchSingleRank) {
  for (int world : {2, 3}) {
    for (ShardingStrategy strategy : kStrategies) {
      for (bool orig : {false, true}) {
        for (bool nested : {false, true}) {
          const std::string label = Label(world, strategy, orig, nested);
          fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
            Net model, ref;
            InitDeterministic(*model);
            InitDeterministic(*ref);
            FullyShardedDataParallel root =
                Wrap(model, {.process_group = pg, .sharding_strategy = strategy, .use_orig_params = orig}, nested);
            {  // before the first forward: lazy init inside
              SummonFullParams full(root);
              ExpectFullParamsEqual(model, ref, label + " before forward");
            }
            ExpectAllSharded(root, label);
            model(Batch(0, 4, 3, 1)).sum().backward();
            {
              SummonFullParams full(root, {.recurse = true, .writeback = true});
              ExpectFullParamsEqual(model, ref, label + " after backward");
            }
            ExpectAllSharded(root, label);
            ExpectSameOutput(model, ref, label);
          });
        }
      }
    }
  }
}

TEST(Fsdp1SummonFullParams, WritebackOfInPlaceEditIsVisibleInLaterForward) {
  for (int world : {2, 3}) {
    for (ShardingStrategy strategy : kStrategies) {
      for (bool orig : {false, true}) {
        const std::string label = Label(world, strategy, orig, true);
        fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
          Net model, ref;
          InitDeterministic(*model);
          InitDeterministic(*ref);
          FullyShardedDataParallel root =
              Wrap(model, {.process_group = pg, .sharding_strategy = strategy, .use_orig_params = orig}, true);
          ExpectSameOutput(model, ref, label + " before edit");
          {
            SummonFullParams full(root);
            Edit(*model);
          }
          Edit(*ref);
          ExpectAllSharded(root, label);
          ExpectSameOutput(model, ref, label + " after edit");
          testing::ExpectParamsMatch(root, *ref, 0.0, label);
        });
      }
    }
  }
}

TEST(Fsdp1SummonFullParams, WritebackFalseDiscardsEditsExceptNoShard) {
  for (int world : {2, 3}) {
    for (ShardingStrategy strategy : kStrategies) {
      for (bool orig : {false, true}) {
        const std::string label = Label(world, strategy, orig, true);
        fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
          Net model, ref;
          InitDeterministic(*model);
          InitDeterministic(*ref);
          FullyShardedDataParallel root =
              Wrap(model, {.process_group = pg, .sharding_strategy = strategy, .use_orig_params = orig}, true);
          {
            SummonFullParams full(root, {.writeback = false});
            Edit(*model);
          }
          // PyTorch: without sharding (NO_SHARD) the full parameters are the shard, so the
          // modification persists regardless of writeback.
          if (strategy == ShardingStrategy::NO_SHARD) Edit(*ref);
          ExpectSameOutput(model, ref, label);
          testing::ExpectParamsMatch(root, *ref, 0.0, label);
        });
      }
    }
  }
}

TEST(Fsdp1SummonFullParams, Rank0OnlyUnshardsOnRank0Only) {
  for (int world : {2, 3}) {
    for (bool orig : {false, true}) {
      for (bool offload_to_cpu : {false, true}) {  // a no-op on the CPU compute device
        const std::string label = Label(world, ShardingStrategy::FULL_SHARD, orig, true);
        fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
          Net model, ref;
          InitDeterministic(*model);
          InitDeterministic(*ref);
          FullyShardedDataParallel root = Wrap(model, {.process_group = pg, .use_orig_params = orig}, true);
          {
            SummonFullParams full(root, {.writeback = false, .rank0_only = true, .offload_to_cpu = offload_to_cpu});
            if (pg->rank() == 0) {
              ExpectFullParamsEqual(model, ref, label);
            } else {
              for (FlatParamHandle* h : root.handles()) EXPECT_TRUE(h->is_sharded(h->flat_param().param)) << label;
              // The originals keep their sharded form: this rank's flattened part (or nothing).
              int64_t numel = 0, full_numel = 0;
              for (const auto& p : model->parameters()) numel += p.numel();
              for (const auto& p : ref->parameters()) full_numel += p.numel();
              EXPECT_LT(numel, full_numel) << label;
              if (!orig) {
                EXPECT_EQ(numel, 0) << label;
              }
            }
          }
          ExpectAllSharded(root, label);
          ExpectSameOutput(model, ref, label);
        });
      }
    }
  }
}

TEST(Fsdp1SummonFullParams, RecurseFalseUnshardsOnlyTheModulesOwnHandle) {
  for (int world : {2, 3}) {
    for (bool orig : {false, true}) {
      const std::string label = Label(world, ShardingStrategy::FULL_SHARD, orig, true);
      fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
        Net model, ref;
        InitDeterministic(*model);
        InitDeterministic(*ref);
        FullyShardedDataParallel root = Wrap(model, {.process_group = pg, .use_orig_params = orig}, true);
        const auto ref_params = ref->named_parameters();
        auto is_full = [&](const std::string& name, const at::Tensor& p) {
          return p.sizes() == ref_params[name].sizes() && at::equal(p, ref_params[name]);
        };
        {
          SummonFullParams full(root, {.recurse = false, .writeback = false});
          EXPECT_EQ(root.handle()->training_state(), HandleTrainingState::SUMMON_FULL_PARAMS) << label;
          for (const auto& item : model->named_parameters()) {
            if (item.key().rfind("block", 0) == 0) {
              if (!orig) {
                EXPECT_EQ(item.value().numel(), 0) << label << " " << item.key();
              }
            } else {
              EXPECT_TRUE(is_full(item.key(), item.value())) << label << " " << item.key();
            }
          }
          for (auto& b : model->layers) {
            FlatParamHandle* h = GetState(*b.ptr())->handle();
            EXPECT_TRUE(h->is_sharded(h->flat_param().param)) << label;
            EXPECT_EQ(h->training_state(), HandleTrainingState::IDLE) << label;
          }
        }
        {  // on an inner FSDP module: only its parameters
          SummonFullParams full(*model->layers[0].ptr(), {.recurse = false});
          for (const auto& item : model->named_parameters()) {
            if (item.key().rfind("block0.", 0) == 0) {
              EXPECT_TRUE(is_full(item.key(), item.value())) << label << " " << item.key();
            }
          }
          EXPECT_TRUE(root.handle()->is_sharded(root.handle()->flat_param().param)) << label;
        }
        ExpectAllSharded(root, label);
        ExpectSameOutput(model, ref, label);
      });
    }
  }
}

TEST(Fsdp1SummonFullParams, MixedPrecisionSummonsFullPrecision) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Net model, ref;
    InitDeterministic(*model);
    InitDeterministic(*ref);
    FullyShardedDataParallel root =
        Wrap(model, {.process_group = pg, .mixed_precision = MixedPrecision{.param_dtype = at::kBFloat16}}, true);
    model(Batch(0, 4, 3, 1)).sum().backward();
    SummonFullParams full(root);
    for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
    ExpectFullParamsEqual(model, ref, "mixed precision");
  });
}

TEST(Fsdp1SummonFullParams, Errors) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Net model;
    InitDeterministic(*model);
    FullyShardedDataParallel root = Wrap(model, {.process_group = pg}, true);
    EXPECT_ERROR_CONTAINS({ SummonFullParams g(root, {.writeback = true, .rank0_only = true}); },
                          "SummonFullParams: writeback=true and rank0_only=true is not supported yet");
    EXPECT_ERROR_CONTAINS({ SummonFullParams g(root, {.with_grads = true}); },
                          "SummonFullParams: with_grads=true, use_orig_params=false, offload_to_cpu=false is not "
                          "supported yet");
    {
      SummonFullParams full(root);
      EXPECT_ERROR_CONTAINS({ SummonFullParams g(root); },
                            "SummonFullParams: Cannot manually unshard parameters when already unsharding parameters");
      EXPECT_ERROR_CONTAINS(model(Batch(0, 4, 3, 1)),
                            "inside SummonFullParams: forward and backward cannot be started while the full "
                            "parameters are summoned");
    }
    // During backward (a hook on the output runs after FSDP's pre-backward hook).
    std::string during_backward;
    at::Tensor out = model(Batch(0, 4, 3, 1));
    out.register_hook([&](const at::Tensor&) {
      try {
        SummonFullParams full(root);
      } catch (const c10::Error& e) {
        during_backward = e.what_without_backtrace();
      }
    });
    out.sum().backward();
    EXPECT_NE(during_backward.find("SummonFullParams: Cannot manually unshard parameters during forward/backward"),
              std::string::npos)
        << during_backward;
    // None of these poisoned the tree: it still works.
    SummonFullParams full(root);
  });
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Net model;
    InitDeterministic(*model);
    FullyShardedDataParallel root =
        Wrap(model, {.process_group = pg, .sharding_strategy = ShardingStrategy::NO_SHARD}, false);
    EXPECT_ERROR_CONTAINS(
        { SummonFullParams g(root, {.writeback = false, .rank0_only = true, .offload_to_cpu = true}); },
        "SummonFullParams: offload_to_cpu=true and NO_SHARD is not supported yet");
  });
}

// sync_module_states: ranks initialize with different seeds (and buffers); after wrapping
// every rank holds rank 0's values, the same as a single-rank model built with rank 0's seed.
TEST(Fsdp1SyncModuleStates, RanksEndWithRankZerosInit) {
  for (int world : {2, 3}) {
    for (ShardingStrategy strategy : kStrategies) {
      for (bool sync : {true, false}) {
        const std::string label = Label(world, strategy, false, true) + (sync ? " sync" : " no sync");
        fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
          const int rank = pg->rank();
          Net model, ref;
          InitDeterministic(*model, 11 + 100 * rank);
          InitDeterministic(*ref, 11);
          model->register_buffer("scale", at::full({3}, static_cast<double>(rank)));
          model->layers[1]->register_buffer("count", at::full({2}, static_cast<int64_t>(rank + 7)));
          FullyShardedDataParallel root =
              Wrap(model, {.process_group = pg, .sharding_strategy = strategy, .sync_module_states = sync}, true);
          const auto buffers = model->named_buffers();
          EXPECT_TRUE(root.is_root());  // lazy init: testing::FullParams reads the local shards
          if (sync) {
            testing::ExpectParamsMatch(root, *ref, 0.0, label);
            SummonFullParams full(root, {.writeback = false});
            ExpectFullParamsEqual(model, ref, label);
            EXPECT_TRUE(at::equal(buffers["scale"], at::zeros({3}))) << label;
            EXPECT_TRUE(at::equal(buffers["block1.count"], at::full({2}, 7, at::kLong))) << label;
          } else {
            EXPECT_TRUE(at::equal(buffers["scale"], at::full({3}, static_cast<double>(rank)))) << label;
            EXPECT_TRUE(at::equal(buffers["block1.count"], at::full({2}, rank + 7, at::kLong))) << label;
            if (strategy == ShardingStrategy::NO_SHARD && rank != 0) {
              SummonFullParams full(root, {.writeback = false});
              EXPECT_FALSE(at::equal(model->head->weight, ref->head->weight)) << label;
            }
          }
        });
      }
    }
  }
}

}  // namespace
}  // namespace fsdp::fsdp1
