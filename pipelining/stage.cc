#include "pipelining/stage.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <sstream>
#include <utility>

#include "pipelining/microbatch.h"
#include "pipelining/split_backward.h"

namespace fsdp::pipelining {

// What one microbatch leaves between its actions.
struct PipelineStage::Microbatch {
  std::vector<at::Tensor> inputs;        // receive buffers or local inputs, then forward's leaves
  bool inputs_set = false;               // received (posted) or set locally
  std::vector<at::Tensor> outputs;       // forward's outputs (the backward's roots)
  std::vector<at::Tensor> sent_outputs;  // contiguous copies in flight to the next stage
  std::vector<at::Tensor> output_grads;  // one per floating output: received or set locally
  bool output_grads_set = false;
  std::vector<at::Tensor> input_grads;  // one per floating input, after backward
  // The weight half of a split backward, kept by I for W: where the parameters' gradients
  // continue from (pipelining/split_backward.h), or for a stage without differentiable
  // inputs (the first) the roots and their gradients, for a full backward in W.
  internal::WeightGradientPlan weight_plan;
  std::vector<at::Tensor> weight_roots;
  std::vector<at::Tensor> weight_root_grads;
  bool forwarded = false;
  bool backward_input_done = false;
  bool awaiting_weight = false;

  // Back to the state before a step, the lists keeping their memory.
  void Reset() {
    for (auto* list :
         {&inputs, &outputs, &sent_outputs, &output_grads, &input_grads, &weight_roots, &weight_root_grads}) {
      list->clear();
    }
    inputs_set = output_grads_set = forwarded = backward_input_done = awaiting_weight = false;
    weight_plan.groups.clear();
  }
};

namespace {

// The module's parameters that take gradients (the weight half's targets).
std::vector<at::Tensor> TrainableParameters(torch::nn::Module& module) {
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : module.parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  return params;
}

bool IsDifferentiable(at::ScalarType dtype) { return at::isFloatingType(dtype) || at::isComplexType(dtype); }

std::vector<TensorMeta> DifferentiableMeta(const std::vector<TensorMeta>& meta) {
  std::vector<TensorMeta> out;
  for (const TensorMeta& m : meta) {
    if (IsDifferentiable(m.dtype)) out.push_back(m);
  }
  return out;
}

std::string MetaList(const std::vector<TensorMeta>& meta) {
  std::string out = "(";
  for (size_t i = 0; i < meta.size(); ++i) out += (i ? ", " : "") + meta[i].ToString();
  return out + ")";
}

}  // namespace

TensorMeta TensorMeta::Of(const at::Tensor& tensor) { return TensorMeta{tensor.sizes().vec(), tensor.scalar_type()}; }

std::string TensorMeta::ToString() const {
  std::ostringstream os;
  os << c10::toString(dtype) << "[";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << "]";
  return os.str();
}

PipelineStage::PipelineStage(std::shared_ptr<torch::nn::Module> module, StageForward forward, int stage_index,
                             int num_stages, comm::ProcessGroupPtr group, PipelineStageOptions options)
    : module_(std::move(module)),
      forward_(std::move(forward)),
      stage_index_(stage_index),
      num_stages_(num_stages),
      group_(std::move(group)),
      device_(options.device),
      inputs_(std::move(options.inputs)),
      outputs_(std::move(options.outputs)),
      data_parallel_(std::move(options.data_parallel)),
      whole_backward_in_input_(options.whole_backward_in_input) {
  TORCH_CHECK(module_ != nullptr, "PipelineStage: module is null");
  TORCH_CHECK(static_cast<bool>(forward_), "PipelineStage: forward is empty");
  TORCH_CHECK(group_ != nullptr, "PipelineStage: group is null");
  TORCH_CHECK(num_stages_ >= 1, "PipelineStage: num_stages must be at least 1, got ", num_stages_);
  TORCH_CHECK(stage_index_ >= 0 && stage_index_ < num_stages_, "PipelineStage: stage_index ", stage_index_,
              " is outside [0, num_stages = ", num_stages_, ")");
  TORCH_CHECK(inputs_.empty() == outputs_.empty(), "PipelineStage: options give ", inputs_.size(), " input and ",
              outputs_.size(), " output metadata; give both or neither (neither: inferred at the first step)");
}

PipelineStage::~PipelineStage() = default;

void PipelineStage::ScaleGrads(int factor) {
  TORCH_CHECK(factor >= 1, "ScaleGrads: factor must be at least 1, got ", factor);
  if (factor == 1) return;
  for (at::Tensor& p : module_->parameters()) {
    if (p.grad().defined()) p.mutable_grad().div_(factor);
  }
}

void PipelineStage::BeginStep(int n_microbatches, std::function<int(int)> stage_to_rank) {
  n_microbatches_ = n_microbatches;
  stage_to_rank_ = std::move(stage_to_rank);
  microbatches_.resize(n_microbatches);
  for (Microbatch& m : microbatches_) m.Reset();
  for (std::vector<at::Tensor>& chunk : output_chunks_) chunk.clear();
  output_chunks_.resize(is_last() ? n_microbatches : 0);
}

int PipelineStage::PrevRank() const { return stage_to_rank_(stage_index_ - 1); }
int PipelineStage::NextRank() const { return stage_to_rank_(stage_index_ + 1); }

std::vector<TensorMeta> PipelineStage::InferMeta(const std::vector<at::Tensor>& first_args,
                                                 const std::vector<TensorMeta>& inputs,
                                                 const std::vector<at::Tensor>& kwargs) {
  std::vector<at::Tensor> in;
  if (is_first()) {
    in = first_args;
  } else {
    for (const TensorMeta& m : inputs)
      in.push_back(at::zeros(m.sizes, at::TensorOptions().dtype(m.dtype).device(device_)));
  }
  std::vector<TensorMeta> in_meta;
  for (const at::Tensor& t : in) in_meta.push_back(TensorMeta::Of(t));
  std::vector<at::Tensor> out;
  {
    at::NoGradGuard no_grad;
    in.insert(in.end(), kwargs.begin(), kwargs.end());
    out = forward_(in);
  }
  TORCH_CHECK(!out.empty(), "stage ", stage_index_, "'s forward returned no tensors");
  std::vector<TensorMeta> out_meta;
  for (const at::Tensor& t : out) {
    TORCH_CHECK(t.defined(), "stage ", stage_index_, "'s forward returned an undefined tensor");
    out_meta.push_back(TensorMeta::Of(t));
  }
  inputs_ = std::move(in_meta);
  outputs_ = std::move(out_meta);
  return outputs_;
}

void PipelineStage::CheckMicrobatch(int mb, const char* what) const {
  TORCH_CHECK(mb >= 0 && mb < n_microbatches_, "stage ", stage_index_, ": ", what, " of microbatch ", mb,
              " outside [0, n_microbatches = ", n_microbatches_, ")");
}

void PipelineStage::CheckAgainstMeta(const std::vector<at::Tensor>& tensors, const std::vector<TensorMeta>& all_meta,
                                     const char* what, int mb, bool differentiable_only) const {
  // Every microbatch passes here several times: compare in place, and build the lists for the
  // message only when something differs.
  size_t k = 0;
  bool same = true;
  for (const TensorMeta& m : all_meta) {
    if (differentiable_only && !IsDifferentiable(m.dtype)) continue;
    if (k == tensors.size()) {
      same = false;
      break;
    }
    const at::Tensor& t = tensors[k++];
    same = same && t.defined() && t.scalar_type() == m.dtype && t.sizes() == at::IntArrayRef(m.sizes);
  }
  if (same && k == tensors.size()) return;
  const std::vector<TensorMeta> meta = differentiable_only ? DifferentiableMeta(all_meta) : all_meta;
  std::vector<TensorMeta> got;
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.defined(), "stage ", stage_index_, " microbatch ", mb, ": an undefined tensor among its ", what);
    got.push_back(TensorMeta::Of(t));
  }
  TORCH_CHECK(got == meta, "stage ", stage_index_, " microbatch ", mb, ": its ", what, " are ", MetaList(got),
              ", the stage's metadata says ", MetaList(meta),
              " (given in PipelineStageOptions or inferred from microbatch 0; microbatches must agree)");
}

