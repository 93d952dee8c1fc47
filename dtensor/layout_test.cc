// Golden tests of the per-rank layout: the expected rows are literal tables or torch.chunk
// applied to an arange, never the code under test.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor_spec.h"
#include "dtensor/placement.h"
#include "testing/expect_error.h"

namespace fsdp::dtensor {
namespace {

using P = Placement;

// The global row indices the rank at `coordinate` holds along tensor dim `dim`.
std::vector<int64_t> Rows(const std::vector<int64_t>& shape, const std::vector<int64_t>& mesh,
                          const std::vector<int64_t>& coordinate, const Placements& placements, int dim) {
  std::vector<int64_t> rows;
  const auto runs = LocalSegments(shape, mesh, coordinate, placements);
  for (const Segment& s : runs[dim]) {
    for (int64_t i = 0; i < s.length; ++i) rows.push_back(s.start + i);
  }
  return rows;
}

std::vector<int64_t> ChunkRows(int64_t n, int64_t pieces, int64_t index) {
  const auto chunks = at::arange(n, at::kLong).chunk(pieces);
  if (index >= static_cast<int64_t>(chunks.size())) return {};
  const at::Tensor c = chunks[index].contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

TEST(LayoutTest, ShardFollowsTorchChunkIncludingEmptyShards) {
  for (int64_t n : {0, 1, 5, 6, 7, 13}) {
    for (int64_t w : {1, 2, 3, 4, 8}) {
      for (int64_t r = 0; r < w; ++r) {
        EXPECT_EQ(Rows({n, 3}, {w}, {r}, {P::Shard(0)}, 0), ChunkRows(n, w, r))
            << "n=" << n << " w=" << w << " r=" << r;
      }
    }
  }
}

TEST(LayoutTest, LiteralShapesAndOffsetsOn1DMesh) {
  // 5 rows on 4 ranks: chunk 2 -> sizes 2, 2, 1, 0; the empty shard's offset is the size.
  const std::vector<int64_t> sizes = {2, 2, 1, 0}, offsets = {0, 2, 4, 5};
  for (int64_t r = 0; r < 4; ++r) {
    const auto got = ComputeLocalShapeAndGlobalOffset({5, 3}, {4}, {r}, {P::Shard(0)});
    EXPECT_EQ(got.shape, (std::vector<int64_t>{sizes[r], 3}));
    EXPECT_EQ(got.offset, (std::vector<int64_t>{offsets[r], 0}));
  }
  // 6 rows on 4 ranks: chunk 2 -> 2, 2, 2, 0 (torch.chunk makes only 3 chunks).
  EXPECT_EQ(ComputeLocalShapeAndGlobalOffset({6}, {4}, {3}, {P::Shard(0)}).shape, std::vector<int64_t>{0});
  EXPECT_EQ(ComputeLocalShapeAndGlobalOffset({6}, {4}, {3}, {P::Shard(0)}).offset, std::vector<int64_t>{6});
  // Replicate and Partial hold everything.
  EXPECT_EQ(ComputeLocalShapeAndGlobalOffset({5, 3}, {4}, {2}, {P::Replicate()}).shape, (std::vector<int64_t>{5, 3}));
  EXPECT_EQ(ComputeLocalShapeAndGlobalOffset({5, 3}, {4}, {2}, {P::Partial()}).offset, (std::vector<int64_t>{0, 0}));
}

TEST(LayoutTest, TwoDimMeshShardsNestLeftToRight) {
  // (Shard(0), Shard(0)) on 2x2 over 5 rows: [0,3) | [3,5), then each halved.
  const std::vector<std::vector<int64_t>> expected = {{0, 1}, {2}, {3}, {4}};
  for (int64_t a = 0; a < 2; ++a) {
    for (int64_t b = 0; b < 2; ++b) {
      EXPECT_EQ(Rows({5, 7}, {2, 2}, {a, b}, {P::Shard(0), P::Shard(0)}, 0), expected[a * 2 + b]);
    }
  }
  // (Shard(0), Shard(1)) on 2x3 over [5, 7]: rows by mesh dim 0, columns by mesh dim 1.
  for (int64_t a = 0; a < 2; ++a) {
    for (int64_t b = 0; b < 3; ++b) {
      const auto got = ComputeLocalShapeAndGlobalOffset({5, 7}, {2, 3}, {a, b}, {P::Shard(0), P::Shard(1)});
      EXPECT_EQ(got.shape, (std::vector<int64_t>{a == 0 ? 3 : 2, b == 2 ? 1 : 3}));
      EXPECT_EQ(got.offset, (std::vector<int64_t>{a * 3, b * 3}));
    }
  }
  // Negative dims are normalized by ValidatePlacements.
  const Placements normalized = ValidatePlacements({P::Shard(-1), P::Replicate()}, 2, 3, "test");
  EXPECT_EQ(normalized[0], P::Shard(2));
}

TEST(LayoutTest, StridedShardInterleavesPieces) {
  // PyTorch 2.15's _StridedShard: torch.chunk into sf pieces, each piece into N chunks; rank
  // c holds chunk c of every piece. (Values printed by PyTorch 2.15's
  // _StridedShard(0, split_factor=sf)._split_tensor(torch.arange(n), N).)
  // 12 rows, 2 ranks, sf 3: pieces [0,4) [4,8) [8,12), each in halves.
  EXPECT_EQ(Rows({12}, {2}, {0}, {P::StridedShard(0, 3)}, 0), (std::vector<int64_t>{0, 1, 4, 5, 8, 9}));
  EXPECT_EQ(Rows({12}, {2}, {1}, {P::StridedShard(0, 3)}, 0), (std::vector<int64_t>{2, 3, 6, 7, 10, 11}));
  // 7 rows, 2 ranks, sf 2: pieces [0,4) [4,7).
  EXPECT_EQ(Rows({7}, {2}, {0}, {P::StridedShard(0, 2)}, 0), (std::vector<int64_t>{0, 1, 4, 5}));
  EXPECT_EQ(Rows({7}, {2}, {1}, {P::StridedShard(0, 2)}, 0), (std::vector<int64_t>{2, 3, 6}));
  // 3 rows, 2 ranks, sf 3: three one-row pieces, each all on rank 0.
  EXPECT_EQ(Rows({3}, {2}, {0}, {P::StridedShard(0, 3)}, 0), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(Rows({3}, {2}, {1}, {P::StridedShard(0, 3)}, 0), (std::vector<int64_t>{}));
  // The example: arange(13), StridedShard(0, 2) on 4 ranks: rank 0 holds [0, 1, 7, 8]
  // (cutting 8 equal pieces would give [0, 1, 8, 9]).
  EXPECT_EQ(Rows({13}, {4}, {0}, {P::StridedShard(0, 2)}, 0), (std::vector<int64_t>{0, 1, 7, 8}));
  EXPECT_EQ(Rows({13}, {4}, {3}, {P::StridedShard(0, 2)}, 0), (std::vector<int64_t>{6}));
  // A StridedShard alone: the local size and the first row, as PyTorch (not an error).
  const auto alone = ComputeLocalShapeAndGlobalOffset({12}, {2}, {1}, {P::StridedShard(0, 3)});
  EXPECT_EQ(alone.shape, std::vector<int64_t>{6});
  EXPECT_EQ(alone.offset, std::vector<int64_t>{2});
  const auto empty = ComputeLocalShapeAndGlobalOffset({3}, {2}, {1}, {P::StridedShard(0, 3)});
  EXPECT_EQ(empty.shape, std::vector<int64_t>{0});
  EXPECT_EQ(empty.offset, std::vector<int64_t>{3});
  // (18, 2) with [StridedShard(0, 2), Shard(0)] on 2 x 2: coordinate [0, 1] starts at row 9.
  EXPECT_EQ(ComputeLocalShapeAndGlobalOffset({18, 2}, {2, 2}, {0, 1}, {P::StridedShard(0, 2), P::Shard(0)}).offset,
            (std::vector<int64_t>{9, 0}));
}

TEST(LayoutTest, StridedShardThenShardIsFsdpOfATensorParallelShard) {
  // FSDP (dp, size D) over TP (tp, size T) on dim 0: tp rank t holds chunk t of T, dp rank
  // d holds chunk d of that. (StridedShard(0, T), Shard(0)) on the (dp, tp) mesh must
  // give the same block, also for the uneven Linear(9, 18) / Linear(9, 27) weights of the
  // issue (not for every uneven size: PyTorch 2.15's layout is the reference, see
  // dtensor/golden_layout_test.cc).
  for (int64_t d_size : {2, 3}) {
    for (int64_t t_size : {2, 3}) {
      for (int64_t n : {d_size * t_size * 2, int64_t{9}, int64_t{18}, int64_t{27}}) {
        for (int64_t d = 0; d < d_size; ++d) {
          for (int64_t t = 0; t < t_size; ++t) {
            const auto tp_rows = ChunkRows(n, t_size, t);
            std::vector<int64_t> expected;
            const auto within = ChunkRows(static_cast<int64_t>(tp_rows.size()), d_size, d);
            for (int64_t i : within) expected.push_back(tp_rows[i]);
            const auto got = ComputeLocalShapeAndGlobalOffset({n, 4}, {d_size, t_size}, {d, t},
                                                              {P::StridedShard(0, t_size), P::Shard(0)});
            EXPECT_EQ(got.shape[0], static_cast<int64_t>(expected.size()));
            EXPECT_EQ(got.offset[0], expected.empty() ? n : expected.front());
            EXPECT_EQ(Rows({n, 4}, {d_size, t_size}, {d, t}, {P::StridedShard(0, t_size), P::Shard(0)}, 0), expected)
                << "n=" << n << " dp=" << d_size << " tp=" << t_size << " at [" << d << ", " << t << "]";
          }
        }
      }
    }
  }
}

TEST(LayoutTest, PlacementValidationAndPrinting) {
  EXPECT_ERROR_CONTAINS(ValidatePlacements({P::Shard(2)}, 1, 2, "from_local"),
                        "shard dim 2 of placement 0 (Shard(dim=2)) is out of range for a 2-D");
  EXPECT_ERROR_CONTAINS(ValidatePlacements({P::Shard(-3)}, 1, 2, "from_local"), "out of range");
  EXPECT_ERROR_CONTAINS(ValidatePlacements({P::Shard(0)}, 2, 2, "from_local"),
                        "got 1 placements (Shard(dim=0)) for a 2-D mesh");
  EXPECT_ERROR_CONTAINS(P::StridedShard(0, 0), "split_factor must be >= 1, got 0");
  EXPECT_ERROR_CONTAINS(P::Replicate().dim(), "Replicate() is not a shard placement");
  EXPECT_EQ(ToString({P::Shard(1), P::Partial(comm::ReduceOp::Max()), P::StridedShard(0, 2)}),
            "(Shard(dim=1), Partial(MAX), StridedShard(dim=0, sf=2))");
  EXPECT_TRUE(P::StridedShard(0, 2).is_shard(0));
  EXPECT_NE(P::Shard(0), P::StridedShard(0, 2));
}

}  // namespace
}  // namespace fsdp::dtensor
