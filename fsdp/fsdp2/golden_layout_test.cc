// Parity with PyTorch 2.15's FSDP2 layouts on the file the real PyTorch wrote
// (testing/golden/gen_fsdp.py; the file documents its format in its header):
// testdata/golden_fsdp2_layouts.txt: fully_shard's sharded parameters (FSDP, HSDP, FSDP + TP,
// HSDP + TP, shard_placement_fn) per parameter and rank: local shape, padded sharded size,
// placements, global shape, local values, full_tensor().
// One test per case, e.g. --gtest_filter='Corpus/Fsdp2GoldenLayout.MatchesPyTorch/case197_hsdp_mesh2x2'.
// Everything is compared exactly. A case's mismatches are counted per category and the first
// few of each printed, so one run shows every way it differs from PyTorch instead of the first.
#include "fsdp/fsdp2/golden_test_common.h"
#include "fsdp/fsdp2/testing_access.h"

namespace fsdp::fsdp2 {
namespace {
// ------------------------------------------------------------------ layouts

struct GoldenParam {
  std::string fqn;
  Shape shape;
  std::optional<int64_t> shard_dim;  // shard_placement_fn's Shard(d); unset: default
};
struct GoldenLinear {
  std::string name;
  int64_t in = 0, out = 0;
  bool bias = false;
  bool colwise;
};
struct GoldenRank {
  Shape local, padded, global;
  std::string placements, full;
  std::vector<double> values;
};
struct LayoutCase {
  int64_t id = 0;
  std::string kind;  // fsdp, hsdp, tp, hsdp_tp
  Shape mesh;
  std::vector<GoldenParam> params;
  std::vector<GoldenLinear> linears;
  std::string error;                                        // fully_shard raised in PyTorch
  std::map<std::pair<int64_t, int64_t>, GoldenRank> ranks;  // (param, rank)
};

std::vector<LayoutCase> ReadLayouts() {
  std::vector<LayoutCase> cases;
  for (const Fields& f : ReadGolden("golden_fsdp2_layouts.txt")) {
    if (f[0] == "case") {
      cases.push_back({.id = Int(f[1]), .kind = f[2], .mesh = ShapeOf(f[3])});
      continue;
    }
    if (cases.empty()) throw std::runtime_error("record before the first case: " + absl::StrJoin(f, " "));
    LayoutCase& c = cases.back();
    if (Int(f[1]) != c.id) throw std::runtime_error("record out of its case: " + absl::StrJoin(f, " "));
    if (f[0] == "param") {
      std::optional<int64_t> dim;
      if (f[5] != "default") dim = Int(f[5].substr(6, f[5].size() - 7));  // "Shard(d)"
      c.params.push_back({f[3], ShapeOf(f[4]), dim});
    } else if (f[0] == "linear") {
      c.linears.push_back({f[2], Int(f[3]), Int(f[4]), f[5] == "1", f[6] == "colwise"});
    } else if (f[0] == "error") {
      c.error = f[2] + ": " + f[3];
    } else if (f[0] == "rank") {
      c.ranks[{Int(f[2]), Int(f[3])}] = {ShapeOf(f[4]), ShapeOf(f[5]), ShapeOf(f[7]), f[6], f[8], ValuesOf(f[9])};
    }
  }
  return cases;
}

// Parameters registered directly on the root, which fully_shard needs hooked.
struct ParamsImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x; }
};
using ParamsModule = fsdp::Hooked<ParamsImpl>;

std::vector<std::string> MeshNames(const std::string& kind) {
  if (kind == "fsdp") return {"shard"};
  if (kind == "hsdp") return {"replicate", "shard"};
  if (kind == "tp") return {"dp", "tp"};
  return {"replicate", "shard", "tp"};
}

