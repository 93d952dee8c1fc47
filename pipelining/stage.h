// PipelineStage: one stage of a pipeline, a chunk of a model on this rank, as PyTorch 2.15's
// torch/distributed/pipelining/stage.py PipelineStage.
//
//   auto stage = std::make_shared<pipelining::PipelineStage>(
//       chunk, [chunk](const std::vector<at::Tensor>& in) { return std::vector{chunk->forward(in[0])}; },
//       /*stage_index=*/rank, /*num_stages=*/pp, pp_group);
//
// A stage runs its forward once per microbatch, keeps what backward needs, and runs the full
// backward (B) or the split one (I: gradients of its inputs, then W: of its parameters, for
// the zero-bubble schedules). A PipelineSchedule (pipelining/pipeline_schedule.h) drives it
// and moves activations and gradients between ranks with `group`'s send / recv.
//
// Activations are tensors: a stage takes a vector (the previous stage's outputs; the
// pipeline's arguments on the first stage) and returns a vector. A floating-point input gets
// a gradient, sent back to the previous stage; other inputs (token ids) do not. Shapes and
// dtypes per microbatch are given (options.inputs / outputs, PyTorch's input_args /
// output_args) or inferred at the first step from one forward of microbatch 0 under no-grad,
// the shapes passing from stage to stage (PyTorch's dynamic metadata inference); at every
// step each forward's inputs and outputs are checked against them (a mismatch is an error
// naming the stage, the tensor and both shapes).
//
// Contract: `module` owns the stage's parameters (their gradients accumulate there);
// `forward` may capture anything but must compute from its inputs and those parameters.
// stage_index in [0, num_stages); `group` is the pipeline's group, stage i living on rank
// StageRank(kind, i, group->size()) of it (the schedule checks). Not thread-safe: one rank's
// thread uses it, through one schedule at a time. Errors: c10::Error naming the argument.
#ifndef FSDP_PIPELINING_STAGE_H_
#define FSDP_PIPELINING_STAGE_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/process_group.h"

namespace fsdp::pipelining {

// A stage's forward of one microbatch: `in` holds its inputs (the first stage's arguments, or
// the activations the previous stage sent) followed by the microbatch's kwargs (PyTorch's
// keyword arguments of step(): tensors every rank passes, given to every stage, never sent).
using StageForward = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& in)>;

// The shape and dtype of one activation of one microbatch.
struct TensorMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  static TensorMeta Of(const at::Tensor& tensor);
  std::string ToString() const;  // "float[2, 8]"
  friend bool operator==(const TensorMeta&, const TensorMeta&) = default;
};

// What a data-parallel wrapper of the stage's module (FSDP2's fully_shard; the trainer's
// train/pipeline_fsdp.h implements it) does at the schedule's actions, as PyTorch's runtime
// does for a stage whose module is an FSDPModule (torch/distributed/pipelining/schedules.py
// _PipelineScheduleRuntime, stage.py backward_maybe_with_nosync / start_gradient_reduction):
// gather at UNSHARD and wait before the stage computes, free at RESHARD, accumulate the
// microbatches' gradients without reducing them, reduce them once at REDUCE_GRAD.
class StageDataParallel {
 public:
  virtual ~StageDataParallel() = default;
  virtual void Unshard() = 0;      // UNSHARD: issue the parameters' all-gathers
  virtual void WaitUnshard() = 0;  // before the stage's next computation after Unshard
  virtual void Reshard() = 0;      // RESHARD: free the gathered parameters
  // Before each backward (B, I or W): gradients accumulate, unreduced and unsharded.
  virtual void BeforeBackward() = 0;
  // REDUCE_GRAD, after the stage's last backward of the step: reduce the accumulated
  // gradients (FSDP: the one reduce-scatter) and reshard. Synchronous.
  virtual void ReduceGrad() = 0;
};

struct PipelineStageOptions {
  // Static metadata of one microbatch's inputs and outputs; empty: inferred at the first step.
  std::vector<TensorMeta> inputs;
  std::vector<TensorMeta> outputs;
  // Where the stage computes (PyTorch's `device` argument): its receive buffers, the inputs of
  // its metadata inference and the metadata messages are allocated there. The module's
  // parameters and the first stage's arguments must live there too, and `group` must move
  // tensors of it (NCCL: a CUDA device; Gloo: the CPU).
  c10::Device device = c10::kCPU;
  // The data-parallel wrapper of `module`, if any (null: none; UNSHARD, RESHARD do nothing).
  std::shared_ptr<StageDataParallel> data_parallel;
  // The input half of a split backward (I) runs the whole backward and the weight half (W)
  // nothing, the schedule's order of actions and communication unchanged. For modules whose
  // backward cannot be split: a region of fsdp/activation_checkpointing (a reentrant
  // checkpoint) runs a nested backward, which a backward restricted to some inputs may not
  // contain (PyTorch's non-reentrant checkpoint can; LibTorch has no saved-tensor hooks).
  bool whole_backward_in_input = false;
};

class PipelineSchedule;

class PipelineStage {
 public:
  PipelineStage(std::shared_ptr<torch::nn::Module> module, StageForward forward, int stage_index, int num_stages,
                comm::ProcessGroupPtr group, PipelineStageOptions options = {});
  ~PipelineStage();
  PipelineStage(const PipelineStage&) = delete;
  PipelineStage& operator=(const PipelineStage&) = delete;

