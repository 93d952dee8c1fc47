#include "optim_state/optimizer_adapter.h"

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <c10/util/Type.h>

#include <algorithm>
#include <mutex>
#include <typeinfo>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "optim_state/builtin_adapters.h"

namespace fsdp::optim_state {
namespace {

class Registry {
 public:
  static Registry& Get() {
    static Registry* registry = new Registry();  // never destroyed: lookups may run at exit
    return *registry;
  }

  void Add(std::shared_ptr<const OptimizerAdapter> adapter) {
    TORCH_CHECK(adapter != nullptr, "RegisterOptimizerAdapter: the adapter is null");
    TORCH_CHECK(!adapter->name().empty(), "RegisterOptimizerAdapter: the adapter's name is empty");
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& a : adapters_) {
      TORCH_CHECK(a->name() != adapter->name(), "RegisterOptimizerAdapter: an optimizer adapter named '",
                  adapter->name(), "' is already registered");
    }
    adapters_.push_back(std::move(adapter));
  }

  std::shared_ptr<const OptimizerAdapter> For(const torch::optim::Optimizer& optimizer) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = adapters_.rbegin(); it != adapters_.rend(); ++it) {
      if ((*it)->Matches(optimizer)) return *it;
    }
    return nullptr;
  }

  std::shared_ptr<const OptimizerAdapter> ForOrThrow(const torch::optim::Optimizer& optimizer) const {
    std::shared_ptr<const OptimizerAdapter> adapter = For(optimizer);
    if (adapter != nullptr) return adapter;
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(false, "optimizer state dicts: no optimizer adapter matches optimizer type ",
                c10::demangle(typeid(optimizer).name()), "; registered adapters: [", absl::StrJoin(NamesLocked(), ", "),
                "] (register one with fsdp::optim_state::RegisterOptimizerAdapter, optim_state/optimizer_adapter.h)");
    return nullptr;
  }

  std::vector<std::string> Names() const {
    std::lock_guard<std::mutex> lock(mu_);
    return NamesLocked();
  }

 private:
  Registry() {
    for (auto& adapter : internal::BuiltinOptimizerAdapters()) adapters_.push_back(std::move(adapter));
  }

  std::vector<std::string> NamesLocked() const {
    std::vector<std::string> names;
    for (const auto& a : adapters_) names.push_back(a->name());
    std::sort(names.begin(), names.end());
    return names;
  }

  mutable std::mutex mu_;
  std::vector<std::shared_ptr<const OptimizerAdapter>> adapters_;
};

const StateValue& Find(const StateMap& state, const std::string& fqn, const std::string& name) {
  auto it = state.find(name);
  TORCH_CHECK(it != state.end(), "optimizer state of '", fqn, "' has no '", name, "'");
  return it->second;
}

template <class T>
const T& Typed(const StateValue& value, const std::string& fqn, const std::string& name, const char* want) {
  const T* typed = std::get_if<T>(&value);
  TORCH_CHECK(typed != nullptr, "optimizer state '", name, "' of '", fqn, "' has the wrong type (expected ", want, ")");
  return *typed;
}

double AsDouble(const c10::IValue& v, const std::string& name) {
  TORCH_CHECK(v.isDouble() || v.isInt(), "param group option '", name, "' is a ", v.tagKind(), ", not a float");
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}

}  // namespace

at::Tensor ParamStateReader::Tensor(const std::string& name) const {
  const at::Tensor& t = Typed<at::Tensor>(Find(state_, fqn_, name), fqn_, name, "a tensor");
  TORCH_CHECK(t.sizes() == param_.sizes(), "optimizer state '", name, "' of '", fqn_, "' has shape ",
              c10::str(c10::IntArrayRef(t.sizes())), " but the parameter has shape ",
              c10::str(c10::IntArrayRef(param_.sizes())));
  at::Tensor on_param = t.to(param_.options());  // `t` itself when it is already there
  if (!on_param.is_same(t)) return on_param;     // a fresh tensor: no second copy
  return adopt_ ? on_param : on_param.clone();
}

at::Tensor ParamStateReader::OptionalTensor(const std::string& name) const {
  return Has(name) ? Tensor(name) : at::Tensor();
}

int64_t ParamStateReader::Int(const std::string& name) const {
  return Typed<int64_t>(Find(state_, fqn_, name), fqn_, name, "an int");
}

int64_t ParamStateReader::Step(const std::string& name) const {
  const int64_t step = Int(name);
  TORCH_CHECK(step >= 0, "optimizer state '", name, "' of '", fqn_, "' is ", step, " (negative)");
  return step;
}

double ParamStateReader::Double(const std::string& name) const {
  const StateValue& v = Find(state_, fqn_, name);
  if (const auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  return Typed<double>(v, fqn_, name, "a float");
}

const c10::IValue& OptionReader::Get(const std::string& name) const {
  auto it = options_.find(name);
  TORCH_CHECK(it != options_.end(), "the optimizer state's param group has no option '", name, "'");
  return it->second;
}

double OptionReader::Double(const std::string& name) const { return AsDouble(Get(name), name); }

bool OptionReader::Bool(const std::string& name) const {
  const c10::IValue& v = Get(name);
  TORCH_CHECK(v.isBool(), "param group option '", name, "' is a ", v.tagKind(), ", not a bool");
  return v.toBool();
}

std::pair<double, double> OptionReader::DoublePair(const std::string& name) const {
  const c10::IValue& v = Get(name);
  TORCH_CHECK(v.isTuple() && v.toTupleRef().elements().size() == 2, "param group option '", name, "' is a ",
              v.tagKind(), ", not a pair of floats");
  return {AsDouble(v.toTupleRef().elements()[0], name), AsDouble(v.toTupleRef().elements()[1], name)};
}

void RegisterOptimizerAdapter(std::shared_ptr<const OptimizerAdapter> adapter) {
  Registry::Get().Add(std::move(adapter));
}

std::shared_ptr<const OptimizerAdapter> OptimizerAdapterFor(const torch::optim::Optimizer& optimizer) {
  return Registry::Get().ForOrThrow(optimizer);
}

std::vector<std::string> RegisteredOptimizerAdapters() { return Registry::Get().Names(); }

}  // namespace fsdp::optim_state
