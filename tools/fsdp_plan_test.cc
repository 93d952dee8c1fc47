// Golden values below are worked out by hand from the torch.chunk rule (chunk = ceil(n/S),
// trailing ranks short or empty, everyone stores chunk) and FlatParamHandle's padding rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include "tools/fsdp_plan_lib.h"

namespace fsdp_plan {
namespace {

Plan PlanFor(RawFlags flags) {
  PlanOptions options;
  const std::string err = ParseOptions(flags, &options);
  EXPECT_EQ(err, "");
  return MakePlan(options);
}

RawFlags Flags(std::string shapes, std::string world, std::string style = "fsdp2") {
  RawFlags f;
  f.shapes = std::move(shapes);
  f.world = std::move(world);
  f.style = std::move(style);
  return f;
}

// Minimal JSON syntax check (RFC 8259 grammar, no semantic checks) so FormatJson's hand-made
// output is known to parse.
class JsonChecker {
 public:
  explicit JsonChecker(const std::string& s) : s_(s) {}
  bool Valid() {
    Ws();
    if (!Value()) return false;
    Ws();
    return i_ == s_.size();
  }

 private:
  void Ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool Eat(char c) {
    Ws();
    if (i_ < s_.size() && s_[i_] == c) return ++i_, true;
    return false;
  }
  bool Lit(const char* w) {
    const std::string word(w);
    if (s_.compare(i_, word.size(), word) != 0) return false;
    i_ += word.size();
    return true;
  }
  bool String() {
    if (!Eat('"')) return false;
    while (i_ < s_.size() && s_[i_] != '"') {
      if (static_cast<unsigned char>(s_[i_]) < 0x20) return false;
      if (s_[i_] == '\\') {
        ++i_;
        if (i_ >= s_.size()) return false;
        if (s_[i_] == 'u') {
          for (int k = 0; k < 4; ++k) {
            if (++i_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[i_]))) {
              return false;
            }
          }
        } else if (std::string("\"\\/bfnrt").find(s_[i_]) == std::string::npos) {
          return false;
        }
      }
      ++i_;
    }
    return Eat('"');
  }
  bool Number() {
    const size_t start = i_;
    if (i_ < s_.size() && s_[i_] == '-') ++i_;
    while (i_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[i_])) || s_[i_] == '.' || s_[i_] == 'e' ||
                              s_[i_] == 'E' || s_[i_] == '+' || s_[i_] == '-')) {
      ++i_;
    }
    return i_ > start && std::isdigit(static_cast<unsigned char>(s_[i_ - 1]));
  }
  bool Value() {
    Ws();
    if (i_ >= s_.size()) return false;
    const char c = s_[i_];
    if (c == '"') return String();
    if (c == '{') {
      ++i_;
      if (Eat('}')) return true;
      do {
        Ws();
        if (!String() || !Eat(':') || !Value()) return false;
      } while (Eat(','));
      return Eat('}');
    }
    if (c == '[') {
      ++i_;
      if (Eat(']')) return true;
      do {
        if (!Value()) return false;
      } while (Eat(','));
      return Eat(']');
    }
    if (c == 't') return Lit("true");
    if (c == 'f') return Lit("false");
    if (c == 'n') return Lit("null");
    return Number();
  }
  const std::string& s_;
  size_t i_ = 0;
};

