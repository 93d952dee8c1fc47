// LlamaConfig from Hugging Face config.json files (hf_config.h) against transformers' own
// reading of the same text (testdata/golden_hf_configs.txt, written by
// testing/golden/gen_models_hf.py: config.json as transformers 5 writes it and as the Llama 3.x
// checkpoints on the Hub have it, with the values LlamaConfig.from_dict computes), the configs
// transformers takes but this model refuses, and malformed ones.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstddef>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "models/llama/hf_config.h"
#include "models/llama/model.h"
#include "testing/expect_error.h"
#include "testing/golden_file.h"
#include "testing/test_dir.h"

namespace fsdp::models::llama {
namespace {

using ::fsdp::testing::GoldenCase;
using ::fsdp::testing::GoldenCaseName;
using ::fsdp::testing::GoldenCases;
using ::fsdp::testing::GoldenFields;
using ::fsdp::testing::GoldenInt;
using ::fsdp::testing::GoldenNum;
using ::fsdp::testing::ReadGoldenFile;

constexpr char kHfGolden[] = "models/llama/testdata/golden_hf_configs.txt";

// The records of kind `kind` of the golden file.
std::vector<GoldenFields> HfRecords(const std::string& kind) {
  std::vector<GoldenFields> out;
  for (GoldenFields& f : ReadGoldenFile(kHfGolden)) {
    if (f[0] == kind) out.push_back(std::move(f));
  }
  return out;
}

std::string HfCaseName(const GoldenFields& f) { return f[1]; }

class HfConfigGolden : public ::testing::TestWithParam<GoldenCase<GoldenFields>> {};

TEST_P(HfConfigGolden, ReadsWhatTransformersReads) {
  ASSERT_GOLDEN_CASE_LOADED();
  const GoldenFields& f = *GetParam();
  ASSERT_EQ(f.size(), 18u);
  const LlamaConfig c = LlamaConfigFromHfJson(f[17], f[1] + "/config.json");
  EXPECT_EQ(c.vocab_size, GoldenInt(f[2]));
  EXPECT_EQ(c.hidden_size, GoldenInt(f[3]));
  EXPECT_EQ(c.intermediate_size, GoldenInt(f[4]));
  EXPECT_EQ(c.num_hidden_layers, GoldenInt(f[5]));
  EXPECT_EQ(c.num_attention_heads, GoldenInt(f[6]));
  EXPECT_EQ(c.num_key_value_heads, GoldenInt(f[7]));
  EXPECT_EQ(c.head_dim(), GoldenInt(f[8]));
  EXPECT_EQ(c.rms_norm_eps, GoldenNum(f[9]));
  EXPECT_EQ(c.tie_word_embeddings, f[10] == "true");
  EXPECT_EQ(c.rope_theta, GoldenNum(f[12]));
  ASSERT_EQ(c.rope_scaling.has_value(), f[11] == "llama3") << "rope_type " << f[11];
  if (c.rope_scaling) {
    EXPECT_EQ(c.rope_scaling->factor, GoldenNum(f[13]));
    EXPECT_EQ(c.rope_scaling->low_freq_factor, GoldenNum(f[14]));
    EXPECT_EQ(c.rope_scaling->high_freq_factor, GoldenNum(f[15]));
    EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, GoldenInt(f[16]));
  }
  EXPECT_EQ(c.attention, LlamaConfig{}.attention);
}

INSTANTIATE_TEST_SUITE_P(Corpus, HfConfigGolden,
                         ::testing::ValuesIn(GoldenCases<GoldenFields>(
                             kHfGolden, 10, [] { return HfRecords("config"); }, HfCaseName)),
                         GoldenCaseName());

class HfConfigRefused : public ::testing::TestWithParam<GoldenCase<GoldenFields>> {};

// Configs transformers takes that this model cannot compute: one error naming the file and the key.
TEST_P(HfConfigRefused, NamesTheFileAndTheKey) {
  ASSERT_GOLDEN_CASE_LOADED();
  const GoldenFields& f = *GetParam();
  ASSERT_EQ(f.size(), 4u);
  const std::string what = f[1] + "/config.json";
  EXPECT_ERROR_CONTAINS(LlamaConfigFromHfJson(f[3], what), absl::StrCat(what, ": "));
  EXPECT_ERROR_CONTAINS(LlamaConfigFromHfJson(f[3], what), absl::StrCat("\"", f[2], "\""));
  EXPECT_ERROR_CONTAINS(LlamaConfigFromHfJson(f[3], what), "is not supported");
}

INSTANTIATE_TEST_SUITE_P(Corpus, HfConfigRefused,
                         ::testing::ValuesIn(GoldenCases<GoldenFields>(
                             kHfGolden, 5, [] { return HfRecords("refused"); }, HfCaseName)),
                         GoldenCaseName());

LlamaConfig FromJson(const std::string& json) { return LlamaConfigFromHfJson(json, "cfg.json"); }

TEST(HfConfig, RefusalsNameTheValue) {
  EXPECT_ERROR_CONTAINS(FromJson(R"({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32})"),
                        "cfg.json: \"head_dim\" = 32 is not supported: this model has no separate head_dim; it is "
                        "\"hidden_size\" / \"num_attention_heads\" = 64 / 4 = 16");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"hidden_act": "gelu"})"), "cfg.json: \"hidden_act\" = \"gelu\" is not supported");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"model_type": "mistral"})"),
                        "cfg.json: \"model_type\" = \"mistral\" is not supported");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"attention_bias": true})"),
                        "cfg.json: \"attention_bias\" = true is not supported: this model has no biases");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"mlp_bias": true})"), "cfg.json: \"mlp_bias\" = true is not supported");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})"),
                        "cfg.json: \"rope_parameters\" > \"rope_type\" = \"yarn\" is not supported");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"rope_scaling": {"type": "linear", "factor": 4.0}})"),
                        "cfg.json: \"rope_scaling\" > \"type\" = \"linear\" is not supported");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}})"),
                        "cfg.json: \"rope_parameters\" > \"partial_rotary_factor\" = 0.5 is not supported");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"partial_rotary_factor": 0.5})"),
                        "cfg.json: \"partial_rotary_factor\" = 0.5 is not supported");
}

