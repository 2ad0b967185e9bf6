#include "shardema/core/warning.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <set>

namespace shardema {
namespace detail {

void warn(const std::string& message) {
  try {
    TORCH_WARN(message);
  } catch (...) {
    // See the header: a warning never becomes the caller's failure.
  }
}

void warnOnce(const std::string& key, const std::string& message) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!seen.insert(key).second) return;
  }
  warn(message);
}

}  // namespace detail
}  // namespace shardema
