// Golden shard metadata: for several parameter lists and every world size 1..5, a real
// FlatParamHandle per rank against a closed form written here from interval arithmetic
// (not fsdp/common/flat_layout, whose branchy transcription of PyTorch's
// _get_shard_metadata the handle uses):
//  - segments: parameter i occupies [b_i, b_i + n_i) of the unsharded flat parameter; without
//    alignment b_i is the prefix sum; with use_orig_params (f32: 16 bytes = 4 elements) b_i is
//    the previous end rounded up to a multiple of 4 (the gap is padding), and the total is
//    rounded up to a multiple of W (padding at the end);
//  - chunk c = ceil(T / W) (torch.chunk); rank r's shard is [r c, (r + 1) c) of the padded
//    flat parameter, real data [min(r c, T), min((r + 1) c, T)), numel_padded c - that;
//  - parameter i in the shard iff lo = max(b_i, r c) < hi = min(b_i + n_i, (r + 1) c); then
//    offset_in_shard = lo - r c, numel_in_shard = hi - lo, intra_param_start_idx = lo - b_i,
//    intra_param_end_idx = hi - 1 - b_i (inclusive, as PyTorch).
// The local shard's contents are checked element by element (parameter values, 42 for
// alignment padding, 0 for the chunk padding), and an all-gather round trip on threaded
// ranks restores every original. One test per (parameter list, W, alignment), e.g.
// --gtest_filter='Sweep/FlatParamClosedForm.*/params_2x3_4_W4_aligned'.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/fake_process_group.h"
#include "fsdp/fsdp1/flat_param.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp1 {
namespace {

using Shape = std::vector<int64_t>;
using ShapeList = std::vector<Shape>;

const std::vector<ShapeList> kLists = {
    {{2, 3}, {4}},               // PyTorch's worked example, total 10
    {{7}},                       // one parameter, total 7
    {{1}, {1}, {1}},             // total 3 < W for W = 4, 5
    {{5, 3}, {6}, {1, 7}, {2}},  // total 30
    {{2}},                       // total 2 < W for W = 3, 4, 5
    {{3}, {5}, {2, 2}, {1}},     // odd sizes: alignment gaps of 1 and 3
};

int64_t Numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// The closed form for one (list, W, rank).
struct GoldenParam {
  int64_t begin = 0, numel = 0;  // in the unsharded flat parameter
  bool in = false;
  int64_t offset = 0, n = 0, intra_start = 0, intra_end = 0;
};
struct Golden {
  int64_t total = 0;  // unpadded unsharded numel (alignment and W padding included)
  int64_t chunk = 0, start = 0, end = 0, numel_padded = 0;
  std::vector<GoldenParam> params;
  std::vector<int64_t> numels_with_padding;
  std::vector<bool> is_padding_mask;
};

Golden MakeGolden(const ShapeList& shapes, int64_t w, int64_t r, bool aligned) {
  constexpr int64_t kAlign = 4;  // 16 bytes of f32
  Golden g;
  int64_t cursor = 0;
  for (const Shape& s : shapes) {
    GoldenParam p;
    p.begin = aligned ? (cursor + kAlign - 1) / kAlign * kAlign : cursor;
    if (p.begin > cursor) {
      g.numels_with_padding.push_back(p.begin - cursor);
      g.is_padding_mask.push_back(true);
    }
    p.numel = Numel(s);
    g.numels_with_padding.push_back(p.numel);
    g.is_padding_mask.push_back(false);
    cursor = p.begin + p.numel;
    g.params.push_back(p);
  }
  g.total = aligned ? (cursor + w - 1) / w * w : cursor;
  if (g.total > cursor) {
    g.numels_with_padding.push_back(g.total - cursor);
    g.is_padding_mask.push_back(true);
  }
  g.chunk = (g.total + w - 1) / w;
  const int64_t lo_shard = r * g.chunk, hi_shard = (r + 1) * g.chunk;
  g.start = std::min(lo_shard, g.total);
  g.end = std::min(hi_shard, g.total);
  g.numel_padded = g.chunk - (g.end - g.start);
  for (GoldenParam& p : g.params) {
    const int64_t lo = std::max(p.begin, lo_shard), hi = std::min(p.begin + p.numel, hi_shard);
    p.in = lo < hi;
    if (!p.in) continue;
    p.offset = lo - lo_shard;
    p.n = hi - lo;
    p.intra_start = lo - p.begin;
    p.intra_end = hi - 1 - p.begin;
  }
  return g;
}

// The unsharded flat parameter as the closed form sees it: parameter i holds 1000 (i + 1) +
// 0, 1, 2, ... (distinct everywhere), padding 42.
std::vector<float> GoldenFlat(const Golden& g) {
  std::vector<float> flat(g.total, 42.0f);
  for (size_t i = 0; i < g.params.size(); ++i) {
    for (int64_t k = 0; k < g.params[i].numel; ++k) flat[g.params[i].begin + k] = 1000.0f * (i + 1) + k;
  }
  return flat;
}

// root -> m0, m1, ... each with one parameter "w" of the list's shapes.
struct ShapeTree {
  std::shared_ptr<torch::nn::Module> root;
  std::vector<at::Tensor> params, originals;
};

ShapeTree MakeShapeTree(const ShapeList& shapes) {
  ShapeTree t;
  t.root = std::make_shared<torch::nn::Module>();
  for (size_t i = 0; i < shapes.size(); ++i) {
    auto m = t.root->register_module(absl::StrCat("m", i), std::make_shared<torch::nn::Module>());
    const at::Tensor v = at::arange(Numel(shapes[i]), at::kFloat).add_(1000.0 * (i + 1)).view(shapes[i]);
    t.params.push_back(m->register_parameter("w", v));
    t.originals.push_back(v.detach().clone());
  }
  return t;
}

std::string Label(const ShapeList& shapes, int64_t w, int64_t r, bool aligned) {
  std::vector<std::string> parts;
  for (const Shape& s : shapes) parts.push_back(absl::StrJoin(s, "x"));
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "} W=", w, " rank ", r, aligned ? " aligned" : "");
}

