// What the trainer reports per logged step, as torchtitan's MetricsProcessor
// (torchtitan/components/metrics.py) does: its console line, and the same metrics, under
// torchtitan's names, one JSON object per line in a JSONL file (metrics.enable_jsonl:
// dump_folder/metrics.save_jsonl_file; with save_for_all_ranks, rank r != 0 writes
// "<file>.rank<r>"), and the same scalars under the same tags in TensorBoard event files
// (metrics.enable_tensorboard: torchtitan's folder dump_folder/save_tb_folder/<YYYYmmdd-HHMM>,
// with save_for_all_ranks its rank_<r> subfolder; tensorboard.h).
//
//   step:  1  loss:  7.66840  grad_norm:  1.5210  memory:  0.31GiB(1.29%)  tps: 1,234  tflops: 0.01  mfu: 0.93%
//   validate step:  5  loss:  6.9123  memory:  0.31GiB(1.29%)  tps: 4,321
//
// A step is logged when it is step 1 or a multiple of metrics.log_freq (should_log). tps is
// this rank's tokens since the last logged step per second, per device of its model replica
// (divided by the tensor-parallel degree); tflops and mfu follow from the model's FLOPs per
// token (mfu against this machine's measured matmul peak, metrics::MeasureMatmulPeakFlops, as
// there is no spec sheet for a CPU); memory is this rank's LibTorch CPU allocation peak since
// the last logged step, against the machine's physical memory.
//
// Contract: one MetricsLog per rank, on the thread that runs the steps (the allocation
// window's). `out` null: this rank writes nothing. A JSONL file that cannot be opened, or a
// TensorBoard folder that cannot be created, is a c10::Error naming it. Not thread-safe.
#ifndef FSDP_TRAIN_METRICS_LOG_H_
#define FSDP_TRAIN_METRICS_LOG_H_

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "train/config.h"

namespace fsdp::metrics {
class AllocationWindow;
}  // namespace fsdp::metrics

namespace fsdp::train {

struct StepResult;
class TensorBoardWriter;

class MetricsLog {
 public:
  MetricsLog(const JobConfig& config, int rank, std::ostream* out, double flops_per_token, int64_t non_dp_size);
  ~MetricsLog();

  void RecordStep(const StepResult& step);
  // local_tokens: this rank's validation tokens; seconds: the validation's duration.
  void LogValidation(int64_t step, double loss, int64_t local_tokens, double seconds);

  // The console line of a logged step (torchtitan's format, without its colors).
  static std::string FormatStep(int64_t step, double loss, double grad_norm, double memory_gib, double memory_pct,
                                double tps, double tflops, double mfu_pct);

 private:
  // The JSONL line and the TensorBoard scalars of one step.
  void Write(int64_t step, const std::vector<std::pair<std::string, double>>& scalars, const std::string& json);

  const JobConfig& config_;
  std::ostream* out_;
  double flops_per_token_, peak_flops_ = 0;
  int64_t non_dp_size_;
  int64_t tokens_since_log_ = 0, tokens_seen_ = 0;
  std::vector<double> data_seconds_, non_model_seconds_;
  std::chrono::steady_clock::time_point last_log_;
  std::unique_ptr<metrics::AllocationWindow> memory_;
  std::ofstream jsonl_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_METRICS_LOG_H_
