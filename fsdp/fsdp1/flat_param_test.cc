// FlatParamHandle against hand-derived layouts (PyTorch's worked example), unshard /
// reshard storage behaviour, use_orig_params views and writeback, gradient reduction
// against direct math, and PyTorch's error paths.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <memory>
#include <vector>

#include "comm/fake_process_group.h"
#include "fsdp/common/flat_layout.h"
#include "fsdp/common/grad_divide.h"
#include "fsdp/fsdp1/flat_param.h"
#include "fsdp/fsdp1/flat_param_streams.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp1 {
namespace {

using fsdp::testing::Backend;
using ModulePtr = std::shared_ptr<torch::nn::Module>;

// root -> a (w: a_shape), b (w: b_shape); values 1, 2, 3, ... in flattening order.
struct Tree {
  ModulePtr root, a, b;
  at::Tensor aw, bw;
  at::Tensor aw0, bw0;  // copies of the original values
};

Tree MakeTree(std::vector<int64_t> a_shape, std::vector<int64_t> b_shape) {
  Tree t;
  t.root = std::make_shared<torch::nn::Module>();
  t.a = t.root->register_module("a", std::make_shared<torch::nn::Module>());
  t.b = t.root->register_module("b", std::make_shared<torch::nn::Module>());
  const int64_t na = c10::multiply_integers(a_shape), nb = c10::multiply_integers(b_shape);
  t.aw = t.a->register_parameter("w", at::arange(1, na + 1, at::kFloat).view(a_shape));
  t.bw = t.b->register_parameter("w", at::arange(na + 1, na + nb + 1, at::kFloat).view(b_shape));
  t.aw0 = t.aw.detach().clone();
  t.bw0 = t.bw.detach().clone();
  return t;
}

FlatParamHandleOptions Options(comm::ProcessGroupPtr pg, HandleShardingStrategy s = HandleShardingStrategy::FULL_SHARD,
                               bool use_orig_params = false) {
  FlatParamHandleOptions o;
  o.process_group = std::move(pg);
  o.sharding_strategy = s;
  o.use_orig_params = use_orig_params;
  return o;
}

at::Tensor Floats(std::vector<float> v) { return at::tensor(v, at::kFloat); }

struct Info {  // in_shard, offset_in_shard, numel_in_shard, intra start, intra end
  bool in;
  int64_t off, n, s, e;
};

void ExpectInfos(const std::vector<ShardParamInfo>& got, const std::vector<Info>& want, const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].in_shard, want[i].in) << where << " param " << i;
    if (!want[i].in) continue;
    EXPECT_EQ(got[i].offset_in_shard, want[i].off) << where << " param " << i;
    EXPECT_EQ(got[i].numel_in_shard, want[i].n) << where << " param " << i;
    EXPECT_EQ(got[i].intra_param_start_idx, want[i].s) << where << " param " << i;
    EXPECT_EQ(got[i].intra_param_end_idx, want[i].e) << where << " param " << i;
  }
}

// PyTorch's worked example: a.w (2x3) = 1..6 and b.w (4) = 7..10 flatten to 1..10; offsets
// (_get_flat_param_offsets) a.w [0, 5], b.w [6, 9]. For a shard [us, ue]: in_shard iff
// us <= param_end and ue >= param_start; if us <= param_start then intra_start 0 and
// offset = param_start - us, else intra_start = us - param_start and offset 0; intra_end =
// min(param_end, ue) - param_start; numel = intra_end - intra_start + 1.
//  W=2, chunk ceil(10/2)=5: r0 [0,4]: a.w 0..4 at 0 (5); b.w out.
//                           r1 [5,9]: a.w 5..5 at 0 (1); b.w 0..3 at 1 (4).
//  W=4, chunk ceil(10/4)=3: r0 [0,2]: a.w 0..2 at 0 (3); b.w out.
//                           r1 [3,5]: a.w 3..5 at 0 (3); b.w out (5 < 6).
//                           r2 [6,8]: a.w out; b.w 0..2 at 0 (3).
//                           r3 [9,11]: a.w out; b.w 3..3 at 0 (1); 2 elements of padding.
const std::vector<std::vector<Info>> kSeedW2 = {{{true, 0, 5, 0, 4}, {false, 0, 0, 0, 0}},
                                                {{true, 0, 1, 5, 5}, {true, 1, 4, 0, 3}}};
const std::vector<std::vector<Info>> kSeedW4 = {{{true, 0, 3, 0, 2}, {false, 0, 0, 0, 0}},
                                                {{true, 0, 3, 3, 5}, {false, 0, 0, 0, 0}},
                                                {{false, 0, 0, 0, 0}, {true, 0, 3, 0, 2}},
                                                {{false, 0, 0, 0, 0}, {true, 0, 1, 3, 3}}};
