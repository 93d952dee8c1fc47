#include "pipelining/split_backward.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace fsdp::pipelining::internal {
namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;
using NodePtr = c10::intrusive_ptr<Node>;
using NodeSet = absl::flat_hash_set<Node*>;

// _get_grad_fn_or_grad_acc: the node a tensor's gradient flows into (null when none exists:
// it does not require grad, or is a leaf no operation recorded).
NodePtr GradFnOrAccumulator(const at::Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return NodePtr();
  if (t.grad_fn()) return t.grad_fn();
  return torch::autograd::impl::try_get_grad_accumulator(t);
}

// construct_reverse_graph: each node reachable from `roots` -> the nodes whose next edge it is.
absl::flat_hash_map<Node*, std::vector<Node*>> ReverseGraph(const std::vector<NodePtr>& roots) {
  absl::flat_hash_map<Node*, std::vector<Node*>> reverse;
  std::deque<Node*> queue;
  NodeSet seen;
  for (const NodePtr& root : roots) {
    if (root && seen.insert(root.get()).second) queue.push_back(root.get());
  }
  while (!queue.empty()) {
    Node* node = queue.front();
    queue.pop_front();
    for (const Edge& edge : node->next_edges()) {
      Node* next = edge.function.get();
      if (next == nullptr) continue;
      if (seen.insert(next).second) queue.push_back(next);
      reverse[next].push_back(node);
    }
  }
  return reverse;
}

// reverse_closure: the nodes reached from `starts` along reverse edges without entering
// `targets`, and the targets met on the way.
std::pair<NodeSet, NodeSet> ReverseClosure(const std::vector<Node*>& starts, const NodeSet& targets,
                                           const absl::flat_hash_map<Node*, std::vector<Node*>>& reverse) {
  NodeSet closure, met;
  std::deque<Node*> queue;
  for (Node* n : starts) {
    if (n != nullptr && closure.insert(n).second) queue.push_back(n);
  }
  while (!queue.empty()) {
    Node* node = queue.front();
    queue.pop_front();
    auto it = reverse.find(node);
    if (it == reverse.end()) continue;
    for (Node* consumer : it->second) {
      if (closure.contains(consumer)) continue;
      if (targets.contains(consumer)) {
        met.insert(consumer);
        continue;
      }
      closure.insert(consumer);
      queue.push_back(consumer);
    }
  }
  return {std::move(closure), std::move(met)};
}

// A pre-hook on an intermediate node: in I it records the gradients flowing into the node; in
// W (`replace`) it feeds the node what I recorded, whatever reaches it from the other roots.
class GradientHook : public torch::autograd::FunctionPreHook {
 public:
  GradientHook(variable_list* slot, bool replace) : slot_(slot), replace_(replace) {}
  variable_list operator()(const variable_list& grads) override {
    if (replace_) return *slot_;
    *slot_ = grads;
    return grads;
  }

 private:
  variable_list* slot_;
  bool replace_;
};

// Removes the hooks it added when it goes out of scope (also on exceptions).
class HookGuard {
 public:
  HookGuard() = default;
  HookGuard(const HookGuard&) = delete;
  HookGuard& operator=(const HookGuard&) = delete;
  ~HookGuard() {
    for (auto& [node, hook] : added_) {
      auto& hooks = node->pre_hooks();
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.get() == hook; }),
                  hooks.end());
    }
  }
  void Add(const NodePtr& node, variable_list* slot, bool replace) {
    auto hook = std::make_unique<GradientHook>(slot, replace);
    added_.emplace_back(node, hook.get());
    node->add_pre_hook(std::move(hook));
  }

 private:
  std::vector<std::pair<NodePtr, torch::autograd::FunctionPreHook*>> added_;
};

