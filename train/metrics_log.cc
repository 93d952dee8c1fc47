// See metrics_log.h.
#include "train/metrics_log.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>

#include "absl/strings/match.h"
#include "device/device_info.h"
#include "metrics/allocation_window.h"
#include "metrics/step_metrics.h"
#include "train/tensorboard.h"
#include "train/trainer.h"

namespace fsdp::train {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Python's f"{n:,}" for a rounded non-negative number.
std::string WithCommas(double x) {
  std::string digits = std::to_string(static_cast<long long>(std::llround(x)));
  std::string out;
  const size_t lead = digits.size() % 3 == 0 ? 3 : digits.size() % 3;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (i - lead) % 3 == 0 && i >= lead) out += ',';
    out += digits[i];
  }
  return out;
}

std::string Number(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", x);
  return buf;
}

// torchtitan's datetime.now().strftime("%Y%m%d-%H%M").
std::string LocalMinute() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%d-%H%M", &local);
  return buf;
}

}  // namespace

double TorchtitanPeakFlops(const std::string& name) {
  // torchtitan's order of tests, which matters ("H20" is in "H200", "B200" in "GB200").
  if (absl::StrContains(name, "A100")) return 312e12;
  if (absl::StrContains(name, "A6000")) return 154.85e12;
  if (absl::StrContains(name, "H100")) {
    if (absl::StrContains(name, "NVL")) return 835e12;
    if (absl::StrContains(name, "PCIe")) return 756e12;
    return 989e12;
  }
  if (absl::StrContains(name, "H200")) return 989e12;
  if (absl::StrContains(name, "H20")) return 148e12;
  if (absl::StrContains(name, "GB200") || absl::StrContains(name, "GB300")) return 2.5e15;
  if (absl::StrContains(name, "B300") || absl::StrContains(name, "B200")) return 2.25e15;
  if (absl::StrContains(name, "MI355X")) return 2500e12;
  if (absl::StrContains(name, "MI300X") || absl::StrContains(name, "MI325X")) return 1300e12;
  if (absl::StrContains(name, "MI250X")) return 191.5e12;
  if (absl::StrContains(name, "l40s")) return 362e12;  // torchtitan's spelling: "NVIDIA L40S" falls through
  return 312e12;
}

std::string MetricsLog::FormatStep(int64_t step, double loss, double grad_norm, double memory_gib, double memory_pct,
                                   double tps, double tflops, double mfu_pct) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "step: %2lld  loss: %8.5f  grad_norm: %7.4f  memory: %5.2fGiB(%.2f%%)  tps: %s  ",
                static_cast<long long>(step), loss, grad_norm, memory_gib, memory_pct, WithCommas(tps).c_str());
  std::string line = buf;
  // f"{tflops:,.2f}": tflops here are far below 1,000.
  std::snprintf(buf, sizeof(buf), "tflops: %.2f  mfu: %.2f%%", tflops, mfu_pct);
  return line + buf;
}

MetricsLog::MetricsLog(const JobConfig& config, int rank, std::ostream* out, double flops_per_token,
                       int64_t non_dp_size, c10::Device device)
    : config_(config),
      out_(out),
      device_(device),
      flops_per_token_(flops_per_token),
      non_dp_size_(non_dp_size),
      last_log_(std::chrono::steady_clock::now()) {
  memory_capacity_ = static_cast<double>(device::DeviceMemoryBytes(device));  // checks the device
  if (device.is_cpu()) memory_ = std::make_unique<metrics::AllocationWindow>();
  ResetPeakMemory();
  if (out_ == nullptr) return;
  peak_flops_ = device.is_cpu() ? metrics::MeasureMatmulPeakFlops() : TorchtitanPeakFlops(device::DeviceName(device));
  if (config.metrics.enable_jsonl) {
    std::filesystem::path path = std::filesystem::path(config.dump_folder) / config.metrics.save_jsonl_file;
    if (rank != 0) path += ".rank" + std::to_string(rank);
    std::error_code ec;
    std::filesystem::create_directories(path.parent_path(), ec);
    jsonl_.open(path, std::ios::out | std::ios::trunc);
    TORCH_CHECK(jsonl_.good(), "metrics.save_jsonl_file: cannot write ", path.string());
  }
  if (config.metrics.enable_tensorboard) {
    // torchtitan's MetricsProcessor: dump_folder/save_tb_folder/<YYYYmmdd-HHMM>[/rank_<r>].
    std::filesystem::path dir =
        std::filesystem::path(config.dump_folder) / config.metrics.save_tb_folder / LocalMinute();
    if (config.metrics.save_for_all_ranks) dir /= "rank_" + std::to_string(rank);
    tensorboard_ = std::make_unique<TensorBoardWriter>(dir.string());
  }
}

