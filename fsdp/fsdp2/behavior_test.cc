// FSDP2 communication volume (CommTrace), storage freeing, and PyTorch's error paths.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <functional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "comm/comm_trace.h"
#include "comm/threaded_process_group.h"
#include "fsdp/fsdp2/fsdp_state.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/fsdp2/testing_access.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp2 {
namespace {

using fsdp::testing::Backend;

struct TwoLinearImpl : torch::nn::Module {
  TwoLinearImpl()
      : a(register_module("a", torch::nn::Linear(5, 3))), b(register_module("b", torch::nn::Linear(3, 6))) {}
  at::Tensor forward(const at::Tensor& x) { return b(a(x)); }
  torch::nn::Linear a, b;
};
using Leaf = Hooked<TwoLinearImpl>;

struct RootImpl : torch::nn::Module {
  RootImpl()
      : first(register_module("first", Leaf())),
        second(register_module("second", Leaf())),
        proj(register_module("proj", torch::nn::Linear(6, 5))) {}
  at::Tensor forward(const at::Tensor& x) { return second(proj(first(x))); }
  Leaf first, second;
  torch::nn::Linear proj;
};
using Root = Hooked<RootImpl>;

// Bytes of a group's padded unsharded parameters: dim 0 rounded up to a multiple of w.
int64_t PaddedBytes(const std::vector<std::vector<int64_t>>& shapes, int64_t w, int64_t element_size = 4) {
  int64_t total = 0;
  for (const auto& s : shapes) {
    int64_t rest = 1;
    for (size_t d = 1; d < s.size(); ++d) rest *= s[d];
    total += (s[0] + w - 1) / w * w * rest * element_size;
  }
  return total;
}

void RunStep(Root& model) { model(at::ones({4, 5})).sum().backward(); }

TEST(FullyShardCommunication, FullShardStepIsTwoAllGathersAndOneReduceScatterPerGroup) {
  for (bool reshard : {true, false}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [reshard](const comm::ProcessGroupPtr& pg) {
      auto trace = std::make_shared<comm::CommTrace>(pg);
      auto mesh = mesh::DeviceMesh::Create(trace, {4});
      Root model;
      FullyShardOptions opts{.mesh = mesh, .reshard_after_forward = reshard};
      fully_shard(model->first.ptr(), opts);
      fully_shard(model->second.ptr(), opts);
      fully_shard(model.ptr(), opts);
      RunStep(model);
      const int64_t leaf = PaddedBytes({{3, 5}, {3}, {6, 3}, {6}}, 4);
      const int64_t root = PaddedBytes({{5, 6}, {5}}, 4);
      const int64_t gathers = reshard ? 2 : 1;
      EXPECT_EQ(trace->total_output_bytes("all_gather_into_tensor"), gathers * (2 * leaf + root));
      EXPECT_EQ(trace->total_input_bytes("reduce_scatter_tensor"), 2 * leaf + root);
      int all_gathers = 0, reduce_scatters = 0;
      for (const auto& r : trace->records()) {
        all_gathers += r.op == "all_gather_into_tensor";
        reduce_scatters += r.op == "reduce_scatter_tensor";
      }
      EXPECT_EQ(all_gathers, gathers * 3);
      EXPECT_EQ(reduce_scatters, 3);
      // After the step every unsharded buffer's storage is freed.
      for (FSDPState* s : CollectStates(*model)) {
        for (const auto& p : s->param_group()->fsdp_params()) {
          EXPECT_EQ(p->all_gather_output().storage().nbytes(), 0u) << p->fqn();
          EXPECT_EQ(p->param().sizes().vec(), p->sharded_size()) << p->fqn();
          ASSERT_TRUE(p->param().grad().defined()) << p->fqn();
          EXPECT_EQ(p->param().grad().sizes().vec(), p->sharded_size()) << p->fqn();
        }
      }
    });
  }
}