TEST(PerParam, UnevenChunksAndEmptyTrailingRank) {
  // 5x3 over 4: chunk ceil(5/4)=2 rows -> 2,2,1,0 rows at offsets 0,2,4,5; 6 -> 2,2,2,0.
  Plan plan = PlanFor(Flags("5x3,6", "4"));
  ASSERT_EQ(plan.ranks.size(), 4u);
  const std::vector<Shape> local0 = {{2, 3}, {2, 3}, {1, 3}, {0, 3}};
  const std::vector<Shape> local1 = {{2}, {2}, {2}, {0}};
  const std::vector<int64_t> off0 = {0, 2, 4, 5}, off1 = {0, 2, 4, 6};
  const std::vector<int64_t> numel = {8, 8, 5, 0};
  for (int s = 0; s < 4; ++s) {
    const RankPlan& r = plan.ranks[s];
    EXPECT_EQ(r.params[0].sharded_size, local0[s]) << s;
    EXPECT_EQ(r.params[0].padded_sharded_size, (Shape{2, 3})) << s;
    EXPECT_EQ(r.params[0].offset, off0[s]) << s;
    EXPECT_EQ(r.params[1].sharded_size, local1[s]) << s;
    EXPECT_EQ(r.params[1].padded_sharded_size, (Shape{2})) << s;
    EXPECT_EQ(r.params[1].offset, off1[s]) << s;
    EXPECT_EQ(r.numel, numel[s]) << s;
    EXPECT_EQ(r.padded_numel, 8) << s;
    EXPECT_EQ(r.bytes.params, 32) << s;  // padded storage, f32
    EXPECT_EQ(r.bytes.grads, numel[s] * 4) << s;
    EXPECT_EQ(r.bytes.optim, 2 * numel[s] * 4) << s;
    EXPECT_EQ(r.bytes.reduce_scatter_output, 32) << s;
    EXPECT_EQ(r.global_ranks, (std::vector<int64_t>{s})) << s;
  }
  EXPECT_EQ(plan.ranks[3].params[0].numel, 0);
  EXPECT_EQ(plan.ranks[3].params[0].padded_numel, 6);
  EXPECT_EQ(plan.total_numel, 21);
  EXPECT_EQ(plan.padded_total, 32);
  EXPECT_EQ(plan.all_gather_buffer_bytes, 128);
  // 3 x 32 x (4-1)/4 = 72 elements = 24 + 24 + 24; f32 -> 288 B.
  EXPECT_EQ(plan.all_gather_elements, 24);
  EXPECT_EQ(plan.reduce_scatter_elements, 24);
  EXPECT_EQ(plan.all_reduce_elements, 0);
  EXPECT_DOUBLE_EQ(plan.comm_bytes, 288);
}

TEST(PerParam, ClosedFormOverManyShapes) {
  // Rows tile [0, n) exactly; every rank stores ceil(n/S) rows.
  for (int64_t n : {1, 2, 3, 7, 8, 9, 31, 64}) {
    for (int64_t S : {1, 2, 3, 4, 8, 16}) {
      Plan plan = PlanFor(Flags(std::to_string(n) + "x3", std::to_string(S)));
      const int64_t chunk = (n + S - 1) / S;
      int64_t next = 0, total = 0;
      for (const RankPlan& r : plan.ranks) {
        const ParamShard& p = r.params[0];
        EXPECT_EQ(p.offset, std::min(n, next));
        EXPECT_EQ(p.padded_sharded_size, (Shape{chunk, 3}));
        next = p.offset + p.sharded_size[0];
        total += p.numel;
      }
      EXPECT_EQ(next, n);
      EXPECT_EQ(total, 3 * n);
      EXPECT_EQ(plan.padded_total, S * chunk * 3);
      EXPECT_EQ(plan.all_gather_elements * S, plan.padded_total * (S - 1));
    }
  }
}

