#include "conversions.h"

#include <c10/util/Exception.h>

#include <initializer_list>
#include <utility>

namespace shardema::python {
namespace {

// The value of `word` among `choices`, or a ValueError such as
// "layout must be 'rank0' or 'sharded', got 'x'".
template <class Enum>
Enum parseChoice(const char* parameter, const std::string& word,
                 std::initializer_list<std::pair<const char*, Enum>> choices) {
  std::string accepted;
  size_t index = 0;
  for (const auto& [name, value] : choices) {
    if (word == name) return value;
    accepted += index == 0 ? "" : index + 1 == choices.size() ? " or " : ", ";
    accepted += std::string("'") + name + "'";
    ++index;
  }
  TORCH_CHECK_VALUE(false, parameter, " must be ", accepted, ", got '", word, "'");
}

}  // namespace

EmaStorage parseEmaStorage(const std::string& word) {
  return parseChoice<EmaStorage>(
      "storage", word, {{"pinned_host", EmaStorage::kPinnedHost}, {"device", EmaStorage::kDevice}});
}

offload::EngineChoice parseEngine(const std::string& word) {
  return parseChoice<offload::EngineChoice>("engine", word,
                                            {{"auto", offload::EngineChoice::kAuto},
                                             {"host", offload::EngineChoice::kHost},
                                             {"cuda", offload::EngineChoice::kCuda}});
}

PostHocLayout parsePostHocLayout(const std::string& word) {
  return parseChoice<PostHocLayout>(
      "layout", word, {{"rank0", PostHocLayout::kRankZero}, {"sharded", PostHocLayout::kSharded}});
}

TrackingPolicy parsePolicy(const std::string& word) {
  return parseChoice<TrackingPolicy>(
      "policy", word,
      {{"versatil", TrackingPolicy::kVersatil}, {"ema_pytorch", TrackingPolicy::kEmaPytorch}});
}

BetaConvention parseConvention(const std::string& word) {
  return parseChoice<BetaConvention>(
      "DecaySchedule.power_function: convention", word,
      {{"nitrous", BetaConvention::kNitrous}, {"edm2", BetaConvention::kEdm2}});
}

}  // namespace shardema::python
