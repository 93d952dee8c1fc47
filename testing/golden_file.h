// Golden files written by real PyTorch (testing/golden/gen_*.py, `./x golden`): reading
// their records and the numbers in their fields, for the C++ tests that compare against
// them. A file's first line names the PyTorch that wrote it, which must be the pinned 2.15;
// other lines starting with '#' are comments; a record is one line of tab-separated fields.
// Errors (missing file, another PyTorch, a field that is not a number) throw
// std::runtime_error naming the file or the field.
#ifndef FSDP_TESTING_GOLDEN_FILE_H_
#define FSDP_TESTING_GOLDEN_FILE_H_

#include <cstdint>
#include <fstream>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace fsdp::testing {

using GoldenFields = std::vector<std::string>;

// The records of `path` (relative to the runfiles root, where Bazel runs tests and data files
// keep their workspace paths).
inline std::vector<GoldenFields> ReadGoldenFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path + " (regenerate: ./x golden)");
  std::vector<GoldenFields> out;
  std::string line;
  for (int n = 0; std::getline(in, line); ++n) {
    if (n == 0 && !absl::StartsWith(line, "# torch 2.15")) throw std::runtime_error(path + ": written by " + line);
    if (line.empty() || line[0] == '#') continue;
    out.push_back(absl::StrSplit(line, '\t'));
  }
  return out;
}

inline int64_t GoldenInt(const std::string& s) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(s, &v)) throw std::runtime_error("not an integer: " + s);
  return v;
}

inline double GoldenNum(const std::string& s) {
  double v = 0;
  if (!absl::SimpleAtod(s, &v)) throw std::runtime_error("not a number: " + s);
  return v;
}

// A `sep`-separated list; "-" is the empty list.
inline std::vector<int64_t> GoldenInts(const std::string& s, char sep = ',') {
  std::vector<int64_t> out;
  if (s == "-") return out;
  for (absl::string_view v : absl::StrSplit(s, sep)) out.push_back(GoldenInt(std::string(v)));
  return out;
}

inline std::vector<double> GoldenNums(const std::string& s) {
  std::vector<double> out;
  if (s == "-") return out;
  for (absl::string_view v : absl::StrSplit(s, ',')) out.push_back(GoldenNum(std::string(v)));
  return out;
}

// A golden comparison's mismatches by category, with the first five examples of each, for
// one failure message listing them all. Thread-safe (threaded ranks report from their
// threads).
class Mismatches {
 public:
  void Add(const std::string& category, const std::string& example) {
    std::lock_guard<std::mutex> lock(mu_);
    if (++counts_[category] <= 5) examples_[category].push_back(example);
  }
  int total() const {
    int n = 0;
    for (const auto& [category, count] : counts_) n += count;
    return n;
  }
  std::string Report() const {
    std::string out;
    for (const auto& [category, count] : counts_) {
      absl::StrAppend(&out, count, " x ", category, "\n");
      for (const auto& e : examples_.at(category)) absl::StrAppend(&out, "    ", e, "\n");
    }
    return out;
  }

 private:
  std::mutex mu_;
  std::map<std::string, int> counts_;
  std::map<std::string, std::vector<std::string>> examples_;
};

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_GOLDEN_FILE_H_
