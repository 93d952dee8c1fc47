// Ring attention against attention over the whole sequence on one rank: values and gradients
// of q, k, v, causal (head-tail load balanced and not) and not, both rotate methods, GQA, 2 and
// 4 ranks, bfloat16 merged in either precision; the backward node under retain_graph; the
// collectives each rotate method issues; the load balancer's layout; errors.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <cmath>
#include <ostream>
#include <string>

#include "comm/comm_trace.h"
#include "context_parallel/load_balancer.h"
#include "context_parallel/ring_attention.h"
#include "testing/expect_error.h"
#include "testing/float_tolerance.h"
#include "testing/golden_file.h"
#include "testing/multi_rank.h"

namespace fsdp::context_parallel {
namespace {

using fsdp::testing::Backend;
using fsdp::testing::RunOnRanks;

struct Case {
  std::string name;
  int world;
  bool causal, balanced;
  RotateMethod rotate;
  int64_t heads = 4, kv_heads = 4;
  friend void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }
};

constexpr int64_t kBatch = 2, kSeq = 32, kDim = 16;

struct Inputs {
  at::Tensor q, k, v, grad_out;
};

Inputs MakeInputs(int64_t heads, int64_t kv_heads) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(17);
  return {at::randn({kBatch, heads, kSeq, kDim}, gen), at::randn({kBatch, kv_heads, kSeq, kDim}, gen),
          at::randn({kBatch, kv_heads, kSeq, kDim}, gen), at::randn({kBatch, heads, kSeq, kDim}, gen)};
}

// The reference and the magnitudes the tolerance scales with, in float64 over the whole
// sequence (k, v repeated to q's heads; their gradients summed back over each group).
struct Reference {
  at::Tensor out, dq, dk, dv;                  // values
  at::Tensor out_mag, dq_mag, dk_mag, dv_mag;  // sums of |terms| of each value
};

at::Tensor SumGroups(const at::Tensor& t, int64_t kv_heads) {
  return t.reshape({t.size(0), kv_heads, -1, t.size(2), t.size(3)}).sum(2);
}

Reference MakeReferenceOfLength(const Inputs& in, bool causal, int64_t seq) {
  const int64_t rep = in.q.size(1) / in.k.size(1), kv_heads = in.k.size(1);
  const at::Tensor q = in.q.to(at::kDouble), k = in.k.to(at::kDouble).repeat_interleave(rep, 1);
  const at::Tensor v = in.v.to(at::kDouble).repeat_interleave(rep, 1), dout = in.grad_out.to(at::kDouble);
  const double scale = 1.0 / std::sqrt(static_cast<double>(in.q.size(3)));
  at::Tensor s = at::matmul(q, k.transpose(-1, -2)) * scale;
  if (causal) s = s.masked_fill(at::ones({seq, seq}, at::kBool).triu(1), -INFINITY);
  const at::Tensor p = at::softmax(s, -1);
  Reference r;
  r.out = at::matmul(p, v);
  const at::Tensor dp = at::matmul(dout, v.transpose(-1, -2));
  const at::Tensor d = (dout * r.out).sum(-1, true);
  const at::Tensor ds = p * (dp - d);
  r.dq = at::matmul(ds, k) * scale;
  r.dk = SumGroups(at::matmul(ds.transpose(-1, -2), q) * scale, kv_heads);
  r.dv = SumGroups(at::matmul(p.transpose(-1, -2), dout), kv_heads);
  const at::Tensor a = p * (at::matmul(dout.abs(), v.abs().transpose(-1, -2)) + d.abs());
  r.out_mag = at::matmul(p, v.abs());
  r.dq_mag = at::matmul(a, k.abs()) * scale;
  r.dk_mag = SumGroups(at::matmul(a.transpose(-1, -2), q.abs()) * scale, kv_heads);
  r.dv_mag = SumGroups(at::matmul(p.transpose(-1, -2), dout.abs()), kv_heads);
  return r;
}

Reference MakeReference(const Inputs& in, bool causal) { return MakeReferenceOfLength(in, causal, kSeq); }

