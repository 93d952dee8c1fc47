// See hf_config.h.
#include "models/llama/hf_config.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/json.h"

namespace fsdp::models::llama {
namespace {

using checkpoint::internal::JsonKindName;
using checkpoint::internal::JsonMember;
using checkpoint::internal::JsonValue;
using Kind = JsonValue::Kind;

// A value as the error messages show it: numbers as written, strings quoted, containers by kind.
std::string Shown(const JsonValue& v) {
  switch (v.kind) {
    case Kind::kNull: return "null";
    case Kind::kBool: return v.boolean ? "true" : "false";
    case Kind::kNumber: return v.text;
    case Kind::kString: return absl::StrCat("\"", v.text, "\"");
    default: return JsonKindName(v.kind);
  }
}

// One JSON object of the config (the root, or the rope object): its keys, read with their
// types checked, named in errors as "<what>: \"key\"" or "<what>: \"rope_parameters\" > \"key\"".
class Object {
 public:
  Object(const JsonValue& object, std::string what, std::string prefix)
      : object_(object), what_(std::move(what)), prefix_(std::move(prefix)) {}

  // The value of `key`; null when absent (null values are returned: the callers decide).
  const JsonValue* Find(const char* key) const {
    for (const JsonMember& m : object_.members) {
      if (m.key == key) return &m.value;
    }
    return nullptr;
  }
  // Find, with a JSON null taken as absent (transformers' None: its default applies).
  const JsonValue* FindSet(const char* key) const {
    const JsonValue* v = Find(key);
    return v != nullptr && v->kind != Kind::kNull ? v : nullptr;
  }

  // "<what>: \"key\"" (or "<what>: \"rope_parameters\" > \"key\""), the start of an error.
  std::string Key(const char* key) const { return absl::StrCat(what_, ": ", prefix_, "\"", key, "\""); }

  [[noreturn]] void WrongType(const char* key, const JsonValue& v, const char* expected) const {
    const bool scalar = v.kind == Kind::kBool || v.kind == Kind::kNumber || v.kind == Kind::kString;
    TORCH_CHECK(false, Key(key), scalar ? absl::StrCat(" = ", Shown(v)) : "", " is ", JsonKindName(v.kind), ", not ",
                expected);
  }

  std::optional<int64_t> Int(const char* key) const {
    const JsonValue* v = Find(key);
    if (v == nullptr) return std::nullopt;
    int64_t x = 0;
    if (v->kind != Kind::kNumber) WrongType(key, *v, "an integer");
    TORCH_CHECK(absl::SimpleAtoi(v->text, &x), Key(key), " = ", v->text, " is not an integer (or out of range)");
    return x;
  }
  // An integer, transformers' default when absent; at least 1.
  int64_t Size(const char* key, int64_t fallback) const {
    const int64_t x = Int(key).value_or(fallback);
    TORCH_CHECK(x >= 1, Key(key), " = ", x, " must be at least 1");
    return x;
  }

  std::optional<double> Num(const char* key) const {
    const JsonValue* v = Find(key);
    if (v == nullptr) return std::nullopt;
    double x = 0;
    if (v->kind != Kind::kNumber) WrongType(key, *v, "a number");
    TORCH_CHECK(absl::SimpleAtod(v->text, &x) && std::isfinite(x), Key(key), " = ", v->text, " is not a finite number");
    return x;
  }
  // A number, positive.
  double Positive(const char* key, double x) const {
    TORCH_CHECK(x > 0, Key(key), " = ", x, " must be positive");
    return x;
  }

  std::optional<bool> Bool(const char* key) const {
    const JsonValue* v = Find(key);
    if (v == nullptr) return std::nullopt;
    if (v->kind != Kind::kBool) WrongType(key, *v, "true or false");
    return v->boolean;
  }

  std::optional<std::string> Str(const char* key) const {
    const JsonValue* v = Find(key);
    if (v == nullptr) return std::nullopt;
    if (v->kind != Kind::kString) WrongType(key, *v, "a string");
    return v->text;
  }

 private:
  const JsonValue& object_;
  std::string what_;
  std::string prefix_;
};

// transformers' LlamaConfig defaults (configuration_llama.py) and the rope default
// (RotaryEmbeddingConfigMixin.default_theta).
constexpr int64_t kVocabSize = 32000;
constexpr int64_t kHiddenSize = 4096;
constexpr int64_t kIntermediateSize = 11008;
constexpr int64_t kNumHiddenLayers = 32;
constexpr int64_t kNumAttentionHeads = 32;
constexpr double kRmsNormEps = 1e-6;
constexpr double kRopeTheta = 10000.0;

// The rotary parameters: transformers' convert_rope_params_to_dict / standardize_rope_params
// (modeling_rope_utils.py): the rope object is a non-empty rope_scaling, else rope_parameters;
// its rope_theta, else the top-level one, else the default; its rope_type, else "type", else
// "default".
void ReadRope(const Object& root, const std::string& what, LlamaConfig& c) {
  const char* name = nullptr;
  const JsonValue* rope = nullptr;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const JsonValue* v = root.FindSet(key);
    if (v == nullptr) continue;
    if (v->kind != Kind::kObject) root.WrongType(key, *v, "an object");
    if (v->members.empty()) continue;  // {}: transformers' falsy rope_scaling
    name = key;
    rope = v;
    break;
  }
  const std::optional<double> top_theta = root.Num("rope_theta");
  const std::optional<double> top_partial = root.Num("partial_rotary_factor");
  if (top_partial) {
    TORCH_CHECK(*top_partial == 1.0, root.Key("partial_rotary_factor"), " = ", *top_partial,
                " is not supported: this model rotates the whole head (1)");
  }
  c.rope_theta = root.Positive("rope_theta", top_theta.value_or(kRopeTheta));
  c.rope_scaling.reset();
  if (rope == nullptr) return;