void PipelineStage::ForwardRecvOps(int mb, P2POps& ops) {
  CheckMicrobatch(mb, "RECV_F");
  TORCH_CHECK(!is_first(), "stage ", stage_index_, " is the first: it receives no activations");
  Microbatch& m = microbatches_[mb];
  TORCH_CHECK(!m.inputs_set, "stage ", stage_index_, " received microbatch ", mb, "'s inputs twice");
  ops.clear();
  m.inputs.clear();
  for (const TensorMeta& meta : inputs_) {
    m.inputs.push_back(at::empty(meta.sizes, at::TensorOptions().dtype(meta.dtype).device(device_)));
    ops.push_back({comm::ProcessGroup::P2POp::Kind::kRecv, m.inputs.back(), PrevRank(), 2 * (stage_index_ - 1)});
  }
  m.inputs_set = true;
}

void PipelineStage::ForwardSendOps(int mb, P2POps& ops) {
  CheckMicrobatch(mb, "SEND_F");
  TORCH_CHECK(!is_last(), "stage ", stage_index_, " is the last: it sends no activations");
  Microbatch& m = microbatches_[mb];
  TORCH_CHECK(m.forwarded, "stage ", stage_index_, " sends microbatch ", mb, "'s outputs before its forward");
  ops.clear();
  m.sent_outputs.clear();
  for (const at::Tensor& out : m.outputs) {
    m.sent_outputs.push_back(out.detach().contiguous());
    ops.push_back({comm::ProcessGroup::P2POp::Kind::kSend, m.sent_outputs.back(), NextRank(), ForwardTag()});
  }
}

