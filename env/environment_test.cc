// env::Get / IsOne against setenv, the unknown-name error, All() listing each variable once
// (tools/check_doc_links.py checks docs/reference/environment.md lists each).
#include "env/environment.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <set>
#include <string>

#include "testing/expect_error.h"

namespace fsdp::env {
namespace {

TEST(Environment, GetReadsTheProcessEnvironmentEachCall) {
  ::unsetenv(kCpuStreams.name);
  EXPECT_EQ(Get(kCpuStreams), std::nullopt);
  ::setenv(kCpuStreams.name, "", 1);
  EXPECT_EQ(Get(kCpuStreams), std::optional<std::string>(""));  // set but empty is not unset
  ::setenv(kCpuStreams.name, "async:5", 1);
  EXPECT_EQ(Get("FSDP_CPU_STREAMS"), std::optional<std::string>("async:5"));
  ::unsetenv(kCpuStreams.name);
}

TEST(Environment, IsOneMeansExactlyOne) {
  for (const char* value : {"0", "true", "11", " 1", ""}) {
    ::setenv(kSkipWritebackCheck.name, value, 1);
    EXPECT_FALSE(IsOne(kSkipWritebackCheck)) << "'" << value << "'";
  }
  ::setenv(kSkipWritebackCheck.name, "1", 1);
  EXPECT_TRUE(IsOne(kSkipWritebackCheck));
  ::unsetenv(kSkipWritebackCheck.name);
  EXPECT_FALSE(IsOne(kSkipWritebackCheck));
}

TEST(Environment, AnUnknownNameIsAnError) {
  EXPECT_ERROR_CONTAINS(Get("FSDP_NO_SUCH_SWITCH"), "'FSDP_NO_SUCH_SWITCH' is not one of the library's variables");
}

TEST(Environment, EveryVariableIsListedOnce) {
  std::set<std::string> names;
  for (const Variable& v : All()) EXPECT_TRUE(names.insert(v.name).second) << v.name << " is in All() twice";
  // The constants of environment.h, spelled out here: a new one must be added to All() too.
  const std::set<std::string> expected = {kRank.name,
                                          kWorldSize.name,
                                          kLocalRank.name,
                                          kMasterAddr.name,
                                          kMasterPort.name,
                                          kTorchelasticUseAgentStore.name,
                                          kTorchelasticRestartCount.name,
                                          kGlooSocketIfname.name,
                                          kTorchFrBufferSize.name,
                                          kTorchFrDumpTempFile.name,
                                          kTorchNcclDumpOnTimeout.name,
                                          kPeakBlocks.name,
                                          kCpuStreams.name,
                                          kUseFullPrecInEval.name,
                                          kSkipWritebackCheck.name};
  EXPECT_EQ(names, expected);
}

}  // namespace
}  // namespace fsdp::env
