// DCP checkpoints of tensor-parallel models without FSDP (dcp/tp_adapter.h): a TPNet on a
// 2-rank tp mesh saves each TensorParallelLinear parameter as its DTensor boxes; the
// checkpoint loads at TP=4 (each rank's shards equal the reference's boxes, found by the
// spec's offsets) and into one plain Net (every tensor whole, equal to the reference).
#include "dcp/dcp_test_trainees.h"

namespace fsdp::dcp {
namespace {

// Every parameter of `model` (a TPNet, or a plain Net) equals `reference`'s, a TP shard its
// box of the whole tensor.
void ExpectShardsOf(torch::nn::Module& model, torch::nn::Module& reference, const std::string& what) {
  const auto want = reference.named_parameters();
  int sharded = 0, whole = 0;
  std::set<std::string> seen;
  for (const auto& m : model.named_modules()) {
    const auto* tp = dynamic_cast<const dtensor::TensorParallelLinearImpl*>(m.value().get());
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
  if (what != "one rank") EXPECT_GT(sharded, 0) << what;
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

}  // namespace
}  // namespace fsdp::dcp