TEST(HfConfig, ImpossibleShapesNameTheKeys) {
  EXPECT_ERROR_CONTAINS(FromJson(R"({"hidden_size": 65, "num_attention_heads": 4})"),
                        "cfg.json: \"hidden_size\" = 65 is not divisible by \"num_attention_heads\" = 4");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3})"),
                        "cfg.json: \"num_attention_heads\" = 4 is not divisible by \"num_key_value_heads\" = 3");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"vocab_size": 0})"), "cfg.json: \"vocab_size\" = 0 must be at least 1");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"num_hidden_layers": -2})"),
                        "cfg.json: \"num_hidden_layers\" = -2 must be at least 1");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"rms_norm_eps": 0})"), "cfg.json: \"rms_norm_eps\" = 0 must be positive");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"rope_theta": -1.5})"), "cfg.json: \"rope_theta\" = -1.5 must be positive");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}})"),
                        "cfg.json: \"rope_scaling\" > \"low_freq_factor\" is missing: rope_type \"llama3\" requires");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 0}})"),
                        "cfg.json: \"rope_scaling\" > \"original_max_position_embeddings\" = 0 must be at least 1");
}

TEST(HfConfig, WrongJsonTypesNameTheKeyAndTheValue) {
  EXPECT_ERROR_CONTAINS(FromJson(R"({"hidden_size": "64"})"),
                        "cfg.json: \"hidden_size\" = \"64\" is a string, not an integer");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"hidden_size": 64.0})"), "cfg.json: \"hidden_size\" = 64.0 is not an integer");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"vocab_size": 99999999999999999999})"),
                        "cfg.json: \"vocab_size\" = 99999999999999999999 is not an integer (or out of range)");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"hidden_size": null})"), "cfg.json: \"hidden_size\" is null, not an integer");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"tie_word_embeddings": 1})"),
                        "cfg.json: \"tie_word_embeddings\" = 1 is a number, not true or false");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"rms_norm_eps": "1e-5"})"),
                        "cfg.json: \"rms_norm_eps\" = \"1e-5\" is a string, not a number");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"rms_norm_eps": 1e999})"), "cfg.json: \"rms_norm_eps\" = 1e999 is not a finite");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"hidden_act": 3})"), "cfg.json: \"hidden_act\" = 3 is a number, not a string");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"rope_parameters": [1]})"),
                        "cfg.json: \"rope_parameters\" is an array, not an object");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"rope_parameters": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1,
                                      "high_freq_factor": 4, "original_max_position_embeddings": 8192}})"),
                        "cfg.json: \"rope_parameters\" > \"factor\" = \"8\" is a string, not a number");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"num_key_value_heads": false})"),
                        "cfg.json: \"num_key_value_heads\" = false is a bool");
}

