#pragma once
// EXPECT_VALUE_ERROR(statement, substring): the statement throws
// c10::ValueError and its message (without backtrace) names `substring`.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

namespace shardema::testing {

// The message of the c10::ValueError thrown by fn, or a marker that makes the
// substring check fail when fn throws something else or nothing.
inline std::string valueErrorMessage(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::ValueError& error) {
    return error.what_without_backtrace();
  } catch (...) {
    return "<threw something other than c10::ValueError>";
  }
  return "<did not throw>";
}

}  // namespace shardema::testing

#define EXPECT_VALUE_ERROR(statement, substring)                               \
  do {                                                                         \
    EXPECT_THROW(statement, c10::ValueError);                                  \
    const std::string message_ =                                               \
        ::shardema::testing::valueErrorMessage([&] { (void)(statement); });    \
    EXPECT_NE(message_.find(substring), std::string::npos)                     \
        << "message '" << message_ << "' should name '" << (substring) << "'"; \
  } while (0)
