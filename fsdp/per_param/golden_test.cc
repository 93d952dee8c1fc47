// Parity with PyTorch 2.15's FSDP2 on files the real PyTorch wrote (testing/golden/gen_fsdp.py;
// each file documents its format in its header):
//  - testdata/golden_fsdp2_layouts.txt: fully_shard's sharded parameters (FSDP, HSDP, FSDP + TP,
//    HSDP + TP, shard_placement_fn) per parameter and rank: local shape, padded sharded size,
//    placements, global shape, local values, full_tensor();
//  - testdata/golden_fsdp2_reduce.txt: per mesh / mixed-precision policy / divide factor, the
//    reduce dtype, the reduce ops and divide factors (_get_gradient_divide_factors in
//    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), the collectives of one step,
//    and with one rank the reduced gradient itself.
// Everything is compared exactly. Mismatches are counted per category and the first few of
// each printed, so one run shows every way we differ from PyTorch instead of the first.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "comm/comm_trace.h"
#include "dtensor/tensor_parallel.h"
#include "fsdp/per_param/fsdp_state.h"
#include "fsdp/per_param/fully_shard.h"
#include "fsdp/per_param/state_dict.h"
#include "testing/golden_file.h"
#include "testing/multi_rank.h"

namespace fsdp::per_param {
namespace {

using Fields = std::vector<std::string>;
using Shape = std::vector<int64_t>;

// ------------------------------------------------------------------ reading the files

// The records of a golden file of this package (testing/golden_file.h).
std::vector<Fields> ReadGolden(const std::string& name) {
  return fsdp::testing::ReadGoldenFile("fsdp/per_param/testdata/" + name);
}

int64_t Int(const std::string& s) { return fsdp::testing::GoldenInt(s); }
double Num(const std::string& s) { return fsdp::testing::GoldenNum(s); }

std::optional<double> OptNum(const std::string& s) { return s == "None" ? std::nullopt : std::optional(Num(s)); }

// "3x5" -> {3, 5}; "7" -> {7}; "scalar" -> {}.
Shape ShapeOf(const std::string& s) {
  Shape out;
  if (s == "scalar") return out;
  for (absl::string_view d : absl::StrSplit(s, 'x')) out.push_back(Int(std::string(d)));
  return out;
}

std::string ShapeStr(at::IntArrayRef shape) { return shape.empty() ? "scalar" : absl::StrJoin(shape, "x"); }

std::vector<double> ValuesOf(const std::string& s) { return fsdp::testing::GoldenNums(s); }

std::vector<double> ValuesOf(const at::Tensor& t) {
  const at::Tensor d = t.detach().to(at::kDouble).contiguous().view(-1);
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

// Values for a message, exactly (%.17g): all of them, or 12 from `from` with "..." around.
std::string Join(const std::vector<double>& v, size_t from = 0, size_t count = SIZE_MAX) {
  std::vector<std::string> parts;
  for (size_t i = from; i < v.size() && i - from < count; ++i) parts.push_back(absl::StrFormat("%.17g", v[i]));
  return absl::StrCat(from > 0 ? "...," : "", absl::StrJoin(parts, ","), from + count < v.size() ? ",..." : "");
}

// Where two value lists first differ, with a few values of each from just before it.
std::string Diff(const std::vector<double>& want, const std::vector<double>& got) {
  size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  const size_t from = i > 3 ? i - 3 : 0;
  return absl::StrCat("first difference at element ", i, " (", want.size(), " vs ", got.size(), " elements): PyTorch [",
                      Join(want, from, 12), "], ours [", Join(got, from, 12), "]");
}

// PyTorch's dtype names (str(torch.float32) without "torch.").
const std::map<std::string, c10::ScalarType>& Dtypes() {
  static const auto* dtypes = new std::map<std::string, c10::ScalarType>{{"float32", at::kFloat},
                                                                         {"bfloat16", at::kBFloat16},
                                                                         {"float16", at::kHalf},
                                                                         {"float64", at::kDouble},
                                                                         {"uint8", at::kByte}};
  return *dtypes;
}
c10::ScalarType DtypeOf(const std::string& s) { return Dtypes().at(s); }
std::optional<c10::ScalarType> OptDtype(const std::string& s) {
  return s == "None" ? std::nullopt : std::optional(DtypeOf(s));
}
std::string DtypeName(c10::ScalarType t) {
  for (const auto& [name, type] : Dtypes()) {
    if (type == t) return name;
  }
  return c10::toString(t);
}

// ------------------------------------------------------------------ mismatch report

// Mismatches by category, thread-safe (ranks report from their threads).
class Mismatches {
 public:
  void Add(const std::string& category, const std::string& example) {
    std::lock_guard<std::mutex> lock(mu_);
    if (++counts_[category] <= 5) examples_[category].push_back(example);
  }
  int total() const {
    int n = 0;
    for (const auto& [category, count] : counts_) n += count;
    return n;
  }
  std::string Report() const {
    std::string out;
    for (const auto& [category, count] : counts_) {
      absl::StrAppend(&out, count, " x ", category, "\n");
      for (const auto& e : examples_.at(category)) absl::StrAppend(&out, "    ", e, "\n");
    }
    return out;
  }

 private:
  std::mutex mu_;
  std::map<std::string, int> counts_;
  std::map<std::string, std::vector<std::string>> examples_;
};

void ExpectNone(const Mismatches& m, int records) {
  EXPECT_EQ(m.total(), 0) << m.total() << " mismatches in " << records << " golden records:\n" << m.Report();
}

// PyTorch's str() of a placements tuple, from ours: the one place where the two spellings
// meet (torch/distributed/tensor/placement_types.py; a 1-tuple keeps Python's trailing comma).
std::string PyTorchPlacements(const dtensor::Placements& placements) {
  std::vector<std::string> parts;
  for (const dtensor::Placement& p : placements) {
    switch (p.kind()) {
      case dtensor::PlacementKind::kShard: parts.push_back(absl::StrCat("Shard(dim=", p.dim(), ")")); break;
      case dtensor::PlacementKind::kStridedShard:
        parts.push_back(absl::StrCat("_StridedShard(dim=", p.dim(), ", sf=", p.split_factor(), ")"));
        break;
      case dtensor::PlacementKind::kReplicate: parts.push_back("Replicate()"); break;
      case dtensor::PlacementKind::kPartial: parts.push_back("Partial(sum)"); break;
    }
  }
  return absl::StrCat("(", absl::StrJoin(parts, ", "), parts.size() == 1 ? ",)" : ")");
}

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
  dtensor::TensorParallelStyle style;
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
    LayoutCase& c = cases.back();
    if (Int(f[1]) != c.id) throw std::runtime_error("record out of its case: " + absl::StrJoin(f, " "));
    if (f[0] == "param") {
      std::optional<int64_t> dim;
      if (f[5] != "default") dim = Int(f[5].substr(6, f[5].size() - 7));  // "Shard(d)"
      c.params.push_back({f[3], ShapeOf(f[4]), dim});
    } else if (f[0] == "linear") {
      c.linears.push_back(
          {f[2], Int(f[3]), Int(f[4]), f[5] == "1",
           f[6] == "colwise" ? dtensor::TensorParallelStyle::kColwise : dtensor::TensorParallelStyle::kRowwise});
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
          model->register_module(l.name, dtensor::ParallelizeLinear(linear, (*mesh)["tp"], l.style));
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
        for (const auto& p : handle.param_group()->fsdp_params()) by_tensor[p->param().unsafeGetTensorImpl()] = p.get();
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

TEST(Fsdp2Golden, LayoutsMatchPyTorch) {
  const std::vector<LayoutCase> cases = ReadLayouts();
  ASSERT_GT(cases.size(), 300u);
  Mismatches m;
  int records = 0;
  for (const LayoutCase& c : cases) {
    RunLayoutCase(c, m);
    records += std::max<int>(1, static_cast<int>(c.ranks.size()));
  }
  ExpectNone(m, records);
}

// ------------------------------------------------------------------ reduction

struct ReduceCase {
  int64_t id = 0;
  bool hsdp = false;
  int64_t r = 1, s = 1;  // replicate x shard
  c10::ScalarType orig;
  std::optional<c10::ScalarType> param_dtype, reduce_dtype;
  std::optional<double> factor;
  bool force_sum = false;
  c10::ScalarType chosen;  // PyTorch's reduce dtype
  std::string rs_op, ar_op;
  std::optional<double> pre, post;
  std::vector<std::string> collectives;
  std::string grad;  // one rank: row 0 of the weight's sharded gradient
  std::string Label() const {
    return absl::StrCat("case ", id, " ", hsdp ? "hsdp " : "fsdp ", r, "x", s, " orig=", DtypeName(orig),
                        " param=", param_dtype ? DtypeName(*param_dtype) : "None",
                        " reduce=", reduce_dtype ? DtypeName(*reduce_dtype) : "None",
                        " factor=", factor ? absl::StrCat(*factor) : "None", force_sum ? " force_sum" : "");
  }
};

std::vector<ReduceCase> ReadReduce() {
  std::vector<ReduceCase> out;
  for (const Fields& f : ReadGolden("golden_fsdp2_reduce.txt")) {
    ReduceCase c{.id = Int(f[1]),
                 .hsdp = f[2] == "hsdp",
                 .r = Int(f[3]),
                 .s = Int(f[4]),
                 .orig = DtypeOf(f[5]),
                 .param_dtype = OptDtype(f[6]),
                 .reduce_dtype = OptDtype(f[7]),
                 .factor = OptNum(f[8]),
                 .force_sum = f[9] == "1",
                 .chosen = DtypeOf(f[10]),
                 .rs_op = f[11],
                 .ar_op = f[12],
                 .pre = OptNum(f[13]),
                 .post = OptNum(f[14]),
                 .grad = f[16]};
    if (f[15] != "-") c.collectives = absl::StrSplit(f[15], ';');
    out.push_back(std::move(c));
  }
  return out;
}

// A reduce op in one spelling for both sides: PyTorch's names, a PREMUL_SUM factor as %g
// (CommTrace's precision; GetGradientDivideFactors' factors are compared exactly elsewhere).
std::string NormalizeOp(const std::string& op) {
  if (!absl::StartsWith(op, "PREMUL_SUM(")) return op;
  return absl::StrFormat("PREMUL_SUM(%g)", Num(op.substr(11, op.size() - 12)));
}
bool SameOp(const std::string& golden, const comm::ReduceOp& ours) {
  if (absl::StartsWith(golden, "PREMUL_SUM(")) {
    return ours.kind() == comm::ReduceOpKind::kPremulSum && ours.factor() == Num(golden.substr(11, golden.size() - 12));
  }
  return golden == ours.ToString();
}

// _get_gradient_divide_factors with force_sum_reduction_for_comms, when ours takes it.
template <class Size>
std::optional<GradientDivideFactors> Factors(Size rs, Size ar, c10::ScalarType dtype, std::optional<double> factor,
                                             bool force_sum) {
  if constexpr (requires { GetGradientDivideFactors(rs, ar, dtype, factor, force_sum); }) {
    return GetGradientDivideFactors(rs, ar, dtype, factor, force_sum);
  } else {
    if (force_sum) return std::nullopt;
    return GetGradientDivideFactors(rs, ar, dtype, factor);
  }
}

// FSDPModule::set_force_sum_reduction_for_comms, when ours has it; false if it is missing.
template <class Module>
bool SetForceSum(Module& module, bool enable) {
  if constexpr (requires { module.set_force_sum_reduction_for_comms(enable); }) {
    module.set_force_sum_reduction_for_comms(enable);
    return true;
  } else {
    return !enable;
  }
}

void CheckFactors(const ReduceCase& c, Mismatches& m) {
  // PyTorch passes the HSDP replicate group as the all-reduce group, no group for FSDP.
  const std::optional<GradientDivideFactors> f =
      Factors<int64_t>(c.s, c.hsdp ? c.r : 1, c.chosen, c.factor, c.force_sum);
  if (!f) {
    m.Add("no force_sum_reduction_for_comms in GetGradientDivideFactors", c.Label());
    return;
  }
  auto opt = [](std::optional<double> v) { return v ? absl::StrCat(*v) : std::string("None"); };
  if (!SameOp(c.rs_op, f->reduce_scatter_op) || !SameOp(c.ar_op, f->all_reduce_op) || f->pre != c.pre ||
      f->post != c.post) {
    m.Add("GetGradientDivideFactors",
          absl::StrCat(c.Label(), " dtype ", DtypeName(c.chosen), ": PyTorch (", c.rs_op, ", ", c.ar_op, ", pre ",
                       opt(c.pre), ", post ", opt(c.post), "), ours (", f->reduce_scatter_op.ToString(), ", ",
                       f->all_reduce_op.ToString(), ", pre ", opt(f->pre), ", post ", opt(f->post), ")"));
  }
}

// One forward + backward of fully_shard(Linear(4, 4)) on threaded ranks, as the generator ran
// it; rank 0 compares its collectives (reduce-scatter / all-reduce: dtype, op, group size;
// all-gathers: group size only, as ours packs them as bytes), the reduce dtype, and with one
// rank the reduced gradient.
void CheckStep(const ReduceCase& c, Mismatches& m) {
  const auto outcomes = fsdp::testing::RunOnRanksCollect(
      fsdp::testing::Backend::kThreaded, static_cast<int>(c.r * c.s), [&](const comm::ProcessGroupPtr& pg) {
        auto trace = std::make_shared<comm::CommTrace>(pg);
        auto mesh = c.hsdp ? mesh::DeviceMesh::Create(trace, {c.r, c.s}, {"replicate", "shard"})
                           : mesh::DeviceMesh::Create(trace, {c.s}, {"shard"});
        fsdp::Hooked<torch::nn::LinearImpl> model(4, 4);
        model->to(c.orig);
        FullyShardOptions options{.mesh = mesh};
        options.mp_policy.param_dtype = c.param_dtype;
        options.mp_policy.reduce_dtype = c.reduce_dtype;
        FSDPModule handle = fully_shard(model.ptr(), options);
        // Half the cases through the older name (an alias in PyTorch 2.15 too).
        static std::atomic<int> calls{0};
        if (c.factor && calls++ % 2 == 0) {
          handle.set_gradient_divide_factor(*c.factor);
        } else if (c.factor) {
          handle.set_reduce_scatter_divide_factor(*c.factor);
        }
        if (!SetForceSum(handle, c.force_sum)) {
          if (pg->rank() == 0) m.Add("no FSDPModule::set_force_sum_reduction_for_comms", c.Label());
          return;
        }
        // Each traced group once (a mesh dimension may reuse the world group).
        std::vector<std::shared_ptr<comm::CommTrace>> traces = {trace};
        for (int d = 0; d < mesh->ndim(); ++d) {
          auto t = std::dynamic_pointer_cast<comm::CommTrace>(mesh->group(d));
          if (t && std::find(traces.begin(), traces.end(), t) == traces.end()) traces.push_back(t);
        }
        for (auto& t : traces) t->clear();  // the mesh's own set-up
        model(at::arange(8, c.orig).view({2, 4})).sum().backward();
        if (pg->rank() != 0) return;

        // "op:dtype:reduce_op:group_size" per collective, those over a 1-rank group apart:
        // PyTorch all-reduces over HSDP's replicate group even when it has one rank.
        std::vector<std::string> got, want, got_single, want_single;
        std::optional<c10::ScalarType> reduce_dtype;  // ours, seen in the reducing collectives
        for (const auto& t : traces) {
          for (const comm::CollectiveRecord& r : t->records()) {
            auto& out = r.group_size == 1 ? got_single : got;
            if (r.op == "all_gather_into_tensor") {
              out.push_back(absl::StrCat("all_gather:", r.group_size));
              continue;
            }
            const std::string op = r.op == "reduce_scatter_tensor" ? "reduce_scatter" : r.op;
            if (!reduce_dtype || op == "reduce_scatter") reduce_dtype = r.dtype;
            out.push_back(absl::StrCat(op, ":", DtypeName(r.dtype), ":", NormalizeOp(r.reduce_op), ":", r.group_size));
          }
        }
        for (const std::string& g : c.collectives) {
          const std::vector<std::string> f = absl::StrSplit(g, ':');
          (f[3] == "1" ? want_single : want)
              .push_back(f[0] == "all_gather" ? absl::StrCat("all_gather:", f[3])
                                              : absl::StrCat(f[0], ":", f[1], ":", NormalizeOp(f[2]), ":", f[3]));
        }
        auto compare = [&](const char* category, std::vector<std::string>& w, std::vector<std::string>& g) {
          std::sort(w.begin(), w.end());
          std::sort(g.begin(), g.end());
          if (w != g) {
            m.Add(category, absl::StrCat(c.Label(), ": PyTorch [", absl::StrJoin(w, " "), "], ours [",
                                         absl::StrJoin(g, " "), "]"));
          }
        };
        compare("collectives of a step", want, got);
        compare("collectives over a 1-rank group", want_single, got_single);
        // The reduce dtype as the collectives show it (with one rank nothing shows it; the
        // reduced gradient below is compared instead).
        if (reduce_dtype && *reduce_dtype != c.chosen) {
          m.Add("reduce dtype",
                absl::StrCat(c.Label(), ": PyTorch ", DtypeName(c.chosen), ", ours ", DtypeName(*reduce_dtype)));
        }
        if (c.grad != "-") {
          const at::Tensor g = model->weight.grad();
          std::vector<double> want = ValuesOf(c.grad);
          // Deliberate difference (README): with one rank, a divide factor and pre/post
          // division (fp16 and other non-fp32/bf16 reduce dtypes, or force-sum), PyTorch 2.15's
          // foreach_reduce divides by the factor in its copy and then pre/post-divides again,
          // i.e. by factor^2; ours divides once, as at every other world size.
          const bool overflow_risk = c.chosen != at::kFloat && c.chosen != at::kBFloat16;
          const bool quirk = c.r * c.s == 1 && c.factor && (overflow_risk || c.force_sum);
          if (quirk) {
            for (double& v : want) v *= *c.factor;
          }
          const auto same = [&](const std::vector<double>& got) {
            if (!quirk) return got == want;  // exact, as everywhere else
            if (got.size() != want.size()) return false;
            for (size_t k = 0; k < got.size(); ++k) {  // PyTorch's value rounded in fp16 twice
              if (std::abs(got[k] - want[k]) > 2e-3 * std::max(1.0, std::abs(want[k]))) return false;
            }
            return true;
          };
          if (!g.defined() || !same(ValuesOf(g[0]))) {
            m.Add("one-rank reduced gradient", absl::StrCat(c.Label(), ": PyTorch ", c.grad, ", ours ",
                                                            g.defined() ? Join(ValuesOf(g[0])) : "none"));
          }
        }
      });
  for (const auto& o : outcomes) {
    if (!o.ok) m.Add("exception", absl::StrCat(c.Label(), " rank ", o.rank, ": ", o.message.substr(0, 300)));
  }
}

TEST(Fsdp2Golden, GradientDivideFactorsMatchPyTorch) {
  const std::vector<ReduceCase> cases = ReadReduce();
  ASSERT_GT(cases.size(), 300u);
  Mismatches m;
  for (const ReduceCase& c : cases) {
    if (!c.force_sum) CheckFactors(c, m);
  }
  ExpectNone(m, static_cast<int>(cases.size()));
}

TEST(Fsdp2Golden, TrainingStepReductionMatchesPyTorch) {
  const std::vector<ReduceCase> cases = ReadReduce();
  Mismatches m;
  for (const ReduceCase& c : cases) {
    if (!c.force_sum) CheckStep(c, m);
  }
  ExpectNone(m, static_cast<int>(cases.size()));
}

// set_force_sum_reduction_for_comms (FSDPModule, PyTorch 2.15): checked once ours has it.
TEST(Fsdp2Golden, ForceSumReductionMatchesPyTorch) {
  const std::vector<ReduceCase> cases = ReadReduce();
  Mismatches m;
  int rows = 0;
  for (const ReduceCase& c : cases) {
    if (!c.force_sum) continue;
    ++rows;
    CheckFactors(c, m);
    CheckStep(c, m);
  }
  if (m.total() == 2 * rows) GTEST_SKIP() << rows << " golden rows need force_sum_reduction_for_comms:\n" << m.Report();
  ExpectNone(m, rows);
}

}  // namespace
}  // namespace fsdp::per_param
