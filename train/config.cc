// See config.h. The keys are config_fields.cc's list; this file reads TOML (toml++), applies
// overrides, prints and validates.
#include "train/config.h"

#include <c10/util/Exception.h>

#include <toml++/toml.h>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "train/config_fields.h"

namespace fsdp::train {
namespace {

using config_internal::DottedKey;
using config_internal::Field;
using config_internal::Kind;
using config_internal::KindName;
using config_internal::Section;
using config_internal::Sections;
using config_internal::Value;

std::string JoinKeys(const std::vector<std::string_view>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "" : ", ") + std::string(k);
  return out;
}

std::string Quoted(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// The shortest text that reads back to `x`, as a TOML float (with a '.' or an exponent).
std::string FormatFloat(double x) {
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof(buf), x);
  std::string s(buf, result.ptr);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // 'n': inf, nan
  return s;
}

// `value` as TOML.
std::string FormatValue(const Value& value) {
  if (const auto* i = std::get_if<int64_t>(&value)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&value)) return FormatFloat(*d);
  if (const auto* b = std::get_if<bool>(&value)) return *b ? "true" : "false";
  if (const auto* s = std::get_if<std::string>(&value)) return Quoted(*s);
  std::string out = "[";
  if (const auto* v = std::get_if<std::vector<double>>(&value)) {
    for (size_t i = 0; i < v->size(); ++i) out += (i ? ", " : "") + FormatFloat((*v)[i]);
  } else if (const auto* v = std::get_if<std::vector<std::string>>(&value)) {
    for (size_t i = 0; i < v->size(); ++i) out += (i ? ", " : "") + Quoted((*v)[i]);
  }
  return out + "]";
}

// A choice's name must be one of its choices; a pair has two numbers. Then sets.
void CheckAndSet(const Field& field, const Value& value, const std::string& where, const std::string& key) {
  if (field.kind == Kind::kChoice) {
    const auto& name = std::get<std::string>(value);
    bool known = false;
    for (const auto& choice : field.choices) known = known || choice == name;
    TORCH_CHECK(known, where, key, " = ", Quoted(name), " is not one of ", JoinKeys(field.choices));
  }
  if (field.kind == Kind::kFloatPair) {
    TORCH_CHECK(std::get<std::vector<double>>(value).size() == 2, where, key, " = ", FormatValue(value),
                " must have two numbers");
  }
  field.set(value);
}

// ---------------------------------------------------------------- TOML

std::string NodeText(const toml::node& node) {
  std::ostringstream out;
  if (const auto* s = node.as_string()) {
    out << Quoted(s->get());
  } else {
    node.visit([&out](const auto& n) { out << n; });
  }
  return out.str();
}

const char* TomlTypeName(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::array: return "an array";
    case toml::node_type::table: return "a table";
    default: return "a date or time";
  }
}

// A TOML node as `field`'s kind; nullopt when its type does not fit.
std::optional<Value> FromToml(const Field& field, const toml::node& node) {
  switch (field.kind) {
    case Kind::kInt:
      if (const auto* i = node.as_integer()) return Value(static_cast<int64_t>(i->get()));
      return std::nullopt;
    case Kind::kFloat:
      if (const auto* f = node.as_floating_point()) return Value(f->get());
      if (const auto* i = node.as_integer()) return Value(static_cast<double>(i->get()));
      return std::nullopt;
    case Kind::kBool:
      if (const auto* b = node.as_boolean()) return Value(b->get());
      return std::nullopt;
    case Kind::kString:
    case Kind::kChoice:
      if (const auto* s = node.as_string()) return Value(s->get());
      return std::nullopt;
    case Kind::kFloatPair: {
      const auto* array = node.as_array();
      if (array == nullptr) return std::nullopt;
      std::vector<double> numbers;
      for (const auto& element : *array) {
        if (const auto* f = element.as_floating_point()) {
          numbers.push_back(f->get());
        } else if (const auto* i = element.as_integer()) {
          numbers.push_back(static_cast<double>(i->get()));
        } else {
          return std::nullopt;
        }
      }
      return Value(std::move(numbers));
    }
    case Kind::kStringList: {
      const auto* array = node.as_array();
      if (array == nullptr) return std::nullopt;
      std::vector<std::string> strings;
      for (const auto& element : *array) {
        const auto* s = element.as_string();
        if (s == nullptr) return std::nullopt;
        strings.push_back(s->get());
      }
      return Value(std::move(strings));
    }
  }
  return std::nullopt;
}