// Shards `h` and compares its metadata and local shard with the closed form.
void CheckShard(FlatParamHandle& h, const ShapeTree& t, const Golden& g, const std::string& label) {
  FlatParameter& fp = h.flat_param();
  EXPECT_EQ(fp.unpadded_unsharded_size, std::vector<int64_t>{g.total}) << label;
  EXPECT_EQ(fp.numels_with_padding, g.numels_with_padding) << label;
  EXPECT_EQ(fp.is_padding_mask, g.is_padding_mask) << label;
  h.Shard();
  EXPECT_EQ(fp.sharded_size, std::vector<int64_t>{g.chunk}) << label;
  EXPECT_EQ(fp.shard_numel_padded, g.numel_padded) << label;
  ASSERT_EQ(fp.shard_param_infos.size(), g.params.size()) << label;
  for (size_t i = 0; i < g.params.size(); ++i) {
    const ShardParamInfo& got = fp.shard_param_infos[i];
    const GoldenParam& want = g.params[i];
    const std::string where = absl::StrCat(label, " param ", i);
    EXPECT_EQ(got.in_shard, want.in) << where;
    if (!want.in) continue;
    EXPECT_EQ(got.offset_in_shard, want.offset) << where;
    EXPECT_EQ(got.numel_in_shard, want.n) << where;
    EXPECT_EQ(got.intra_param_start_idx, want.intra_start) << where;
    EXPECT_EQ(got.intra_param_end_idx, want.intra_end) << where;
    // The shard's slice is that part of the original, flattened.
    EXPECT_TRUE(at::equal(fp.param.detach().narrow(0, want.offset, want.n),
                          t.originals[i].flatten().narrow(0, want.intra_start, want.n)))
        << where;
    if (h.use_orig_params()) {  // _use_sharded_views: the original is that slice
      EXPECT_EQ(t.params[i].sizes().vec(), std::vector<int64_t>{want.n}) << where;
      EXPECT_EQ(t.params[i].data_ptr<float>(), fp.param.data_ptr<float>() + want.offset) << where;
    }
  }
  if (h.use_orig_params()) {
    for (size_t i = 0; i < g.params.size(); ++i) {
      if (!g.params[i].in) {
        EXPECT_EQ(t.params[i].numel(), 0) << label << " param " << i;
      }
    }
  }
  // Every element of the local shard: [start, end) of the flat parameter, then zeros.
  const std::vector<float> flat = GoldenFlat(g);
  std::vector<float> want(flat.begin() + g.start, flat.begin() + g.end);
  want.resize(g.chunk, 0.0f);
  EXPECT_TRUE(at::equal(fp.param.detach(), at::tensor(want, at::kFloat))) << label;
}

// One (parameter list, world size, alignment) of the sweep: kLists x W 1..5 x use_orig_params.
struct SweepCase {
  ShapeList shapes;
  int w = 1;
  bool aligned = false;
  // params_2x3_4_W4_aligned: the shapes, the world size, use_orig_params.
  std::string Name() const {
    std::vector<std::string> parts;
    for (const Shape& s : shapes) parts.push_back(absl::StrJoin(s, "x"));
    return absl::StrCat("params_", absl::StrJoin(parts, "_"), "_W", w, aligned ? "_aligned" : "_unaligned");
  }
};
void PrintTo(const SweepCase& c, std::ostream* os) { *os << c.Name(); }