TEST(PerParam, HsdpAndMixedPrecision) {
  RawFlags f = Flags("4x2,3", "6");
  f.mesh = "3x2";  // 3 replicas x 2 shards: 4 rows -> 2,2; 3 -> 2,1
  f.param_dtype = "bf16";
  f.reduce_dtype = "f32";
  Plan plan = PlanFor(f);
  ASSERT_EQ(plan.ranks.size(), 2u);
  EXPECT_EQ(plan.ranks[0].global_ranks, (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(plan.ranks[1].global_ranks, (std::vector<int64_t>{1, 3, 5}));
  EXPECT_EQ(plan.ranks[1].numel, 5);
  EXPECT_EQ(plan.ranks[1].padded_numel, 6);
  EXPECT_EQ(plan.unsharded_dtype, DType::kBF16);
  EXPECT_EQ(plan.reduce_dtype, DType::kF32);
  EXPECT_EQ(plan.padded_total, 12);
  EXPECT_EQ(plan.all_gather_buffer_bytes, 24);     // bf16
  EXPECT_EQ(plan.reduce_scatter_input_bytes, 48);  // f32
  EXPECT_EQ(plan.all_gather_elements, 6);
  EXPECT_DOUBLE_EQ(plan.all_reduce_elements, 2.0 * 6 * 2 / 3);  // 2 x P x (R-1)/R
  EXPECT_DOUBLE_EQ(plan.comm_bytes, 2 * 6 * 2 + 6 * 4 + 8.0 * 4);
  // param_dtype alone: PyTorch 2.15's FSDP2 reduces in the original dtype
  // (FSDPParam.unsharded_grad_dtype), FSDP1 in param_dtype (_init_param_reduce_dtypes).
  f.reduce_dtype = "";
  EXPECT_EQ(PlanFor(f).reduce_dtype, DType::kF32);
}

TEST(Flat, AlignedF32Layout) {
  // f32: aligned_numel 16/4 = 4. p0 [0,15) pad 1, p1 [16,22) pad 2, p2 [24,31),
  // then world-size pad 1 -> 32 = 4 x 8: chunks divide evenly, no _shard_numel_padded.
  Plan plan = PlanFor(Flags("5x3,6,1x7", "4", "fsdp1"));
  EXPECT_EQ(plan.aligned_numel, 4);
  const std::vector<FlatSegment> want = {{0, 0, 15}, {-1, 15, 1}, {1, 16, 6}, {-1, 22, 2}, {2, 24, 7}, {-1, 31, 1}};
  ASSERT_EQ(plan.flat_segments.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(plan.flat_segments[i].param_index, want[i].param_index) << i;
    EXPECT_EQ(plan.flat_segments[i].start, want[i].start) << i;
    EXPECT_EQ(plan.flat_segments[i].numel, want[i].numel) << i;
  }
  EXPECT_EQ(plan.padded_total, 32);
  // {param, offset_in_shard, numel_in_shard, intra start, intra end (inclusive)}
  struct Want {
    int64_t param, off, numel, start, end;
  };
  const std::vector<std::vector<Want>> infos = {
      {{0, 0, 8, 0, 7}}, {{0, 0, 7, 8, 14}}, {{1, 0, 6, 0, 5}}, {{2, 0, 7, 0, 6}}};
  for (int s = 0; s < 4; ++s) {
    const RankPlan& r = plan.ranks[s];
    EXPECT_EQ(r.flat_start, 8 * s);
    EXPECT_EQ(r.flat_end, 8 * s + 8);
    EXPECT_EQ(r.shard_numel_padded, 0);
    EXPECT_EQ(r.padded_numel, 8);
    ASSERT_EQ(r.flat_infos.size(), 3u);  // one per original parameter, as in PyTorch
    int in_shard = 0;
    for (const FlatShardParamInfo& x : r.flat_infos) {
      if (!x.in_shard) continue;
      ASSERT_LT(in_shard, static_cast<int>(infos[s].size()));
      const Want& w = infos[s][in_shard++];
      EXPECT_EQ(x.index, w.param);
      EXPECT_EQ(x.offset_in_shard, w.off);
      EXPECT_EQ(x.numel_in_shard, w.numel);
      EXPECT_EQ(x.intra_param_start_idx, w.start);
      EXPECT_EQ(x.intra_param_end_idx, w.end);
    }
    EXPECT_EQ(in_shard, static_cast<int>(infos[s].size()));
    EXPECT_EQ(r.bytes.params, 32);
    EXPECT_EQ(r.bytes.grads, 32);
    EXPECT_EQ(r.bytes.optim, 2 * r.numel * 4);  // use_orig_params: real elements only
  }
  EXPECT_DOUBLE_EQ(plan.comm_bytes, 3 * 24 * 4);
}

TEST(Flat, AlignmentFollowsUnshardedDtype) {
  // bf16 (and f32 stored with param_dtype bf16): 16/2 = 8 elements; f64: 2.
  RawFlags f = Flags("5x3,6", "4", "fsdp1");
  f.dtype = "bf16";
  Plan plan = PlanFor(f);
  EXPECT_EQ(plan.aligned_numel, 8);
  // p0 [0,15) pad 1 -> p1 [16,22), pad 2 -> 24 = 4 x 6.
  EXPECT_EQ(plan.padded_total, 24);
  const RankPlan& r2 = plan.ranks[2];  // [12,18): p0 12..14 at 0, p1 0..1 at 4
  EXPECT_EQ(r2.flat_infos[0].intra_param_start_idx, 12);
  EXPECT_EQ(r2.flat_infos[0].numel_in_shard, 3);
  EXPECT_EQ(r2.flat_infos[1].offset_in_shard, 4);
  EXPECT_EQ(r2.flat_infos[1].intra_param_end_idx, 1);
  EXPECT_EQ(r2.numel, 5);
  f.dtype = "f32";
  f.param_dtype = "bf16";
  EXPECT_EQ(PlanFor(f).aligned_numel, 8);
  f.param_dtype = "";
  f.dtype = "f64";
  plan = PlanFor(f);
  EXPECT_EQ(plan.aligned_numel, 2);
  EXPECT_EQ(plan.flat_segments[1].start, 15);  // pad 1 to 16, then p1 [16,22) = 22 -> 24
  EXPECT_EQ(plan.padded_total, 24);
}

TEST(Flat, NoAlignPadsTheLastChunk) {
  // use_orig_params=False: N = 21, chunk ceil(21/4) = 6, rank 3 holds [18,21) + 3 padding.
  RawFlags f = Flags("5x3,6", "4", "fsdp1");
  f.align = false;
  Plan plan = PlanFor(f);
  EXPECT_EQ(plan.aligned_numel, 0);
  EXPECT_EQ(plan.flat_segments.size(), 2u);
  EXPECT_EQ(plan.padded_total, 24);
  const std::vector<int64_t> padded = {0, 0, 0, 3};
  for (int s = 0; s < 4; ++s) {
    EXPECT_EQ(plan.ranks[s].shard_numel_padded, padded[s]);
    EXPECT_EQ(plan.ranks[s].bytes.optim, 2 * 6 * 4);  // optimizer sees the flat shard
  }
  EXPECT_EQ(plan.ranks[3].flat_start, 18);
  EXPECT_EQ(plan.ranks[3].flat_end, 21);
  EXPECT_EQ(plan.ranks[2].flat_infos[1].offset_in_shard, 3);  // p1 starts at 15 in [12,18)
  EXPECT_EQ(plan.ranks[2].flat_infos[1].numel_in_shard, 3);
  // More ranks than elements: torch.chunk(5 elements, 8) gives 5 chunks of 1; ranks 5..7
  // get an empty chunk fully padded.
  f = Flags("5", "8", "fsdp1");
  f.align = false;
  plan = PlanFor(f);
  EXPECT_EQ(plan.ranks[7].flat_start, 5);
  EXPECT_EQ(plan.ranks[7].flat_end, 5);
  EXPECT_EQ(plan.ranks[7].shard_numel_padded, 1);
  EXPECT_FALSE(plan.ranks[7].flat_infos[0].in_shard);
}

TEST(Flat, PaddingOnlyRanksAndWorldOne) {
  // 1,1 over 8 (f32): p0 [0,1) pad 3, p1 [4,5), world pad 3 -> 8; chunk 1.
  Plan plan = PlanFor(Flags("1,1", "8", "fsdp1"));
  EXPECT_EQ(plan.padded_total, 8);
  for (int s = 0; s < 8; ++s) {
    const bool holds = s == 0 || s == 4;
    EXPECT_EQ(plan.ranks[s].flat_infos[s == 4 ? 1 : 0].in_shard, holds) << s;
    EXPECT_EQ(plan.ranks[s].numel, holds ? 1 : 0) << s;
  }
  // World 1: no world-size padding; the single rank holds everything.
  plan = PlanFor(Flags("5x3,6", "1", "fsdp1"));
  EXPECT_EQ(plan.padded_total, 22);
  EXPECT_EQ(plan.ranks[0].flat_infos[1].offset_in_shard, 16);
  EXPECT_EQ(plan.all_gather_elements, 0);
}

TEST(Format, JsonIsValidAndHasKeys) {
  for (const char* style : {"fsdp2", "fsdp1"}) {
    RawFlags f = Flags("5x3,6,1x7", "4", style);
    f.mesh = "2x2";
    const std::string json = FormatJson(PlanFor(f));
    EXPECT_TRUE(JsonChecker(json).Valid()) << json;
    for (const char* key : {"\"style\":", "\"world\":4", "\"replicate\":2", "\"shard\":2", "\"param_dtype\":null",
                            "\"ranks\":[", "\"global_ranks\":[0,2]", "\"bytes\":{\"params\":", "\"optim\":",
                            "\"all_gather_buffer\":", "\"all_reduce_elements\":", "\"formula\":"}) {
      EXPECT_NE(json.find(key), std::string::npos) << style << " " << key;
    }
  }
  const std::string fsdp2 = FormatJson(PlanFor(Flags("5x3,6", "4")));
  EXPECT_NE(fsdp2.find("\"sharded_size\":[0,3],\"padded_sharded_size\":[2,3],\"offset\":5"), std::string::npos);
  const std::string flat = FormatJson(PlanFor(Flags("5x3,6,1x7", "4", "fsdp1")));
  EXPECT_NE(flat.find("\"aligned_numel\":4"), std::string::npos);
  EXPECT_NE(flat.find("{\"param\":null,\"start\":15,\"end\":16}"), std::string::npos);
  EXPECT_NE(flat.find("{\"param\":0,\"in_shard\":true,\"offset_in_shard\":0,"
                      "\"numel_in_shard\":7,\"intra_param_start_idx\":8,"
                      "\"intra_param_end_idx\":14}"),
            std::string::npos);
  EXPECT_NE(flat.find("{\"param\":1,\"in_shard\":false}"), std::string::npos);
}

TEST(Format, JsonQuoteEscapes) {
  EXPECT_EQ(JsonQuote("plain"), "\"plain\"");
  EXPECT_EQ(JsonQuote("a\"b\\c\n\t\x01"), "\"a\\\"b\\\\c\\n\\t\\u0001\"");
  EXPECT_TRUE(JsonChecker(JsonQuote(std::string("x\0y\x1f\x7f", 5))).Valid());
}

TEST(Format, TextMentionsTheEssentials) {
  const std::string text = FormatText(PlanFor(Flags("5x3,6", "4")));
  EXPECT_NE(text.find("shard rank 3 (global rank 3)"), std::string::npos) << text;
  EXPECT_NE(text.find("[0,3]"), std::string::npos);
  EXPECT_NE(text.find("3 x 32 x (4-1)/4 = 72 elements"), std::string::npos) << text;
  const std::string flat = FormatText(PlanFor(Flags("5x3,6", "4", "fsdp1")));
  EXPECT_NE(flat.find("align to 4 elements"), std::string::npos) << flat;
  EXPECT_NE(flat.find("_shard_numel_padded 0"), std::string::npos);
}

TEST(Parse, ErrorsNameTheFlagAndValue) {
  struct Case {
    RawFlags flags;
    std::string want;
  };
  auto with = [](auto edit) {
    RawFlags f = Flags("5x3", "4");
    edit(f);
    return f;
  };
  const std::vector<Case> cases = {
      {Flags("", "4"), "--shapes: empty"},
      {Flags("5x3,,6", "4"), "--shapes: empty shape in '5x3,,6'"},
      {Flags("5x", "4"), "--shapes: dimension '' of shape '5x'"},
      {Flags("5x0", "4"), "--shapes: dimension 0 of shape '5x0' must be positive"},
      {Flags("-2", "4"), "--shapes: dimension -2 of shape '-2' must be positive"},
      {Flags("5x3a", "4"), "--shapes: dimension '3a'"},
      {Flags("1048576x1048576x1048576", "4"), "more than 2^44"},
      {Flags("5", "0"), "--world: 0 must be in [1, "},
      {Flags("5", "-3"), "--world: -3"},
      {Flags("5", "four"), "--world: 'four' is not an integer"},
      {with([](RawFlags& f) { f.mesh = "3x2"; }), "--mesh: '3x2' (3 replicas x 2 shards)"},
      {with([](RawFlags& f) { f.mesh = "2x2x1"; }), "--mesh: '2x2x1' is not RxS"},
      {with([](RawFlags& f) { f.mesh = "0x4"; }), "--mesh: '0x4' is not RxS"},
      {with([](RawFlags& f) { f.dtype = "f8"; }), "--dtype: unknown dtype 'f8'"},
      {with([](RawFlags& f) { f.param_dtype = "int8"; }), "--param_dtype: unknown dtype 'int8'"},
      {with([](RawFlags& f) { f.reduce_dtype = "F32"; }), "--reduce_dtype: unknown dtype 'F32'"},
      {with([](RawFlags& f) { f.style = "zero3"; }), "--style: unknown style 'zero3'"},
  };
  for (const Case& c : cases) {
    PlanOptions options;
    const std::string err = ParseOptions(c.flags, &options);
    EXPECT_NE(err.find(c.want), std::string::npos) << "got: " << err << "\nwant: " << c.want;
  }
  PlanOptions options;
  RawFlags ok = with([](RawFlags& f) { f.mesh = "2x2"; });
  EXPECT_EQ(ParseOptions(ok, &options), "");
  EXPECT_EQ(options.replicate, 2);
  EXPECT_EQ(options.shard, 2);
}

}  // namespace
}  // namespace fsdp_plan