const std::vector<std::vector<float>> kSeedShardsW2 = {{1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}};
const std::vector<std::vector<float>> kSeedShardsW4 = {{1, 2, 3}, {4, 5, 6}, {7, 8, 9}, {10, 0, 0}};

// Aligned example (use_orig_params, f32: 16 bytes = 4 elements): p0 (3) at [0, 2], 1 padding
// at 3, p1 (5) at [4, 8], then padding to a multiple of W: W=2 -> 1 (total 10), W=4 -> 3
// (total 12). W=4, chunk 3: r0 [0,2]: p0 0..2 at 0; p1 out.  r1 [3,5]: p0 out; p1 0..1 at 1.
// r2 [6,8]: p1 2..4 at 0.  r3 [9,11]: padding only (p1 ends at 8).
// W=2, chunk 5: r0 [0,4]: p0 0..2 at 0; p1 0..0 at 4.  r1 [5,9]: p0 out; p1 1..4 at 0.
const std::vector<std::vector<Info>> kAlignedW4 = {{{true, 0, 3, 0, 2}, {false, 0, 0, 0, 0}},
                                                   {{false, 0, 0, 0, 0}, {true, 1, 2, 0, 1}},
                                                   {{false, 0, 0, 0, 0}, {true, 0, 3, 2, 4}},
                                                   {{false, 0, 0, 0, 0}, {false, 0, 0, 0, 0}}};
const std::vector<std::vector<Info>> kAlignedW2 = {{{true, 0, 3, 0, 2}, {true, 4, 1, 0, 0}},
                                                   {{false, 0, 0, 0, 0}, {true, 0, 4, 1, 4}}};

TEST(FlatLayout, SeedWorkedExampleAsIntegers) {
  const auto segs = MakeFlatSegments({6, 4}, 0, 4);
  ASSERT_EQ(segs.size(), 2u);
  EXPECT_EQ(FlatTotalNumel(segs), 10);
  for (int w : {2, 4}) {
    for (int r = 0; r < w; ++r) {
      const FlatChunk c = MakeFlatChunk(10, w, r);
      EXPECT_EQ(c.chunk, w == 2 ? 5 : 3);
      EXPECT_EQ(c.numel_padded, w == 4 && r == 3 ? 2 : 0);
      ExpectInfos(FlatShardParamInfos(segs, c.chunk * r, c.chunk * (r + 1) - 1), (w == 2 ? kSeedW2 : kSeedW4)[r],
                  "W=" + std::to_string(w) + " r=" + std::to_string(r));
    }
  }
  // 5 elements over 4 ranks: chunk 2, torch.chunk gives only 3 chunks; rank 3 is all padding.
  const FlatChunk c = MakeFlatChunk(5, 4, 3);
  EXPECT_EQ(c.start, c.end);
  EXPECT_EQ(c.numel_padded, 2);
  EXPECT_EQ(FlatAlignedNumel(4), 4);
  EXPECT_EQ(FlatAlignedNumel(2), 8);
  EXPECT_EQ(FlatAlignedNumel(8), 2);
  // Divide factors: double while size % factor == 0 and size / factor > factor (the check
  // is on the factor before doubling, so 6 -> 1, 2, 4: 4 does not divide 6; post = 1.5).
  const std::vector<std::pair<double, double>> pre = {{1, 1}, {2, 2}, {3, 2}, {4, 2}, {8, 4}, {16, 4}, {32, 8}, {6, 4}};
  for (auto [n, p] : pre) EXPECT_EQ(GradientPredivideFactor(n), p) << n;
}

