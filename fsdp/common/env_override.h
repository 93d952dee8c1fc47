// Environment variables that may override an option for debugging (the option fields are
// the API; docs/reference/environment.md lists the overrides). Read when the option is read,
// not cached.
#pragma once

#include <cstdlib>
#include <cstring>

namespace fsdp {

// True when the environment variable `name` is set to exactly "1".
inline bool EnvOverrideIsOne(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::strcmp(value, "1") == 0;
}

}  // namespace fsdp
