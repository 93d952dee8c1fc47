// Golden files written by real PyTorch (testing/golden/gen_*.py, `./x golden`): reading
// their records and the numbers in their fields, for the C++ tests that compare against
// them. A file's first line names the PyTorch that wrote it, which must be the pinned 2.15;
// other lines starting with '#' are comments; a record is one line of tab-separated fields.
// Errors (missing file, another PyTorch, a field that is not a number) throw
// std::runtime_error naming the file or the field.
//
// A golden suite is value-parameterized, one test per corpus case, so that
// --gtest_filter='*/CASE' runs one case (GoldenCases and GoldenCaseName below):
//
//   INSTANTIATE_TEST_SUITE_P(Corpus, Suite, ::testing::ValuesIn(GoldenCases<Case>("file", 100, Read, Name)),
//                            GoldenCaseName());
#ifndef FSDP_TESTING_GOLDEN_FILE_H_
#define FSDP_TESTING_GOLDEN_FILE_H_

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

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

// A golden comparison's mismatches by category, with the first five examples of each
// (in sorted order, so that the message does not depend on which rank thread came first), for
// one failure message listing them all. Thread-safe (threaded ranks report from their
// threads).
class Mismatches {
 public:
  void Add(const std::string& category, const std::string& example) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[category];
    auto& examples = examples_[category];
    examples.insert(example);
    if (examples.size() > 5) examples.erase(std::prev(examples.end()));
  }
  int total() const {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (const auto& [category, count] : counts_) n += count;
    return n;
  }
  // How many mismatches of `category`.
  int count(const std::string& category) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = counts_.find(category);
    return it == counts_.end() ? 0 : it->second;
  }
  std::string Report() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::string out;
    for (const auto& [category, count] : counts_) {
      absl::StrAppend(&out, count, " x ", category, "\n");
      for (const auto& e : examples_.at(category)) absl::StrAppend(&out, "    ", e, "\n");
    }
    return out;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, int> counts_;
  std::map<std::string, std::set<std::string>> examples_;
};

// ------------------------------------------------------------------ one test per case

// `text` as a GoogleTest name: letters, digits and '_' only (each run of other characters
// becomes one '_', none at either end); "case" if nothing is left.
inline std::string GoldenTestName(absl::string_view text) {
  std::string out;
  for (char ch : text) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_';
    if (ok) {
      out.push_back(ch);
    } else if (!out.empty() && out.back() != '_') {
      out.push_back('_');
    }
  }
  while (!out.empty() && out.back() == '_') out.pop_back();
  return out.empty() ? "case" : out;
}

// One case of a corpus as a test parameter: its test name and the case (shared: GoogleTest
// copies parameters), or, for the one stand-in case of a corpus that did not load, the error.
template <class T>
struct GoldenCase {
  std::string name;  // GoldenTestName, unique in the corpus
  std::shared_ptr<const T> value;
  std::string corpus_error;  // set iff value is null

  const T& operator*() const { return *value; }
  const T* operator->() const { return value.get(); }
  // What GoogleTest prints for the parameter (--gtest_list_tests, failures, test.xml).
  friend std::ostream& operator<<(std::ostream& os, const GoldenCase& c) { return os << c.name; }
};

// INSTANTIATE_TEST_SUITE_P's name generator: the case's name.
struct GoldenCaseName {
  template <class Info>
  std::string operator()(const Info& info) const {
    return info.param.name;
  }
};

// The cases `read` returns, each named GoldenTestName(name(case)) (a repeated name gets _2,
// _3, ...). This runs while GoogleTest registers the tests: an exception from `read`, or
// fewer than `min_cases` cases, gives one case named corpus_not_loaded whose test must fail
// with corpus_error (start each test with ASSERT_GOLDEN_CASE_LOADED), not a crash and not a
// suite of zero tests.
template <class T>
std::vector<GoldenCase<T>> GoldenCases(const std::string& corpus, size_t min_cases,
                                       const std::function<std::vector<T>()>& read,
                                       const std::function<std::string(const T&)>& name) {
  std::vector<GoldenCase<T>> out;
  std::string error;
  try {
    std::vector<T> cases = read();
    if (cases.size() < min_cases) {
      error = absl::StrCat(corpus, " has ", cases.size(), " cases, fewer than the ", min_cases,
                           " expected (regenerate: ./x golden)");
    }
    std::set<std::string> taken;
    for (T& c : cases) {
      const std::string base = GoldenTestName(name(c));
      std::string n = base;
      for (int k = 2; !taken.insert(n).second; ++k) n = absl::StrCat(base, "_", k);
      out.push_back({n, std::make_shared<const T>(std::move(c)), ""});
    }
  } catch (const std::exception& e) {
    error = absl::StrCat(corpus, ": ", e.what());
  }
  if (!error.empty()) return {GoldenCase<T>{"corpus_not_loaded", nullptr, error}};
  return out;
}

// The first statement of a golden TEST_P: fails the stand-in case of a corpus that did not
// load (GoldenCases), with the reason.
#define ASSERT_GOLDEN_CASE_LOADED()                                     \
  do {                                                                  \
    if (GetParam().value == nullptr) FAIL() << GetParam().corpus_error; \
  } while (0)

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_GOLDEN_FILE_H_