// Every value is a sum over the sequence of products; float32 evaluations in two orders (the
// flash kernel's blocks over the whole sequence against the ring's blocks and merges) differ
// by at most 2 gamma(terms) times the sum of the terms' magnitudes (SummationOrderTolerance),
// and each of the ring's W merges and the kernels' exp / log add a few float32 roundings
// relative to that magnitude: 16 W u more. A wrong block, mask or merge is off by a
// sizeable fraction of the magnitude.
void ExpectClose(const at::Tensor& ours, const at::Tensor& reference, const at::Tensor& magnitude, int world,
                 const std::string& what, int64_t seq = kSeq) {
  const double u = testing::UnitRoundoff(at::kFloat);
  const double rel = testing::SummationOrderTolerance(at::kFloat, seq) + 16.0 * world * u;
  const at::Tensor excess = (ours.to(at::kDouble) - reference).abs() - magnitude * rel - 1e-30;
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": max |diff| " << (ours.to(at::kDouble) - reference).abs().max().item<double>();
}

class RingAttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(RingAttentionTest, ValuesAndGradientsEqualWholeSequenceAttention) {
  const Case& c = GetParam();
  const Inputs in = MakeInputs(c.heads, c.kv_heads);
  const Reference ref = MakeReference(in, c.causal);
  RunOnRanks(Backend::kThreaded, c.world, [&](const comm::ProcessGroupPtr& pg) {
    const int rank = pg->rank();
    auto shard = [&](const at::Tensor& t) { return ShardSequence(t, 2, rank, c.world, c.balanced); };
    const at::Tensor q = shard(in.q).requires_grad_(), k = shard(in.k).requires_grad_();
    const at::Tensor v = shard(in.v).requires_grad_();
    const at::Tensor out =
        RingAttention(q, k, v, c.causal, pg, {.rotate_method = c.rotate, .load_balanced = c.balanced});
    out.backward(shard(in.grad_out));
    ExpectClose(out, shard(ref.out), shard(ref.out_mag), c.world, "out");
    ExpectClose(q.grad(), shard(ref.dq), shard(ref.dq_mag), c.world, "dq");
    ExpectClose(k.grad(), shard(ref.dk), shard(ref.dk_mag), c.world, "dk");
    ExpectClose(v.grad(), shard(ref.dv), shard(ref.dv_mag), c.world, "dv");
    // And the whole output back in order.
    ExpectClose(UnshardSequence(out.detach(), 2, pg, c.balanced), ref.out, ref.out_mag, c.world, "unsharded out");
  });
}

INSTANTIATE_TEST_SUITE_P(
    Ring, RingAttentionTest,
    ::testing::Values(Case{"causal_balanced_allgather_w2", 2, true, true, RotateMethod::kAllGather},
                      Case{"causal_balanced_alltoall_w2", 2, true, true, RotateMethod::kAllToAll},
                      Case{"causal_balanced_allgather_w4", 4, true, true, RotateMethod::kAllGather},
                      Case{"causal_balanced_alltoall_w4", 4, true, true, RotateMethod::kAllToAll},
                      Case{"causal_contiguous_allgather_w4", 4, true, false, RotateMethod::kAllGather},
                      Case{"causal_contiguous_alltoall_w4", 4, true, false, RotateMethod::kAllToAll},
                      Case{"full_allgather_w4", 4, false, false, RotateMethod::kAllGather},
                      Case{"full_alltoall_w2", 2, false, false, RotateMethod::kAllToAll},
                      Case{"gqa_causal_balanced_w4", 4, true, true, RotateMethod::kAllGather, 4, 2}),
    [](const auto& info) { return info.param.name; });

