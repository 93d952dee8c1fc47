// torchtitan 0.3.0's checkpoints (torchtitan/components/checkpointer/dcp.py, CheckpointManager)
// as the trainer reads them: where each of our tensors is in one. A torchtitan step-N folder is
// a DCP checkpoint holding
//   <torchtitan FQN>                          the model's state_dict at top level (ModelWrapper)
//   optimizer.state.<FQN>.<name>              OptimizersContainer's flattened optimizer state
//   optimizer.param_groups.<FQN>.<option>     (components/optimizer/utils.py,
//                                             get_flat_optim_state_dict)
//   lr_scheduler.last_epoch, train_state.{step,ntokens_seen}   as ours (checkpoint_state.h)
//   dataloader.dp_rank_<r>, dataloader.world_size   its per-rank loader, pickled: not read
//                                                   (the data position comes from the step)
// The FQNs are torchtitan's Llama3Model's, which its Llama3StateDictAdapter maps to Hugging
// Face's, ours (models/llama/model.h):
//   tok_embeddings.weight                        model.embed_tokens.weight
//   layers.<i>.attention.qkv_linear.w{q,k,v}.weight   model.layers.<i>.self_attn.{q,k,v}_proj.weight
//   layers.<i>.attention.wo.weight               model.layers.<i>.self_attn.o_proj.weight
//   layers.<i>.feed_forward.w{1,3,2}.weight      model.layers.<i>.mlp.{gate,up,down}_proj.weight
//   layers.<i>.{attention,ffn}_norm.weight       model.layers.<i>.{input,post_attention}_layernorm.weight
//   norm.weight, lm_head.weight                  model.norm.weight, lm_head.weight
// Rows: torchtitan's ComplexRoPE rotates the row pairs (2i, 2i+1) of each q/k head where HF's
// rotate_half rotates (i, i + head_dim/2), so our row j*head_dim/2 + i of a head is torchtitan's
// row 2i + j (the adapter's _permute). Its FusedQKVLinear (fuse_qkv = True, every llama3
// flavor) saves the model under the stock wq/wk/wv names (its state-dict hooks) but the
// optimizer state under qkv_linear.wqkv.weight, rows [n_kv_heads, heads_per_kv + 2, head_dim]:
// group g's q heads, then its k head, then its v head (torchtitan/models/common/attention.py).
//
// Contract: pure functions, thread-safe. The layout is for a model whose config is `config`;
// errors are c10::Errors naming the FQN.
#ifndef FSDP_TRAIN_TORCHTITAN_CHECKPOINT_H_
#define FSDP_TRAIN_TORCHTITAN_CHECKPOINT_H_

#include <string>

#include "checkpoint/dcp_metadata.h"
#include "dcp/dcp.h"
#include "models/llama/model.h"

namespace fsdp::train {

// torchtitan's FQN of one of ours (HF's); a c10::Error for a name it has none for.
std::string TorchtitanFqn(const std::string& fqn);

// Whether `metadata` is a torchtitan checkpoint (its embedding is "tok_embeddings.weight").
bool IsTorchtitanCheckpoint(const checkpoint::DcpMetadata& metadata);

// LoadOptions::layout for a torchtitan checkpoint of this model: model and optimizer FQNs,
// q/k rows, and the fused qkv optimizer state where `metadata` holds it.
dcp::StoredLayout TorchtitanLayout(const models::llama::LlamaConfig& config, const checkpoint::DcpMetadata& metadata);

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_TORCHTITAN_CHECKPOINT_H_