TEST(FullyShardMemory, ForwardReshardsFreeStorageAndBackwardReallocatesTheSameStorage) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Root model;
    fully_shard(model->first.ptr(), {.mesh = mesh});
    fully_shard(model->second.ptr(), {.mesh = mesh});
    fully_shard(model.ptr(), {.mesh = mesh});
    at::Tensor loss = model(at::ones({4, 5})).sum();
    FSDPParamGroup* first = GetState(*model->first)->param_group();
    const at::Tensor& output = first->fsdp_params()[0]->all_gather_output();
    EXPECT_EQ(output.storage().nbytes(), 0u) << "resharded after forward";
    EXPECT_EQ(first->sharded_state(), ShardedState::kSharded);
    const void* storage = output.storage().unsafeGetStorageImpl();
    loss.backward();
    EXPECT_EQ(output.storage().unsafeGetStorageImpl(), storage);
    EXPECT_EQ(output.storage().nbytes(), 0u);
  });
}

struct NonContiguousImpl : torch::nn::Module {
  NonContiguousImpl() { w = register_parameter("w", at::randn({3, 4}).t()); }
  at::Tensor forward(const at::Tensor& x) { return x.matmul(w); }
  at::Tensor w;
};

struct MixedDtypeImpl : torch::nn::Module {
  MixedDtypeImpl() {
    a = register_parameter("a", at::ones({4}));
    b = register_parameter("b", at::ones({4}, at::kDouble));
  }
  at::Tensor forward(const at::Tensor& x) { return x * a + b.to(at::kFloat); }
  at::Tensor a, b;
};

TEST(FullyShardErrors, SeedErrorsAreRaisedWithTheirMessages) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    EXPECT_ERROR_CONTAINS(fully_shard(Hooked<NonContiguousImpl>().ptr(), {.mesh = mesh}),
                          "FSDP does not support non-contiguous parameters yet: w shape=[4, 3] stride=[1, 4]");
    FullyShardOptions dim1{.mesh = mesh};
    dim1.shard_placement_fn = [](const at::Tensor&, const std::string&) { return std::optional<int64_t>(1); };
    EXPECT_ERROR_CONTAINS(fully_shard(Leaf().ptr(), dim1),
                          "FSDP does not support uneven sharding on dim 1: [3, 5] (world size: 2)");
    EXPECT_ERROR_CONTAINS(fully_shard(Leaf().ptr(), {.mesh = mesh, .device = c10::Device("meta")}),
                          "Expects the parameter to already be moved to device meta but got cpu");
    EXPECT_ERROR_CONTAINS(fully_shard(Leaf().ptr(), {.mesh = mesh, .reshard_after_forward = int64_t{3}}),
                          "it should be a factor of 2, not 3");
    EXPECT_ERROR_CONTAINS(fully_shard(std::make_shared<TwoLinearImpl>(), {.mesh = mesh}),
                          "cannot run forward hooks; construct it as fsdp::Hooked<");
    Leaf twice;
    fully_shard(twice.ptr(), {.mesh = mesh});
    EXPECT_ERROR_CONTAINS(fully_shard(twice.ptr(), {.mesh = mesh}), "is already fully_shard'ed");
    Hooked<MixedDtypeImpl> mixed;
    fully_shard(mixed.ptr(), {.mesh = mesh});
    EXPECT_ERROR_CONTAINS(mixed(at::ones({4})),
                          "FSDP expects uniform original parameter dtype but got {Float, Double}");
    auto flat = mesh::DeviceMesh::Create(pg, {1, 2});
    EXPECT_ERROR_CONTAINS(fully_shard(Leaf().ptr(), {.mesh = flat}),
                          "Please init the 2D mesh for HSDP with mesh_dim_names specified");
  });
  fsdp::testing::RunOnRanks(Backend::kThreaded, 8, [](const comm::ProcessGroupPtr& pg) {
    auto cube = mesh::DeviceMesh::Create(pg, {2, 2, 2});
    EXPECT_ERROR_CONTAINS(fully_shard(Leaf().ptr(), {.mesh = cube}), "fully_shard expects a 1D or 2D DeviceMesh");
  });
}

