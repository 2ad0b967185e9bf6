#include "shardema/core/failpoint.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <mutex>

namespace shardema {
namespace failpoint {
namespace detail {
std::atomic<int> armedCount{0};
}  // namespace detail

namespace {

// The names failpoint.h documents; arming any other is a typo.
constexpr const char* kNames[] = {
    "offload.pipeline.chunk",
    "offload.pipeline.stage_host_source",
    "lib.ema_storage.allocate",
};

struct Arm {
  Predicate when;
  bool once = false;
  bool spent = false;
  int64_t fired = 0;
};

struct Registry {
  std::mutex mutex;
  std::map<std::string, Arm> arms;
};

Registry& registry() {
  static Registry* instance = new Registry();  // never destroyed: workers may outlive statics
  return *instance;
}

}  // namespace

bool detail::firesArmed(const char* name, int64_t a, int64_t b) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto found = r.arms.find(name);
  if (found == r.arms.end()) return false;
  Arm& arm = found->second;
  if (arm.spent || !arm.when(a, b)) return false;
  ++arm.fired;
  arm.spent = arm.once;
  return true;
}

Armed::Armed(std::string name, Predicate when, bool once) : name_(std::move(name)) {
  TORCH_CHECK_VALUE(
      std::find_if(std::begin(kNames), std::end(kNames),
                   [&](const char* known) { return name_ == known; }) != std::end(kNames),
      "failpoint::Armed: no failpoint is named '", name_,
      "' (core/include/shardema/core/failpoint.h lists them)");
  TORCH_CHECK_VALUE(when != nullptr, "failpoint::Armed('", name_, "'): the predicate is empty");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  TORCH_CHECK_VALUE(r.arms.count(name_) == 0, "failpoint::Armed: '", name_, "' is armed already");
  r.arms[name_] = Arm{std::move(when), once, false, 0};
  detail::armedCount.fetch_add(1, std::memory_order_relaxed);
}

Armed::~Armed() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.arms.erase(name_);
  detail::armedCount.fetch_sub(1, std::memory_order_relaxed);
}

int64_t Armed::fired() const {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto found = r.arms.find(name_);
  return found == r.arms.end() ? 0 : found->second.fired;
}

}  // namespace failpoint
}  // namespace shardema
