// EXPECT_ERROR_CONTAINS(statement, substring): the statement throws a c10::Error whose
// message (without backtrace) contains `substring`.
#ifndef FSDP_TESTING_EXPECT_ERROR_H_
#define FSDP_TESTING_EXPECT_ERROR_H_

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"

#define EXPECT_ERROR_CONTAINS(statement, substring)                                    \
  do {                                                                                 \
    try {                                                                              \
      statement;                                                                       \
      ADD_FAILURE() << #statement << " did not throw";                                 \
    } catch (const c10::Error& e) {                                                    \
      EXPECT_TRUE(absl::StrContains(e.what_without_backtrace(), substring))            \
          << "message: " << e.what_without_backtrace() << "\nexpected: " << substring; \
    }                                                                                  \
  } while (0)

#endif  // FSDP_TESTING_EXPECT_ERROR_H_