TEST(FullyShardMixedPrecision, AllGatherInParamDtypeReduceScatterInReduceDtype) {
  // PyTorch 2.15: an unset reduce_dtype reduces in the original dtype (fp32 here), not in
  // param_dtype (FSDPParam.unsharded_grad_dtype in torch/distributed/fsdp/_fully_shard/_fsdp_param.py).
  for (std::optional<c10::ScalarType> reduce :
       {std::optional<c10::ScalarType>(), std::optional(at::kFloat), std::optional(at::kBFloat16)}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [reduce](const comm::ProcessGroupPtr& pg) {
      auto trace = std::make_shared<comm::CommTrace>(pg);
      auto mesh = mesh::DeviceMesh::Create(trace, {4});
      Root model;
      FullyShardOptions opts{.mesh = mesh};
      opts.mp_policy.param_dtype = at::kBFloat16;
      opts.mp_policy.reduce_dtype = reduce;
      fully_shard(model->first.ptr(), opts);
      fully_shard(model->second.ptr(), opts);
      fully_shard(model.ptr(), opts);
      const at::Tensor out = model(at::ones({4, 5}));
      EXPECT_EQ(out.scalar_type(), at::kBFloat16);
      out.sum().backward();
      const std::vector<std::vector<int64_t>> leaf = {{3, 5}, {3}, {6, 3}, {6}}, root = {{5, 6}, {5}};
      const int64_t reduce_size = reduce == at::kBFloat16 ? 2 : 4;
      // The root keeps its parameters after forward: 2 gathers per leaf, 1 for the root.
      EXPECT_EQ(trace->total_output_bytes("all_gather_into_tensor"),
                4 * PaddedBytes(leaf, 4, 2) + PaddedBytes(root, 4, 2));
      EXPECT_EQ(trace->total_input_bytes("reduce_scatter_tensor"),
                2 * PaddedBytes(leaf, 4, reduce_size) + PaddedBytes(root, 4, reduce_size));
      for (FSDPState* s : CollectStates(*model)) {
        for (const auto& p : s->param_group()->fsdp_params()) {
          EXPECT_EQ(p->param().scalar_type(), at::kFloat) << p->fqn();  // sharded: original dtype
          EXPECT_EQ(p->param().grad().scalar_type(), at::kFloat) << p->fqn();
        }
      }
    });
  }
}

TEST(FullyShardWorldSizeOne, IssuesNoCollectivesAndEqualsPlainTraining) {
  // PyTorch 2.15 skips the all-gather (FSDPParamGroup.unshard) and the reduce-scatter
  // (foreach_reduce) when the shard group has one rank. (HSDP's all-reduce over a 1-rank
  // replicate group it does issue: only all-reduces may appear then.)
  for (bool hsdp : {false, true}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 1, [hsdp](const comm::ProcessGroupPtr& pg) {
      auto trace = std::make_shared<comm::CommTrace>(pg);
      auto mesh =
          hsdp ? mesh::DeviceMesh::Create(trace, {1, 1}, {"replicate", "shard"}) : mesh::DeviceMesh::Create(trace, {1});
      Root model, plain;
      {
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < plain->parameters().size(); ++i) plain->parameters()[i].copy_(model->parameters()[i]);
      }
      FullyShardOptions opts{.mesh = mesh};
      fully_shard(model->first.ptr(), opts);
      fully_shard(model->second.ptr(), opts);
      fully_shard(model.ptr(), opts);
      const size_t before = trace->records().size();  // building the mesh may talk
      model(at::ones({4, 5})).sum().backward();
      plain(at::ones({4, 5})).sum().backward();
      const auto records = trace->records();
      for (size_t i = before; i < records.size(); ++i) {
        EXPECT_TRUE(hsdp && records[i].op == "all_reduce") << records[i].op << "\n" << trace->ToTable();
      }
      if (!hsdp) {
        EXPECT_EQ(records.size(), before) << trace->ToTable();
      }
      for (size_t i = 0; i < plain->parameters().size(); ++i) {
        EXPECT_TRUE(at::equal(model->parameters()[i].grad(), plain->parameters()[i].grad())) << i;
      }
    });
  }
}

