// TensorBoard event files (train/tensorboard.h): what TensorBoardWriter and MetricsLog write,
// read back by the real tensorboard of the peer venv (EventAccumulator, which checks each
// record's CRCs); CRC-32C's standard check value; a directory that cannot be made.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "testing/expect_error.h"
#include "testing/peer_python.h"
#include "testing/test_dir.h"
#include "train/config.h"
#include "train/metrics_log.h"
#include "train/tensorboard.h"
#include "train/trainer.h"

namespace fsdp::train {
namespace {

namespace fs = std::filesystem;

// (step, value) of each tag.
using Scalars = std::map<std::string, std::vector<std::pair<int64_t, double>>>;

// Prints "VERSION <file_version>", "FILE <name>" per event file and "<tag>\t<step>\t<repr>"
// per scalar: repr of the float32 value widened to a double is exact.
constexpr char kReadScript[] = R"(import os, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
print("VERSION", acc.file_version)
for name in sorted(os.listdir(sys.argv[1])):
    print("FILE", name)
for tag in acc.Tags()["scalars"]:
    for e in acc.Scalars(tag):
        print(f"{tag}\t{e.step}\t{e.value!r}")
)";

std::vector<std::string> Split(const std::string& text, const std::string& separator) {
  std::vector<std::string> parts;
  size_t begin = 0;
  for (size_t end; (end = text.find(separator, begin)) != std::string::npos; begin = end + separator.size()) {
    parts.push_back(text.substr(begin, end - begin));
  }
  parts.push_back(text.substr(begin));
  return parts;
}

bool StartsWith(const std::string& text, const std::string& prefix) { return text.rfind(prefix, 0) == 0; }

// Reads `dir` with the peer venv's tensorboard; false with the reason in `why_not` when there is
// no peer venv.
bool ReadWithTensorBoard(const std::string& dir, Scalars* scalars, std::vector<std::string>* files,
                         std::string* version, std::string* why_not) {
  const std::string python = fsdp::testing::PeerPython(why_not);
  if (python.empty()) return false;
  const std::string script = fsdp::testing::NewTestPath("read_tb") + ".py";
  std::ofstream(script) << kReadScript;
  std::string output;
  const int status = fsdp::testing::RunCommand(absl::StrCat(python, " ", script, " ", dir), &output);
  if (status != 0 && absl::StrContains(output, "No module named 'tensorboard'")) {
    *why_not = absl::StrCat(python, " has no tensorboard");
    return false;
  }
  EXPECT_EQ(status, 0) << output;
  for (const std::string& line : Split(output, "\n")) {
    if (line.empty()) continue;
    if (StartsWith(line, "VERSION ")) {
      *version = line.substr(8);
    } else if (StartsWith(line, "FILE ")) {
      files->push_back(line.substr(5));
    } else {
      const std::vector<std::string> fields = Split(line, "\t");
      if (fields.size() != 3) {
        ADD_FAILURE() << "unexpected line: " << line << "\n" << output;
        continue;
      }
      (*scalars)[fields[0]].emplace_back(std::stoll(fields[1]), std::strtod(fields[2].c_str(), nullptr));
    }
  }
  return true;
}

double AsFloat(double x) { return static_cast<double>(static_cast<float>(x)); }

TEST(TensorBoard, Crc32cCheckValue) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
  const uint32_t crc = Crc32c("123456789");
  EXPECT_EQ(MaskedCrc32c("123456789"), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

TEST(TensorBoard, ADirectoryThatCannotBeMadeIsAnErrorNamingIt) {
  const std::string file = fsdp::testing::NewTestPath("tb_not_a_dir");
  std::ofstream(file) << "a file";
  const std::string dir = file + "/tb";
  EXPECT_ERROR_CONTAINS(TensorBoardWriter{dir}, dir);
  EXPECT_ERROR_CONTAINS(TensorBoardWriter{file}, file);
}

TEST(TensorBoard, EventFileIsNamedAsTensorBoardsAndStartsWithTheVersion) {
  const std::string dir = fsdp::testing::NewTestPath("tb_name");
  std::string first, second;
  {
    TensorBoardWriter a(dir), b(dir);
    first = fs::path(a.path()).filename().string();
    second = fs::path(b.path()).filename().string();
  }
  // events.out.tfevents.<10 digits>.<host>.<pid>.<n>, n counting this process's writers.
  const std::vector<std::string> fields = Split(first, ".");
  ASSERT_GE(fields.size(), 7u) << first;
  EXPECT_EQ(absl::StrCat(fields[0], ".", fields[1], ".", fields[2]), "events.out.tfevents") << first;
  EXPECT_EQ(fields[3].size(), 10u) << first;
  EXPECT_EQ(fields[fields.size() - 2], std::to_string(getpid())) << first;
  const std::vector<std::string> second_fields = Split(second, ".");
  EXPECT_EQ(std::stoll(second_fields.back()), std::stoll(fields.back()) + 1) << first << " " << second;
  // The first record: length 8 + 4 bytes of CRC, then an Event with file_version "brain.Event:2".
  std::ifstream in(fs::path(dir) / first, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  EXPECT_TRUE(absl::StrContains(bytes.str(), "brain.Event:2"));
}

TEST(TensorBoard, ScalarsReadBackByTensorBoard) {
  const std::string dir = fsdp::testing::NewTestPath("tb_scalars");
  Scalars written;
  {
    TensorBoardWriter writer(dir);
    for (int64_t step = 0; step <= 30; step += 3) {
      const std::vector<std::pair<std::string, double>> values = {
          {"loss_metrics/global_avg_loss", 8.0 / (1.0 + 0.1 * step) + 1e-9},
          {"lr", 3e-4 * step / 30.0},
          {"throughput(tps)", 1234.5678 * (step + 1)},
          {"validation_metrics/loss", -0.1 * step}};
      for (const auto& [tag, value] : values) {
        writer.AddScalar(tag, value, step);
        written[tag].emplace_back(step, AsFloat(value));
      }
      writer.Flush();
    }
    writer.AddScalar("grad_norm", 1e30, int64_t{1} << 40);  // a large step: a multi-byte varint
    written["grad_norm"].emplace_back(int64_t{1} << 40, AsFloat(1e30));
    writer.Flush();
  }
  Scalars read;
  std::vector<std::string> files;
  std::string version, why_not;
  if (!ReadWithTensorBoard(dir, &read, &files, &version, &why_not)) GTEST_SKIP() << why_not;
  EXPECT_EQ(version, "2.0");
  ASSERT_EQ(files.size(), 1u);
  EXPECT_TRUE(StartsWith(files[0], "events.out.tfevents.")) << files[0];
  EXPECT_EQ(read, written);  // every (step, value), exactly the float32 written
}

// MetricsLog with metrics.enable_tensorboard: torchtitan's folder (save_tb_folder/<YYYYmmdd-HHMM>,
// rank_<r> with save_for_all_ranks) and the JSONL line's scalars under the same tags.
TEST(TensorBoard, MetricsLogWritesTheJsonlScalarsInTorchtitansFolder) {
  JobConfig config;
  config.dump_folder = fsdp::testing::NewTestPath("tb_metrics");
  config.metrics.log_freq = 2;
  config.metrics.enable_tensorboard = true;
  config.metrics.enable_jsonl = true;
  config.metrics.save_for_all_ranks = true;
  std::ostringstream console;
  {
    MetricsLog log(config, /*rank=*/1, &console, /*flops_per_token=*/1e6, /*non_dp_size=*/1);
    for (int64_t step = 1; step <= 4; ++step) {
      StepResult r;
      r.step = step;
      r.loss = 8.0 - 0.25 * step;
      r.max_loss = 9.0 - 0.25 * step;
      r.grad_norm = 1.5 / step;
      r.lr = 1e-4 * step;
      r.global_tokens = r.local_tokens = 64;
      r.data_seconds = 1e-3;
      log.RecordStep(r);
    }
    log.LogValidation(4, 7.125, 128, 0.5);
  }
  // dump_folder/tb/<YYYYmmdd-HHMM>/rank_1/events.out.tfevents.*
  const fs::path tb = fs::path(config.dump_folder) / "tb";
  std::vector<fs::path> minutes;
  for (const auto& entry : fs::directory_iterator(tb)) minutes.push_back(entry.path());
  ASSERT_EQ(minutes.size(), 1u);
  const std::string minute = minutes[0].filename().string();
  EXPECT_EQ(minute.size(), 13u) << minute;
  EXPECT_EQ(minute[8], '-') << minute;
  const fs::path dir = minutes[0] / "rank_1";
  ASSERT_TRUE(fs::is_directory(dir)) << dir;

  // What the JSONL has (rank 1: "<file>.rank1"), step by step.
  Scalars expected;
  std::ifstream jsonl(fs::path(config.dump_folder) / "metrics.jsonl.rank1");
  ASSERT_TRUE(jsonl.good());
  int lines = 0;
  for (std::string line; std::getline(jsonl, line);) {
    ++lines;
    ASSERT_TRUE(StartsWith(line, "{\"step\": ") && line.back() == '}') << line;
    const std::vector<std::string> pairs = Split(line.substr(1, line.size() - 2), ", ");
    const int64_t step = std::stoll(pairs[0].substr(8));
    for (size_t i = 1; i < pairs.size(); ++i) {
      const size_t colon = pairs[i].rfind("\": ");
      ASSERT_NE(colon, std::string::npos) << pairs[i];
      expected[pairs[i].substr(1, colon - 1)].emplace_back(step,
                                                           AsFloat(std::strtod(pairs[i].c_str() + colon + 3, nullptr)));
    }
  }
  EXPECT_EQ(lines, 4);  // steps 1, 2, 4 and the validation
  ASSERT_EQ(expected.count("loss_metrics/global_avg_loss"), 1u);
  ASSERT_EQ(expected.count("lr"), 1u);
  EXPECT_EQ(expected["lr"][2], std::make_pair(int64_t{4}, AsFloat(4e-4)));
  EXPECT_EQ(expected["validation_metrics/loss"], (std::vector<std::pair<int64_t, double>>{{4, 7.125}}));

  Scalars read;
  std::vector<std::string> files;
  std::string version, why_not;
  if (!ReadWithTensorBoard(dir.string(), &read, &files, &version, &why_not)) GTEST_SKIP() << why_not;
  EXPECT_EQ(files.size(), 1u);
  EXPECT_EQ(read, expected);
}

}  // namespace
}  // namespace fsdp::train
