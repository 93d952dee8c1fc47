// The trainer's pipeline split against torchtitan's own (train/testdata/golden_pipeline_split.txt,
// written by testing/golden/gen_train.py from _get_pipeline_metadata and
// _generate_llm_fqn_per_model_part): every stage's modules for a grid of degrees, schedules,
// layer counts and layers_per_stage / first / last weights, and torchtitan's rejections.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "testing/expect_error.h"
#include "testing/golden_file.h"
#include "train/config.h"
#include "train/pipeline_llama.h"

namespace fsdp::train {
namespace {

TEST(PipelineLayerSplit, EqualsTorchtitansSplit) {
  const auto records = ::fsdp::testing::ReadGoldenFile("train/testdata/golden_pipeline_split.txt");
  int cases = 0;
  for (size_t i = 0; i < records.size();) {
    const auto& c = records[i++];
    ASSERT_EQ(c.at(0), "case");
    ParallelismConfig p;
    p.pipeline_parallel_degree = std::stoll(c.at(1));
    p.pipeline_parallel_schedule = c.at(2);
    const int64_t layers = std::stoll(c.at(3));
    if (c.at(4) != "-") p.pipeline_parallel_layers_per_stage = std::stoll(c.at(4));
    p.pipeline_parallel_first_stage_less_layers = std::stoll(c.at(5));
    p.pipeline_parallel_last_stage_less_layers = std::stoll(c.at(6));
    const std::string name = absl::StrJoin(c, " ");
    ++cases;
    if (records.at(i).at(0) == "error") {
      ++i;
      EXPECT_THROW(PipelineLayerSplit(p, layers, 1), c10::Error) << name;
      continue;
    }
    const int64_t stages = std::stoll(records.at(i++).at(1));
    PipelineSplit split;
    try {
      split = PipelineLayerSplit(p, layers, 1);
    } catch (const c10::Error& e) {
      ADD_FAILURE() << name << ": " << e.what_without_backtrace();
    }
    EXPECT_EQ(static_cast<int64_t>(split.parts.size()), stages) << name;
    for (int64_t s = 0; s < stages; ++s) {
      const auto& rec = records.at(i++);
      ASSERT_EQ(rec.at(0), "stage");
      if (s < static_cast<int64_t>(split.parts.size())) {
        EXPECT_EQ(absl::StrJoin(TorchtitanModuleNames(split.parts[s]), ","), rec.at(2)) << name << " stage " << s;
      }
    }
  }
  EXPECT_GT(cases, 500);
}

TEST(PipelineLayerSplit, BadValuesNameTheirKey) {
  ParallelismConfig p;
  p.pipeline_parallel_degree = 2;
  p.pipeline_parallel_schedule = "NoSuchSchedule";
  EXPECT_THROW(PipelineLayerSplit(p, 4, 1), c10::Error);
  p.pipeline_parallel_schedule = "1F1B";
  p.pipeline_parallel_microbatch_size = 3;
  EXPECT_ERROR_CONTAINS(PipelineLayerSplit(p, 4, 4),
                        "training.local_batch_size = 4 is not divisible by "
                        "parallelism.pipeline_parallel_microbatch_size = 3");
  p.pipeline_parallel_microbatch_size = 1;
  p.pipeline_parallel_layers_per_stage = 1;
  EXPECT_ERROR_CONTAINS(PipelineLayerSplit(p, 4, 4), "parallelism.pipeline_parallel_layers_per_stage = 1");
}

}  // namespace
}  // namespace fsdp::train
