// StepMetrics: what a training loop prints about its steps, as torchtitan's metrics line does:
// step time, tokens/s, model FLOPs utilization against a peak the caller gives, the
// allocation peak of this rank (CPU: LibTorch's CPU allocator; CUDA: its caching allocator's
// statistics), the bytes this rank all-gathered, reduce-scattered and all-reduced (counted by
// the comm layer for every backend: comm::FlightRecorder::traffic()), and beside the peak the
// memory model's prediction (tools/fsdp_memory.h, `fsdp_plan --memory`) when given.
//
//   metrics::StepMetrics m({.rank = rank, .tokens_per_step = batch * seq, .flops_per_token = f,
//                           .peak_flops = metrics::MeasureMatmulPeakFlops(), .print_every = 10});
//   for (...) { m.BeginStep(); ...forward, backward, step...; m.EndStep(); }
//
// Contract: BeginStep and EndStep alternate, on the thread that runs the step (the CPU
// allocation peak counts the allocations LibTorch reports to that thread's window, and the
// frees of every thread). Construct it on that thread. Not thread-safe. Errors (an option out
// of range, EndStep without BeginStep) are c10::Error naming the argument.
#ifndef FSDP_METRICS_STEP_METRICS_H_
#define FSDP_METRICS_STEP_METRICS_H_

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "comm/flight_recorder.h"

namespace fsdp::metrics {

class AllocationWindow;

struct StepMetricsOptions {
  int rank = 0;                                 // this process's global rank (its traffic counters)
  c10::Device device = c10::Device(c10::kCPU);  // where the step allocates (CPU or CUDA)
  int64_t tokens_per_step = 0;                  // tokens this rank processes per step; 0: no tokens/s
  double flops_per_token = 0;                   // model FLOPs per token, forward + backward; 0: no MFU
  double peak_flops = 0;                        // this device's peak FLOP/s; 0: no MFU
  int64_t predicted_peak_bytes = -1;            // the memory model's peak for this rank; -1: none
  int64_t print_every = 0;                      // EndStep prints every N-th step on stdout; 0: never
};

struct StepReport {
  int64_t step = 0;  // from 0, counted by EndStep
  double seconds = 0;
  double tokens_per_second = -1;  // -1 without tokens_per_step
  double mfu = -1;                // fraction of peak_flops; -1 without flops_per_token / peak_flops
  int64_t peak_bytes = -1;        // this rank's allocation peak during the step
  // Bytes this rank moved in the step: all-gather outputs, reduce-scatter inputs, all-reduce,
  // broadcast and all-to-all tensors.
  comm::CollectiveTraffic traffic;
};

class StepMetrics {
 public:
  explicit StepMetrics(StepMetricsOptions options);
  ~StepMetrics();
  StepMetrics(const StepMetrics&) = delete;
  StepMetrics& operator=(const StepMetrics&) = delete;

  void BeginStep();
  // Measures the step since BeginStep; prints Format(report) when the step's number + 1 is a
  // multiple of print_every.
  const StepReport& EndStep();
  const StepReport& last() const { return last_; }
  const StepMetricsOptions& options() const { return options_; }

  // "step 9: 41.2 ms, 9930 tokens/s, MFU 3.1% of 95.0 GFLOP/s, peak 12.4 MiB (model 11.9 MiB),
  // all-gather 1.2 MiB, reduce-scatter 1.2 MiB, all-reduce 4 B"
  std::string Format(const StepReport& report) const;

 private:
  StepMetricsOptions options_;
  std::unique_ptr<AllocationWindow> cpu_window_;  // CPU devices
  bool in_step_ = false;
  int64_t steps_ = 0;
  std::chrono::steady_clock::time_point start_;
  comm::CollectiveTraffic traffic_at_start_;
  StepReport last_;
};

// The CPU's float32 matmul rate in FLOP/s (the best of a few at::mm of n x n on this thread's
// intra-op threads): a stand-in for a CPU's peak, which no vendor table gives.
double MeasureMatmulPeakFlops(int64_t n = 512);

// FLOPs per token of a dense decoder, forward + backward, as torchtitan counts them
// (torchtitan/models/utils.py get_dense_model_nparams_and_flops): 6 per non-embedding
// parameter plus attention's 12 * layers * heads * head_dim * seq_len.
double DecoderFlopsPerToken(int64_t non_embedding_params, int64_t layers, int64_t heads, int64_t head_dim,
                            int64_t seq_len);

}  // namespace fsdp::metrics

#endif  // FSDP_METRICS_STEP_METRICS_H_
