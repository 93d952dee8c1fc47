#include "tensor_parallel/parallelize_module.h"

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace fsdp::tensor_parallel {
namespace {

// A '[...]' set starting at pattern[i] (after the '['); sets *end past the ']'. Returns
// false with *end = npos when the set is not closed (then '[' is a literal, as fnmatch).
bool MatchSet(const std::string& pattern, size_t i, char c, size_t* end) {
  size_t j = i;
  bool negate = false;
  if (j < pattern.size() && pattern[j] == '!') {
    negate = true;
    ++j;
  }
  const size_t first = j;
  bool matched = false;
  while (j < pattern.size() && (pattern[j] != ']' || j == first)) {
    if (j + 2 < pattern.size() && pattern[j + 1] == '-' && pattern[j + 2] != ']') {
      if (pattern[j] <= c && c <= pattern[j + 2]) matched = true;
      j += 3;
    } else {
      if (pattern[j] == c) matched = true;
      ++j;
    }
  }
  if (j >= pattern.size()) {
    *end = std::string::npos;
    return false;
  }
  *end = j + 1;
  return matched != negate;
}

bool Match(const std::string& p, size_t pi, const std::string& s, size_t si) {
  while (pi < p.size()) {
    const char c = p[pi];
    if (c == '*') {
      for (size_t k = si; k <= s.size(); ++k) {
        if (Match(p, pi + 1, s, k)) return true;
      }
      return false;
    }
    if (si >= s.size()) return false;
    if (c == '?') {
      ++pi;
      ++si;
      continue;
    }
    if (c == '[') {
      size_t end = 0;
      const bool ok = MatchSet(p, pi + 1, s[si], &end);
      if (end != std::string::npos) {
        if (!ok) return false;
        pi = end;
        ++si;
        continue;
      }
    }
    if (c != s[si]) return false;
    ++pi;
    ++si;
  }
  return si == s.size();
}

void Collect(torch::nn::Module& module, const std::string& prefix, const std::vector<std::string>& atoms, size_t i,
             std::vector<std::pair<std::string, torch::nn::Module*>>* out) {
  for (const auto& child : module.named_children()) {
    if (!FnMatch(atoms[i], child.key())) continue;
    const std::string fqn = prefix.empty() ? child.key() : absl::StrCat(prefix, ".", child.key());
    if (i + 1 == atoms.size()) {
      out->emplace_back(fqn, child.value().get());
    } else {
      Collect(*child.value(), fqn, atoms, i + 1, out);
    }
  }
}

std::vector<std::pair<std::string, torch::nn::Module*>> Resolve(torch::nn::Module& module, const std::string& key) {
  std::vector<std::pair<std::string, torch::nn::Module*>> found;
  if (key.empty()) {
    found.emplace_back("", &module);
    return found;
  }
  const std::vector<std::string> atoms = absl::StrSplit(key, '.');
  Collect(module, "", atoms, 0, &found);
  return found;
}

}  // namespace

bool FnMatch(const std::string& pattern, const std::string& name) { return Match(pattern, 0, name, 0); }

std::vector<std::string> MatchModulePath(torch::nn::Module& module, const std::string& key) {
  std::vector<std::string> fqns;
  for (const auto& [fqn, m] : Resolve(module, key)) fqns.push_back(fqn);
  return fqns;
}

torch::nn::Module& parallelize_module(torch::nn::Module& module, const mesh::DeviceMeshPtr& tp_mesh,
                                      const ParallelStylePtr& style, std::optional<int> src_data_rank) {
  TORCH_CHECK(style != nullptr, "parallelize_module: the style is null");
  style->src_data_rank = src_data_rank;
  style->Apply(module, "", tp_mesh);
  return module;
}

torch::nn::Module& parallelize_module(torch::nn::Module& module, const mesh::DeviceMeshPtr& tp_mesh,
                                      const ParallelizePlan& plan, std::optional<int> src_data_rank) {
  TORCH_CHECK(tp_mesh != nullptr, "parallelize_module: tp_mesh is null");
  TORCH_CHECK(tp_mesh->ndim() == 1, "parallelize_module: only a 1-D DeviceMesh is accepted, got ", tp_mesh->ToString(),
              "; slice the tensor-parallel dimension first (mesh[\"tp\"])");
  // Every key resolved before any module changes.
  std::vector<std::vector<std::pair<std::string, torch::nn::Module*>>> targets;
  for (const auto& [key, style] : plan) {
    TORCH_CHECK(style != nullptr, "parallelize_module: the style for plan key '", key, "' is null");
    targets.push_back(Resolve(module, key));
    TORCH_CHECK(!targets.back().empty(), "parallelize_module: plan key '", key,
                "' matches no submodule of the module (keys are module paths whose '.'-separated atoms are fnmatch "
                "patterns over child names, e.g. 'layers.*.self_attn.q_proj')");
  }
  for (size_t i = 0; i < plan.size(); ++i) {
    plan[i].second->src_data_rank = src_data_rank;
    for (const auto& [fqn, m] : targets[i]) plan[i].second->Apply(*m, fqn, tp_mesh);
  }
  return module;
}

}  // namespace fsdp::tensor_parallel
