// See pipeline_llama.h.
#include "train/pipeline_llama.h"

#include <c10/util/Exception.h>

namespace fsdp::train {

PipelineSplit PipelineLayerSplit(const ParallelismConfig& p, int64_t num_layers, int64_t local_batch_size) {
  PipelineSplit split;
  const int64_t pp = p.pipeline_parallel_degree;
  split.custom_csv = !p.pipeline_parallel_schedule_csv.empty();
  split.kind = pipelining::ScheduleKindFromName(p.pipeline_parallel_schedule);
  // torchtitan sizes and places the stages by pipeline_parallel_schedule even when a CSV file
  // gives the order.
  const bool single = pipelining::IsSingleStageSchedule(split.kind);
  const int64_t in = p.pipeline_parallel_first_stage_less_layers;
  const int64_t out = p.pipeline_parallel_last_stage_less_layers;
  int64_t stages = 0;
  if (p.pipeline_parallel_layers_per_stage) {
    const int64_t per = *p.pipeline_parallel_layers_per_stage;
    stages = (num_layers + in + out + per - 1) / per;
    TORCH_CHECK(stages % pp == 0, "parallelism.pipeline_parallel_layers_per_stage = ", per, ": ", num_layers,
                " layers make ", stages, " virtual stages, not a multiple of pipeline_parallel_degree = ", pp);
    const int64_t per_rank = stages / pp;
    TORCH_CHECK(!single || per_rank == 1, "parallelism.pipeline_parallel_layers_per_stage = ", per, ": ",
                p.pipeline_parallel_schedule, " runs one stage per rank, the split gives ", per_rank);
    TORCH_CHECK(single || per_rank >= 2, "parallelism.pipeline_parallel_layers_per_stage = ", per, ": ",
                p.pipeline_parallel_schedule, " needs at least 2 stages per rank, the split gives ", per_rank);
  } else {
    stages = pp * (single ? 1 : 2);
  }
  const int64_t mb = p.pipeline_parallel_microbatch_size;
  TORCH_CHECK(local_batch_size % mb == 0, "training.local_batch_size = ", local_batch_size,
              " is not divisible by parallelism.pipeline_parallel_microbatch_size = ", mb);
  split.n_microbatches = local_batch_size / mb;

  // _generate_llm_fqn_per_model_part.
  if (stages == 1) {
    split.parts.push_back(models::llama::LlamaParts{});
    return split;
  }
  const int64_t effective = num_layers + in + out;
  TORCH_CHECK(stages <= effective, "parallelism: ", stages, " pipeline stages exceed the ", effective,
              " effective layers (model.n_layers = ", num_layers, " + pipeline_parallel_first_stage_less_layers = ", in,
              " + pipeline_parallel_last_stage_less_layers = ", out, ")");
  const int64_t per_stage = effective / stages;
  const int64_t extra = effective % stages;
  TORCH_CHECK(in <= per_stage, "parallelism.pipeline_parallel_first_stage_less_layers = ", in,
              " exceeds the minimum layers per stage ", per_stage);
  TORCH_CHECK(out <= per_stage, "parallelism.pipeline_parallel_last_stage_less_layers = ", out,
              " exceeds the minimum layers per stage ", per_stage);
  int64_t layer = 0;
  for (int64_t s = 0; s < stages; ++s) {
    int64_t budget = per_stage + (s < extra ? 1 : 0);
    models::llama::LlamaParts part;
    part.embedding = s == 0;
    part.head = s == stages - 1;
    if (part.embedding) budget -= in;
    if (part.head) budget -= out;
    part.first_layer = layer;
    for (int64_t k = 0; k < budget && layer < num_layers; ++k) ++layer;
    part.end_layer = layer;
    split.parts.push_back(part);
  }
  return split;
}

std::vector<std::string> TorchtitanModuleNames(const models::llama::LlamaParts& part) {
  std::vector<std::string> names;
  if (part.embedding) names.push_back("tok_embeddings");
  for (int64_t i = part.first_layer; i < part.end_layer; ++i) names.push_back("layers." + std::to_string(i));
  if (part.head) {
    names.push_back("norm");
    names.push_back("lm_head");
  }
  return names;
}

std::vector<int> LocalStageIndices(const PipelineSplit& split, int pp_rank, int pp_degree) {
  std::vector<int> out;
  for (int s = 0; s < static_cast<int>(split.parts.size()); ++s) {
    if (pipelining::StageRank(split.kind, s, pp_degree) == pp_rank) out.push_back(s);
  }
  return out;
}

}  // namespace fsdp::train