TEST(FlatParamHandle, SeedExampleShardsUnshardsAndFreesStorage) {
  for (int w : {2, 4}) {
    for (auto strategy : {HandleShardingStrategy::FULL_SHARD, HandleShardingStrategy::SHARD_GRAD_OP}) {
      fsdp::testing::RunOnRanks(Backend::kThreaded, w, [w, strategy](const comm::ProcessGroupPtr& pg) {
        Tree t = MakeTree({2, 3}, {4});
        FlatParamHandle h({t.aw, t.bw}, *t.root, Options(pg, strategy));
        FlatParameter& fp = h.flat_param();
        EXPECT_EQ(fp.num_params, 2);
        EXPECT_EQ(fp.fqns, (std::vector<std::string>{"a.w", "b.w"}));
        EXPECT_EQ(fp.numels, (std::vector<int64_t>{6, 4}));
        EXPECT_EQ(fp.numels_with_padding, (std::vector<int64_t>{6, 4}));
        EXPECT_EQ(fp.is_padding_mask, (std::vector<bool>{false, false}));
        EXPECT_EQ(fp.shapes, (std::vector<std::vector<int64_t>>{{2, 3}, {4}}));
        EXPECT_EQ(fp.param_infos[1].module, t.b.get());
        EXPECT_EQ(fp.param_infos[1].module_name, "b");
        EXPECT_EQ(fp.unpadded_unsharded_size, std::vector<int64_t>{10});
        EXPECT_TRUE(fp.param.requires_grad());
        // Before sharding the originals are views into the flat parameter (torch.cat order).
        EXPECT_TRUE(at::equal(fp.param.detach(), at::arange(1, 11, at::kFloat)));
        EXPECT_EQ(t.aw.data_ptr<float>(), fp.param.data_ptr<float>());

        h.Shard();
        const int r = pg->rank();
        EXPECT_TRUE(at::equal(fp.param.detach(), Floats((w == 2 ? kSeedShardsW2 : kSeedShardsW4)[r])));
        EXPECT_EQ(fp.shard_numel_padded, w == 4 && r == 3 ? 2 : 0);
        EXPECT_EQ(fp.sharded_size, std::vector<int64_t>{w == 2 ? 5 : 3});
        ExpectInfos(fp.shard_param_infos, (w == 2 ? kSeedW2 : kSeedW4)[r], "rank " + std::to_string(r));
        const FlatParamShardMetadata m = h.ShardMetadata();
        std::vector<std::string> want_names;
        for (size_t i = 0; i < 2; ++i) {
          if ((w == 2 ? kSeedW2 : kSeedW4)[r][i].in) want_names.push_back(i == 0 ? "a.w" : "b.w");
        }
        EXPECT_EQ(m.param_names, want_names);
        EXPECT_EQ(h.FqnsInShard(), want_names);
        // Without use_orig_params the originals expose no data while sharded.
        EXPECT_EQ(t.aw.numel(), 0);

        h.InitFlatParamAttributes();
        EXPECT_EQ(fp.full_param_padded.storage().nbytes(), 0u);
        EXPECT_EQ(fp.padded_unsharded_size, std::vector<int64_t>{w == 2 ? 10 : 12});
        const c10::StorageImpl* storage = fp.full_param_padded.storage().unsafeGetStorageImpl();
        for (int round = 0; round < 2; ++round) {
          EXPECT_TRUE(h.NeedsUnshard());
          h.PreUnshard();
          h.Unshard();
          h.PostUnshard();
          EXPECT_FALSE(h.NeedsUnshard());
          EXPECT_EQ(fp.param.numel(), 10);
          EXPECT_TRUE(at::equal(t.aw, t.aw0)) << "round " << round;
          EXPECT_TRUE(at::equal(t.bw, t.bw0)) << "round " << round;
          EXPECT_EQ(t.aw.sizes(), t.aw0.sizes());
          // The originals are views into the all-gather output, re-allocated in place.
          EXPECT_EQ(fp.full_param_padded.storage().unsafeGetStorageImpl(), storage);
          EXPECT_EQ(t.aw.storage().unsafeGetStorageImpl(), storage);
          EXPECT_EQ(t.aw.data_ptr<float>(), fp.full_param_padded.data_ptr<float>());
          EXPECT_EQ(t.bw.data_ptr<float>(), fp.full_param_padded.data_ptr<float>() + 6);
          EXPECT_EQ(fp.param.data_ptr<float>(), fp.full_param_padded.data_ptr<float>());
          h.Reshard(/*free_unsharded_flat_param=*/true);
          h.PostReshard();
          EXPECT_EQ(fp.full_param_padded.storage().nbytes(), 0u);  // PyTorch's _check_storage_freed
          EXPECT_TRUE(at::equal(fp.param.detach(), Floats((w == 2 ? kSeedShardsW2 : kSeedShardsW4)[r])));
          EXPECT_EQ(t.aw.numel(), 0);  // nothing points into the freed storage
        }
        // Reshard without freeing keeps the unsharded data: the next unshard is a no-op switch.
        h.Unshard();
        h.Reshard(false);
        EXPECT_FALSE(h.NeedsUnshard());
        h.Unshard();
        EXPECT_TRUE(at::equal(t.bw, t.bw0));
      });
    }
  }
}