// get_param_groups: parameters whose gradient paths join the inputs' at the same nodes form
// one group (merged transitively, so each parameter is in exactly one).
std::vector<WeightGradientPlan::Group> ParamGroups(const std::vector<NodePtr>& input_nodes,
                                                   const std::vector<NodePtr>& param_nodes,
                                                   const absl::flat_hash_map<Node*, std::vector<Node*>>& reverse) {
  std::vector<Node*> inputs;
  for (const NodePtr& n : input_nodes) inputs.push_back(n.get());
  const NodeSet inputs_closure = ReverseClosure(inputs, {}, reverse).first;
  // Union-find over the parameters, keyed by the intermediates they meet.
  std::vector<size_t> parent(param_nodes.size());
  for (size_t i = 0; i < parent.size(); ++i) parent[i] = i;
  const auto find = [&](size_t i) {
    while (parent[i] != i) i = parent[i] = parent[parent[i]];
    return i;
  };
  absl::flat_hash_map<Node*, size_t> owner;  // intermediate -> a parameter meeting it
  std::vector<std::vector<Node*>> met(param_nodes.size());
  for (size_t i = 0; i < param_nodes.size(); ++i) {
    NodeSet hit = ReverseClosure({param_nodes[i].get()}, inputs_closure, reverse).second;
    met[i].assign(hit.begin(), hit.end());
    std::sort(met[i].begin(), met[i].end());  // a deterministic order
    for (Node* node : met[i]) {
      auto [it, inserted] = owner.emplace(node, i);
      if (!inserted) parent[find(i)] = find(it->second);
    }
  }
  absl::flat_hash_map<size_t, size_t> group_of_root;
  std::vector<WeightGradientPlan::Group> groups;
  absl::flat_hash_set<Node*> placed;
  for (size_t i = 0; i < param_nodes.size(); ++i) {
    if (met[i].empty()) continue;  // no path to an input's: PyTorch's param_groups leave it out
    auto [it, inserted] = group_of_root.emplace(find(i), groups.size());
    if (inserted) groups.emplace_back();
    WeightGradientPlan::Group& g = groups[it->second];
    g.params.emplace_back(param_nodes[i], 0);
    for (Node* node : met[i]) {
      if (placed.insert(node).second) g.intermediates.push_back(NodePtr::unsafe_reclaim_from_nonowning(node));
    }
  }
  for (WeightGradientPlan::Group& g : groups) g.grads.resize(g.intermediates.size());
  return groups;
}

}  // namespace

std::vector<at::Tensor> BackwardInput(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& root_grads,
                                      const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& params,
                                      WeightGradientPlan& plan) {
  TORCH_CHECK(root_grads.empty() || root_grads.size() == roots.size(), "BackwardInput: ", root_grads.size(),
              " root gradients for ", roots.size(), " roots");
  std::vector<NodePtr> root_nodes, input_nodes, param_nodes;
  for (const at::Tensor& r : roots) root_nodes.push_back(GradFnOrAccumulator(r));
  std::vector<at::Tensor> inputs_with_grad;
  std::vector<size_t> with_grad_index;  // into `inputs`
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (NodePtr n = GradFnOrAccumulator(inputs[i])) {
      input_nodes.push_back(std::move(n));
      inputs_with_grad.push_back(inputs[i]);
      with_grad_index.push_back(i);
    }
  }
  for (const at::Tensor& p : params) {
    if (NodePtr n = GradFnOrAccumulator(p)) param_nodes.push_back(std::move(n));
  }
  plan.groups = ParamGroups(input_nodes, param_nodes, ReverseGraph(root_nodes));
  std::vector<at::Tensor> grads(inputs.size());
  if (inputs_with_grad.empty() || roots.empty()) return grads;
  {
    HookGuard hooks;
    for (WeightGradientPlan::Group& g : plan.groups) {
      for (size_t i = 0; i < g.intermediates.size(); ++i) hooks.Add(g.intermediates[i], &g.grads[i], false);
    }
    const std::vector<at::Tensor> computed = torch::autograd::grad(roots, inputs_with_grad, root_grads,
                                                                   /*retain_graph=*/true, /*create_graph=*/false,
                                                                   /*allow_unused=*/true);
    for (size_t k = 0; k < computed.size(); ++k) grads[with_grad_index[k]] = computed[k];
  }
  return grads;
}

void BackwardWeight(WeightGradientPlan& plan) {
  for (WeightGradientPlan::Group& g : plan.groups) {
    torch::autograd::edge_list roots;
    variable_list root_grads;
    for (size_t i = 0; i < g.intermediates.size(); ++i) {
      for (size_t k = 0; k < g.grads[i].size(); ++k) {
        if (!g.grads[i][k].defined()) continue;
        roots.emplace_back(g.intermediates[i], static_cast<uint32_t>(k));
        root_grads.push_back(g.grads[i][k]);
      }
    }
    if (roots.empty()) continue;
    HookGuard hooks;
    // With several intermediates one may lie below another: each gets exactly what it got in
    // I, not that plus what W sends it from the other roots.
    if (g.intermediates.size() > 1) {
      for (size_t i = 0; i < g.intermediates.size(); ++i) {
        if (!g.grads[i].empty()) hooks.Add(g.intermediates[i], &g.grads[i], true);
      }
    }
    torch::autograd::Engine::get_default_engine().execute(roots, root_grads, /*keep_graph=*/false,
                                                          /*create_graph=*/false, /*accumulate_grad=*/true, g.params);
  }
  plan.groups.clear();
}

}  // namespace fsdp::pipelining::internal
