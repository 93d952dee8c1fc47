// DCP checkpoints of tensor-parallel models without FSDP (dcp/tp_adapter.h): a TPNet on a
// 2-rank tp mesh saves each parameter a parallel style sharded as its DTensor boxes; the
// checkpoint loads at TP=4 (each rank's shards equal the reference's boxes, found by the
// spec's offsets) and into one plain Net (every tensor whole, equal to the reference).
#include "dcp/dcp_test_trainees.h"

#include <torch/nn/modules/linear.h>

#include <mutex>

#include "fsdp/hooked_module/hooked_module.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"

namespace fsdp::dcp {
namespace {

// Every parameter of `model` (a TPNet, or a plain Net) equals `reference`'s, a TP shard its
// box of the whole tensor.
void ExpectShardsOf(torch::nn::Module& model, torch::nn::Module& reference, const std::string& what) {
  const auto want = reference.named_parameters();
  int sharded = 0, whole = 0;
  std::set<std::string> seen;
  for (const auto& m : model.named_modules()) {
    const auto* tp = distributed_parameters::FindDistributedParameters(*m.value());
    if (tp == nullptr) continue;
    for (const auto& [name, spec] : tp->named_parameter_specs()) {
      const std::string fqn = m.key() + "." + name;
      const dtensor::LocalShapeAndOffset box = spec.local_shape_and_offset();
      at::Tensor expected = want[fqn];
      for (size_t d = 0; d < box.shape.size(); ++d) expected = expected.narrow(d, box.offset[d], box.shape[d]);
      EXPECT_TRUE(at::equal(m.value()->named_parameters(false)[name], expected)) << what << " " << fqn;
      seen.insert(fqn);
      ++sharded;
    }
  }
  for (const auto& p : model.named_parameters()) {
    if (seen.count(p.key())) continue;
    EXPECT_TRUE(at::equal(p.value(), want[p.key()])) << what << " " << p.key();
    ++whole;
  }
  EXPECT_GT(whole, 0) << what;
  if (what != "one rank") {
    EXPECT_GT(sharded, 0) << what;
  }
}

TEST(DcpTensorParallel, ATensorParallelCheckpointReshardsFromTwoToFourAndOne) {
  Net reference(kNet);
  InitDeterministic(*reference, 11);
  const std::string dir = NewDir("tp_only");
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    TPNet model(*reference, mesh::DeviceMesh::Create(pg, {2}, {"tp"}));
    Save(*model, nullptr, dir);
  });
  // The metadata holds global shapes, not the local ones.
  const checkpoint::DcpMetadata md = checkpoint::ReadMetadata(dir);
  const checkpoint::DcpEntry* fc1 = md.Find("model.block0.fc1.weight");
  ASSERT_NE(fc1, nullptr);
  EXPECT_EQ(fc1->size, reference->named_parameters()["block0.fc1.weight"].sizes().vec());
  EXPECT_EQ(fc1->chunks.size(), 2u);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    Net other(kNet);
    InitDeterministic(*other, 5);
    TPNet model(*other, mesh::DeviceMesh::Create(pg, {4}, {"tp"}));
    Load(*model, nullptr, dir);
    ExpectShardsOf(*model, *reference, absl::StrCat("TP=4 rank ", pg->rank()));
  });
  Net one(kNet);
  InitDeterministic(*one, 5);
  Load(*one, nullptr, dir);
  ExpectShardsOf(*one, *reference, "one rank");
}

// AdamW's moments of `param` (undefined before its first step).
at::Tensor ExpAvg(torch::optim::AdamW& opt, const at::Tensor& param) {
  auto it = opt.state().find(param.unsafeGetTensorImpl());
  if (it == opt.state().end()) return at::Tensor();
  return static_cast<torch::optim::AdamWParamState&>(*it->second).exp_avg();
}

void AdamWStep(torch::nn::Module& model, const std::function<at::Tensor(const at::Tensor&)>& forward,
               torch::optim::AdamW& opt) {
  torch::nn::functional::mse_loss(forward(Batch(0, 12, 3, 1)), Batch(0, 12, 1, 2)).backward();
  opt.step();
  opt.zero_grad();
}