void PipelineStage::ReleaseForwardSend(int mb) {
  if (mb >= 0 && mb < static_cast<int>(microbatches_.size())) microbatches_[mb].sent_outputs.clear();
}

void PipelineStage::BackwardRecvOps(int mb, P2POps& ops) {
  CheckMicrobatch(mb, "RECV_B");
  TORCH_CHECK(!is_last(), "stage ", stage_index_, " is the last: it receives no gradients");
  Microbatch& m = microbatches_[mb];
  TORCH_CHECK(!m.output_grads_set, "stage ", stage_index_, " received microbatch ", mb, "'s gradients twice");
  // Uninitialized buffers for the differentiable outputs' gradients, which the receives fill
  // (torch.empty, as PyTorch's _make_tensor_from_meta).
  ops.clear();
  m.output_grads.clear();
  for (const TensorMeta& meta : outputs_) {
    if (!IsDifferentiable(meta.dtype)) continue;
    m.output_grads.push_back(at::empty(meta.sizes, at::TensorOptions().dtype(meta.dtype).device(device_)));
    ops.push_back(
        {comm::ProcessGroup::P2POp::Kind::kRecv, m.output_grads.back(), NextRank(), 2 * (stage_index_ + 1) - 1});
  }
  m.output_grads_set = true;
}

void PipelineStage::BackwardSendOps(int mb, P2POps& ops) {
  CheckMicrobatch(mb, "SEND_B");
  TORCH_CHECK(!is_first(), "stage ", stage_index_, " is the first: it sends no gradients");
  Microbatch& m = microbatches_[mb];
  TORCH_CHECK(m.backward_input_done, "stage ", stage_index_, " sends microbatch ", mb,
              "'s input gradients before its backward");
  ops.clear();
  for (const at::Tensor& g : m.input_grads) {
    ops.push_back({comm::ProcessGroup::P2POp::Kind::kSend, g, PrevRank(), BackwardTag()});
  }
}