  const Object r(*rope, what, absl::StrCat("\"", name, "\" > "));
  if (const std::optional<double> theta = r.Num("rope_theta")) c.rope_theta = r.Positive("rope_theta", *theta);
  if (const std::optional<double> partial = r.Num("partial_rotary_factor")) {
    TORCH_CHECK(*partial == 1.0, r.Key("partial_rotary_factor"), " = ", *partial,
                " is not supported: this model rotates the whole head (1)");
  }
  const char* type_key = r.Find("rope_type") != nullptr ? "rope_type" : "type";
  const std::string type = r.Str(type_key).value_or("default");
  if (type == "default") return;
  TORCH_CHECK(type == "llama3", r.Key(type_key), " = \"", type,
              "\" is not supported: this model has rope types \"default\" and \"llama3\"");
  Llama3RopeScaling s;
  const auto required = [&](const char* key) {
    TORCH_CHECK(r.FindSet(key) != nullptr, r.Key(key), " is missing: rope_type \"llama3\" requires factor, ",
                "low_freq_factor, high_freq_factor and original_max_position_embeddings");
  };
  for (const char* key : {"factor", "low_freq_factor", "high_freq_factor"}) required(key);
  required("original_max_position_embeddings");
  s.factor = r.Positive("factor", *r.Num("factor"));
  s.low_freq_factor = r.Positive("low_freq_factor", *r.Num("low_freq_factor"));
  s.high_freq_factor = r.Positive("high_freq_factor", *r.Num("high_freq_factor"));
  s.original_max_position_embeddings = r.Size("original_max_position_embeddings", 1);
  c.rope_scaling = s;
}

}  // namespace

LlamaConfig LlamaConfigFromHfJson(std::string_view json, const std::string& what) {
  size_t end = 0;
  const JsonValue root_value = checkpoint::internal::ParseJson(json, checkpoint::internal::JsonLimits{}, what, &end);
  for (size_t i = end; i < json.size(); ++i) {
    const char ch = json[i];
    TORCH_CHECK(ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r', what,
                ": unexpected bytes after the JSON value at byte ", i);
  }
  TORCH_CHECK(root_value.kind == Kind::kObject, what, ": the config is ", JsonKindName(root_value.kind),
              ", not an object");
  const Object root(root_value, what, "");

  if (const std::optional<std::string> type = root.Str("model_type")) {
    TORCH_CHECK(*type == "llama", root.Key("model_type"), " = \"", *type,
                "\" is not supported: this model reads Llama configs (\"llama\")");
  }
  const std::string act = root.Str("hidden_act").value_or("silu");
  TORCH_CHECK(act == "silu", root.Key("hidden_act"), " = \"", act,
              "\" is not supported: this model's MLP is SwiGLU (\"silu\")");
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    TORCH_CHECK(!root.Bool(key).value_or(false), root.Key(key), " = true is not supported: this model has no biases");
  }

  LlamaConfig c;
  c.vocab_size = root.Size("vocab_size", kVocabSize);
  c.hidden_size = root.Size("hidden_size", kHiddenSize);
  c.intermediate_size = root.Size("intermediate_size", kIntermediateSize);
  c.num_hidden_layers = root.Size("num_hidden_layers", kNumHiddenLayers);
  c.num_attention_heads = root.Size("num_attention_heads", kNumAttentionHeads);
  c.num_key_value_heads =
      root.FindSet("num_key_value_heads") ? root.Size("num_key_value_heads", 1) : c.num_attention_heads;
  TORCH_CHECK(c.hidden_size % c.num_attention_heads == 0, root.Key("hidden_size"), " = ", c.hidden_size,
              " is not divisible by \"num_attention_heads\" = ", c.num_attention_heads);
  TORCH_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, root.Key("num_attention_heads"), " = ",
              c.num_attention_heads, " is not divisible by \"num_key_value_heads\" = ", c.num_key_value_heads);
  if (root.FindSet("head_dim") != nullptr) {
    const int64_t head_dim = root.Size("head_dim", 1);
    TORCH_CHECK(head_dim == c.head_dim(), root.Key("head_dim"), " = ", head_dim,
                " is not supported: this model has no separate head_dim; it is \"hidden_size\" / ",
                "\"num_attention_heads\" = ", c.hidden_size, " / ", c.num_attention_heads, " = ", c.head_dim());
  }
  c.rms_norm_eps = root.Positive("rms_norm_eps", root.Num("rms_norm_eps").value_or(kRmsNormEps));
  c.tie_word_embeddings = root.Bool("tie_word_embeddings").value_or(false);
  ReadRope(root, what, c);
  return c;
}

LlamaConfig LoadHfLlamaConfig(const std::string& directory) {
  TORCH_CHECK(!directory.empty(), "LoadHfLlamaConfig: no directory given");
  const std::string path =
      directory.back() == '/' ? absl::StrCat(directory, "config.json") : absl::StrCat(directory, "/config.json");
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "LoadHfLlamaConfig: cannot open '", path, "' for reading (", std::strerror(errno), ")");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TORCH_CHECK(!in.bad(), "LoadHfLlamaConfig: reading '", path, "' failed (", std::strerror(errno), ")");
  return LlamaConfigFromHfJson(text, path);
}

}  // namespace fsdp::models::llama
