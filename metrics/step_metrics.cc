#include "metrics/step_metrics.h"

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/flight_recorder.h"
#include "metrics/allocation_window.h"

namespace fsdp::metrics {
namespace {

std::string Bytes(int64_t b) {
  if (b < 1024) return absl::StrCat(b, " B");
  if (b < (int64_t{1} << 20)) return absl::StrFormat("%.1f KiB", b / 1024.0);
  if (b < (int64_t{1} << 30)) return absl::StrFormat("%.1f MiB", b / 1048576.0);
  return absl::StrFormat("%.2f GiB", b / 1073741824.0);
}

std::string Flops(double f) {
  if (f >= 1e12) return absl::StrFormat("%.1f TFLOP/s", f / 1e12);
  return absl::StrFormat("%.1f GFLOP/s", f / 1e9);
}

c10::CachingDeviceAllocator::DeviceStats CudaStats(c10::Device device) {
  return c10::getDeviceAllocator(device.type())->getDeviceStats(device.index());
}

}  // namespace

StepMetrics::StepMetrics(StepMetricsOptions options) : options_(std::move(options)) {
  TORCH_CHECK(options_.rank >= 0, "StepMetrics: rank must be >= 0, got ", options_.rank);
  TORCH_CHECK(options_.tokens_per_step >= 0, "StepMetrics: tokens_per_step must be >= 0, got ",
              options_.tokens_per_step);
  TORCH_CHECK(options_.flops_per_token >= 0, "StepMetrics: flops_per_token must be >= 0, got ",
              options_.flops_per_token);
  TORCH_CHECK(options_.peak_flops >= 0, "StepMetrics: peak_flops must be >= 0, got ", options_.peak_flops);
  TORCH_CHECK(options_.print_every >= 0, "StepMetrics: print_every must be >= 0, got ", options_.print_every);
  TORCH_CHECK(options_.device.is_cpu() || options_.device.is_cuda(), "StepMetrics: device must be cpu or cuda, got ",
              options_.device.str());
  TORCH_CHECK(options_.device.is_cpu() || options_.device.has_index(),
              "StepMetrics: a cuda device needs an index, got ", options_.device.str());
  if (options_.device.is_cpu()) cpu_window_ = std::make_unique<AllocationWindow>();
}

StepMetrics::~StepMetrics() = default;

void StepMetrics::BeginStep() {
  TORCH_CHECK(!in_step_, "StepMetrics::BeginStep: step ", steps_, " has not ended (call EndStep first)");
  in_step_ = true;
  if (cpu_window_) {
    cpu_window_->Mark();
  } else {
    c10::getDeviceAllocator(options_.device.type())->resetPeakStats(options_.device.index());
  }
  traffic_at_start_ = comm::FlightRecorder::ForRank(options_.rank).traffic();
  start_ = std::chrono::steady_clock::now();
}

const StepReport& StepMetrics::EndStep() {
  const auto end = std::chrono::steady_clock::now();
  TORCH_CHECK(in_step_, "StepMetrics::EndStep: no step began (call BeginStep first)");
  in_step_ = false;
  StepReport r;
  r.step = steps_++;
  r.seconds = std::chrono::duration<double>(end - start_).count();
  const double seconds = std::max(r.seconds, 1e-9);
  if (options_.tokens_per_step > 0) r.tokens_per_second = options_.tokens_per_step / seconds;
  if (options_.tokens_per_step > 0 && options_.flops_per_token > 0 && options_.peak_flops > 0) {
    r.mfu = options_.tokens_per_step * options_.flops_per_token / seconds / options_.peak_flops;
  }
  if (cpu_window_) {
    r.peak_bytes = cpu_window_->peak();
  } else {
    const auto stats = CudaStats(options_.device);
    r.peak_bytes = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
  const comm::CollectiveTraffic t = comm::FlightRecorder::ForRank(options_.rank).traffic();
  const comm::CollectiveTraffic& s = traffic_at_start_;
  r.traffic = {t.all_gather - s.all_gather, t.reduce_scatter - s.reduce_scatter, t.all_reduce - s.all_reduce,
               t.broadcast - s.broadcast, t.all_to_all - s.all_to_all};
  last_ = r;
  if (options_.print_every > 0 && (r.step + 1) % options_.print_every == 0) {
    std::printf("%s\n", Format(r).c_str());
    std::fflush(stdout);
  }
  return last_;
}

std::string StepMetrics::Format(const StepReport& r) const {
  std::string line = absl::StrFormat("[rank %d] step %d: %.1f ms", options_.rank, r.step, r.seconds * 1e3);
  if (r.tokens_per_second >= 0) absl::StrAppend(&line, absl::StrFormat(", %.0f tokens/s", r.tokens_per_second));
  if (r.mfu >= 0)
    absl::StrAppend(&line, absl::StrFormat(", MFU %.1f%% of %s", 100 * r.mfu, Flops(options_.peak_flops)));
  absl::StrAppend(&line, ", peak ", options_.device.is_cpu() ? "CPU " : "CUDA ", Bytes(r.peak_bytes));
  if (options_.predicted_peak_bytes >= 0) absl::StrAppend(&line, " (model ", Bytes(options_.predicted_peak_bytes), ")");
  absl::StrAppend(&line, ", all-gather ", Bytes(r.traffic.all_gather), ", reduce-scatter ",
                  Bytes(r.traffic.reduce_scatter), ", all-reduce ", Bytes(r.traffic.all_reduce));
  return line;
}

double MeasureMatmulPeakFlops(int64_t n) {
  TORCH_CHECK(n >= 16 && n <= 8192, "MeasureMatmulPeakFlops: n must be in [16, 8192], got ", n);
  const at::Tensor a = at::rand({n, n}), b = at::rand({n, n});
  at::Tensor c = at::empty({n, n});
  at::mm_out(c, a, b);  // warm-up: packing buffers, threads
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    at::mm_out(c, a, b);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * n * n * n / std::max(s, 1e-9));
  }
  return best;
}

double DecoderFlopsPerToken(int64_t non_embedding_params, int64_t layers, int64_t heads, int64_t head_dim,
                            int64_t seq_len) {
  TORCH_CHECK(non_embedding_params >= 0 && layers >= 0 && heads >= 0 && head_dim >= 0 && seq_len >= 0,
              "DecoderFlopsPerToken: arguments must be >= 0, got params ", non_embedding_params, ", layers ", layers,
              ", heads ", heads, ", head_dim ", head_dim, ", seq_len ", seq_len);
  return 6.0 * non_embedding_params + 12.0 * layers * heads * head_dim * seq_len;
}

}  // namespace fsdp::metrics