// Blocks that report, while they compute (forward) and while their gradient flows
// (backward), how many bytes of parameter storage FSDP holds on this rank.
struct ProbedBlockImpl : torch::nn::Module {
  explicit ProbedBlockImpl(std::function<void()>* probe)
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 8))),
        probe_(probe) {}
  at::Tensor forward(const at::Tensor& x) {
    (*probe_)();
    at::Tensor h = fc2(fc1(x).relu());
    h.register_hook([probe = probe_](const at::Tensor& g) {
      (*probe)();
      return g;
    });
    return x + h;
  }
  torch::nn::Linear fc1, fc2;
  std::function<void()>* probe_;
};
using ProbedBlock = Hooked<ProbedBlockImpl>;

struct ProbedNetImpl : torch::nn::Module {
  explicit ProbedNetImpl(std::function<void()>* probe) : in(register_module("in", torch::nn::Linear(5, 8))) {
    for (int i = 0; i < 6; ++i) blocks.push_back(register_module(absl::StrCat("block", i), ProbedBlock(probe)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    for (auto& b : blocks) h = b(h);
    return h;
  }
  torch::nn::Linear in;
  std::vector<ProbedBlock> blocks;
};

int64_t GroupUnshardedBytes(const FSDPParamGroup& g) {
  int64_t bytes = 0;
  for (const auto& p : g.fsdp_params()) bytes += p->AllGatherInputNumel() * g.mesh_info().shard_size() * 4;
  return bytes;
}

TEST(FullyShardMemory, PeakParameterStorageIsTheZero3FormulaPlusAtMostOnePrefetchedGroup) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {4});
    std::function<void()> probe = [] {};
    auto model = std::make_shared<HookedImpl<ProbedNetImpl>>(&probe);
    for (auto& b : model->blocks) fully_shard(b.ptr(), {.mesh = mesh});
    fully_shard(model, {.mesh = mesh, .reshard_after_forward = true});
    const std::vector<FSDPState*> states = CollectStates(*model);
    int64_t sharded = 0, peak = 0, samples = 0;
    for (FSDPState* s : states) {
      for (const auto& p : s->param_group()->fsdp_params()) sharded += p->AllGatherInputNumel() * 4;
    }
    probe = [&] {
      int64_t bytes = 0;
      for (FSDPState* s : states) {
        for (const auto& p : s->param_group()->fsdp_params()) {
          bytes += p->sharded_param_data().storage().nbytes();
          if (p->all_gather_output().defined()) bytes += p->all_gather_output().storage().nbytes();
        }
      }
      peak = std::max(peak, bytes);
      ++samples;
    };
    model->forward(at::ones({4, 5})).sum().backward();
    EXPECT_EQ(samples, 12);
    // ZeRO-3: every shard, plus the root (gathered around its whole forward body) and the
    // one block that computes; implicit prefetch may hold one more block.
    const int64_t root = GroupUnshardedBytes(*states[0]->param_group());
    const int64_t block = GroupUnshardedBytes(*states[1]->param_group());
    const int64_t formula = sharded + root + block;
    EXPECT_GE(peak, formula);
    EXPECT_LE(peak, formula + block) << "sharded " << sharded << " root " << root << " block " << block;
  });
}

