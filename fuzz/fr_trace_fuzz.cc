// Fuzz target: the flight recorder dump reader (tools/fr_trace_lib.h), which reads pickles
// from disk: the bytes are one rank's dump, then analyzed alone. A c10::Error is a valid
// outcome; a crash, a hang or a leak is not.
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tools/fr_trace_lib.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const fsdp::tools::FlightDump dump =
        fsdp::tools::ParseFlightDump(std::string_view(reinterpret_cast<const char*>(data), size), 0);
    fsdp::tools::DiagnoseFlightDumps({dump});
  } catch (const c10::Error&) {
  }
  return 0;
}
