// Parity with PyTorch 2.15's FSDP1 FlatParameter on testdata/golden_fsdp1_flat_param.txt,
// which testing/golden/gen_fsdp.py wrote from the real FullyShardedDataParallel (format in its
// header): for parameter lists of uneven sizes (an empty one among them), world sizes 1..8,
// use_orig_params off (unaligned) and on (aligned, also under mixed precision and other
// dtypes), every rank's flat parameter sizes, padding layout, local shard values,
// _shard_param_infos and shard_metadata() (torch/distributed/fsdp/_flat_param.py).
//
// Sharding needs no peers, so each rank is a FlatParamHandle on a Fake group of that rank.
// One test per case, named for the case's record, e.g.
// --gtest_filter='Corpus/Fsdp1GoldenFlatParam.ShardMetadataMatchesPyTorch/case6_W4_FULL_SHARD_float32'.
// Everything is compared exactly; a case's mismatches are counted per category and the first
// few of each printed.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "comm/fake_process_group.h"
#include "fsdp/fsdp1/flat_param.h"
#include "testing/golden_file.h"

namespace fsdp::fsdp1 {
namespace {

using Fields = std::vector<std::string>;

// The records of a golden file of this package (testing/golden_file.h).
std::vector<Fields> ReadGolden(const std::string& name) {
  return fsdp::testing::ReadGoldenFile("fsdp/fsdp1/testdata/" + name);
}

int64_t Int(const std::string& s) { return fsdp::testing::GoldenInt(s); }
std::vector<int64_t> Ints(const std::string& s, char sep = ',') { return fsdp::testing::GoldenInts(s, sep); }
std::vector<double> Values(const std::string& s) { return fsdp::testing::GoldenNums(s); }

std::vector<double> Values(const at::Tensor& t) {
  const at::Tensor d = t.detach().to(at::kDouble).contiguous().view(-1);
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

c10::ScalarType DtypeOf(const std::string& s) {
  static const auto* dtypes = new std::map<std::string, c10::ScalarType>{
      {"float32", at::kFloat}, {"bfloat16", at::kBFloat16}, {"float16", at::kHalf}, {"float64", at::kDouble}};
  return dtypes->at(s);
}

HandleShardingStrategy StrategyOf(const std::string& s) {
  if (s == "FULL_SHARD") return HandleShardingStrategy::FULL_SHARD;
  if (s == "SHARD_GRAD_OP") return HandleShardingStrategy::SHARD_GRAD_OP;
  if (s == "NO_SHARD") return HandleShardingStrategy::NO_SHARD;
  throw std::runtime_error("unknown strategy " + s);
}

// One rank's records of a case.
struct GoldenInfo {
  std::string fqn;
  bool in = false;
  int64_t offset = 0, numel = 0, start = 0, end = 0;
};
struct GoldenRank {
  int64_t unpadded = 0, padded = 0, sharded = 0, numel_padded = 0, aligned = 0;
  std::vector<int64_t> numels_with_padding, is_padding;
  std::vector<double> values;
  std::vector<GoldenInfo> infos;
  std::string meta_fqns, meta_offsets;
};
struct Fsdp1Case {
  int64_t id = 0, world = 1;
  bool use_orig_params = false;
  std::string strategy, dtype, mp_param;
  std::vector<std::pair<std::string, std::vector<int64_t>>> params;  // FQN, shape
  std::map<int64_t, GoldenRank> ranks;
  // The test's name: case6_W4[_use_orig_params]_FULL_SHARD_float32[_mp_bfloat16].
  std::string Name() const {
    return absl::StrCat("case", id, "_W", world, use_orig_params ? "_use_orig_params_" : "_", strategy, "_", dtype,
                        mp_param != "None" ? "_mp_" + mp_param : "");
  }
  std::string Label() const {
    std::vector<std::string> p;
    for (const auto& [fqn, shape] : params) p.push_back(absl::StrCat(fqn, ":", absl::StrJoin(shape, "x")));
    return absl::StrCat("case ", id, " W=", world, use_orig_params ? " use_orig_params " : " ", strategy, " ", dtype,
                        mp_param != "None" ? " mp=" + mp_param : "", " {", absl::StrJoin(p, ", "), "}");
  }
};

std::vector<Fsdp1Case> ReadCases() {
  std::vector<Fsdp1Case> cases;
  for (const Fields& f : ReadGolden("golden_fsdp1_flat_param.txt")) {
    if (f[0] == "case") {
      Fsdp1Case c{.id = Int(f[1]),
                  .world = Int(f[2]),
                  .use_orig_params = f[3] == "1",
                  .strategy = f[4],
                  .dtype = f[5],
                  .mp_param = f[6]};
      for (absl::string_view p : absl::StrSplit(f[7], ',')) {
        const std::vector<std::string> parts = absl::StrSplit(p, ':');
        c.params.emplace_back(parts[0], Ints(parts[1], 'x'));
      }
      cases.push_back(std::move(c));
      continue;
    }
    if (cases.empty()) throw std::runtime_error("record before the first case: " + absl::StrJoin(f, " "));
    Fsdp1Case& c = cases.back();
    if (Int(f[1]) != c.id) throw std::runtime_error("record out of its case: " + absl::StrJoin(f, " "));
    GoldenRank& g = c.ranks[Int(f[2])];
    if (f[0] == "flat") {
      g.unpadded = Int(f[3]), g.padded = Int(f[4]), g.sharded = Int(f[5]), g.numel_padded = Int(f[6]);
      g.aligned = Int(f[7]), g.numels_with_padding = Ints(f[8]), g.is_padding = Ints(f[9]), g.values = Values(f[10]);
    } else if (f[0] == "info") {
      GoldenInfo info{.fqn = f[4], .in = f[5] == "1"};
      if (info.in) info.offset = Int(f[6]), info.numel = Int(f[7]), info.start = Int(f[8]), info.end = Int(f[9]);
      g.infos.push_back(info);
    } else if (f[0] == "meta") {
      g.meta_fqns = f[3], g.meta_offsets = f[4];
    }
  }
  return cases;
}

using fsdp::testing::Mismatches;  // testing/golden_file.h

// The generator's module tree: each FQN's modules created on first use, in list order, and
// parameter k = 1000 (k + 1) + arange(numel), made in float64 and cast (as the generator).
struct Tree {
  std::shared_ptr<torch::nn::Module> root = std::make_shared<torch::nn::Module>();
  std::vector<at::Tensor> params;
};

Tree MakeTree(const Fsdp1Case& c) {
  Tree t;
  for (size_t k = 0; k < c.params.size(); ++k) {
    const auto& [fqn, shape] = c.params[k];
    std::vector<std::string> path = absl::StrSplit(fqn, '.');
    const std::string leaf = path.back();
    path.pop_back();
    torch::nn::Module* module = t.root.get();
    for (const std::string& part : path) {
      auto children = module->named_children();
      auto* child = children.find(part);
      module = child ? child->get() : module->register_module(part, std::make_shared<torch::nn::Module>()).get();
    }
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    const at::Tensor v = at::arange(numel, at::kDouble).add_(1000.0 * (k + 1)).to(DtypeOf(c.dtype)).view(shape);
    t.params.push_back(module->register_parameter(leaf, v));
  }
  return t;
}

template <class T>
std::string Str(const std::vector<T>& v) {
  return v.empty() ? "-" : absl::StrJoin(v, ",");
}

void CheckRank(const Fsdp1Case& c, int64_t rank, const GoldenRank& g, Mismatches& m) {
  const std::string where = absl::StrCat(c.Label(), " rank ", rank);
  Tree t = MakeTree(c);
  FlatParamHandleOptions o;
  o.process_group = comm::CreateFakeProcessGroup(static_cast<int>(rank), static_cast<int>(c.world));
  o.sharding_strategy = StrategyOf(c.strategy);
  o.use_orig_params = c.use_orig_params;
  if (c.mp_param != "None") o.mp_param_dtype = DtypeOf(c.mp_param);
  FlatParamHandle h(t.params, *t.root, o);
  h.Shard();
  h.InitFlatParamAttributes();
  const FlatParameter& fp = h.flat_param();
  auto expect = [&](const char* category, bool same, const std::string& want, const std::string& got) {
    if (!same) m.Add(category, absl::StrCat(where, ": PyTorch ", want, ", ours ", got));
  };
  const int64_t unpadded = fp.unpadded_unsharded_size.at(0);
  // PyTorch sets _padded_unsharded_size for sharded strategies only; NO_SHARD records numel.
  const int64_t padded = fp.padded_unsharded_size.empty() ? fp.sharded_size.at(0) : fp.padded_unsharded_size.at(0);
  const std::vector<int64_t> sizes = {unpadded, padded, fp.local_shard.numel(), fp.shard_numel_padded};
  const std::vector<int64_t> want_sizes = {g.unpadded, g.padded, g.sharded, g.numel_padded};
  expect("flat sizes (unpadded, padded unsharded, shard, shard padding)", sizes == want_sizes, Str(want_sizes),
         Str(sizes));
  expect("_aligned_numel", h.aligned_numel() == g.aligned, absl::StrCat(g.aligned), absl::StrCat(h.aligned_numel()));
  std::vector<int64_t> is_padding(fp.is_padding_mask.begin(), fp.is_padding_mask.end());
  expect("_numels_with_padding / _is_padding_mask",
         fp.numels_with_padding == g.numels_with_padding && is_padding == g.is_padding,
         Str(g.numels_with_padding) + " " + Str(g.is_padding), Str(fp.numels_with_padding) + " " + Str(is_padding));
  expect("local shard values", Values(fp.local_shard) == g.values, Str(g.values), Str(Values(fp.local_shard)));
  if (fp.shard_param_infos.size() != g.infos.size()) {
    m.Add("_shard_param_infos",
          absl::StrCat(where, ": PyTorch ", g.infos.size(), " entries, ours ", fp.shard_param_infos.size()));
    return;
  }
  for (size_t k = 0; k < g.infos.size(); ++k) {
    const GoldenInfo& w = g.infos[k];
    const ShardParamInfo& s = fp.shard_param_infos[k];
    expect("_fqns", fp.fqns.at(k) == w.fqn, w.fqn, fp.fqns.at(k));
    // PyTorch's fields are None when not in the shard; ours are 0 then (flat_layout.h).
    const std::vector<int64_t> got = s.in_shard ? std::vector<int64_t>{1, s.offset_in_shard, s.numel_in_shard,
                                                                       s.intra_param_start_idx, s.intra_param_end_idx}
                                                : std::vector<int64_t>{0};
    const std::vector<int64_t> want =
        w.in ? std::vector<int64_t>{1, w.offset, w.numel, w.start, w.end} : std::vector<int64_t>{0};
    expect("_shard_param_infos (in, offset, numel, start, end)", got == want, w.fqn + " " + Str(want), Str(got));
  }
  const FlatParamShardMetadata meta = h.ShardMetadata();
  std::vector<std::string> offsets;
  for (const auto& [start, end] : meta.param_offsets) offsets.push_back(absl::StrCat(start, ":", end));
  const std::string fqns = meta.param_names.empty() ? "-" : absl::StrJoin(meta.param_names, ",");
  expect("shard_metadata()", fqns == g.meta_fqns && Str(offsets) == g.meta_offsets, g.meta_fqns + " " + g.meta_offsets,
         fqns + " " + Str(offsets));
}

// One case: every rank's FlatParamHandle against PyTorch's records.
class Fsdp1GoldenFlatParam : public ::testing::TestWithParam<fsdp::testing::GoldenCase<Fsdp1Case>> {};

TEST_P(Fsdp1GoldenFlatParam, ShardMetadataMatchesPyTorch) {
  ASSERT_GOLDEN_CASE_LOADED();
  const Fsdp1Case& c = *GetParam();
  ASSERT_EQ(static_cast<int64_t>(c.ranks.size()), c.world) << c.Label();
  Mismatches m;
  for (const auto& [rank, g] : c.ranks) {
    try {
      CheckRank(c, rank, g, m);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      m.Add("exception", absl::StrCat(c.Label(), " rank ", rank, ": ", what.substr(0, what.find('\n'))));
    }
  }
  EXPECT_EQ(m.total(), 0) << m.total() << " mismatches in " << c.Label() << ":\n" << m.Report();
}

INSTANTIATE_TEST_SUITE_P(
    Corpus, Fsdp1GoldenFlatParam,
    ::testing::ValuesIn(fsdp::testing::GoldenCases<Fsdp1Case>("fsdp/fsdp1/testdata/golden_fsdp1_flat_param.txt", 500,
                                                              ReadCases, [](const Fsdp1Case& c) { return c.Name(); })),
    fsdp::testing::GoldenCaseName());

}  // namespace
}  // namespace fsdp::fsdp1
