// The training the Llama parity test and the Llama demo share, mirroring Hugging Face's side
// (testdata/hf_llama_reference.py, testdata/hf_llama_fsdp2.py): the tiny config, AdamW with
// weight decay, clip_grad_norm_ at 1.0, FSDP2 per decoder layer and then the root, each rank
// on its rows of a global batch.
#ifndef FSDP_EXAMPLES_LLAMA_LLAMA_TRAINING_H_
#define FSDP_EXAMPLES_LLAMA_LLAMA_TRAINING_H_

#include <torch/optim/adamw.h>

#include <memory>
#include <string>

#include "checkpoint/tensor_dict_file.h"
#include "comm/process_group.h"
#include "mesh/device_mesh.h"
#include "models/llama/model.h"

namespace fsdp::examples::llama {

// hf_llama_reference.py's config and constants.
models::llama::LlamaConfig HfReferenceConfig();
// hf_llama_2d.py's: HfReferenceConfig with 8 query and 4 key/value heads (head_dim 4), so
// that tp = 4 still holds whole heads and grouped-query attention (2 query heads per kv).
models::llama::LlamaConfig TwoDReferenceConfig();
inline constexpr double kLr = 1e-2, kWeightDecay = 0.1, kMaxNorm = 1.0;
inline constexpr int64_t kGlobalBatch = 8;  // hf_llama_fsdp2.py's GLOBAL_BATCH

// Copies an HF state_dict into `model` by name (llama.h's 1:1 mapping). Throws c10::Error
// naming the key when the key sets or a shape differ.
void LoadHfWeights(models::llama::LlamaForCausalLMImpl& model, const checkpoint::TensorDict& init);

struct ShardedLlama {
  models::llama::LlamaForCausalLM model{nullptr};
  std::unique_ptr<torch::optim::AdamW> opt;  // built after fully_shard: it holds the shards
  comm::ProcessGroupPtr world;               // the mesh's world group
  mesh::DeviceMeshPtr dp_mesh;               // fully_shard's: the whole 1-D mesh, or mesh["dp"]
  mesh::DeviceMeshPtr tp_mesh;               // mesh["tp"] of a 2-D mesh; null on a 1-D one
};

// A `config` model (HfReferenceConfig's by default), decoder layers checkpointed when
// `activation_checkpointing`, fully_shard'ed per decoder layer and then the root, then loaded
// from the Hugging Face directory `hf_dir` (save_pretrained's output; dcp::LoadHuggingFace:
// each rank reads only its shards). On a 1-D mesh FSDP2 over it; on a 2-D ("dp", "tp") mesh
// models::llama::ApplyTensorParallel on mesh["tp"] first, then fully_shard over mesh["dp"]. Collective over
// the mesh.
// `dtype`: the parameters' (the file's values converted on load).
ShardedLlama BuildShardedLlama(const std::string& hf_dir, const mesh::DeviceMeshPtr& mesh,
                               bool activation_checkpointing,
                               const models::llama::LlamaConfig& config = HfReferenceConfig(),
                               c10::ScalarType dtype = c10::ScalarType::Float);

struct StepResult {
  double loss = 0;       // the global batch's: mean over the ranks of their equal slices' losses
  double grad_norm = 0;  // total, before clipping (fsdp2::clip_grad_norm_)
};

// One step on this rank's rows of `global_tokens` [batch, seq] (batch divisible by the dp
// size; the tp ranks of a dp rank share its rows): ForwardBackward, then FinishStep.
// Collective over `s.world`.
StepResult TrainStep(ShardedLlama& s, const at::Tensor& global_tokens);
// Forward, CausalLMLoss (CausalLMLossParallel under TP, models/llama/parallelize.h), backward; returns this dp rank's
// loss.
at::Tensor ForwardBackward(ShardedLlama& s, const at::Tensor& global_tokens);
// clip_grad_norm_(kMaxNorm), AdamW step, zero_grad; the global loss from each dp rank's.
StepResult FinishStep(ShardedLlama& s, const at::Tensor& loss);

// Relative difference of `got` from `want`: max |got - want| / max(1, max |want|), in double.
double RelDiff(const at::Tensor& got, const at::Tensor& want);

// The largest RelDiff between a reference's run and one of its other runs stored under
// `prefix` (hf_llama_*.py: "f64." the same training in float64, "rows<k>." in float32 on one
// process with each batch's rows split in k parts), over the keys both hold: with `step0`,
// step 0's logits0, loss0 and grad.<fqn>; else the trained losses, grad_norms and final.<fqn>.
// Throws c10::Error naming `prefix` when the reference holds none of those keys under it.
double ReferenceSpread(const checkpoint::TensorDict& ref, const std::string& prefix, bool step0 = false);

// The tolerance of a float32 run of the reference's training (ours, on `world` ranks each on its
// rows of every batch, or one process) against the reference's float32 run:
//   2 * E + S,   E = ReferenceSpread(ref, "f64."),   S = ReferenceSpread(ref, "rows<world>.").
// Why: ours is another float32 evaluation of the same training, no less accurate than the
// reference's; each lies within E (the reference's own f32 rounding error, measured against
// f64 on this machine's kernels, so its summation orders and vector widths) of the exact
// result when both sum in the same order, hence within 2E of each other (triangle inequality).
// Ours sums the batch in `world` row parts; S is the measured distance between the
// reference's order and that one. A sharding, reduction or convention bug is off by orders
// of magnitude more. Throws c10::Error when the reference lacks "f64." or "rows<world>.".
double TrainingTolerance(const checkpoint::TensorDict& ref, int world);

}  // namespace fsdp::examples::llama

#endif  // FSDP_EXAMPLES_LLAMA_LLAMA_TRAINING_H_