void PipelineStage::SetLocalForwardInput(int mb, const std::vector<at::Tensor>& previous_outputs) {
  CheckMicrobatch(mb, "a local forward input");
  Microbatch& m = microbatches_[mb];
  TORCH_CHECK(!m.inputs_set, "stage ", stage_index_, " got microbatch ", mb, "'s inputs twice");
  m.inputs.clear();
  for (const at::Tensor& t : previous_outputs) m.inputs.push_back(t.detach());
  m.inputs_set = true;
}

const std::vector<at::Tensor>& PipelineStage::Forward(int mb, const std::vector<at::Tensor>& args,
                                                      const std::vector<at::Tensor>& kwargs) {
  CheckMicrobatch(mb, "F");
  Microbatch& m = microbatches_[mb];
  TORCH_CHECK(!m.forwarded, "stage ", stage_index_, " ran microbatch ", mb, "'s forward twice");
  if (is_first()) {
    m.inputs = args;
  } else {
    TORCH_CHECK(m.inputs_set, "stage ", stage_index_, " computes microbatch ", mb, "'s forward before receiving it");
    // Receive buffers and SetLocalForwardInput's detached copies are leaves of no graph: they
    // become the backward's leaves in place.
    for (at::Tensor& t : m.inputs) {
      if (IsDifferentiable(t.scalar_type()) && !t.requires_grad()) t.requires_grad_(true);
    }
  }
  CheckAgainstMeta(m.inputs, inputs_, "inputs", mb);
  if (kwargs.empty()) {
    m.outputs = forward_(m.inputs);
  } else {
    std::vector<at::Tensor> in = m.inputs;
    in.insert(in.end(), kwargs.begin(), kwargs.end());
    m.outputs = forward_(in);
  }
  CheckAgainstMeta(m.outputs, outputs_, "outputs", mb);
  m.forwarded = true;
  // The last stage's outputs, for MergeOutputs: as PyTorch's output_chunks, the outputs
  // themselves (their graph's buffers go with the backward; merged without a graph).
  if (is_last()) output_chunks_[mb] = m.outputs;
  return m.outputs;
}

