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
// token, mfu against the device's peak: on a CUDA device torchtitan's spec-sheet bfloat16 peak
// of its name (TorchtitanPeakFlops), on the CPU this machine's measured matmul peak
// (metrics::MeasureMatmulPeakFlops: a CPU has no spec sheet). memory is, since the last
// logged step, on a CUDA device the caching allocator's peak reserved bytes (torchtitan's
// max_reserved) against the device's memory, on the CPU this rank's LibTorch allocation peak
// against the machine's physical memory.
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

#include <c10/core/Device.h>

#include "train/config.h"

namespace fsdp::metrics {
class AllocationWindow;
}  // namespace fsdp::metrics

namespace fsdp::train {

struct StepResult;
class TensorBoardWriter;

// torchtitan's get_peak_flops (torchtitan/tools/utils.py) for a CUDA or ROCm device's name as
// torch.cuda.get_device_name gives it: the dense bfloat16 peak in FLOP/s (A100 312e12, H100
// SXM 989e12, ...; a name it does not know: A100's). Unlike torchtitan it does not look for an
// H100 in `lspci` first (that only refines an "H100" name, which carries the variant).
double TorchtitanPeakFlops(const std::string& device_name);

class MetricsLog {
 public:
  // `device`: where the rank trains (the CPU, or a CUDA device with an index).
  MetricsLog(const JobConfig& config, int rank, std::ostream* out, double flops_per_token, int64_t non_dp_size,
             c10::Device device = c10::Device(c10::kCPU));
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
  // The memory peak since the last logged step, and a new window from now.
  double PeakMemoryBytes() const;
  void ResetPeakMemory();

  const JobConfig& config_;
  std::ostream* out_;
  c10::Device device_;
  double flops_per_token_, peak_flops_ = 0;
  double memory_capacity_ = 0;  // the device's memory, bytes
  int64_t non_dp_size_;
  int64_t tokens_since_log_ = 0, tokens_seen_ = 0;
  std::vector<double> data_seconds_, non_model_seconds_;
  std::chrono::steady_clock::time_point last_log_;
  std::unique_ptr<metrics::AllocationWindow> memory_;  // the CPU's
  std::ofstream jsonl_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_METRICS_LOG_H_
