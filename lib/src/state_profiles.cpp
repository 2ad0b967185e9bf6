#include "state_profiles.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include "shardema/core/file_metadata.h"
#include "shardema/core/update_kernels.h"

namespace shardema {
namespace {

// A prefix no module name has (a dot then an underscore word, then a
// slash, which module paths never hold): Averager construction refuses
// tracked names that begin with it, so a stored name parses one way only.
constexpr const char* kProfilePrefix = "shardema.profile_";

}  // namespace

std::string profileTensorName(const std::string& name, int profile) {
  return profile == 0 ? name : kProfilePrefix + std::to_string(profile) + "/" + name;
}

int profileOfStoredName(const std::string& stored, std::string* name) {
  const std::string prefix = kProfilePrefix;
  *name = stored;
  if (stored.compare(0, prefix.size(), prefix) != 0) return 0;
  const size_t slash = stored.find('/', prefix.size());
  int64_t profile = 0;
  if (slash == std::string::npos ||
      !detail::parseDecimalDigits(stored.substr(prefix.size(), slash - prefix.size()), &profile) ||
      profile < 1 || profile >= kMaxProfiles) {
    return -1;
  }
  *name = stored.substr(slash + 1);
  return static_cast<int>(profile);
}

namespace detail {

std::string profilesJson(const std::vector<AveragerStateInfo::Profile>& profiles) {
  nlohmann::json out = nlohmann::json::array();
  for (const AveragerStateInfo::Profile& p : profiles) {
    out.push_back({{"schedule", nlohmann::json::parse(p.schedule.toJson())},
                   {"last_decay", formatDecimal17(p.lastDecay)}});
  }
  return out.dump();
}

std::vector<AveragerStateInfo::Profile> savedProfiles(
    const std::map<std::string, std::string>& metadata, const AveragerStateInfo::Profile& first,
    const char* api) {
  const auto it = metadata.find(kProfilesKey);
  if (it == metadata.end()) return {first};
  const nlohmann::json array =
      nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK_VALUE(
      array.is_array() && array.size() >= 2 && array.size() <= static_cast<size_t>(kMaxProfiles),
      api, ": ", kProfilesKey, " must be a JSON array of 2 to ", kMaxProfiles, " profiles");
  std::vector<AveragerStateInfo::Profile> out;
  for (size_t p = 0; p < array.size(); ++p) {
    const nlohmann::json& entry = array[p];
    TORCH_CHECK_VALUE(entry.is_object() && entry.contains("schedule") &&
                          entry["schedule"].is_object() && entry.contains("last_decay") &&
                          entry["last_decay"].is_string(),
                      api, ": ", kProfilesKey, "[", p,
                      "] must be {\"schedule\": {...}, \"last_decay\": \"...\"}");
    AveragerStateInfo::Profile profile;
    try {
      profile.schedule = DecaySchedule::fromJson(entry["schedule"].dump());
    } catch (const c10::Error& error) {
      TORCH_CHECK_VALUE(false, api, ": ", kProfilesKey, "[", p,
                        "]: ", error.what_without_backtrace());
    }
    const std::string decay = entry["last_decay"].get<std::string>();
    TORCH_CHECK_VALUE(parseFiniteDecimal(decay, &profile.lastDecay) && profile.lastDecay >= 0.0 &&
                          profile.lastDecay <= 1.0,
                      api, ": ", kProfilesKey, "[", p, "].last_decay is '", decay,
                      "', not a number in [0, 1]");
    out.push_back(profile);
  }
  TORCH_CHECK_VALUE(out[0].schedule == first.schedule && out[0].lastDecay == first.lastDecay, api,
                    ": ", kProfilesKey, "[0] disagrees with ", kScheduleKey, " and ", kLastDecayKey,
                    " (the same profile)");
  for (size_t p = 1; p < out.size(); ++p) {
    TORCH_CHECK_VALUE(out[p].schedule.updateEvery() == first.schedule.updateEvery(), api, ": ",
                      kProfilesKey, "[", p, "] updates every ", out[p].schedule.updateEvery(),
                      " steps, profile 0 every ", first.schedule.updateEvery(),
                      "; profiles share their due steps");
  }
  return out;
}

}  // namespace detail
}  // namespace shardema