// Gathers a parameter as (data / 2 in f32, a tensor of 2s in f64) and rebuilds data * 2:
// exact, so training is unchanged, while the all-gather moves 12 instead of 4 bytes per
// element.
class HalvedExtension : public AllGatherExtension {
 public:
  PreAllGatherResult PreAllGather(const at::Tensor& sharded, const mesh::DeviceMesh&, const std::vector<int64_t>&,
                                  const MixedPrecisionPolicy&) override {
    ++pre_calls;
    return {{sharded * 0.5, at::full(sharded.sizes(), 2.0, at::kDouble)}, c10::IValue(std::string("halved"))};
  }
  at::Tensor PostAllGather(const std::vector<at::Tensor>& outputs, const c10::IValue& metadata, c10::ScalarType dtype,
                           const at::Tensor& out) override {
    ++post_calls;
    TORCH_CHECK(outputs.size() == 2 && metadata.toStringRef() == "halved", "unexpected post-all-gather arguments");
    const at::Tensor data = (outputs[0] * outputs[1]).to(dtype).view(-1);
    if (!out.defined()) return data.clone();
    out.copy_(data);
    return out;
  }
  int pre_calls = 0, post_calls = 0;
};

struct HalvedLinearImpl : torch::nn::Module, AllGatherExtensionProvider {
  HalvedLinearImpl() {
    weight = register_parameter("weight", at::randn({3, 5}, at::make_generator<at::CPUGeneratorImpl>(3)));
    bias = register_parameter("bias", at::randn({3}, at::make_generator<at::CPUGeneratorImpl>(4)));
  }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight, bias); }
  std::shared_ptr<AllGatherExtension> all_gather_extension(const std::string& name) const override {
    return name == "weight" ? extension : nullptr;
  }
  at::Tensor weight, bias;
  std::shared_ptr<HalvedExtension> extension = std::make_shared<HalvedExtension>();
};
TORCH_MODULE(HalvedLinear);

struct ExtensionNetImpl : torch::nn::Module {
  ExtensionNetImpl()
      : halved(register_module("halved", HalvedLinear())), out(register_module("out", torch::nn::Linear(3, 6))) {
    at::NoGradGuard no_grad;
    out->weight.copy_(at::randn({6, 3}, at::make_generator<at::CPUGeneratorImpl>(5)));
    out->bias.copy_(at::randn({6}, at::make_generator<at::CPUGeneratorImpl>(6)));
  }
  at::Tensor forward(const at::Tensor& x) { return out(halved(x).relu()); }
  HalvedLinear halved;
  torch::nn::Linear out;
};
using ExtensionNet = Hooked<ExtensionNetImpl>;

TEST(AllGatherExtension, PreAndPostHooksRunEachUnshardAndTrainingIsUnchanged) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [](const comm::ProcessGroupPtr& pg) {
    auto trace = std::make_shared<comm::CommTrace>(pg);
    ExtensionNet ref, model;
    fully_shard(model.ptr(), {.mesh = mesh::DeviceMesh::Create(trace, {3}), .reshard_after_forward = true});
    torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(model->parameters(), 0.1);
    constexpr int kSteps = 3;
    for (int step = 0; step < kSteps; ++step) {
      const at::Tensor x = at::randn({6, 5}, at::make_generator<at::CPUGeneratorImpl>(100 + step));
      ref(x).square().mean().backward();
      model(x.narrow(0, 2 * pg->rank(), 2)).square().mean().backward();
      ref_opt.step();
      opt.step();
      ref_opt.zero_grad();
      opt.zero_grad();
    }
    const auto& ext = *model->halved->extension;
    EXPECT_EQ(ext.pre_calls, 2 * kSteps);  // forward and backward unshard
    EXPECT_EQ(ext.post_calls, 2 * kSteps);
    // Per all-gather: weight 15 x (4 + 8) bytes, the rest 4 bytes per element.
    EXPECT_EQ(trace->total_output_bytes("all_gather_into_tensor"), 2 * kSteps * (15 * 12 + (3 + 18 + 6) * 4));
    const FullStateDict full = GetFullStateDict(*model);
    for (const auto& item : ref->named_parameters()) {
      // kSteps SGD steps at lr 0.1 of gradients that differ by a few float32 ulps (2^-23; their
      // summation order): 1e-6, 8 ulps at scale 1, far below a lost step (0.1 * |g|).
      EXPECT_LE((full[item.key()] - item.value()).abs().max().item<double>(), 1e-6) << item.key();
    }
    EXPECT_EQ(model->halved->weight.sizes(), (c10::IntArrayRef{1, 5}));  // sharded again
  });
}

