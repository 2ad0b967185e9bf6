#pragma once
// shardema's one channel for warnings. Underneath is c10's warning handler,
// the one TORCH_WARN uses: it prints to stderr by default, and once torch's
// Python bindings are loaded they install a handler that turns each
// warning into a Python warning, so it reaches the user where they look
// (and `warnings.filterwarnings` can silence it). c10 keeps that handler
// per thread: a warning from one of our worker threads goes to the default
// (stderr) one. Any thread may call these.
#include <string>

namespace shardema {
namespace detail {

/// Emits `message` as one warning, on the calling thread. Never throws: a
/// handler that fails (e.g. Python's, with warnings turned into errors) is
/// ignored, because the callers include destructors and worker threads,
/// where a warning must not become the failure.
void warn(const std::string& message);

/// As warn, but only the first call of this process with a given `key`
/// emits; later calls with that key do nothing. For facts that hold for the
/// whole process (which copy engine kAuto chose). Thread-safe.
void warnOnce(const std::string& key, const std::string& message);

}  // namespace detail
}  // namespace shardema
