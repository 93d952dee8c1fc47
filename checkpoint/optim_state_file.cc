#include "checkpoint/optim_state_file.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <type_traits>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/file_io.h"

namespace fsdp::checkpoint {

StateKind Classify(const StateValue& value) {
  if (const auto* t = std::get_if<at::Tensor>(&value)) {
    return t->dim() > 0 ? StateKind::kPositiveDimTensor : StateKind::kZeroDimTensor;
  }
  return StateKind::kNonTensor;
}

std::vector<char> SerializeOptimStateDict(const OptimStateDict& state_dict) {
  c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [fqn, values] : state_dict.state) {
    c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    for (const auto& item : values) {
      const std::string& key = item.first;  // (clang 14 cannot capture a structured binding)
      std::visit(
          [&](const auto& v) {
            if constexpr (std::is_same_v<std::decay_t<decltype(v)>, at::Tensor>) {
              entry.insert(key, v.detach().cpu());
            } else {
              entry.insert(key, v);
            }
          },
          item.second);
    }
    state.insert(fqn, entry);
  }
  c10::impl::GenericList groups(c10::AnyType::get());
  for (const auto& g : state_dict.param_groups) {
    c10::impl::GenericDict options(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [key, value] : g.options) options.insert(key, value);
    groups.push_back(c10::ivalue::Tuple::create(c10::IValue(g.params), c10::IValue(options)));
  }
  const auto root =
      c10::ivalue::Tuple::create(c10::IValue(state_dict.optimizer), c10::IValue(state), c10::IValue(groups));
  return WriteCheckpoint(c10::IValue(root));
}

void SaveOptimStateDict(const OptimStateDict& state_dict, const std::string& path) {
  WriteFileAtomically(path, SerializeOptimStateDict(state_dict), "SaveOptimStateDict");
}

OptimStateDict LoadOptimStateDict(const std::string& path) {
  return DeserializeOptimStateDict(ReadFile(path, "LoadOptimStateDict"), "'" + path + "'");
}

OptimStateDict DeserializeOptimStateDict(const std::vector<char>& bytes, const std::string& source) {
  const c10::IValue root = ReadCheckpoint(bytes.data(), bytes.size(), "LoadOptimStateDict: " + source);
  const auto bad = [&](const std::string& what) {
    TORCH_CHECK(false, "LoadOptimStateDict: ", source, " is not an optimizer state dict: ", what);
  };
  if (!root.isTuple() || root.toTupleRef().elements().size() != 3) bad("expected a 3-tuple");
  const auto& top = root.toTupleRef().elements();
  if (!top[0].isString() || !top[1].isGenericDict() || !top[2].isList()) bad("expected (str, dict, list)");
  OptimStateDict out;
  out.optimizer = top[0].toStringRef();
  for (const auto& item : top[1].toGenericDict()) {
    if (!item.key().isString() || !item.value().isGenericDict()) bad("state entries must be str -> dict");
    auto& values = out.state[item.key().toStringRef()];
    for (const auto& kv : item.value().toGenericDict()) {
      if (!kv.key().isString()) bad("state names must be strings");
      const c10::IValue& v = kv.value();
      if (v.isTensor()) {
        values.emplace(kv.key().toStringRef(), v.toTensor());
      } else if (v.isInt()) {
        values.emplace(kv.key().toStringRef(), v.toInt());
      } else if (v.isDouble()) {
        values.emplace(kv.key().toStringRef(), v.toDouble());
      } else {
        bad(absl::StrCat("state '", kv.key().toStringRef(), "' is a ", v.tagKind()));
      }
    }
  }
  for (const auto& g : top[2].toListRef()) {
    if (!g.isTuple() || g.toTupleRef().elements().size() != 2) bad("param groups must be (params, options)");
    const auto& e = g.toTupleRef().elements();
    if (!e[0].isList() || !e[1].isGenericDict()) bad("param groups must be (list, dict)");
    ParamGroupState group;
    for (const auto& fqn : e[0].toListRef()) {
      if (!fqn.isString()) bad("param group FQNs must be strings");
      group.params.push_back(fqn.toStringRef());
    }
    for (const auto& kv : e[1].toGenericDict()) {
      if (!kv.key().isString()) bad("param group option names must be strings");
      group.options.emplace(kv.key().toStringRef(), kv.value());
    }
    out.param_groups.push_back(std::move(group));
  }
  return out;
}

}  // namespace fsdp::checkpoint