// bfloat16 q, k, v, merged and accumulated in float32 (convert_to_f32, PyTorch's default) or in
// bfloat16. Beyond the float32 bound of ExpectClose, every bfloat16 rounding of a value (each
// block's kernel output, and without convert_to_f32 each merge or gradient addition, W of each,
// plus the final cast) errs by at most its unit roundoff times the value's magnitude: 2 (W + 1)
// of them.
TEST(RingAttention, BFloat16MergesInFloat32OrInBFloat16) {
  constexpr int kWorld = 4;
  const Inputs bf16 = [] {
    Inputs in = MakeInputs(4, 4);
    for (at::Tensor* t : {&in.q, &in.k, &in.v, &in.grad_out}) *t = t->to(at::kBFloat16);
    return in;
  }();
  const Inputs exact{bf16.q.to(at::kFloat), bf16.k.to(at::kFloat), bf16.v.to(at::kFloat), bf16.grad_out.to(at::kFloat)};
  const Reference ref = MakeReference(exact, /*causal=*/true);
  const double rel = testing::SummationOrderTolerance(at::kFloat, kSeq) +
                     16.0 * kWorld * testing::UnitRoundoff(at::kFloat) +
                     2.0 * (kWorld + 1) * testing::UnitRoundoff(at::kBFloat16);
  const auto expect_close = [&](const at::Tensor& ours, const at::Tensor& reference, const at::Tensor& magnitude,
                                const std::string& what) {
    ASSERT_EQ(ours.scalar_type(), at::kBFloat16) << what;
    const at::Tensor diff = (ours.to(at::kDouble) - reference).abs();
    EXPECT_LE((diff - magnitude * rel - 1e-30).max().item<double>(), 0.0)
        << what << ": max |diff| " << diff.max().item<double>();
  };
  for (const bool convert_to_f32 : {true, false}) {
    SCOPED_TRACE(convert_to_f32 ? "convert_to_f32" : "bfloat16 merges");
    RunOnRanks(Backend::kThreaded, kWorld, [&](const comm::ProcessGroupPtr& pg) {
      auto shard = [&](const at::Tensor& t) { return ShardSequence(t, 2, pg->rank(), kWorld, true); };
      const at::Tensor q = shard(bf16.q).requires_grad_(), k = shard(bf16.k).requires_grad_();
      const at::Tensor v = shard(bf16.v).requires_grad_();
      const at::Tensor out = RingAttention(q, k, v, true, pg, {.convert_to_f32 = convert_to_f32});
      out.backward(shard(bf16.grad_out));
      expect_close(out, shard(ref.out), shard(ref.out_mag), "out");
      expect_close(q.grad(), shard(ref.dq), shard(ref.dq_mag), "dq");
      expect_close(k.grad(), shard(ref.dk), shard(ref.dk_mag), "dk");
      expect_close(v.grad(), shard(ref.dv), shard(ref.dv_mag), "dv");
    });
  }
}

