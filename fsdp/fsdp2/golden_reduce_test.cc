// Parity with PyTorch 2.15's FSDP2 gradient reduction on the file the real PyTorch wrote
// (testing/golden/gen_fsdp.py; the file documents its format in its header):
// testdata/golden_fsdp2_reduce.txt: per mesh / mixed-precision policy / divide factor, the
// reduce dtype, the reduce ops and divide factors (_get_gradient_divide_factors in
// torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), the collectives of one step, and
// with one rank the reduced gradient itself.
// Two tests per record (the factors, a training step), e.g.
// --gtest_filter='Corpus/Fsdp2GoldenReduce.*/case12_*'. Everything is compared exactly; a
// case's mismatches are counted per category (golden_test_common.h).
#include "fsdp/fsdp2/golden_test_common.h"

namespace fsdp::fsdp2 {
namespace {
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
  // The test's name: case172_hsdp_2x2_orig_float32_param_bfloat16_reduce_None_factor_None.
  std::string Name() const {
    const std::string label = Label();
    return absl::StrCat("case", id, label.substr(label.find(' ', 5)));
  }
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
    if (f.size() < 17) throw std::runtime_error("a reduce record has 17 fields: " + absl::StrJoin(f, " "));
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
        if (c.factor && c.id % 2 == 0) {
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
              // PyTorch's fp16 roundings (unit roundoff u = 2^-11 each; two: 2u ~ 1e-3 relative) against
              // ours: 2e-3 ~ 4u, far below a missing factor or rank.
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

// Whether ours has force_sum_reduction_for_comms: in GetGradientDivideFactors, on FSDPModule.
bool HasForceSumFactors() { return Factors<int64_t>(2, 1, at::kFloat, std::nullopt, true).has_value(); }
template <class Module = FSDPModule>
constexpr bool HasForceSumSetter() {
  return requires(Module & m) { m.set_force_sum_reduction_for_comms(true); };
}

// One `reduce` record. Its force_sum rows (set_force_sum_reduction_for_comms, FSDPModule,
// PyTorch 2.15) are checked once ours has it, skipped before.
class Fsdp2GoldenReduce : public ::testing::TestWithParam<fsdp::testing::GoldenCase<ReduceCase>> {
 protected:
  void SetUp() override {
    if (GetParam().value && GetParam()->force_sum && !HasForceSumFactors() && !HasForceSumSetter()) {
      GTEST_SKIP() << "needs force_sum_reduction_for_comms: " << GetParam()->Label();
    }
  }
};

TEST_P(Fsdp2GoldenReduce, GradientDivideFactorsMatchPyTorch) {
  ASSERT_GOLDEN_CASE_LOADED();
  Mismatches m;
  CheckFactors(*GetParam(), m);
  ExpectNone(m, GetParam()->Label());
}

TEST_P(Fsdp2GoldenReduce, TrainingStepReductionMatchesPyTorch) {
  ASSERT_GOLDEN_CASE_LOADED();
  Mismatches m;
  CheckStep(*GetParam(), m);
  ExpectNone(m, GetParam()->Label());
}

INSTANTIATE_TEST_SUITE_P(Corpus, Fsdp2GoldenReduce,
                         ::testing::ValuesIn(fsdp::testing::GoldenCases<ReduceCase>(
                             "fsdp/fsdp2/testdata/golden_fsdp2_reduce.txt", 300, ReadReduce,
                             [](const ReduceCase& c) { return c.Name(); })),
                         fsdp::testing::GoldenCaseName());

}  // namespace
}  // namespace fsdp::fsdp2