TEST(FlatParamHandle, NoShardKeepsTheWholeFlatParameter) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Tree t = MakeTree({2, 3}, {4});
    FlatParamHandle h({t.aw, t.bw}, *t.root, Options(pg, HandleShardingStrategy::NO_SHARD));
    h.Shard();
    FlatParameter& fp = h.flat_param();
    EXPECT_EQ(fp.sharded_size, std::vector<int64_t>{10});
    EXPECT_EQ(fp.shard_numel_padded, 0);
    ExpectInfos(fp.shard_param_infos, {{true, 0, 6, 0, 5}, {true, 6, 4, 0, 3}}, "NO_SHARD");
    h.InitFlatParamAttributes();
    EXPECT_FALSE(h.NeedsUnshard());
    h.Unshard();
    EXPECT_TRUE(at::equal(t.aw, t.aw0));
    EXPECT_EQ(t.bw.data_ptr<float>(), fp.param.data_ptr<float>() + 6);
    // Gradient: all-reduce mean of (rank + 1) * 1 = (1 + 2) / 2.
    t.aw.mutable_grad() = at::full({2, 3}, pg->rank() + 1.0f);
    t.bw.mutable_grad() = at::full({4}, 2 * (pg->rank() + 1.0f));
    ASSERT_TRUE(h.FlattenOrigGrads());
    h.Reshard(false);
    at::Tensor g = h.ReduceScatterGrad();
    EXPECT_TRUE(at::allclose(g, Floats({1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 3, 3, 3, 3})));
    EXPECT_TRUE(fp.param.grad().is_same(g));
    EXPECT_TRUE(at::equal(t.aw, t.aw0));
  });
}

TEST(FlatParamHandle, AlignedUseOrigParamsPaddingAndShardedViews) {
  for (int w : {2, 4}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, w, [w](const comm::ProcessGroupPtr& pg) {
      Tree t = MakeTree({3}, {5});  // p0 = 1..3, p1 = 4..8
      FlatParamHandle h({t.aw, t.bw}, *t.root, Options(pg, HandleShardingStrategy::FULL_SHARD, true));
      FlatParameter& fp = h.flat_param();
      EXPECT_EQ(h.aligned_numel(), 4);
      const int64_t tail = w == 2 ? 1 : 3;
      EXPECT_EQ(fp.numels_with_padding, (std::vector<int64_t>{3, 1, 5, tail}));
      EXPECT_EQ(fp.is_padding_mask, (std::vector<bool>{false, true, false, true}));
      EXPECT_EQ(fp.numels, (std::vector<int64_t>{3, 5}));
      std::vector<float> flat = {1, 2, 3, 42, 4, 5, 6, 7, 8};
      for (int64_t i = 0; i < tail; ++i) flat.push_back(42);  // _FLAT_PARAM_PADDING_VALUE
      EXPECT_TRUE(at::equal(fp.param.detach(), Floats(flat)));
      // Aligned views skip the padding; unaligned ones would not fit the padded tensor.
      auto views = h.GetUnflatViewsAligned();
      EXPECT_TRUE(at::equal(views[1], t.bw0));
      EXPECT_ERROR_CONTAINS(h.GetUnflatViewsUnaligned(), "expects a 1-D tensor of 8 elements");

      h.Shard();
      const int r = pg->rank();
      const int64_t chunk = w == 2 ? 5 : 3;
      EXPECT_TRUE(at::equal(fp.param.detach(),
                            Floats(std::vector<float>(flat.begin() + r * chunk, flat.begin() + (r + 1) * chunk))));
      EXPECT_EQ(fp.shard_numel_padded, 0);
      const auto& table = (w == 2 ? kAlignedW2 : kAlignedW4)[r];
      ExpectInfos(fp.shard_param_infos, table, "rank " + std::to_string(r));
      // _use_sharded_views: flattened views of the local shard, size-0 outside it.
      const at::Tensor origs[2] = {t.aw, t.bw};
      const at::Tensor orig0[2] = {t.aw0, t.bw0};
      for (int i = 0; i < 2; ++i) {
        if (!table[i].in) {
          EXPECT_EQ(origs[i].numel(), 0) << i;
          continue;
        }
        EXPECT_EQ(origs[i].sizes().vec(), std::vector<int64_t>{table[i].n}) << i;
        EXPECT_EQ(origs[i].data_ptr<float>(), fp.param.data_ptr<float>() + table[i].off) << i;
        EXPECT_TRUE(at::equal(origs[i], orig0[i].flatten().narrow(0, table[i].s, table[i].n))) << i;
      }
      h.InitFlatParamAttributes();
      EXPECT_FALSE(h.PreUnshard());  // no writeback needed, nothing to cast
      h.Unshard();
      EXPECT_TRUE(at::equal(t.aw, t.aw0));
      EXPECT_TRUE(at::equal(t.bw, t.bw0));
      EXPECT_EQ(t.bw.data_ptr<float>(), fp.full_param_padded.data_ptr<float>() + 4);  // 16-byte aligned
      h.Reshard(true);
      EXPECT_EQ(fp.full_param_padded.storage().nbytes(), 0u);
      for (int i = 0; i < 2; ++i) EXPECT_EQ(origs[i].numel(), table[i].in ? table[i].n : 0) << i;
    });
  }
}

