#include "conversions.h"

#include <c10/util/Exception.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "shardema/core/byte_size.h"

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

std::optional<int64_t> byteSizeOf(const pybind11::handle& value, const char* parameter) {
  if (value.is_none()) return std::nullopt;
  if (pybind11::isinstance<pybind11::str>(value)) {
    return parseByteSize(value.cast<std::string>(), parameter);
  }
  const bool integer =
      pybind11::isinstance<pybind11::int_>(value) && !pybind11::isinstance<pybind11::bool_>(value);
  TORCH_CHECK_TYPE(integer, parameter,
                   " must be an int (bytes) or a string such as \"5GB\", got ",
                   std::string(pybind11::str(pybind11::type::of(value).attr("__name__"))));
  // Compared in Python: an int of any size, no overflow on the way.
  const bool positive = value.cast<pybind11::int_>() >= pybind11::int_(1);
  const bool fits = value.cast<pybind11::int_>() <= pybind11::int_(INT64_MAX);
  TORCH_CHECK_VALUE(positive && fits, parameter, " must be a positive number of bytes below 2**63, got ",
                    std::string(pybind11::str(value)));
  return value.cast<int64_t>();
}

}  // namespace shardema::python