std::string Where(std::string_view source, const toml::node& node) {
  const auto& begin = node.source().begin;
  return std::string(source) + ":" + std::to_string(begin.line) + ":" + std::to_string(begin.column) + ": ";
}

// The keys of `table` into `section`'s fields; an unknown key is an error.
void ReadTable(const toml::table& table, Section& section, std::string_view source) {
  for (const auto& [toml_key, node] : table) {
    const std::string_view key = toml_key.str();
    if (section.name.empty() && node.is_table()) continue;  // a table: ReadToml reads it
    Field* field = nullptr;
    for (auto& f : section.fields) field = f.key == key ? &f : field;
    const std::string dotted =
        section.name.empty() ? std::string(key) : std::string(section.name) + "." + std::string(key);
    if (field == nullptr) {
      std::vector<std::string_view> known;
      for (const auto& f : section.fields) known.push_back(f.key);
      TORCH_CHECK(false, Where(source, node), "unknown key ", dotted, " (",
                  section.name.empty() ? "top-level keys" : "the keys of [" + std::string(section.name) + "]", ": ",
                  JoinKeys(known), ")");
    }
    const std::optional<Value> value = FromToml(*field, node);
    TORCH_CHECK(value.has_value(), Where(source, node), dotted, " = ", NodeText(node), " must be ",
                KindName(field->kind), ", not ", TomlTypeName(node));
    CheckAndSet(*field, *value, Where(source, node), dotted);
  }
}

void ReadToml(std::string_view text, std::string_view source, std::vector<Section>& sections) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    const auto& begin = e.source().begin;
    TORCH_CHECK(false, source, ":", begin.line, ":", begin.column, ": not TOML: ", e.description());
  }
  ReadTable(root, sections.front(), source);
  for (const auto& [toml_key, node] : root) {
    if (!node.is_table()) continue;
    Section* section = nullptr;
    for (auto& s : sections) section = !s.name.empty() && s.name == toml_key.str() ? &s : section;
    if (section == nullptr) {
      std::vector<std::string_view> known;
      for (const auto& s : sections) {
        if (!s.name.empty()) known.push_back(s.name);
      }
      TORCH_CHECK(false, Where(source, node), "unknown table [", toml_key.str(), "] (the tables: ", JoinKeys(known),
                  ")");
    }
    ReadTable(*node.as_table(), *section, source);
  }
}

// ---------------------------------------------------------------- overrides

// An override's text as `field`'s kind, as tyro reads torchtitan's: numbers, true/false,
// None for an unset optional; a pair or a list comma-separated, optionally in brackets.
std::optional<Value> FromText(const Field& field, std::string_view text) {
  if (field.optional && (text == "None" || text == "none")) return Value();
  const auto parse_float = [](std::string_view s) -> std::optional<double> {
    const std::string copy(s);
    char* end = nullptr;
    const double x = std::strtod(copy.c_str(), &end);
    if (copy.empty() || end != copy.c_str() + copy.size()) return std::nullopt;
    return x;
  };
  const auto split = [](std::string_view s) {
    if (s.size() >= 2 && (s.front() == '[' || s.front() == '(')) s = s.substr(1, s.size() - 2);
    std::vector<std::string> items;
    while (!s.empty()) {
      const size_t comma = s.find(',');
      std::string_view item = s.substr(0, comma);
      while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
      while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
      items.emplace_back(item);
      if (comma == std::string_view::npos) break;
      s.remove_prefix(comma + 1);
    }
    return items;
  };
  switch (field.kind) {
    case Kind::kInt: {
      int64_t x = 0;
      const auto result = std::from_chars(text.data(), text.data() + text.size(), x);
      if (text.empty() || result.ec != std::errc() || result.ptr != text.data() + text.size()) return std::nullopt;
      return Value(x);
    }
    case Kind::kFloat:
      if (const auto x = parse_float(text)) return Value(*x);
      return std::nullopt;
    case Kind::kBool:
      if (text == "true" || text == "True") return Value(true);
      if (text == "false" || text == "False") return Value(false);
      return std::nullopt;
    case Kind::kString:
    case Kind::kChoice: return Value(std::string(text));
    case Kind::kFloatPair: {
      std::vector<double> numbers;
      for (const auto& item : split(text)) {
        const auto x = parse_float(item);
        if (!x) return std::nullopt;
        numbers.push_back(*x);
      }
      return Value(std::move(numbers));
    }
    case Kind::kStringList: return Value(split(text));
  }
  return std::nullopt;
}

