// The registry behind averager_registry.h. Averagers add themselves when
// built and remove themselves when destroyed (averager.cpp); the set holds
// their addresses only, under one mutex, which fenceEveryAverager() holds
// while it fences so that none is destroyed meanwhile.
#include "shardema/averager_registry.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <string>
#include <unordered_set>

#include "averager_registry_entry.h"
#include "shardema/averager.h"
#include "shardema/core/warning.h"

namespace shardema {
namespace {

struct Registry {
  std::mutex mutex;
  std::unordered_set<Averager*> live;
};

Registry& registry() {
  // Never destroyed: Averagers held by static objects may outlive any
  // other static in their destructors.
  static Registry* instance = new Registry();
  return *instance;
}

}  // namespace

namespace detail {

void registerAverager(Averager* averager) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.live.insert(averager);
}

void unregisterAverager(Averager* averager) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.live.erase(averager);
}

}  // namespace detail

void fenceEveryAverager() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (Averager* averager : r.live) {
    if (averager->failed() || !averager->hasStorage()) continue;
    try {
      averager->fence();
    } catch (const c10::Error& e) {
      detail::warn(std::string("fenceEveryAverager: ") + e.what_without_backtrace());
    }
  }
}

size_t liveAveragers() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.live.size();
}

}  // namespace shardema
