#pragma once
// Failpoints: the one seam through which tests make the library fail, or
// take a path it takes only on other hardware, at a named place.
//
// The library marks a place with `failpoint::fires("name", a, b)`, passing
// two values that say where it is (a step and a chunk, an index). While no
// failpoint is armed, which is every production run, that is one relaxed
// atomic load and a branch that is never taken. A test arms one by name for
// the lifetime of a failpoint::Armed, with a predicate over the two values;
// the code at the failpoint says what firing does. Armed failpoints are
// process-wide: every thread passing one (pool workers included) sees it.
//
// The failpoints, each with its values and what firing does:
//   "offload.pipeline.chunk"              (step, chunk)  UpdatePipeline: the
//        math of that chunk throws c10::Error "injected fault"; wait()
//        reports it and the update is failed.
//   "offload.pipeline.stage_host_source"  (job index, 0) UpdatePipeline: that
//        host source is staged through the copy engine instead of being read
//        in place, so one update runs both paths side by side (as a job
//        with some device and some host sources would) without a GPU.
//   "lib.ema_storage.allocate"            (tracked tensor index, 0) the EMA
//        storage of that tensor fails to allocate (c10::Error), after the
//        earlier ones were allocated: a constructor failing part-way.
// Arming another name is a c10::ValueError, so a test cannot arm a typo.
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

namespace shardema {
namespace failpoint {

/// Whether an armed failpoint fires at one pass, from its two values.
/// Runs under the registry's lock, on the thread passing the failpoint.
using Predicate = std::function<bool(int64_t a, int64_t b)>;

namespace detail {
extern std::atomic<int> armedCount;
bool firesArmed(const char* name, int64_t a, int64_t b);
}  // namespace detail

/// True when failpoint `name` is armed and its predicate holds for (a, b).
/// Any thread; blocks only while a failpoint is armed (a lock).
inline bool fires(const char* name, int64_t a = 0, int64_t b = 0) {
  if (detail::armedCount.load(std::memory_order_relaxed) == 0) return false;
  return detail::firesArmed(name, a, b);
}

/// Arms failpoint `name` (one of the list above) until destroyed. `once`:
/// disarmed after it first fires. At most one Armed per name at a time
/// (c10::ValueError otherwise). Arm and disarm between the operations that
/// pass the failpoint, not during them. Not copyable or movable.
class Armed {
 public:
  Armed(std::string name, Predicate when, bool once = false);
  ~Armed();
  Armed(const Armed&) = delete;
  Armed& operator=(const Armed&) = delete;

  /// How many times it has fired so far.
  int64_t fired() const;

 private:
  std::string name_;
};

}  // namespace failpoint
}  // namespace shardema