void ApplyOverride(const ConfigOverride& override, std::vector<Section>& sections) {
  const std::string where = "command line: --" + override.key + ": ";
  for (auto& section : sections) {
    for (auto& field : section.fields) {
      if (DottedKey(section, field) != override.key) continue;
      if (!override.has_value) {
        TORCH_CHECK(field.kind == Kind::kBool, where, "needs a value (", KindName(field.kind), ")");
        field.set(Value(true));
        return;
      }
      const std::optional<Value> value = FromText(field, override.value);
      TORCH_CHECK(value.has_value(), where, Quoted(override.value), " is not ", KindName(field.kind));
      CheckAndSet(field, *value, "command line: --", override.key);
      return;
    }
  }
  TORCH_CHECK(false, where, "unknown key ", override.key, " (keys are section.key as in the TOML file, e.g. ",
              "training.steps; --print-config lists them)");
}

}  // namespace

CommandLine ParseCommandLine(const std::vector<std::string>& args) {
  CommandLine out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    TORCH_CHECK(arg.size() > 2 && arg.compare(0, 2, "--") == 0, "command line: unexpected argument ", Quoted(arg),
                " (arguments are --config FILE, --print-config, --nproc N and --section.key=value)");
    std::string key = arg.substr(2), value;
    bool has_value = false;
    if (const size_t eq = key.find('='); eq != std::string::npos) {
      value = key.substr(eq + 1);
      key.resize(eq);
      has_value = true;
    } else if (i + 1 < args.size() && args[i + 1].compare(0, 2, "--") != 0) {
      value = args[++i];
      has_value = true;
    }
    if (key == "nproc") {
      int n = 0;
      const auto parsed = std::from_chars(value.data(), value.data() + value.size(), n);
      TORCH_CHECK(
          has_value && parsed.ec == std::errc() && parsed.ptr == value.data() + value.size() && n >= 1 && n <= 1024,
          "command line: --nproc needs a number of processes from 1 to 1024, got ", Quoted(value));
      out.nproc = n;
    } else if (key == "print-config" || key == "print_config") {
      TORCH_CHECK(!has_value, "command line: --print-config takes no value, got ", Quoted(value));
      out.print_config = true;
    } else if (key == "config") {
      TORCH_CHECK(has_value && !value.empty(), "command line: --config needs a file");
      out.config_file = value;
    } else {
      out.overrides.push_back({key, value, has_value});
    }
  }
  return out;
}

JobConfig ParseConfig(std::string_view toml_text, std::string_view source,
                      const std::vector<ConfigOverride>& overrides) {
  JobConfig config;
  std::vector<Section> sections = Sections(config);
  ReadToml(toml_text, source, sections);
  for (const auto& override : overrides) ApplyOverride(override, sections);
  return config;
}

JobConfig LoadConfig(const CommandLine& command_line) {
  if (command_line.config_file.empty()) return ParseConfig("", "defaults", command_line.overrides);
  std::ifstream in(command_line.config_file, std::ios::binary);
  TORCH_CHECK(in.good(), "--config ", command_line.config_file, ": cannot be read");
  std::ostringstream text;
  text << in.rdbuf();
  TORCH_CHECK(!in.bad(), "--config ", command_line.config_file, ": read failed");
  return ParseConfig(text.str(), command_line.config_file, command_line.overrides);
}

std::string PrintConfig(const JobConfig& config) {
  JobConfig copy = config;  // Sections() hands out writable handles
  std::string out;
  for (const auto& section : Sections(copy)) {
    if (!section.name.empty()) out += "\n[" + std::string(section.name) + "]\n";
    for (const auto& field : section.fields) {
      const Value value = field.get();
      if (std::holds_alternative<std::monostate>(value)) {
        out += "# " + std::string(field.key) + " = (unset)\n";
      } else {
        out += std::string(field.key) + " = " + FormatValue(value) + "\n";
      }
    }
  }
  return out;
}

}  // namespace fsdp::train