TEST(AllGatherExtension, UnevenShardsNeedPaddedInputs) {
  const auto outcomes = fsdp::testing::RunOnRanksCollect(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    ExtensionNet model;  // weight [3, 5] on 2 ranks: rank 1 holds 1 of 2 padded rows
    fully_shard(model.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {2})});
    model(at::ones({2, 5}));
  });
  ASSERT_FALSE(outcomes[1].ok);
  EXPECT_TRUE(absl::StrContains(outcomes[1].message,
                                "fsdp_pre_all_gather must return all-gather inputs with the padded sharded size [2, 5] "
                                "but got [1, 5]"))
      << outcomes[1].message;
}

TEST(AllGatherBufferPool, ReusesTheSmallestFittingBufferAndKeepsAtMostTheLimit) {
  AllGatherBufferPool pool(2, /*min_cpu_bytes=*/0);
  const auto options = at::TensorOptions().dtype(at::kByte);
  at::Tensor big = pool.Take(100, options).bytes, small = pool.Take(10, options).bytes,
             extra = pool.Take(50, options).bytes;
  const void* big_ptr = big.data_ptr();
  const void* small_ptr = small.data_ptr();
  pool.Give(big);
  pool.Give(small);
  pool.Give(extra);  // over the limit: the smallest (10) is dropped
  EXPECT_EQ(pool.size(), 2u);
  EXPECT_NE(pool.Take(5, options).bytes.data_ptr(), small_ptr);  // the 50-byte one now
  EXPECT_EQ(pool.Take(80, options).bytes.data_ptr(), big_ptr);
  EXPECT_GE(pool.Take(200, options).bytes.numel(), 200);  // nothing fits: new
  EXPECT_EQ(pool.size(), 0u);
}

TEST(AllGatherBufferPool, AReusedBufferCarriesTheEventOfItsLastReader) {
  AllGatherBufferPool pool(2, /*min_cpu_bytes=*/0);
  const auto options = at::TensorOptions().dtype(at::kByte);
  auto copied_out = std::make_shared<device::Event>("compute");
  pool.Give(pool.Take(64, options).bytes, copied_out);
  AllGatherBufferPool::Buffer reused = pool.Take(32, options);
  EXPECT_EQ(reused.ready, copied_out);               // the copy-in stream waits for it before writing
  EXPECT_EQ(pool.Take(32, options).ready, nullptr);  // a new buffer: nothing to wait for
}

// The streams follow FSDP_CPU_STREAMS (fsdp2_async_streams_test sets "async:200"):
// with asynchronous streams the reduce-scatter's copy-in runs off the host thread.
TEST(CommStreams, FollowFsdpCpuStreamsAndRunSideWorkOffTheHostInAsyncMode) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Root model;
    fully_shard(model->first.ptr(), {.mesh = mesh});
    fully_shard(model.ptr(), {.mesh = mesh});
    RunStep(model);
    FSDPCommContext& ctx = GetState(*model)->comm_ctx();
    ASSERT_NE(ctx.stream_pool(), nullptr);
    const device::CpuStreamMode mode = device::StreamOptionsFromEnv().cpu_mode;
    EXPECT_EQ(ctx.stream_pool()->options().cpu_mode, mode);
    std::thread::id ran_on;
    ctx.streams().reduce_scatter->Launch([&] { ran_on = std::this_thread::get_id(); });
    ctx.streams().reduce_scatter->Synchronize();
    EXPECT_EQ(ran_on != std::this_thread::get_id(), mode == device::CpuStreamMode::kAsync);
    if (pg->rank() == 0) {
      std::printf("FSDP CPU streams: %s\n", mode == device::CpuStreamMode::kAsync ? "async" : "inline");
    }
  });
}

