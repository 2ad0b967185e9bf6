// The swap and its registry (weight_swap.h). The registry holds, for every
// live WeightSwap, the storage bytes of its targets; a count of live swaps
// lets Averager::update skip the lookup entirely in the common case.
#include "shardema/weight_swap.h"

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <list>
#include <mutex>
#include <unordered_map>

#include "shardema/averager_registry.h"
#include "shardema/core/warning.h"

namespace shardema {
namespace {

// Where a tensor's elements live: a storage and a byte range of it.
struct Footprint {
  const c10::StorageImpl* storage = nullptr;
  int64_t begin = 0;
  int64_t end = 0;  // exclusive; begin == end: no bytes
};

std::optional<Footprint> footprintOf(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) return std::nullopt;
  const auto itemsize = static_cast<int64_t>(t.dtype().itemsize());
  int64_t last = t.storage_offset();  // the element furthest from the start
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return Footprint{t.storage().unsafeGetStorageImpl(), t.storage_offset() * itemsize,
                   (last + 1) * itemsize};
}

bool overlaps(const Footprint& a, const Footprint& b) {
  return a.storage == b.storage && a.begin < b.end && b.begin < a.end;
}

struct Held {
  const WeightSwap* swap = nullptr;
  std::string owner;
  std::vector<std::pair<std::string, Footprint>> targets;
};

struct Registry {
  std::mutex mutex;
  std::list<Held> held;
  std::atomic<int> live{0};
};

Registry& registry() {
  static Registry* instance = new Registry();  // never destroyed, as averager_registry's
  return *instance;
}

// The (owner, target name) of the first registered target overlapping `t`.
// Caller holds the registry's mutex.
std::optional<std::pair<std::string, std::string>> holderOf(const Registry& r,
                                                            const at::Tensor& t) {
  const std::optional<Footprint> mine = footprintOf(t);
  if (!mine) return std::nullopt;
  for (const Held& h : r.held) {
    for (const auto& [name, footprint] : h.targets) {
      if (overlaps(*mine, footprint)) return std::make_pair(h.owner, name);
    }
  }
  return std::nullopt;
}

at::Tensor hostCopyOf(const at::Tensor& target) {
  // Pinned where the target is on a device, so the copy back is one DMA.
  const bool pin = !target.device().is_cpu() && target.device().is_cuda();
  at::Tensor raw = at::empty(target.sizes(), target.options().device(at::kCPU).pinned_memory(pin));
  raw.copy_(target.detach());
  return raw;
}

}  // namespace

WeightSwap::WeightSwap(std::vector<std::pair<std::string, at::Tensor>> targets, std::string owner)
    : targets_(std::move(targets)), owner_(std::move(owner)) {
  fenceEveryAverager();
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    Held held{this, owner_, {}};
    for (const auto& [name, tensor] : targets_) {
      const auto holder = holderOf(r, tensor);
      TORCH_CHECK(!holder, owner_, ": cannot swap the EMA into '", name, "': ", holder->first,
                  " has its EMA swapped into it (as '", holder->second,
                  "'); swaps do not nest: end that swap first");
      if (const auto footprint = footprintOf(tensor)) held.targets.emplace_back(name, *footprint);
    }
    r.held.push_back(std::move(held));
    r.live.fetch_add(1, std::memory_order_release);
  }
  try {
    raw_.reserve(targets_.size());
    for (const auto& entry : targets_) raw_.push_back(hostCopyOf(entry.second));
  } catch (...) {
    restored_ = true;  // nothing was written: only the registration to undo
    std::lock_guard<std::mutex> lock(r.mutex);
    r.held.remove_if([this](const Held& h) { return h.swap == this; });
    r.live.fetch_sub(1, std::memory_order_release);
    throw;
  }
}

WeightSwap::~WeightSwap() {
  try {
    restore();
  } catch (const c10::Error& e) {
    detail::warn(owner_ + ": writing the raw weights back failed: " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    detail::warn(owner_ + ": writing the raw weights back failed: " + e.what());
  }
}

void WeightSwap::write(const std::vector<std::pair<std::string, at::Tensor>>& values) {
  TORCH_CHECK(!restored_, owner_, ": the swap has ended (restore() ran)");
  std::unordered_map<std::string, const at::Tensor*> byName;
  for (const auto& [name, value] : values) byName[name] = &value;
  for (const auto& [name, target] : targets_) {
    const auto it = byName.find(name);
    if (it == byName.end()) continue;
    TORCH_CHECK_VALUE(it->second->numel() == target.numel(), owner_, ": the EMA of '", name,
                      "' has ", it->second->numel(), " elements but the model's tensor ",
                      target.numel());
  }
  c10::NoGradGuard noGrad;
  for (const auto& [name, target] : targets_) {
    const auto it = byName.find(name);
    if (it != byName.end()) target.detach().copy_(it->second->reshape(target.sizes()));
  }
}

void WeightSwap::restore() {
  if (restored_) return;
  {
    c10::NoGradGuard noGrad;
    for (size_t i = 0; i < targets_.size(); ++i) targets_[i].second.detach().copy_(raw_[i]);
  }
  restored_ = true;
  raw_.clear();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.held.remove_if([this](const Held& h) { return h.swap == this; });
  r.live.fetch_sub(1, std::memory_order_release);
}

std::optional<std::string> swappedInBy(const at::Tensor& tensor) {
  Registry& r = registry();
  if (r.live.load(std::memory_order_acquire) == 0) return std::nullopt;
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto holder = holderOf(r, tensor);
  if (!holder) return std::nullopt;
  return holder->first;
}

void checkModelWritable(const std::vector<std::pair<std::string, at::Tensor>>& targets,
                        const char* api) {
  fenceEveryAverager();
  Registry& r = registry();
  if (r.live.load(std::memory_order_acquire) == 0) return;
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& [name, tensor] : targets) {
    const auto holder = holderOf(r, tensor);
    TORCH_CHECK(!holder, api, ": '", name, "' holds the EMA weights ", holder->first,
                " swapped in; end that swap first (its end would put the raw weights back "
                "over what this writes)");
  }
}

}  // namespace shardema
