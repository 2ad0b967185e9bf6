#pragma once
// Internal to offload/src: errors that cross threads. A worker or an engine
// callback captures what failed as text (the exception object itself never
// crosses threads: its last release could race a reader), and the thread
// that reports it builds the c10::Error that wait() rethrows.
#include <c10/util/Exception.h>

#include <exception>
#include <string>
#include <utility>

namespace shardema::offload::detail {

/// The one-line text of a captured error.
inline std::string describeError(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

/// A c10::Error with `message` (what TORCH_CHECK(false, message) throws),
/// captured for a later rethrow without being thrown here.
inline std::exception_ptr capturedError(const char* function, std::string message) {
  return std::make_exception_ptr(
      c10::Error(c10::SourceLocation{function, __FILE__, static_cast<uint32_t>(__LINE__)},
                 std::move(message)));
}

}  // namespace shardema::offload::detail