// Below glibc's largest mmap threshold a CPU buffer goes back to the heap (which recycles
// it) instead of staying allocated between steps; from it on, the pool keeps it.
TEST(AllGatherBufferPool, KeepsCpuBuffersFromGlibcsLargestMmapThresholdOn) {
  AllGatherBufferPool pool;
  const auto options = at::TensorOptions().dtype(at::kByte);
  constexpr int64_t kThreshold = int64_t{32} << 20;
  pool.Give(pool.Take(kThreshold - 1, options).bytes);
  EXPECT_EQ(pool.size(), 0u);
  at::Tensor large = pool.Take(kThreshold, options).bytes;
  const void* large_ptr = large.data_ptr();
  pool.Give(std::move(large));
  EXPECT_EQ(pool.size(), 1u);
  EXPECT_EQ(pool.Take(kThreshold - 1, options).bytes.data_ptr(), large_ptr);
}

// A small CPU buffer's memory goes back at Give; its tensor is re-allocated by the next
// Take, unless someone else still holds it or its last reader has not finished.
TEST(AllGatherBufferPool, FreesSmallCpuBuffersAndReusesTheirTensor) {
  AllGatherBufferPool pool;
  const auto options = at::TensorOptions().dtype(at::kByte);
  at::Tensor buffer = pool.Take(10, options).bytes;
  const c10::TensorImpl* impl = buffer.unsafeGetTensorImpl();
  const c10::weak_intrusive_ptr<c10::StorageImpl> storage(buffer.storage().getWeakStorageImpl());
  pool.Give(std::move(buffer));
  EXPECT_EQ(pool.size(), 0u);
  ASSERT_EQ(pool.shells(), 1u);
  EXPECT_EQ(storage.lock()->nbytes(), 0u);  // the memory is freed at once
  at::Tensor again = pool.Take(24, options).bytes;
  EXPECT_EQ(again.unsafeGetTensorImpl(), impl);
  EXPECT_EQ(again.numel(), 24);
  EXPECT_EQ(again.storage().nbytes(), 24u);
  again.fill_(7);
  EXPECT_EQ(again.sum().item<int64_t>(), 168);
  EXPECT_EQ(pool.shells(), 0u);
  // Held elsewhere: not freed (the other holder keeps reading it), not kept.
  const at::Tensor reader = again.view({4, 6});
  pool.Give(std::move(again));
  EXPECT_EQ(pool.shells(), 0u);
  EXPECT_EQ(reader.sum().item<int64_t>(), 168);
  // Its last reader still pending: not kept either.
  auto pending = std::make_shared<device::Event>("compute");
  pool.Give(pool.Take(8, options).bytes, pending);
  EXPECT_EQ(pool.shells(), 0u);
  // At most kMaxShells.
  std::vector<at::Tensor> taken;
  for (size_t i = 0; i < AllGatherBufferPool::kMaxShells + 1; ++i) taken.push_back(pool.Take(4, options).bytes);
  for (at::Tensor& t : taken) pool.Give(std::move(t));
  EXPECT_EQ(pool.shells(), AllGatherBufferPool::kMaxShells);
}

TEST(AllGatherBufferPool, StepsFreeSmallPackedBuffers) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Root model;
    fully_shard(model->first.ptr(), {.mesh = mesh});
    fully_shard(model->second.ptr(), {.mesh = mesh});
    fully_shard(model.ptr(), {.mesh = mesh});
    RunStep(model);
    EXPECT_EQ(GetState(*model)->comm_ctx().all_gather_buffers.size(), 0u);  // bytes, not MiB
  });
}

// A group of 32 MiB unsharded (Linear(2048, 4096) over 2 ranks: 16 MiB per rank, 32 MiB
// packed): its all-gather buffer stays for the next unshard.
TEST(AllGatherBufferPool, StepsReuseLargePackedBuffers) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    fsdp::Hooked<torch::nn::LinearImpl> model(torch::nn::LinearOptions(2048, 4096).bias(false));
    fully_shard(model.ptr(), {.mesh = mesh});
    auto step = [&] { model(at::ones({1, 2048})).sum().backward(); };
    step();
    AllGatherBufferPool& pool = GetState(*model)->comm_ctx().all_gather_buffers;
    EXPECT_EQ(pool.size(), 1u);
    step();
    EXPECT_EQ(pool.size(), 1u);
  });
}

