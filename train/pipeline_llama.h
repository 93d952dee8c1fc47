// Pipeline parallelism for the trainer's Llama model: torchtitan's split of the model into
// stages and the stages of this rank (torchtitan/distributed/pipeline_parallel.py:
// _get_pipeline_metadata, _generate_llm_fqn_per_model_part, pipeline_llm).
//
// Contract:
// - PipelineLayerSplit is torchtitan's: the number of virtual stages (layers_per_stage given:
//   ceil((layers + first_stage_less_layers + last_stage_less_layers) / layers_per_stage),
//   a multiple of the degree, one per rank for GPipe / 1F1B and at least two otherwise;
//   unset: one stage per rank for those two, two for the others), then each stage's part
//   (the embedding and norm + head weighing as first / last_stage_less_layers layers, the
//   layers spread evenly, earlier stages taking the remainder). Errors: torchtitan's
//   ValueErrors as c10::Error naming the parallelism key and value. Pure.
// - LocalStageIndices: the stages rank `pp_rank` holds under the schedule's placement
//   (pipelining::StageRank), ascending.
#ifndef FSDP_TRAIN_PIPELINE_LLAMA_H_
#define FSDP_TRAIN_PIPELINE_LLAMA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "models/llama/model.h"
#include "pipelining/schedule_orders.h"
#include "train/config.h"

namespace fsdp::train {

struct PipelineSplit {
  pipelining::ScheduleKind kind = pipelining::ScheduleKind::k1F1B;
  bool custom_csv = false;                       // parallelism.pipeline_parallel_schedule_csv
  std::vector<models::llama::LlamaParts> parts;  // one per (virtual) stage
  int64_t n_microbatches = 1;                    // local_batch_size / pipeline_parallel_microbatch_size
};

PipelineSplit PipelineLayerSplit(const ParallelismConfig& parallelism, int64_t num_layers, int64_t local_batch_size);

// torchtitan's module names of one stage's part ("tok_embeddings", "layers.3", "norm",
// "lm_head"), for messages and the comparison with torchtitan's split.
std::vector<std::string> TorchtitanModuleNames(const models::llama::LlamaParts& part);

std::vector<int> LocalStageIndices(const PipelineSplit& split, int pp_rank, int pp_degree);

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_PIPELINE_LLAMA_H_
