#include "dcp/checkpoint_dirs.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/dcp_storage.h"

namespace fsdp::dcp {
namespace {
constexpr char kStepPrefix[] = "step-";
}  // namespace

std::string StepCheckpointDir(const std::string& root, int64_t step) {
  TORCH_CHECK(step >= 0, "StepCheckpointDir: step must be >= 0, got ", step);
  return absl::StrCat(root, "/", kStepPrefix, step);
}

CheckpointScan ScanCheckpoints(const std::string& root) {
  namespace fs = std::filesystem;
  CheckpointScan scan;
  std::error_code ec;
  if (!fs::exists(root, ec)) return scan;
  fs::directory_iterator it(root, ec);
  TORCH_CHECK(!ec, "ScanCheckpoints: cannot list '", root, "' (", ec.message(), ")");
  std::vector<std::pair<int64_t, std::string>> candidates;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    TORCH_CHECK(!ec, "ScanCheckpoints: cannot list '", root, "' (", ec.message(), ")");
    const std::string name = it->path().filename().string();
    int64_t step = 0;
    if (!absl::StartsWith(name, kStepPrefix) || !absl::SimpleAtoi(name.substr(sizeof(kStepPrefix) - 1), &step) ||
        step < 0 || name != absl::StrCat(kStepPrefix, step) || !it->is_directory(ec)) {
      continue;  // not ours (step-007, step-x, files)
    }
    candidates.emplace_back(step, it->path().string());
  }
  std::sort(candidates.begin(), candidates.end());
  for (const auto& [step, dir] : candidates) {
    std::error_code exists_ec;
    if (!fs::exists(fs::path(dir) / ".metadata", exists_ec)) {
      scan.incomplete.push_back({dir, step, "no .metadata (the save did not finish)"});
      continue;
    }
    try {
      checkpoint::ReadMetadata(dir);
    } catch (const c10::Error& e) {
      scan.incomplete.push_back({dir, step, absl::StrCat("invalid .metadata: ", e.what_without_backtrace())});
      continue;
    }
    scan.latest_dir = dir;
    scan.latest_step = step;
    scan.complete_steps.push_back(step);
  }
  return scan;
}

}  // namespace fsdp::dcp