// On a GPU, ATen's CUDA kernels: flash for bfloat16, memory-efficient for float32 (which takes
// no grouped-query inputs: the ring repeats k / v heads and sums their gradients back), two
// threaded ranks sharing the device, causal load balanced and not, and full attention, against
// the float64 reference of the inputs as rounded. float32: ExpectClose's bound. bfloat16: as
// BFloat16MergesInFloat32OrInBFloat16's, plus the CUDA flash kernel's own bfloat16 roundings
// of the probabilities before P V in the forward and of P and dS before their products in the
// backward (at most 2 per value, each within its unit roundoff of the magnitude), twice over.
TEST(RingAttention, CudaKernelsEqualWholeSequenceAttention) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA device (a --config=cuda or FSDP_WITH_CUDA build on a GPU host)";
  constexpr int kWorld = 2;
  const c10::Device cuda(c10::kCUDA, 0);
  for (const c10::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (const int64_t kv_heads : {4, 2}) {
      for (const auto& [causal, balanced] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, false}}) {
        SCOPED_TRACE(::testing::Message() << dtype << " kv_heads " << kv_heads << (causal ? " causal" : " full")
                                          << (balanced ? " balanced" : ""));
        Inputs in = MakeInputs(4, kv_heads);
        for (at::Tensor* t : {&in.q, &in.k, &in.v, &in.grad_out}) *t = t->to(dtype).to(at::kFloat);
        const Reference ref = MakeReference(in, causal);
        const double u16 = dtype == at::kBFloat16 ? testing::UnitRoundoff(at::kBFloat16) : 0.0;
        const double rel = testing::SummationOrderTolerance(at::kFloat, kSeq) +
                           16.0 * kWorld * testing::UnitRoundoff(at::kFloat) + (2.0 * (kWorld + 1) + 4.0) * u16;
        RunOnRanks(Backend::kThreaded, kWorld, [&](const comm::ProcessGroupPtr& pg) {
          auto shard = [&](const at::Tensor& t) { return ShardSequence(t, 2, pg->rank(), kWorld, balanced); };
          auto on_gpu = [&](const at::Tensor& t) { return shard(t).to(cuda, dtype).requires_grad_(); };
          const at::Tensor q = on_gpu(in.q), k = on_gpu(in.k), v = on_gpu(in.v);
          const at::Tensor out = RingAttention(q, k, v, causal, pg, {.load_balanced = balanced});
          out.backward(shard(in.grad_out).to(cuda, dtype));
          const auto expect_close = [&](const at::Tensor& ours, const at::Tensor& reference,
                                        const at::Tensor& magnitude, const char* what) {
            ASSERT_EQ(ours.device(), cuda) << what;
            ASSERT_EQ(ours.scalar_type(), dtype) << what;
            const at::Tensor diff = (ours.cpu().to(at::kDouble) - shard(reference)).abs();
            EXPECT_LE((diff - shard(magnitude) * rel - 1e-30).max().item<double>(), 0.0)
                << what << ": max |diff| " << diff.max().item<double>();
          };
          expect_close(out, ref.out, ref.out_mag, "out");
          expect_close(q.grad(), ref.dq, ref.dq_mag, "dq");
          expect_close(k.grad(), ref.dk, ref.dk_mag, "dk");
          expect_close(v.grad(), ref.dv, ref.dv_mag, "dv");
        });
      }
    }
  }
}

// The backward node keeps its saved tensors under retain_graph (a second backward doubles the
// gradients) and says so when they were freed; without grad no node is made; a double backward
// is an error.
TEST(RingAttention, RetainedGraphBackwardsTwiceAndAFreedOneIsAnError) {
  constexpr int kWorld = 2;
  const Inputs in = MakeInputs(4, 4);
  RunOnRanks(Backend::kThreaded, kWorld, [&](const comm::ProcessGroupPtr& pg) {
    auto shard = [&](const at::Tensor& t) { return ShardSequence(t, 2, pg->rank(), kWorld, true); };
    const at::Tensor q = shard(in.q).requires_grad_(), k = shard(in.k), v = shard(in.v);
    const at::Tensor out = RingAttention(q, k, v, true, pg);
    ASSERT_NE(out.grad_fn(), nullptr);
    EXPECT_EQ(out.grad_fn()->name(), "RingAttentionBackward");
    out.backward(shard(in.grad_out), /*retain_graph=*/true);
    const at::Tensor once = q.grad().clone();
    out.backward(shard(in.grad_out));
    EXPECT_TRUE(at::allclose(q.grad(), 2 * once, 0, 0)) << "a retained graph's second backward adds the same gradient";
    EXPECT_ERROR_CONTAINS(out.backward(shard(in.grad_out)), "RingAttention: backward through the graph a second time");
    {
      const at::NoGradGuard no_grad;
      EXPECT_FALSE(RingAttention(q, k, v, true, pg).requires_grad());
    }
    // create_graph: the same gradient, and a backward through it is an error.
    const at::Tensor dq = torch::autograd::grad({RingAttention(q, k, v, true, pg)}, {q}, {shard(in.grad_out)},
                                                /*retain_graph=*/std::nullopt, /*create_graph=*/true)[0];
    EXPECT_TRUE(at::equal(dq.detach(), once));
    EXPECT_ERROR_CONTAINS(dq.sum().backward(), "derivative for RingAttentionBackward is not implemented");
  });
}

int64_t Count(const comm::CommTrace& trace, const std::string& op) {
  int64_t n = 0;
  for (const auto& r : trace.records()) n += r.op == op;
  return n;
}