TEST(FlatParamHandle, WritebackOfChangedOriginalParameters) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Tree t = MakeTree({3}, {5});
    FlatParamHandle h({t.aw, t.bw}, *t.root, Options(pg, HandleShardingStrategy::FULL_SHARD, true));
    h.Shard();
    h.InitFlatParamAttributes();
    // Each rank gives its sharded views new storage holding 10x the values.
    for (at::Tensor p : {t.aw, t.bw}) {
      if (p.numel() > 0) p.set_data(p.detach().clone() * 10);
    }
    EXPECT_TRUE(h.PreUnshard());
    h.Unshard();
    EXPECT_TRUE(at::equal(t.aw, t.aw0 * 10));
    EXPECT_TRUE(at::equal(t.bw, t.bw0 * 10));
    h.Reshard(true);
    // An in-place change of a view needs no writeback.
    at::Tensor p = t.bw;  // in both ranks' shards
    {
      at::NoGradGuard g;
      p.add_(1);
    }
    EXPECT_FALSE(h.PreUnshard());
    h.Unshard();
    EXPECT_TRUE(at::equal(t.bw, t.bw0 * 10 + 1));
    // Gradient writeback (sharded, W=2, chunk 5): rank 0 holds p0 at [0, 3) and p1[0] at 4,
    // rank 1 holds p1[1..4] at [0, 4). A new gradient on rank 0's p0 lands in a zero flat
    // gradient; p1 (no gradient) is zeroed there and marked in is_grad_none_mask.
    h.Reshard(true);
    if (pg->rank() == 0) t.aw.mutable_grad() = at::full({3}, 5.0f);
    EXPECT_FALSE(h.PreUnshard());
    const FlatParameter& fp = h.flat_param();
    if (pg->rank() == 0) {
      EXPECT_TRUE(at::equal(fp.param.grad(), Floats({5, 5, 5, 0, 0})));
      EXPECT_EQ(fp.is_grad_none_mask, (std::vector<bool>{false, true}));
    } else {
      EXPECT_FALSE(fp.param.grad().defined());
    }
  });
}

