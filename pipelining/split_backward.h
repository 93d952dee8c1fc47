// The split backward of the zero-bubble schedules (PyTorch 2.15's
// torch/distributed/pipelining/_backward.py stage_backward_input / stage_backward_weight):
// the input half (I) computes the stage inputs' gradients and keeps, for each group of
// parameters, the gradients that flowed into the graph nodes where the parameters' gradient
// paths join the inputs' ("intermediates"); the weight half (W) starts from those nodes, so
// it computes only the parameters' part of the graph instead of walking it again from the
// stage's outputs.
//
// Preconditions: the graph of `roots` is alive (built under grad mode); `inputs` are the
// stage's differentiable inputs (leaves or not), `params` the stage's parameters. I runs
// with retain_graph so W can run later; W runs once and frees what it used. Parameter
// gradients accumulate through their AccumulateGrad nodes (their hooks run, as in a full
// backward). A parameter whose gradient path never joins an input's gets no gradient from W,
// as in PyTorch (the first stage, whose inputs need no gradient, does a full backward in W
// instead: pipelining/stage.cc).
//
// Thread-safety: one call at a time per graph.
#ifndef FSDP_PIPELINING_SPLIT_BACKWARD_H_
#define FSDP_PIPELINING_SPLIT_BACKWARD_H_

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <vector>

namespace fsdp::pipelining::internal {

// What I keeps for W (PyTorch's param_groups): per group, the intermediate nodes, the
// gradients flowing into each during I, and the parameters' gradient edges.
struct WeightGradientPlan {
  struct Group {
    std::vector<c10::intrusive_ptr<torch::autograd::Node>> intermediates;
    std::vector<torch::autograd::variable_list> grads;  // per intermediate; empty: it did not run
    std::vector<torch::autograd::Edge> params;
  };
  std::vector<Group> groups;
};

// stage_backward_input: the gradients of `inputs` (undefined where unused) from `roots` with
// `root_grads` (empty: `roots` is one scalar loss); fills `plan`.
std::vector<at::Tensor> BackwardInput(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& root_grads,
                                      const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& params,
                                      WeightGradientPlan& plan);

// stage_backward_weight: accumulates the parameters' gradients from `plan`, then clears it.
void BackwardWeight(WeightGradientPlan& plan);

}  // namespace fsdp::pipelining::internal

#endif  // FSDP_PIPELINING_SPLIT_BACKWARD_H_
