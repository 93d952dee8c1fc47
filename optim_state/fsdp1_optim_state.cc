#include "optim_state/fsdp1_optim_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fsdp/common/flat_layout.h"
#include "fsdp/flat_param/flat_param.h"

namespace fsdp::optim_state {
namespace {

std::string Shape(c10::IntArrayRef s) { return absl::StrCat("[", absl::StrJoin(s, ", "), "]"); }

std::string Names(const std::vector<std::string>& names) { return absl::StrCat("[", absl::StrJoin(names, ", "), "]"); }

std::string ValueText(const StateValue& v) {
  if (const auto* t = std::get_if<at::Tensor>(&v)) return absl::StrCat(t->item<double>());
  if (const auto* i = std::get_if<int64_t>(&v)) return absl::StrCat(*i);
  return absl::StrCat(std::get<double>(v));
}

// The value's type for the seed's "same type" rule: positive-dim tensor, zero-dim tensor
// of a dtype, int, double.
std::string TypeKey(const StateValue& v) {
  switch (Classify(v)) {
    case StateKind::kPositiveDimTensor: return "tensor";
    case StateKind::kZeroDimTensor: return absl::StrCat("scalar tensor ", c10::toString(std::get<at::Tensor>(v).scalar_type()));
    case StateKind::kNonTensor: return std::holds_alternative<int64_t>(v) ? "int" : "float";
  }
  return "?";
}

}  // namespace

std::map<std::string, StateMap> UnflattenOptimState(const flat_param::FlatParamHandle& handle, const StateMap& flat_state,
                                                    const comm::ProcessGroupPtr& shard_group, const std::string& prefix) {
  const flat_param::FlatParameter& fp = handle.flat_param();
  const int64_t total = FlatTotalNumel(fp.segments);
  std::map<std::string, StateMap> out;
  for (const auto& [name, value] : flat_state) {
    if (Classify(value) != StateKind::kPositiveDimTensor) {
      for (const auto& fqn : fp.fqns) out[prefix + fqn][name] = value;
      continue;
    }
    at::Tensor local = std::get<at::Tensor>(value).contiguous().view(-1);
    at::Tensor full = local;
    if (shard_group && shard_group->size() > 1) {
      full = at::empty({local.numel() * shard_group->size()}, local.options());
      shard_group->all_gather_into_tensor(full, local)->wait();
    }
    TORCH_CHECK(full.numel() >= total, "UnflattenOptimState: state '", name, "' gathers ", full.numel(),
                " elements but the flat parameter has ", total);
    for (const FlatSegment& seg : fp.segments) {
      if (seg.param_index < 0) continue;  // padding
      out[prefix + fp.fqns[seg.param_index]][name] =
          full.narrow(0, seg.start, seg.numel).view(fp.shapes[seg.param_index]).clone();
    }
  }
  return out;
}

StateMap FlattenOptimState(const flat_param::FlatParamHandle& handle, const std::map<std::string, StateMap>& full,
                           int64_t rank, int64_t world_size, const std::string& prefix) {
  const flat_param::FlatParameter& fp = handle.flat_param();
  std::vector<std::string> fqns;
  std::vector<const StateMap*> states;
  std::set<std::string> names;
  bool first = true;
  for (const auto& fqn : fp.fqns) {
    fqns.push_back(prefix + fqn);
    auto it = full.find(prefix + fqn);
    states.push_back(it == full.end() ? nullptr : &it->second);
    if (it == full.end()) continue;
    std::set<std::string> mine;
    for (const auto& [name, v] : it->second) mine.insert(name);
    TORCH_CHECK(first || mine == names, "Differing optimizer state names for the unflattened parameters: ", Names(fqns));
    names = mine;
    first = false;
  }
  StateMap flat;
  if (first) return flat;  // no state at all (e.g. before the first step)
  const int64_t total = FlatTotalNumel(fp.segments);
  for (const std::string& name : names) {
    std::vector<const StateValue*> values;
    std::set<std::string> types;
    for (const StateMap* s : states) {
      values.push_back(s ? &s->at(name) : nullptr);
      if (s) types.insert(TypeKey(s->at(name)));
    }
    TORCH_CHECK(types.size() == 1, "Differing optimizer state types for state ", name,
                " and unflattened parameter names ", Names(fqns));
    if (*types.begin() == "tensor") {
      std::set<c10::ScalarType> dtypes;
      for (const StateValue* v : values) {
        if (v) dtypes.insert(std::get<at::Tensor>(*v).scalar_type());
      }
      TORCH_CHECK(dtypes.size() == 1, "All unflattened parameters comprising a single flattened parameter must have "
                  "positive-dimension tensor state with the same dtype for state ", name,
                  " and unflattened parameter names ", Names(fqns));
      // Zeros for parameters without the state (Adam's moments: zero == no state).
      at::Tensor flat_tensor = at::zeros({total}, at::TensorOptions(*dtypes.begin()));
      for (const FlatSegment& seg : fp.segments) {
        if (seg.param_index < 0 || values[seg.param_index] == nullptr) continue;
        const at::Tensor& t = std::get<at::Tensor>(*values[seg.param_index]);
        TORCH_CHECK(t.sizes().vec() == fp.shapes[seg.param_index],
                    "Tensor optimizer state does not have same shape as its parameter: ", Shape(t.sizes()), " ",
                    Shape(fp.shapes[seg.param_index]), " (state ", name, " of ", fqns[seg.param_index], ")");
        flat_tensor.narrow(0, seg.start, seg.numel).copy_(t.reshape(-1));
      }
      // This rank's chunk, zero padded as the flat parameter's shard (_get_shard).
      const FlatChunk chunk = MakeFlatChunk(total, world_size, rank);
      at::Tensor shard = at::zeros({chunk.chunk}, flat_tensor.options());
      if (chunk.end > chunk.start) shard.narrow(0, 0, chunk.end - chunk.start).copy_(flat_tensor.narrow(0, chunk.start, chunk.end - chunk.start));
      flat[name] = shard;
      continue;
    }
    // Scalar state: every original parameter has it, with one value (no value would mean,
    // e.g. for Adam's step, a different bias correction).
    std::set<std::string> texts;
    bool missing = false;
    for (const StateValue* v : values) {
      if (v) texts.insert(ValueText(*v));
      missing = missing || v == nullptr;
    }
    TORCH_CHECK(!missing && texts.size() == 1, "All unflattened parameters comprising a single flattened parameter must "
                "have scalar state with the same value and dtype but got values {",
                absl::StrJoin(texts, ", "), missing ? ", None" : "", "} for state ", name,
                " and unflattened parameter names ", Names(fqns));
    flat[name] = *values.front();
  }
  return flat;
}

}  // namespace fsdp::optim_state