TEST(FlatParamHandle, TiedParametersAreFlattenedOnce) {
  auto pg = comm::CreateFakeProcessGroup(0, 1);
  auto root = std::make_shared<torch::nn::Module>();
  auto a = root->register_module("a", std::make_shared<torch::nn::Module>());
  auto b = root->register_module("b", std::make_shared<torch::nn::Module>());
  auto c = root->register_module("c", std::make_shared<torch::nn::Module>());
  // a.w is non-contiguous: flattening follows its logical order (torch.flatten copies).
  at::Tensor tied = a->register_parameter("w", at::arange(6, at::kFloat).view({3, 2}).t());
  b->register_parameter("w", tied);
  at::Tensor cw = c->register_parameter("w", at::arange(10, 13, at::kFloat));
  const at::Tensor tied0 = tied.detach().clone();
  FlatParamHandle h({tied, cw}, *root, Options(pg));
  FlatParameter& fp = h.flat_param();
  EXPECT_EQ(fp.num_params, 2);
  EXPECT_EQ(fp.fqns, (std::vector<std::string>{"a.w", "c.w"}));
  EXPECT_EQ(fp.param.numel(), 9);
  EXPECT_EQ(fp.strides[0], (std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(at::equal(fp.param.detach(), Floats({0, 2, 4, 1, 3, 5, 10, 11, 12})));
  ASSERT_EQ(fp.shared_param_infos.size(), 1u);
  const SharedParamInfo& s = fp.shared_param_infos[0];
  EXPECT_EQ(s.param_name, "w");
  EXPECT_EQ(s.module, b.get());
  EXPECT_EQ(s.module_name, "b");
  EXPECT_EQ(s.prim_param_name, "w");
  EXPECT_EQ(s.prim_module, a.get());
  EXPECT_EQ(s.prim_module_name, "a");
  EXPECT_EQ(fp.modules.size(), 3u);
  h.Shard();
  h.InitFlatParamAttributes();
  h.Unshard();
  EXPECT_TRUE(at::equal(tied, tied0));
  EXPECT_TRUE(tied.is_contiguous());
  EXPECT_TRUE(b->named_parameters(false)["w"].is_same(tied));
}

TEST(FlatParamHandle, ReduceScatterGradIsTheMeanOverRanks) {
  for (int w : {3, 4}) {
    for (bool use_orig_params : {false, true}) {
      fsdp::testing::RunOnRanks(Backend::kThreaded, w, [w, use_orig_params](const comm::ProcessGroupPtr& pg) {
        Tree t = MakeTree({2, 3}, {4});
        FlatParamHandle h({t.aw, t.bw}, *t.root, Options(pg, HandleShardingStrategy::FULL_SHARD, use_orig_params));
        h.Shard();
        h.InitFlatParamAttributes();
        h.Unshard();
        auto grad_of = [](int rank) {  // rank r's flat gradient (a.w then b.w), in double
          return at::cat({at::arange(1, 7, at::kDouble) * (rank + 1), at::full({4}, 100.0 * (rank + 1), at::kDouble)});
        };
        const at::Tensor mine = grad_of(pg->rank()).to(at::kFloat);
        t.aw.mutable_grad() = mine.narrow(0, 0, 6).view({2, 3}).clone();
        t.bw.mutable_grad() = mine.narrow(0, 6, 4).clone();
        ASSERT_TRUE(h.FlattenOrigGrads());
        EXPECT_FALSE(t.aw.grad().defined());
        h.set_training_state(HandleTrainingState::BACKWARD_POST);
        h.Reshard(true);
        at::Tensor sharded = h.ReduceScatterGrad();
        // Direct: the mean over ranks of the (aligned: padded) flat gradients, chunked.
        at::Tensor mean = at::zeros({10}, at::kDouble);
        for (int r = 0; r < w; ++r) mean += grad_of(r);
        mean /= w;
        std::vector<float> padded_flat;
        const int64_t total = h.flat_param().unpadded_unsharded_size[0];
        if (use_orig_params) {  // aligned: a.w [0,6), pad 2, b.w [8,12), then pad to W
          for (int i = 0; i < 6; ++i) padded_flat.push_back(mean[i].item<double>());
          padded_flat.insert(padded_flat.end(), {0, 0});
          for (int i = 6; i < 10; ++i) padded_flat.push_back(mean[i].item<double>());
        } else {
          for (int i = 0; i < 10; ++i) padded_flat.push_back(mean[i].item<double>());
        }
        while (static_cast<int64_t>(padded_flat.size()) < total) padded_flat.push_back(0);
        const int64_t chunk = (total + w - 1) / w;
        padded_flat.resize(chunk * w, 0);
        const at::Tensor want = Floats(std::vector<float>(padded_flat.begin() + pg->rank() * chunk,
                                                          padded_flat.begin() + (pg->rank() + 1) * chunk));
        // The ranks' gradients averaged by the reduce-scatter vs in double here: a few float32 ulps
        // (2^-23) of order-1 values; 1e-5 absolute (~80 ulps).
        EXPECT_TRUE(at::allclose(sharded, want, 1e-6, 1e-5)) << sharded << want;
        EXPECT_EQ(sharded.scalar_type(), at::kFloat);
        h.set_training_state(HandleTrainingState::IDLE);
        h.PrepareGradientForOptim();
        EXPECT_TRUE(h.flat_param().param.grad().is_same(sharded));
        if (use_orig_params) {
          h.UseShardedGradViews();
          const auto& infos = h.flat_param().shard_param_infos;
          const at::Tensor origs[2] = {t.aw, t.bw};
          for (int i = 0; i < 2; ++i) {
            if (!infos[i].in_shard) {
              EXPECT_FALSE(origs[i].grad().defined());
              continue;
            }
            EXPECT_TRUE(
                at::equal(origs[i].grad(), sharded.narrow(0, infos[i].offset_in_shard, infos[i].numel_in_shard)));
          }
        }
      });
    }
  }
}

// PyTorch's _accumulate_sharded_grad check: a saved sharded gradient of another shape is an
// error, not a broadcast or a silent overwrite.
TEST(FlatParamHandle, AccumulatingAShardedGradientOfTheWrongShapeIsAnError) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Tree t = MakeTree({2, 3}, {4});
    FlatParamHandle h({t.aw, t.bw}, *t.root, Options(pg));
    h.Shard();
    h.InitFlatParamAttributes();
    h.Unshard();
    t.aw.mutable_grad() = at::ones({2, 3});
    t.bw.mutable_grad() = at::ones({4});
    ASSERT_TRUE(h.FlattenOrigGrads());
    h.set_training_state(HandleTrainingState::BACKWARD_POST);
    h.Reshard(true);
    h.flat_param().saved_grad_shard = at::zeros({7});  // a chunk is 5 elements
    EXPECT_ERROR_CONTAINS(
        h.ReduceScatterGrad(),
        "Shape mismatch when accumulating gradients: existing gradient shape=[7] new gradient shape=[5]");
  });
}

