#include "pipelining/split_backward.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace fsdp::pipelining::internal {
namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;
using NodePtr = c10::intrusive_ptr<Node>;

// _get_grad_fn_or_grad_acc: the node a tensor's gradient flows into (null when none exists:
// it does not require grad, or is a leaf no operation recorded).
NodePtr GradFnOrAccumulator(const at::Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return NodePtr();
  if (t.grad_fn()) return t.grad_fn();
  return torch::autograd::impl::try_get_grad_accumulator(t);
}

// construct_reverse_graph: the nodes reachable from `roots`, numbered in the order a
// breadth-first walk meets them, and for each the nodes whose next edge it is (its
// consumers). Arrays indexed by number rather than a map of sets: the walk runs for every I
// of every microbatch, so it allocates a few arrays, not one per node.
struct ReverseGraph {
  explicit ReverseGraph(const std::vector<NodePtr>& roots) {
    std::vector<std::pair<int, int>> edges;  // (node, a consumer of it)
    for (const NodePtr& root : roots) {
      if (root && index.emplace(root.get(), static_cast<int>(nodes.size())).second) nodes.push_back(root.get());
    }
    for (size_t head = 0; head < nodes.size(); ++head) {
      for (const Edge& edge : nodes[head]->next_edges()) {
        Node* next = edge.function.get();
        if (next == nullptr) continue;
        auto [it, inserted] = index.emplace(next, static_cast<int>(nodes.size()));
        if (inserted) nodes.push_back(next);
        edges.emplace_back(it->second, static_cast<int>(head));
      }
    }
    first_consumer.assign(nodes.size() + 1, 0);
    for (const auto& [node, consumer] : edges) ++first_consumer[node + 1];
    for (size_t i = 1; i < first_consumer.size(); ++i) first_consumer[i] += first_consumer[i - 1];
    consumers.resize(edges.size());
    std::vector<int> fill(first_consumer.begin(), first_consumer.end() - 1);
    for (const auto& [node, consumer] : edges) consumers[fill[node]++] = consumer;
  }
  // The number of `node`, or -1 when the walk did not meet it.
  int IndexOf(const NodePtr& node) const {
    auto it = index.find(node.get());
    return it == index.end() ? -1 : it->second;
  }

  absl::flat_hash_map<Node*, int> index;
  std::vector<Node*> nodes;
  std::vector<int> first_consumer;  // node i's consumers: consumers[first_consumer[i], first_consumer[i + 1])
  std::vector<int> consumers;
};

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
// one group (merged transitively, so each parameter is in exactly one). A path joins the
// inputs' at the first node on it (walking from the parameter towards the roots) that the
// inputs' gradients flow through (reverse_closure of the inputs).
std::vector<WeightGradientPlan::Group> ParamGroups(const std::vector<NodePtr>& input_nodes,
                                                   const std::vector<NodePtr>& param_nodes, const ReverseGraph& graph) {
  const size_t n = graph.nodes.size();
  std::vector<int> queue;
  std::vector<char> inputs_closure(n, 0);
  for (const NodePtr& node : input_nodes) {
    const int i = graph.IndexOf(node);
    if (i >= 0 && !inputs_closure[i]) {
      inputs_closure[i] = 1;
      queue.push_back(i);
    }
  }
  for (size_t head = 0; head < queue.size(); ++head) {
    for (int k = graph.first_consumer[queue[head]]; k < graph.first_consumer[queue[head] + 1]; ++k) {
      const int consumer = graph.consumers[k];
      if (!inputs_closure[consumer]) {
        inputs_closure[consumer] = 1;
        queue.push_back(consumer);
      }
    }
  }
  // Per parameter, the walk's visited marks and the met nodes, stamped with the parameter's
  // number + 1 so the arrays need no clearing between parameters.
  std::vector<size_t> visited(n, 0), met_stamp(n, 0);
  std::vector<std::vector<int>> met(param_nodes.size());
  for (size_t p = 0; p < param_nodes.size(); ++p) {
    const int start = graph.IndexOf(param_nodes[p]);
    if (start < 0) continue;  // not in the roots' graph: no path at all
    const size_t stamp = p + 1;
    queue.assign(1, start);
    visited[start] = stamp;
    for (size_t head = 0; head < queue.size(); ++head) {
      for (int k = graph.first_consumer[queue[head]]; k < graph.first_consumer[queue[head] + 1]; ++k) {
        const int consumer = graph.consumers[k];
        if (visited[consumer] == stamp) continue;
        if (inputs_closure[consumer]) {
          if (met_stamp[consumer] != stamp) {
            met_stamp[consumer] = stamp;
            met[p].push_back(consumer);
          }
          continue;
        }
        visited[consumer] = stamp;
        queue.push_back(consumer);
      }
    }
    std::sort(met[p].begin(), met[p].end());  // the walk's order: deterministic for a graph's shape
  }
  // Union-find over the parameters, keyed by the intermediates they meet.
  std::vector<size_t> parent(param_nodes.size());
  for (size_t i = 0; i < parent.size(); ++i) parent[i] = i;
  const auto find = [&](size_t i) {
    while (parent[i] != i) i = parent[i] = parent[parent[i]];
    return i;
  };
  std::vector<size_t> owner(n, SIZE_MAX);  // intermediate -> a parameter meeting it
  for (size_t p = 0; p < param_nodes.size(); ++p) {
    for (int node : met[p]) {
      if (owner[node] == SIZE_MAX) {
        owner[node] = p;
      } else {
        parent[find(p)] = find(owner[node]);
      }
    }
  }
  std::vector<size_t> group_of_root(param_nodes.size(), SIZE_MAX);
  std::vector<WeightGradientPlan::Group> groups;
  std::vector<char> placed(n, 0);
  for (size_t p = 0; p < param_nodes.size(); ++p) {
    if (met[p].empty()) continue;  // no path to an input's: PyTorch's param_groups leave it out
    size_t& group = group_of_root[find(p)];
    if (group == SIZE_MAX) {
      group = groups.size();
      groups.emplace_back();
    }
    WeightGradientPlan::Group& g = groups[group];
    g.params.emplace_back(param_nodes[p], 0);
    for (int node : met[p]) {
      if (!placed[node]) {
        placed[node] = 1;
        g.intermediates.push_back(NodePtr::unsafe_reclaim_from_nonowning(graph.nodes[node]));
      }
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
