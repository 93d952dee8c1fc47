#include "comm/main_guard.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "comm/flight_recorder.h"
#include "env/environment.h"

namespace fsdp::comm {
namespace {

std::atomic<int64_t> exit_grace_ms{0};

struct ExitHooks {
  std::mutex mu;
  std::vector<std::function<void(const std::string&)>> hooks;
};
ExitHooks& Hooks() {
  static auto* hooks = new ExitHooks;  // never destroyed: used while the process ends
  return *hooks;
}

std::string Rank() {
  const std::optional<std::string> rank = env::Get(env::kRank);
  return rank && !rank->empty() ? *rank : "?";
}

std::string OneLine(const std::string& text) {
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (!line.empty()) lines.emplace_back(line);
  }
  return lines.empty() ? "(no message)" : absl::StrJoin(lines, " | ");
}

[[noreturn]] void Die(std::exception_ptr error) {
  const std::string line = ErrorLine(Rank(), error);
  {
    ExitHooks& hooks = Hooks();
    std::lock_guard<std::mutex> lock(hooks.mu);
    for (const auto& hook : hooks.hooks) {
      try {
        hook(line);
      } catch (...) {
      }
    }
  }
  std::fflush(stdout);
  // What each rank of this process issued last, for fr_trace (comm/flight_recorder.h).
  DumpFlightRecordersAfterFailure("error exit");
  std::fputs((line + "\n").c_str(), stderr);
  std::fflush(stderr);
  if (const int64_t grace = exit_grace_ms.load(); grace > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(grace));
  }
  std::_Exit(1);
}

}  // namespace

std::string ErrorLine(const std::string& rank, std::exception_ptr error) {
  std::string what = "unknown error (not a std::exception)";
  if (error != nullptr) {
    try {
      std::rethrow_exception(error);
    } catch (const c10::Error& e) {
      what = e.what_without_backtrace();
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
  } else {
    what = "std::terminate without an exception";
  }
  return absl::StrCat("[rank ", rank, "] error: ", OneLine(what));
}

void AddErrorExitHook(std::function<void(const std::string& line)> hook) {
  ExitHooks& hooks = Hooks();
  std::lock_guard<std::mutex> lock(hooks.mu);
  hooks.hooks.push_back(std::move(hook));
}

void SetExitGraceAfterError(std::chrono::milliseconds grace) { exit_grace_ms.store(grace.count()); }

int RunMain(const std::function<int()>& body) {
  std::set_terminate([] { Die(std::current_exception()); });
  InstallFlightRecorderDumpSignal(SIGUSR1);
  try {
    return body();
  } catch (...) {
    Die(std::current_exception());
  }
}

}  // namespace fsdp::comm