TEST(FlatParamHandle, HybridShardReducesOverShardAndReplicaGroups) {
  // World 4 as 2 replicas x 2 shards: shard groups {0,1}, {2,3}; replica groups {0,2}, {1,3}.
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& world) {
    auto g01 = world->new_subgroup({0, 1});
    auto g23 = world->new_subgroup({2, 3});
    auto g02 = world->new_subgroup({0, 2});
    auto g13 = world->new_subgroup({1, 3});
    const int r = world->rank();
    auto shard = r < 2 ? g01 : g23;
    auto replica = r % 2 == 0 ? g02 : g13;
    Tree t = MakeTree({2, 3}, {4});
    FlatParamHandle h({t.aw, t.bw}, *t.root, Options(shard, HandleShardingStrategy::HYBRID_SHARD));
    h.Shard();
    h.InitFlatParamAttributes();
    h.Unshard();
    t.aw.mutable_grad() = at::full({2, 3}, 1.0f + r);
    t.bw.mutable_grad() = at::full({4}, 10.0f * (1 + r));
    ASSERT_TRUE(h.FlattenOrigGrads());
    h.Reshard(true);
    EXPECT_ERROR_CONTAINS(h.ReduceScatterGrad(), "inter_node_group must be given exactly for hybrid strategies");
    at::Tensor g = h.ReduceScatterGrad(replica);
    // Mean over all 4 ranks: a.w (1+2+3+4)/4 = 2.5, b.w 25; shard rank s holds [5s, 5s+5).
    const std::vector<float> mean = {2.5, 2.5, 2.5, 2.5, 2.5, 2.5, 25, 25, 25, 25};
    const int s = shard->rank();
    EXPECT_TRUE(at::allclose(g, Floats(std::vector<float>(mean.begin() + 5 * s, mean.begin() + 5 * s + 5))));
  });
}

TEST(FlatParamHandle, ParamMixedPrecisionGathersLowPrecision) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Tree t = MakeTree({2, 3}, {4});
    FlatParamHandleOptions o = Options(pg);
    o.mp_param_dtype = at::kBFloat16;
    FlatParamHandle h({t.aw, t.bw}, *t.root, o);
    EXPECT_EQ(h.reduce_dtype(), at::kBFloat16);  // inferred from param_dtype
    h.Shard();
    h.InitFlatParamAttributes();
    FlatParameter& fp = h.flat_param();
    EXPECT_EQ(fp.full_param_padded.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(h.PreUnshard());
    EXPECT_EQ(fp.param.scalar_type(), at::kBFloat16);  // the low precision shard
    h.Unshard();
    h.PostUnshard();
    EXPECT_EQ(fp.mp_shard.storage().nbytes(), 0u);
    EXPECT_EQ(t.aw.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(t.aw, t.aw0.to(at::kBFloat16)));
    t.aw.mutable_grad() = at::full({2, 3}, 1.0f + pg->rank(), at::kBFloat16);
    t.bw.mutable_grad() = at::full({4}, 3.0f, at::kBFloat16);
    ASSERT_TRUE(h.FlattenOrigGrads());
    h.Reshard(true);
    EXPECT_EQ(fp.param.scalar_type(), at::kFloat);
    at::Tensor g = h.ReduceScatterGrad();
    EXPECT_EQ(g.scalar_type(), at::kFloat);  // cast back to the parameter dtype
    const std::vector<float> want =
        pg->rank() == 0 ? std::vector<float>{1.5, 1.5, 1.5, 1.5, 1.5} : std::vector<float>{1.5, 3, 3, 3, 3};
    EXPECT_TRUE(at::allclose(g, Floats(want)));
  });
}