// Every rank of one case: builds the parameters (arange values, as the generator), shards
// them like PyTorch did, and compares each rank's view and the gathered tensors.
void RunLayoutCase(const LayoutCase& c, Mismatches& m) {
  int64_t world = 1;
  for (int64_t d : c.mesh) world *= d;
  const std::string label = absl::StrCat("case ", c.id, " ", c.kind, " mesh ", ShapeStr(c.mesh));
  const auto outcomes = fsdp::testing::RunOnRanksCollect(
      fsdp::testing::Backend::kThreaded, static_cast<int>(world), [&](const comm::ProcessGroupPtr& pg) {
        auto mesh = mesh::DeviceMesh::Create(pg, c.mesh, MeshNames(c.kind));
        ParamsModule model;
        std::map<std::string, at::Tensor> originals;
        std::map<const c10::TensorImpl*, int64_t> shard_dims;
        for (const GoldenParam& p : c.params) {
          if (!c.linears.empty()) break;  // TP cases: the Linear layers below
          int64_t numel = 1;
          for (int64_t d : p.shape) numel *= d;
          originals[p.fqn] = at::arange(numel, at::kFloat).view(p.shape);
          at::Tensor t = model->register_parameter(p.fqn, originals[p.fqn].clone());
          if (p.shard_dim) shard_dims[t.unsafeGetTensorImpl()] = *p.shard_dim;
        }
        for (const GoldenLinear& l : c.linears) {
          torch::nn::Linear linear(torch::nn::LinearOptions(l.in, l.out).bias(l.bias));
          {
            at::NoGradGuard no_grad;
            linear->weight.copy_(at::arange(l.in * l.out, at::kFloat).view({l.out, l.in}));
            originals[l.name + ".weight"] = linear->weight.detach().clone();
            if (l.bias) {
              linear->bias.copy_(at::arange(l.out, at::kFloat));
              originals[l.name + ".bias"] = linear->bias.detach().clone();
            }
          }
          model->register_module(l.name, testing::ParallelLinear(linear, (*mesh)["tp"],
                                                                 l.colwise ? tensor_parallel::ColwiseParallel()
                                                                           : tensor_parallel::RowwiseParallel()));
        }
        FullyShardOptions options{.mesh = c.kind == "tp"        ? (*mesh)["dp"]
                                          : c.kind == "hsdp_tp" ? mesh->slice({"replicate", "shard"})
                                                                : mesh};
        if (!shard_dims.empty()) {
          options.shard_placement_fn = [shard_dims](const at::Tensor& p, const std::string&) -> std::optional<int64_t> {
            auto it = shard_dims.find(p.unsafeGetTensorImpl());
            return it == shard_dims.end() ? std::nullopt : std::optional(it->second);
          };
        }
        FSDPModule handle;
        std::string error;
        try {
          handle = fully_shard(model.ptr(), options);
        } catch (const std::exception& e) {
          error = std::string(e.what()).substr(0, std::string(e.what()).find('\n'));
        }
        // Agree on whether every rank sharded before the gathers below (one rank's error must
        // not leave the others waiting).
        at::Tensor ok = at::full({1}, error.empty() ? 1.0f : 0.0f);
        pg->all_reduce(ok, comm::ReduceOp::Sum())->wait();
        if (pg->rank() == 0 && error.empty() != c.error.empty()) {
          m.Add("fully_shard raises iff PyTorch does",
                absl::StrCat(label, ": PyTorch ", c.error.empty() ? "shards" : c.error, "; ours ",
                             error.empty() ? "shards" : error));
        }
        if (ok.item<float>() != static_cast<float>(world)) return;

        std::map<const c10::TensorImpl*, FSDPParam*> by_tensor;
        for (const auto& p : FSDPModuleTestAccess::param_group(handle)->fsdp_params()) {
          by_tensor[p->param().unsafeGetTensorImpl()] = p.get();
        }
        const auto named = model->named_parameters();
        for (size_t i = 0; i < c.params.size(); ++i) {
          const std::string& fqn = c.params[i].fqn;
          const GoldenRank& g = c.ranks.at({static_cast<int64_t>(i), pg->rank()});
          const std::string where = absl::StrCat(label, " ", fqn, " rank ", pg->rank());
          FSDPParam* p = by_tensor.at(named[fqn].unsafeGetTensorImpl());
          const dtensor::DTensor d = p->ShardedDTensor();
          auto expect = [&](const char* category, bool same, const std::string& want, const std::string& got) {
            if (!same) m.Add(category, absl::StrCat(where, ": PyTorch ", want, ", ours ", got));
          };
          expect("sharded local shape", d.to_local().sizes().vec() == g.local, ShapeStr(g.local),
                 ShapeStr(d.to_local().sizes()));
          expect("padded sharded size", p->layout().padded_sharded_size == g.padded, ShapeStr(g.padded),
                 ShapeStr(p->layout().padded_sharded_size));
          expect("placements", PyTorchPlacements(p->sharding_spec().placements) == g.placements, g.placements,
                 PyTorchPlacements(p->sharding_spec().placements));
          expect("DTensor global shape", p->sharding_spec().shape == g.global, ShapeStr(g.global),
                 ShapeStr(p->sharding_spec().shape));
          if (d.to_local().sizes().vec() == g.local && ValuesOf(d.to_local()) != g.values) {
            m.Add("local values", absl::StrCat(where, ": ", Diff(g.values, ValuesOf(d.to_local()))));
          }
          // PyTorch's param.full_tensor(); ours is GatherLikeParam (FSDP + TP: the FSDP
          // rows back into the TP shard, then the TP shards, as PyTorch's redistribute does
          // with its _StridedShard read as a shard order). Collective: every rank, same order.
          const at::Tensor full = GatherLikeParam(*p, d.to_local());
          // "orig", else PyTorch's full_tensor() as SHAPE:VALUES ("error:..." if it raised:
          // the generator avoids those cases, and there is nothing to compare then).
          if (absl::StartsWith(g.full, "error:")) continue;
          const size_t colon = g.full.find(':');
          const Shape want_shape = g.full == "orig" ? originals[fqn].sizes().vec() : ShapeOf(g.full.substr(0, colon));
          const std::vector<double> want =
              g.full == "orig" ? ValuesOf(originals[fqn]) : ValuesOf(g.full.substr(colon + 1));
          if (full.sizes().vec() != want_shape || ValuesOf(full) != want) {
            m.Add("full_tensor()", absl::StrCat(where, ": shape ", ShapeStr(want_shape), " vs ", ShapeStr(full.sizes()),
                                                ", ", Diff(want, ValuesOf(full))));
          }
        }
        // The state dict gathers through the same layout; PyTorch's full_tensor() gave the
        // original back wherever a case records "orig" on every rank.
        const FullStateDict state = GetFullStateDict(*model);
        for (size_t i = 0; i < c.params.size(); ++i) {
          const std::string& fqn = c.params[i].fqn;
          bool orig_everywhere = true;
          for (int64_t r = 0; r < world; ++r)
            orig_everywhere &= c.ranks.at({static_cast<int64_t>(i), r}).full == "orig";
          const at::Tensor* got = state.find(fqn);
          if (orig_everywhere && pg->rank() == 0 && (got == nullptr || !at::equal(*got, originals[fqn]))) {
            m.Add("GetFullStateDict", absl::StrCat(label, " ", fqn, ": ",
                                                   got ? Diff(ValuesOf(originals[fqn]), ValuesOf(*got)) : "missing"));
          }
        }
      });
  for (const auto& o : outcomes) {
    if (!o.ok) m.Add("exception", absl::StrCat(label, " rank ", o.rank, ": ", o.message.substr(0, 300)));
  }
}

// One case: fully_shard on its own threaded world, every parameter on every rank.
class Fsdp2GoldenLayout : public ::testing::TestWithParam<fsdp::testing::GoldenCase<LayoutCase>> {};

TEST_P(Fsdp2GoldenLayout, MatchesPyTorch) {
  ASSERT_GOLDEN_CASE_LOADED();
  const LayoutCase& c = *GetParam();
  Mismatches m;
  RunLayoutCase(c, m);
  ExpectNone(m, absl::StrCat("case ", c.id, " ", c.kind, " mesh ", ShapeStr(c.mesh)));
}

INSTANTIATE_TEST_SUITE_P(Corpus, Fsdp2GoldenLayout,
                         ::testing::ValuesIn(fsdp::testing::GoldenCases<LayoutCase>(
                             "fsdp/fsdp2/testdata/golden_fsdp2_layouts.txt", 300, ReadLayouts,
                             [](const LayoutCase& c) {
                               return absl::StrCat("case", c.id, "_", c.kind, "_mesh", ShapeStr(c.mesh));
                             })),
                         fsdp::testing::GoldenCaseName());

}  // namespace
}  // namespace fsdp::fsdp2