// PyTorch's rotaters (_attention.py): the forward all-gathers the key / value blocks once
// (kAllGather) or permutes them W - 1 times (kAllToAll: permute_tensor, an all_to_all_single);
// the backward does the same for the blocks and permutes the key / value gradients W times.
TEST(RingAttention, CollectivesPerRotateMethodAsPyTorchs) {
  const Inputs in = MakeInputs(4, 4);
  for (const RotateMethod rotate : {RotateMethod::kAllGather, RotateMethod::kAllToAll}) {
    RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
      auto trace = std::make_shared<comm::CommTrace>(pg);
      auto shard = [&](const at::Tensor& t) { return ShardSequence(t, 2, pg->rank(), 4); };
      const at::Tensor q = shard(in.q).requires_grad_();
      const at::Tensor out = RingAttention(q, shard(in.k), shard(in.v), true, trace, {.rotate_method = rotate});
      const bool gather = rotate == RotateMethod::kAllGather;
      EXPECT_EQ(Count(*trace, "all_gather_into_tensor"), gather ? 1 : 0);
      EXPECT_EQ(Count(*trace, "all_to_all_single"), gather ? 0 : 3);
      trace->clear();
      out.sum().backward();
      EXPECT_EQ(Count(*trace, "all_gather_into_tensor"), gather ? 1 : 0);
      EXPECT_EQ(Count(*trace, "all_to_all_single"), gather ? 4 : 3 + 4);
    });
  }
}

// Against PyTorch's own ring (testdata/golden_ring_attention.txt, testing/golden/
// gen_context_parallel.py: _templated_ring_attention and its backward on Gloo processes):
// each rank's output and gradients within the same summation-order tolerance (both run the
// same kernel over the same blocks; the merges' order of operations may differ), and the same
// collectives in kind and count.
std::string Counts(const comm::CommTrace& trace) {
  const int64_t gathers = Count(trace, "all_gather_into_tensor"), a2a = Count(trace, "all_to_all_single");
  std::string out;
  if (gathers > 0) out += "all_gather=" + std::to_string(gathers);
  if (a2a > 0) out += (out.empty() ? "" : " ") + std::string("all_to_all=") + std::to_string(a2a);
  return out.empty() ? "-" : out;
}

TEST(RingAttention, EqualsPyTorchsRingOnGlooProcesses) {
  const auto records = testing::ReadGoldenFile("context_parallel/testdata/golden_ring_attention.txt");
  int cases = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    const auto& c = records[i];
    if (c[0] != "case") continue;
    ++cases;
    SCOPED_TRACE(c[1]);
    const int world = static_cast<int>(testing::GoldenInt(c[2]));
    const bool causal = c[3] == "1", balanced = c[4] == "1";
    const RotateMethod rotate = c[5] == "alltoall" ? RotateMethod::kAllToAll : RotateMethod::kAllGather;
    std::vector<int64_t> q_shape = testing::GoldenInts(c[6]), kv_shape = q_shape;
    kv_shape[1] = testing::GoldenInt(c[7]);
    auto tensor = [](const std::string& field, const std::vector<int64_t>& shape) {
      return at::tensor(testing::GoldenNums(field), at::kDouble).reshape(shape).to(at::kFloat);
    };
    const Inputs in{tensor(c[8], q_shape), tensor(c[9], kv_shape), tensor(c[10], kv_shape), tensor(c[11], q_shape)};
    const int64_t seq = q_shape[2];
    ASSERT_EQ(seq, kSeq / 2);  // the golden cases' length
    const Reference ref = MakeReferenceOfLength(in, causal, seq);
    RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
      const int rank = pg->rank();
      const auto& theirs = records[i + 1 + rank];
      ASSERT_EQ(theirs[0], "rank");
      ASSERT_EQ(testing::GoldenInt(theirs[2]), rank);
      auto trace = std::make_shared<comm::CommTrace>(pg);
      auto shard = [&](const at::Tensor& t) { return ShardSequence(t, 2, rank, world, balanced); };
      const at::Tensor q = shard(in.q).requires_grad_(), k = shard(in.k).requires_grad_();
      const at::Tensor v = shard(in.v).requires_grad_();
      const at::Tensor out =
          RingAttention(q, k, v, causal, trace, {.rotate_method = rotate, .load_balanced = balanced});
      EXPECT_EQ(Counts(*trace), theirs[7]);
      trace->clear();
      out.backward(shard(in.grad_out));
      EXPECT_EQ(Counts(*trace), theirs[8]);
      auto golden = [&](int field, const at::Tensor& like) {
        return at::tensor(testing::GoldenNums(theirs[field]), at::kDouble).reshape(like.sizes());
      };
      ExpectClose(out, golden(3, out), shard(ref.out_mag), world, "out", seq);
      ExpectClose(q.grad(), golden(4, q), shard(ref.dq_mag), world, "dq", seq);
      ExpectClose(k.grad(), golden(5, k), shard(ref.dk_mag), world, "dk", seq);
      ExpectClose(v.grad(), golden(6, v), shard(ref.dv_mag), world, "dv", seq);
    });
  }
  EXPECT_EQ(cases, 7);
}