std::vector<SweepCase> Sweep() {
  std::vector<SweepCase> out;
  for (bool aligned : {false, true}) {
    for (const ShapeList& shapes : kLists) {
      for (int w = 1; w <= 5; ++w) out.push_back({shapes, w, aligned});
    }
  }
  return out;
}

class FlatParamClosedForm : public ::testing::TestWithParam<SweepCase> {};

TEST_P(FlatParamClosedForm, ShardMetadataForEveryRank) {
  const ShapeList& shapes = GetParam().shapes;
  const int w = GetParam().w;
  const bool aligned = GetParam().aligned;
  for (int r = 0; r < w; ++r) {
    // A Fake group of the right rank and size: sharding needs no peers.
    ShapeTree t = MakeShapeTree(shapes);
    FlatParamHandleOptions o;
    o.process_group = comm::CreateFakeProcessGroup(r, w);
    o.use_orig_params = aligned;
    FlatParamHandle h(t.params, *t.root, o);
    EXPECT_EQ(h.aligned_numel(), aligned ? 4 : 0);
    CheckShard(h, t, MakeGolden(shapes, w, r, aligned), Label(shapes, w, r, aligned));
  }
}

// The closed form's own sanity on PyTorch's worked example (hand-derived in
// flat_param_test.cc): W=4 rank 3 holds b.w[3] and 2 elements of padding.
TEST(FlatParamGolden, ClosedFormMatchesTheSeedExample) {
  const Golden g = MakeGolden({{2, 3}, {4}}, 4, 3, false);
  EXPECT_EQ(g.total, 10);
  EXPECT_EQ(g.chunk, 3);
  EXPECT_EQ(g.numel_padded, 2);
  EXPECT_FALSE(g.params[0].in);
  EXPECT_TRUE(g.params[1].in);
  EXPECT_EQ(g.params[1].offset, 0);
  EXPECT_EQ(g.params[1].intra_start, 3);
  EXPECT_EQ(g.params[1].intra_end, 3);
  // Aligned {3, 5, 2x2, 1} at W=5: 3 | pad 1 | 5 | pad 3 | 4 | 1 | pad 3 (to a multiple of 5).
  const Golden a = MakeGolden({{3}, {5}, {2, 2}, {1}}, 5, 0, true);
  EXPECT_EQ(a.numels_with_padding, (std::vector<int64_t>{3, 1, 5, 3, 4, 1, 3}));
  EXPECT_EQ(a.is_padding_mask, (std::vector<bool>{false, true, false, true, false, false, true}));
  EXPECT_EQ(a.chunk, 4);
  EXPECT_EQ(a.params[2].begin, 12);
  EXPECT_EQ(a.total, 20);
}

// Threaded ranks: the handle's all-gather of the shards rebuilds every original exactly.
TEST_P(FlatParamClosedForm, UnshardRestoresEveryOriginal) {
  const ShapeList& shapes = GetParam().shapes;
  const int w = GetParam().w;
  const bool aligned = GetParam().aligned;
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, w, [&](const comm::ProcessGroupPtr& pg) {
    ShapeTree t = MakeShapeTree(shapes);
    FlatParamHandleOptions o;
    o.process_group = pg;
    o.use_orig_params = aligned;
    FlatParamHandle h(t.params, *t.root, o);
    const Golden g = MakeGolden(shapes, w, pg->rank(), aligned);
    const std::string label = Label(shapes, w, pg->rank(), aligned);
    CheckShard(h, t, g, label);
    h.InitFlatParamAttributes();
    EXPECT_EQ(h.flat_param().padded_unsharded_size, std::vector<int64_t>{g.chunk * w}) << label;
    h.Unshard();
    for (size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_TRUE(at::equal(t.params[i], t.originals[i])) << label << " param " << i;
    }
    const std::vector<float> flat = GoldenFlat(g);
    EXPECT_TRUE(at::equal(h.flat_param().param.detach(), at::tensor(flat, at::kFloat))) << label;
    h.Reshard(true);
  });
}

INSTANTIATE_TEST_SUITE_P(Sweep, FlatParamClosedForm, ::testing::ValuesIn(Sweep()),
                         [](const ::testing::TestParamInfo<SweepCase>& info) { return info.param.Name(); });

}  // namespace
}  // namespace fsdp::fsdp1