// With AdamW state: the moments are laid out like their parameters, so they reshard too.
TEST(DcpTensorParallel, OptimizerStateReshardsWithTheParameters) {
  Net reference(kNet);
  InitDeterministic(*reference, 11);
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(kLr));
  AdamWStep(
      *reference, [&](const at::Tensor& x) { return reference(x); }, ref_opt);
  const std::string dir = NewDir("tp_only_optim");
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Net plain(kNet);
    InitDeterministic(*plain, 11);
    TPNet model(*plain, mesh::DeviceMesh::Create(pg, {2}, {"tp"}));
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(kLr));
    AdamWStep(
        *model, [&](const at::Tensor& x) { return model(x); }, opt);
    Save(*model, &opt, dir);
  });
  // One plain rank: every moment whole, equal to the reference's up to the rounding of TP's
  // split matmuls (kTol: a few float32 ulps of one step).
  Net one(kNet);
  InitDeterministic(*one, 5);
  torch::optim::AdamW one_opt(one->parameters(), torch::optim::AdamWOptions(kLr));
  Load(*one, &one_opt, dir);
  const auto ref_params = reference->named_parameters();
  for (const auto& p : one->named_parameters()) {
    const at::Tensor got = ExpAvg(one_opt, p.value()), want = ExpAvg(ref_opt, ref_params[p.key()]);
    ASSERT_TRUE(got.defined()) << p.key();
    EXPECT_LE((got - want).abs().max().item<double>(), kTol * std::max(1e-3, want.abs().max().item<double>()))
        << p.key();
  }
  // TP=4: each rank's moments are the boxes of the one-rank load's, bitwise.
  const auto one_params = one->named_parameters();
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    Net plain(kNet);
    InitDeterministic(*plain, 5);
    TPNet model(*plain, mesh::DeviceMesh::Create(pg, {4}, {"tp"}));
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(kLr));
    Load(*model, &opt, dir);
    const auto specs = distributed_parameters::DistributedParameterSpecs(*model);
    int sharded = 0;
    for (const auto& p : model->named_parameters()) {
      at::Tensor want = ExpAvg(one_opt, one_params[p.key()]);
      if (auto it = specs.find(p.value().unsafeGetTensorImpl()); it != specs.end()) {
        const dtensor::LocalShapeAndOffset box = it->second.local_shape_and_offset();
        for (size_t d = 0; d < box.shape.size(); ++d) want = want.narrow(d, box.offset[d], box.shape[d]);
        ++sharded;
      }
      EXPECT_TRUE(at::equal(ExpAvg(opt, p.value()), want)) << "rank " << pg->rank() << " " << p.key();
    }
    EXPECT_GT(sharded, 0);
  });
}

// An FSDP model with a tensor-parallel module outside every fully_shard (fully_shard'ed
// blocks, a parallelized head, no root fully_shard) on dp 2 x tp 2: the head is saved as its
// DTensor boxes (not as each rank's local columns under the global name) and the checkpoint
// loads at dp 1 x tp 4 and dp 4 x tp 1, every full tensor equal bitwise.
struct HeadNetImpl : torch::nn::Module {
  HeadNetImpl()
      : block(register_module("block", Hooked<torch::nn::LinearImpl>(8, 8))),
        head(register_module("head", Hooked<torch::nn::LinearImpl>(8, 6))) {}
  at::Tensor forward(const at::Tensor& x) { return head(block(x)); }
  Hooked<torch::nn::LinearImpl> block, head;
};
using HeadNet = Hooked<HeadNetImpl>;

HeadNet MakeHeadNet(const mesh::DeviceMeshPtr& mesh, double seed) {
  HeadNet model;
  {
    at::NoGradGuard no_grad;
    int k = 0;
    for (auto& p : model->parameters())
      p.copy_(at::sin(at::arange(p.numel(), at::kFloat) * seed + (++k)).view(p.sizes()));
  }
  tensor_parallel::parallelize_module(*model, (*mesh)["tp"], {{"head", tensor_parallel::ColwiseParallel()}});
  fsdp2::fully_shard(model->block.ptr(), {.mesh = (*mesh)["dp"]});
  return model;
}

TEST(DcpTensorParallel, AModuleOutsideFullyShardKeepsItsLayout) {
  const std::string dir = NewDir("fsdp_with_tp_head");
  checkpoint::TensorDict saved;
  std::mutex mu;
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    HeadNet model = MakeHeadNet(mesh::DeviceMesh::Create(pg, {2, 2}, {"dp", "tp"}), 0.3);
    checkpoint::TensorDict full = fsdp2::GetFullStateDict(*model);
    Save(*model, nullptr, dir);
    std::lock_guard<std::mutex> lock(mu);
    if (pg->rank() == 0) saved = std::move(full);
  });
  const checkpoint::DcpMetadata md = checkpoint::ReadMetadata(dir);
  const checkpoint::DcpEntry* head = md.Find("model.head.weight");
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(head->size, (std::vector<int64_t>{6, 8}));
  ASSERT_EQ(saved.find("head.weight")->sizes(), (c10::IntArrayRef{6, 8}));
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{1, 4}, std::vector<int64_t>{4, 1}}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
      HeadNet model = MakeHeadNet(mesh::DeviceMesh::Create(pg, shape, {"dp", "tp"}), -1.7);
      Load(*model, nullptr, dir);
      const checkpoint::TensorDict full = fsdp2::GetFullStateDict(*model);
      for (const auto& item : saved) {
        ASSERT_NE(full.find(item.key()), nullptr) << item.key();
        EXPECT_TRUE(at::equal(*full.find(item.key()), item.value()))
            << item.key() << " at dp " << shape[0] << " x tp " << shape[1];
      }
    });
  }
}

}  // namespace
}  // namespace fsdp::dcp