  int stage_index() const { return stage_index_; }
  int num_stages() const { return num_stages_; }
  bool is_first() const { return stage_index_ == 0; }
  bool is_last() const { return stage_index_ == num_stages_ - 1; }
  torch::nn::Module& module() { return *module_; }
  const std::shared_ptr<torch::nn::Module>& module_ptr() const { return module_; }
  const comm::ProcessGroupPtr& group() const { return group_; }
  c10::Device device() const { return device_; }
  StageDataParallel* data_parallel() const { return data_parallel_.get(); }
  // Empty until given or inferred.
  const std::vector<TensorMeta>& input_meta() const { return inputs_; }
  const std::vector<TensorMeta>& output_meta() const { return outputs_; }

  // Divides every parameter gradient by `factor` (PyTorch's scale_grads; the schedule calls
  // it after the last backward when scale_grads is on: the loss of each microbatch is a mean
  // over that microbatch, the step's gradient the mean over microbatches).
  void ScaleGrads(int factor);

 private:
  friend class PipelineSchedule;
  struct Microbatch;

  // The schedule's side (pipelining/pipeline_schedule.cc).
  void BeginStep(int n_microbatches, std::function<int(int)> stage_to_rank);
  bool has_meta() const { return !inputs_.empty() && !outputs_.empty(); }
  // Metadata inference of this stage: `inputs` are the microbatch-0 arguments (first stage)
  // or the previous stage's output metadata; `kwargs` microbatch 0's. Returns the output metadata.
  std::vector<TensorMeta> InferMeta(const std::vector<at::Tensor>& first_args, const std::vector<TensorMeta>& inputs,
                                    const std::vector<at::Tensor>& kwargs = {});
  int PrevRank() const;
  int NextRank() const;
  // Tags of this stage's traffic: its activations to stage+1 and its gradients to stage-1
  // (one tag per direction and stage pair, so nothing of one stage can match another's).
  int ForwardTag() const { return 2 * stage_index_; }
  int BackwardTag() const { return 2 * stage_index_ - 1; }

  // The sends and receives of microbatch mb's activations and gradients, written over `ops`.
  using P2POps = std::vector<comm::ProcessGroup::P2POp>;
  void ForwardRecvOps(int mb, P2POps& ops);
  void ForwardSendOps(int mb, P2POps& ops);
  void BackwardRecvOps(int mb, P2POps& ops);
  void BackwardSendOps(int mb, P2POps& ops);
  void ReleaseForwardSend(int mb);

  // Forward of microbatch mb: `args` on the first stage, the received (or locally set) inputs
  // otherwise, then `kwargs`. Returns the outputs (kept for backward and, on the last stage,
  // for the merge), valid until the microbatch's backward.
  const std::vector<at::Tensor>& Forward(int mb, const std::vector<at::Tensor>& args,
                                         const std::vector<at::Tensor>& kwargs = {});
  void SetLocalForwardInput(int mb, const std::vector<at::Tensor>& previous_outputs);
  // Full (B) or input-only (I) backward of microbatch mb; `loss` on the last stage.
  // kInputWithWeight: I that also runs what W would (W then has nothing left to do), the same
  // gradients in one autograd pass instead of two; PipelineSchedule asks for it when an I's
  // next action (past waits for sends) is its own W.
  enum class BackwardPart { kFull, kInput, kInputWithWeight };
  void Backward(int mb, const at::Tensor& loss, BackwardPart part);
  // The weight half (W) after an input-only backward.
  void BackwardWeight(int mb);
  std::vector<at::Tensor> LocalBackwardOutput(int mb) const;
  void SetLocalBackwardInput(int mb, const std::vector<at::Tensor>& grads);
  // The last stage's outputs of this step, merged along the batch dim, without a graph.
  std::vector<at::Tensor> MergeOutputs();

  void CheckMicrobatch(int mb, const char* what) const;
  // `tensors` against `meta` (against its differentiable entries only, if so asked).
  void CheckAgainstMeta(const std::vector<at::Tensor>& tensors, const std::vector<TensorMeta>& meta, const char* what,
                        int mb, bool differentiable_only = false) const;

  std::shared_ptr<torch::nn::Module> module_;
  StageForward forward_;
  int stage_index_;
  int num_stages_;
  comm::ProcessGroupPtr group_;
  c10::Device device_;
  std::vector<TensorMeta> inputs_;
  std::vector<TensorMeta> outputs_;
  std::shared_ptr<StageDataParallel> data_parallel_;
  bool whole_backward_in_input_ = false;
  std::function<int(int)> stage_to_rank_;
  int n_microbatches_ = 0;
  std::vector<Microbatch> microbatches_;                // n_microbatches_ of them, reset by BeginStep
  std::vector<std::vector<at::Tensor>> output_chunks_;  // by microbatch, on the last stage
  std::vector<at::Tensor> scratch_roots_, scratch_root_grads_, scratch_inputs_;  // Backward's, empty between calls
};

}  // namespace fsdp::pipelining

#endif  // FSDP_PIPELINING_STAGE_H_