TEST(FlatParamHandle, SeedErrorPaths) {
  auto pg = comm::CreateFakeProcessGroup(0, 2);
  Tree t = MakeTree({2, 3}, {4});
  EXPECT_ERROR_CONTAINS(FlatParamHandle({}, *t.root, Options(pg)),
                        "Cannot construct a FlatParamHandle with an empty parameter list");
  EXPECT_ERROR_CONTAINS(FlatParamHandle({t.aw}, *t.root, Options(nullptr)), "process_group must not be null");
  {
    auto m = std::make_shared<torch::nn::Module>();
    at::Tensor i = m->register_parameter("i", at::arange(3), /*requires_grad=*/false);
    EXPECT_ERROR_CONTAINS(FlatParamHandle({i}, *m, Options(pg)),
                          "Cannot flatten integer dtype tensors (tensor 0 has dtype Long)");
    at::Tensor d = m->register_parameter("d", at::ones({2}, at::kDouble));
    EXPECT_ERROR_CONTAINS(FlatParamHandle({d, t.aw}, *m, Options(pg)),
                          "Must flatten tensors with uniform dtype but got Double and Float (tensor 1)");
    at::Tensor frozen = m->register_parameter("frozen", at::ones({2}, at::kDouble), /*requires_grad=*/false);
    EXPECT_ERROR_CONTAINS(FlatParamHandle({d, frozen}, *m, Options(pg)),
                          "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False` (tensor 1 "
                          "has requires_grad=False)");
    // use_orig_params permits it; the flat parameter requires grad if any original does.
    FlatParamHandle ok({d, frozen}, *m, Options(pg, HandleShardingStrategy::FULL_SHARD, true));
    EXPECT_TRUE(ok.flat_param().param.requires_grad());
    at::Tensor meta =
        m->register_parameter("meta", at::empty({2}, at::TensorOptions().dtype(at::kDouble).device(at::kMeta)));
    EXPECT_ERROR_CONTAINS(FlatParamHandle({d, meta}, *m, Options(pg)),
                          "Must flatten tensors on the same device but got both cpu and meta (tensor 1)");
  }
  EXPECT_ERROR_CONTAINS(FlatParamHandle({at::ones({2}, at::kFloat)}, *t.root, Options(pg)),
                        "`params` were not found in `module`'s tree");
  EXPECT_ERROR_CONTAINS(MakeFlatSegments({3}, -1, 2), "Expects non-negative `aligned_numel` but got -1");
  EXPECT_ERROR_CONTAINS(FlatShardParamInfos({}, 0, -1), "unsharded_start_idx: 0 unsharded_end_idx: -1");

  FlatParamHandle h({t.aw, t.bw}, *t.root, Options(pg, HandleShardingStrategy::FULL_SHARD, true));
  EXPECT_ERROR_CONTAINS(h.FlattenTensors({}, 0), "Expects non-empty `tensors`");
  EXPECT_ERROR_CONTAINS(h.FlattenTensors({t.aw0}, -4), "Expects non-negative `aligned_numel` but got -4");
  // flatten_tensors with the handle's alignment reproduces the flat parameter.
  EXPECT_TRUE(at::equal(h.FlattenTensors({t.aw0, t.bw0}, h.aligned_numel()), h.flat_param().param.detach()));
  EXPECT_ERROR_CONTAINS(h.Unshard(), "call Shard() first");
  EXPECT_ERROR_CONTAINS(h.ReduceScatterGrad(), "flat_param.grad is undefined");
  h.Shard();
  EXPECT_ERROR_CONTAINS(h.Shard(), "is already sharded");
  EXPECT_ERROR_CONTAINS(h.Unshard(), "call Shard() and InitFlatParamAttributes() first");
  h.InitFlatParamAttributes();
  // Rank 0 of 2 holds all of a.w (padded flat 12 elements: chunk 6 = a.w): a wrong shape
  // cannot be written back.
  ASSERT_EQ(t.aw.numel(), 6);
  t.aw.set_data(at::zeros({7}));
  EXPECT_ERROR_CONTAINS(h.PreUnshard(),
                        "Cannot writeback when the parameter shape changes\nExpects [6] but got [7] (a.w)");
}

// StreamAlias is what at::from_blob makes over the tensor's memory: the same bytes, sizes,
// strides and keys through a storage of its own that owns nothing, so the memory it reads
// stays where it was when the host re-allocates the tensor's storage in place.
TEST(StreamAlias, IsFromBlobOverTheSameMemory) {
  const at::Tensor base = at::arange(24, at::kFloat);
  for (const at::Tensor& t : {base, base.view({4, 6}).t(), base.narrow(0, 5, 7), base.to(at::kDouble)}) {
    const at::Tensor ours = StreamAlias(t);
    const at::Tensor reference = at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options());
    EXPECT_EQ(ours.data_ptr(), t.data_ptr());
    EXPECT_EQ(ours.sizes(), reference.sizes());
    EXPECT_EQ(ours.strides(), reference.strides());
    EXPECT_EQ(ours.storage().nbytes(), reference.storage().nbytes());
    EXPECT_EQ(ours.scalar_type(), t.scalar_type());
    EXPECT_EQ(ours.key_set(), reference.key_set());
    EXPECT_TRUE(at::equal(ours, t));
    EXPECT_NE(ours.storage().unsafeGetStorageImpl(), t.storage().unsafeGetStorageImpl());
  }
  // The host swaps the storage's memory in place (FreeStorageAfterStreams hands the old
  // memory to the streams, held here): the alias keeps reading the old memory.
  at::Tensor buffer = at::full({8}, 3.0);
  const at::Tensor alias = StreamAlias(buffer);
  c10::StorageImpl* storage = buffer.storage().unsafeGetStorageImpl();
  const c10::DataPtr old = storage->set_data_ptr(storage->allocator()->allocate(storage->nbytes()));
  buffer.fill_(5.0);
  EXPECT_EQ(alias.data_ptr(), old.get());
  EXPECT_EQ(alias.sum().item<double>(), 24.0);
  EXPECT_EQ(buffer.sum().item<double>(), 40.0);
  EXPECT_FALSE(StreamAlias(at::Tensor()).defined());
}

}  // namespace
}  // namespace fsdp::fsdp1