TEST(HfConfig, MalformedJsonNamesTheFile) {
  EXPECT_ERROR_CONTAINS(FromJson("{\"hidden_size\": 64"), "cfg.json");
  EXPECT_ERROR_CONTAINS(FromJson(R"({"a": 1, "a": 2})"), "cfg.json");
  EXPECT_ERROR_CONTAINS(FromJson("{} x"), "cfg.json: unexpected bytes after the JSON value at byte 3");
  EXPECT_ERROR_CONTAINS(FromJson("[]"), "cfg.json: the config is an array, not an object");
  EXPECT_ERROR_CONTAINS(FromJson(""), "cfg.json");
}

// Absent keys are transformers' defaults; null kv heads / head_dim / rope objects are absent;
// unknown keys are ignored; whitespace after the object is fine.
TEST(HfConfig, DefaultsNullsAndUnknownKeys) {
  const LlamaConfig c = FromJson(
      R"({"num_attention_heads": 8, "num_key_value_heads": null, "head_dim": null, "rope_scaling": null,
          "rope_parameters": null, "future_key": {"x": [1, 2]}, "torch_dtype": "bfloat16"})"
      "\n\t ");
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 11008);
  EXPECT_EQ(c.num_hidden_layers, 32);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.rope_scaling.has_value());
  EXPECT_FALSE(c.tie_word_embeddings);
}

TEST(HfConfig, LoadReadsConfigJsonOfTheDirectory) {
  const std::string dir = ::fsdp::testing::NewTestPath("hf_config");
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  EXPECT_ERROR_CONTAINS(LoadHfLlamaConfig(dir), "LoadHfLlamaConfig: cannot open '" + dir + "/config.json'");
  {
    std::ofstream out(dir + "/config.json");
    out << R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
               "rope_theta": 500000.0, "tie_word_embeddings": true})";
  }
  for (const std::string& d : {dir, dir + "/"}) {
    const LlamaConfig c = LoadHfLlamaConfig(d);
    EXPECT_EQ(c.hidden_size, 64);
    EXPECT_EQ(c.num_key_value_heads, 2);
    EXPECT_EQ(c.rope_theta, 500000.0);
    EXPECT_TRUE(c.tie_word_embeddings);
  }
  {
    std::ofstream out(dir + "/config.json");
    out << R"({"hidden_act": "relu"})";
  }
  EXPECT_ERROR_CONTAINS(LoadHfLlamaConfig(dir), dir + "/config.json: \"hidden_act\" = \"relu\" is not supported");
  EXPECT_ERROR_CONTAINS(LoadHfLlamaConfig(""), "LoadHfLlamaConfig: no directory given");
}

}  // namespace
}  // namespace fsdp::models::llama