MetricsLog::~MetricsLog() = default;

double MetricsLog::PeakMemoryBytes() const {
  if (memory_ != nullptr) return static_cast<double>(memory_->peak());
  const c10::CachingDeviceAllocator::DeviceStats stats =
      c10::getDeviceAllocator(device_.type())->getDeviceStats(device_.index());
  return static_cast<double>(
      stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak);
}

void MetricsLog::ResetPeakMemory() {
  if (memory_ != nullptr) {
    memory_->Mark();
  } else {
    c10::getDeviceAllocator(device_.type())->resetPeakStats(device_.index());
  }
}

void MetricsLog::Write(int64_t step, const std::vector<std::pair<std::string, double>>& scalars,
                       const std::string& json) {
  if (jsonl_.is_open()) {
    jsonl_ << json << '\n';
    jsonl_.flush();
  }
  if (tensorboard_ != nullptr) {
    for (const auto& [tag, value] : scalars) tensorboard_->AddScalar(tag, value, step);
    tensorboard_->Flush();
  }
}

void MetricsLog::RecordStep(const StepResult& r) {
  tokens_since_log_ += r.local_tokens;
  tokens_seen_ += r.global_tokens;
  data_seconds_.push_back(r.data_seconds);
  non_model_seconds_.push_back(r.non_model_seconds());
  if (!(r.step == 1 || r.step % config_.metrics.log_freq == 0)) return;
  const double delta = std::chrono::duration<double>(std::chrono::steady_clock::now() - last_log_).count();
  const double tps = static_cast<double>(tokens_since_log_) / (delta * static_cast<double>(non_dp_size_));
  const double tflops = flops_per_token_ * tps / 1e12;
  const double mfu = peak_flops_ > 0 ? 100.0 * flops_per_token_ * tps / peak_flops_ : 0.0;
  const double peak = PeakMemoryBytes();
  const double gib = peak / kGiB, pct = 100.0 * peak / memory_capacity_;
  double data = 0, non_model = 0;
  for (const double s : data_seconds_) data += s;
  for (const double s : non_model_seconds_) non_model += s;
  if (out_ != nullptr) {
    *out_ << FormatStep(r.step, r.loss, r.grad_norm, gib, pct, tps, tflops, mfu) << std::endl;
    // torchtitan's names; n_tokens_seen, an integer, is the last.
    const std::vector<std::pair<std::string, double>> scalars = {
        {"loss_metrics/global_avg_loss", r.loss},
        {"loss_metrics/global_max_loss", r.max_loss},
        {"grad_norm", r.grad_norm},
        {"lr", r.lr},
        {"throughput(tps)", tps},
        {"tflops", tflops},
        {"mfu(%)", mfu},
        {"memory/max_reserved(GiB)", gib},
        {"time_metrics/end_to_end(s)", delta / config_.metrics.log_freq},
        {"time_metrics/data_loading(s)", data / data_seconds_.size()},
        {"time_metrics/data_loading(%)", 100.0 * data / delta},
        // Ours: a step's time outside forward, backward and the optimizer (data included).
        {"time_metrics/non_model(s)", non_model / non_model_seconds_.size()},
        {"n_tokens_seen", static_cast<double>(tokens_seen_)}};
    std::string json = "{\"step\": " + std::to_string(r.step);
    for (size_t i = 0; i + 1 < scalars.size(); ++i)
      json += ", \"" + scalars[i].first + "\": " + Number(scalars[i].second);
    json += ", \"n_tokens_seen\": " + std::to_string(tokens_seen_) + "}";
    Write(r.step, scalars, json);
  }
  tokens_since_log_ = 0;
  data_seconds_.clear();
  non_model_seconds_.clear();
  ResetPeakMemory();
  last_log_ = std::chrono::steady_clock::now();
}

void MetricsLog::LogValidation(int64_t step, double loss, int64_t local_tokens, double seconds) {
  const double peak = PeakMemoryBytes();
  if (out_ != nullptr) {
    char buf[256];
    std::snprintf(
        buf, sizeof(buf), "validate step: %2lld  loss: %7.4f  memory: %5.2fGiB(%.2f%%)  tps: %s",
        static_cast<long long>(step), loss, peak / kGiB, 100.0 * peak / memory_capacity_,
        WithCommas(seconds > 0 ? static_cast<double>(local_tokens) / (seconds * static_cast<double>(non_dp_size_)) : 0)
            .c_str());
    *out_ << buf << std::endl;
    Write(step, {{"validation_metrics/loss", loss}},
          "{\"step\": " + std::to_string(step) + ", \"validation_metrics/loss\": " + Number(loss) + "}");
  }
}

}  // namespace fsdp::train
