#pragma once
// Internal to offload/src: the one-line text of a captured error, for the
// messages that name the tensor and step it happened at.
#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace shardema::offload::detail {

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

}  // namespace shardema::offload::detail