TEST(FSDPModuleHandle, UnshardReshardResetAndReshardAfterBackward) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Root model;
    FSDPModule first = fully_shard(model->first.ptr(), {.mesh = mesh});
    fully_shard(model->second.ptr(), {.mesh = mesh});
    FSDPModule root = fully_shard(model.ptr(), {.mesh = mesh});
    at::Tensor& w = model->first->a->weight;  // [3, 5] on 2 ranks: 2 rows, then 1
    // reset_sharded_param: the sharded parameter replaced (not changed in place) before the
    // root's lazy init is re-padded into FSDP's storage then. (Lazy init must start at the
    // root: unshard() on `first` first would make it a root, as in PyTorch.)
    w.set_data(at::full(w.sizes(), 3.0f + static_cast<float>(pg->rank())));
    root.unshard();
    root.reshard();
    first.unshard();
    EXPECT_EQ(w.sizes(), (c10::IntArrayRef{3, 5}));
    EXPECT_TRUE(at::equal(w.narrow(0, 0, 2), at::full({2, 5}, 3.0f)));
    EXPECT_TRUE(at::equal(w.narrow(0, 2, 1), at::full({1, 5}, 4.0f)));
    first.reshard();
    EXPECT_EQ(w.sizes()[0], pg->rank() == 0 ? 2 : 1);
    EXPECT_EQ(GetState(*model->first)->param_group()->fsdp_params()[0]->all_gather_output().storage().nbytes(), 0u);
    // In-place changes of the shard need no reset: it is a view into FSDP's storage.
    {
      at::NoGradGuard no_grad;
      w.mul_(2);
    }
    first.unshard(/*async_op=*/true);
    first.wait_for_unshard();
    EXPECT_TRUE(at::equal(w.narrow(0, 2, 1), at::full({1, 5}, 8.0f)));
    first.reshard();
    // reshard_after_backward false: the blocks stay unsharded after backward until reshard().
    root.set_reshard_after_backward(false);
    RunStep(model);
    EXPECT_EQ(w.sizes(), (c10::IntArrayRef{3, 5}));
    EXPECT_EQ(model->second->b->weight.sizes(), (c10::IntArrayRef{6, 3}));
    root.reshard();
    first.reshard();
    fsdp::fsdp2::FSDPModule(GetState(*model->second)).reshard();
    EXPECT_EQ(w.sizes()[0], pg->rank() == 0 ? 2 : 1);
    ASSERT_TRUE(w.grad().defined());
    EXPECT_EQ(w.grad().sizes(), w.sizes());  // the reduced, sharded gradient
  });
}

struct ReluImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x.relu(); }
};

struct WithParameterlessImpl : torch::nn::Module {
  WithParameterlessImpl() : leaf(register_module("leaf", Leaf())), act(register_module("act", Hooked<ReluImpl>())) {}
  at::Tensor forward(const at::Tensor& x) { return act(leaf(x)); }
  Leaf leaf;
  Hooked<ReluImpl> act;
};

TEST(FullyShardStructure, ModulesWithoutParametersTakePart) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Hooked<WithParameterlessImpl> model;
    fully_shard(model->leaf.ptr(), {.mesh = mesh});
    FSDPModule act = fully_shard(model->act.ptr(), {.mesh = mesh});
    fully_shard(model.ptr(), {.mesh = mesh});  // the root has no parameters of its own either
    EXPECT_EQ(FSDPModuleTestAccess::param_group(act), nullptr);
    for (int step = 0; step < 2; ++step) model(at::ones({4, 5})).sum().backward();
    ASSERT_TRUE(model->leaf->a->weight.grad().defined());
    EXPECT_EQ(model->leaf->a->weight.grad().sizes(), model->leaf->a->weight.sizes());
  });
}

}  // namespace
}  // namespace fsdp::fsdp2
