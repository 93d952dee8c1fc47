// InternString: one string per distinct text, never freed, so a pointer to it stays valid for
// the life of the process (profiler labels, thread names: what flight recorder entries keep
// by pointer). Thread-safe (a mutex: call it once per name, not per use). Private to //comm.
#ifndef FSDP_COMM_INTERNAL_INTERNED_STRING_H_
#define FSDP_COMM_INTERNAL_INTERNED_STRING_H_

#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>

namespace fsdp::comm::internal {

inline const std::string* InternString(std::string_view text) {
  static std::mutex mu;
  static auto* strings = new std::unordered_set<std::string>();  // never destroyed: callers keep pointers
  std::lock_guard<std::mutex> lock(mu);
  return &*strings->emplace(text).first;  // node-based: the address survives rehashes
}

}  // namespace fsdp::comm::internal

#endif  // FSDP_COMM_INTERNAL_INTERNED_STRING_H_
