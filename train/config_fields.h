// The one list of the job config's keys (train/config.h): each table's fields as typed
// handles onto a JobConfig, so that reading TOML, applying command-line overrides and printing
// walk the same list and cannot disagree about a key, its type or its choices. Internal to
// //train (config.cc, config_toml.cc).
#ifndef FSDP_TRAIN_CONFIG_FIELDS_H_
#define FSDP_TRAIN_CONFIG_FIELDS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "train/config.h"

namespace fsdp::train::config_internal {

enum class Kind { kInt, kFloat, kBool, kString, kChoice, kFloatPair, kStringList };

// A field's value; monostate is an unset optional.
using Value =
    std::variant<std::monostate, int64_t, double, bool, std::string, std::vector<double>, std::vector<std::string>>;

struct Field {
  std::string_view key;
  Kind kind;
  bool optional = false;
  std::vector<std::string_view> choices;  // kChoice: the accepted names
  std::function<Value()> get;
  // Takes a value of `kind` (monostate only when optional; a kChoice name among `choices`,
  // a kFloatPair of two): the callers check, so this cannot fail.
  std::function<void(const Value&)> set;
};

struct Section {
  std::string_view name;  // "" for the top-level keys
  std::vector<Field> fields;
};

// Every table of `config` in the order PrintConfig writes them, top-level keys first. The
// fields refer to `config`, which must outlive them.
std::vector<Section> Sections(JobConfig& config);

// "integer", "float", ... for error messages.
const char* KindName(Kind kind);
// The dotted key of a field: "training.steps", or "dump_folder" at the top level.
std::string DottedKey(const Section& section, const Field& field);

}  // namespace fsdp::train::config_internal

#endif  // FSDP_TRAIN_CONFIG_FIELDS_H_