void PipelineStage::Backward(int mb, const at::Tensor& loss, BackwardPart part) {
  const bool full = part == BackwardPart::kFull;
  const bool whole = full || part == BackwardPart::kInputWithWeight || whole_backward_in_input_;
  CheckMicrobatch(mb, full ? "B" : "I");
  Microbatch& m = microbatches_[mb];
  TORCH_CHECK(m.forwarded, "stage ", stage_index_, " runs microbatch ", mb, "'s backward before its forward");
  TORCH_CHECK(!m.backward_input_done, "stage ", stage_index_, " ran microbatch ", mb, "'s backward twice");
  // Scratch lists kept by the stage, so a backward allocates none.
  std::vector<at::Tensor>& roots = scratch_roots_;
  std::vector<at::Tensor>& root_grads = scratch_root_grads_;
  std::vector<at::Tensor>& differentiable_inputs = scratch_inputs_;
  roots.clear();
  root_grads.clear();
  differentiable_inputs.clear();
  if (is_last()) {
    TORCH_CHECK(loss.defined(), "stage ", stage_index_, " is the last: its backward needs the microbatch's loss");
    roots.push_back(loss);
  } else {
    TORCH_CHECK(m.output_grads_set, "stage ", stage_index_, " runs microbatch ", mb,
                "'s backward before receiving its gradients");
    size_t k = 0;
    for (const at::Tensor& out : m.outputs) {
      if (!IsDifferentiable(out.scalar_type())) continue;
      const at::Tensor& g = m.output_grads[k++];
      if (out.requires_grad()) {
        roots.push_back(out);
        root_grads.push_back(g);
      }
    }
  }
  if (!is_first()) {
    for (const at::Tensor& t : m.inputs) {
      if (IsDifferentiable(t.scalar_type())) differentiable_inputs.push_back(t);
    }
  }
  m.input_grads.clear();
  if (whole) {
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    for (const at::Tensor& t : differentiable_inputs) {
      m.input_grads.push_back(t.grad().defined() ? t.grad() : at::zeros_like(t));
    }
    m.awaiting_weight = !full;  // W: nothing left to do
  } else if (!roots.empty() && !differentiable_inputs.empty()) {
    // Input half (PyTorch's stage_backward_input): the inputs' gradients, and what W needs to
    // compute the parameters' from where their paths join the inputs'. The graph above those
    // points goes with the outputs.
    const std::vector<at::Tensor> grads =
        internal::BackwardInput(roots, root_grads, differentiable_inputs, TrainableParameters(*module_), m.weight_plan);
    for (size_t i = 0; i < grads.size(); ++i) {
      m.input_grads.push_back(grads[i].defined() ? grads[i] : at::zeros_like(differentiable_inputs[i]));
    }
    m.outputs.clear();
    m.awaiting_weight = true;
  } else {
    // No input needs a gradient (the first stage): W is the whole backward, as PyTorch's.
    for (const at::Tensor& t : differentiable_inputs) m.input_grads.push_back(at::zeros_like(t));
    m.weight_roots = roots;
    m.weight_root_grads = root_grads;
    m.awaiting_weight = true;
  }
  m.backward_input_done = true;
  if (!is_first()) CheckAgainstMeta(m.input_grads, inputs_, "input gradients", mb, /*differentiable_only=*/true);
  if (whole) {
    m.outputs.clear();
    m.inputs.clear();
  }
  roots.clear();  // not to keep the graph alive until the next backward
  root_grads.clear();
  differentiable_inputs.clear();
}

void PipelineStage::BackwardWeight(int mb) {
  CheckMicrobatch(mb, "W");
  Microbatch& m = microbatches_[mb];
  TORCH_CHECK(m.awaiting_weight, "stage ", stage_index_, " runs microbatch ", mb,
              "'s weight backward (W) without its input backward (I) first");
  internal::BackwardWeight(m.weight_plan);
  if (!m.weight_roots.empty()) {
    const std::vector<at::Tensor> params = TrainableParameters(*module_);
    if (!params.empty()) {
      torch::autograd::backward(m.weight_roots, m.weight_root_grads, /*retain_graph=*/false,
                                /*create_graph=*/false, params);
    }
  }
  m.awaiting_weight = false;
  m.weight_roots.clear();
  m.weight_root_grads.clear();
  m.outputs.clear();
  m.inputs.clear();
}

std::vector<at::Tensor> PipelineStage::LocalBackwardOutput(int mb) const {
  TORCH_CHECK(mb >= 0 && mb < static_cast<int>(microbatches_.size()) && microbatches_[mb].backward_input_done, "stage ",
              stage_index_, " has no input gradients of microbatch ", mb, " yet");
  return microbatches_[mb].input_grads;
}

void PipelineStage::SetLocalBackwardInput(int mb, const std::vector<at::Tensor>& grads) {
  CheckMicrobatch(mb, "a local backward input");
  Microbatch& m = microbatches_[mb];
  TORCH_CHECK(!m.output_grads_set, "stage ", stage_index_, " got microbatch ", mb, "'s gradients twice");
  m.output_grads = grads;
  m.output_grads_set = true;
}

std::vector<at::Tensor> PipelineStage::MergeOutputs() {
  std::vector<at::Tensor> merged;
  {
    at::NoGradGuard no_grad;
    merged = MergeMicrobatches(output_chunks_);
  }
  for (std::vector<at::Tensor>& chunk : output_chunks_) chunk.clear();
  return merged;
}

}  // namespace fsdp::pipelining