TEST(LoadBalancer, HeadTailChunksAndTheirInverse) {
  // Rank r of W holds chunks r and 2W-1-r of 2W (PyTorch's example: 8 positions over 2 ranks).
  EXPECT_TRUE(at::equal(ShardPositions(8, 0, 2), at::tensor({0, 1, 6, 7}, at::kLong)));
  EXPECT_TRUE(at::equal(ShardPositions(8, 1, 2), at::tensor({2, 3, 4, 5}, at::kLong)));
  EXPECT_TRUE(at::equal(ShardPositions(8, 1, 4, /*load_balanced=*/false), at::tensor({2, 3}, at::kLong)));
  const at::Tensor ids = at::arange(24, at::kLong).reshape({2, 12});
  EXPECT_TRUE(
      at::equal(ShardSequence(ids, 1, 2, 3), at::tensor({4, 5, 6, 7, 16, 17, 18, 19}, at::kLong).reshape({2, 4})));
  EXPECT_ERROR_CONTAINS(ShardSequence(ids, 1, 0, 5), "the sequence length 12 must be divisible by 10");
  EXPECT_ERROR_CONTAINS(ShardSequence(ids, 1, 3, 3), "cp_rank 3 outside [0, cp_size = 3)");
  EXPECT_ERROR_CONTAINS(ShardSequence(ids, 2, 0, 3), "seq_dim 2 outside a 2-D tensor");
}

TEST(RingAttention, BadInputsAreErrors) {
  RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    const at::Tensor q = at::randn({1, 4, 8, 16}), k = at::randn({1, 4, 8, 16});
    EXPECT_ERROR_CONTAINS(RingAttention(q, k, k, false, pg), "load balancing requires is_causal = true");
    EXPECT_ERROR_CONTAINS(RingAttention(q, k.narrow(2, 0, 6), k.narrow(2, 0, 6), true, pg),
                          "is_causal requires the same query and context sequence lengths, got 8 and 6");
    EXPECT_ERROR_CONTAINS(RingAttention(q, at::randn({1, 3, 8, 16}), at::randn({1, 3, 8, 16}), true, pg),
                          "q's heads a multiple of k's");
    EXPECT_ERROR_CONTAINS(RingAttention(q.narrow(2, 0, 7), k.narrow(2, 0, 7), k.narrow(2, 0, 7), true, pg),
                          "its length must be even, got 7");
    EXPECT_ERROR_CONTAINS(RingAttention(q[0], k, k, true, pg), "must be 4-D");
    const at::Tensor m = at::empty({1, 4, 8, 16}, at::kMeta);
    EXPECT_ERROR_CONTAINS(RingAttention(m, m, m, true, pg),
                          "must be on the CPU or a CUDA device (the ring runs ATen's SDPA kernels there), got meta");
    const at::Tensor i = at::ones({1, 4, 8, 16}, at::kInt);
    EXPECT_ERROR_CONTAINS(RingAttention(i, i, i, true, pg), "must be floating point, got Int");
  });
}

}  // namespace
}  // namespace fsdp::context_parallel
