// Averager state for resume: EMA tensors of every profile plus step, flags,
// schedules, roles.
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ema_store.h"
#include "load_matching.h"
#include "shardema/averager.h"
#include "shardema/core/checksum.h"
#include "shardema/core/file_metadata.h"
#include "state_profiles.h"

namespace shardema {
namespace {

using detail::kKindKey;
constexpr const char* kAveragerKind = detail::kAveragerStateKind;

using Metadata = std::map<std::string, std::string>;

const std::string& requireKey(const Metadata& metadata, const char* key, const char* api) {
  const auto it = metadata.find(key);
  TORCH_CHECK_VALUE(it != metadata.end(), api, ": metadata key '", key,
                    "' is missing; this is not an Averager state");
  return it->second;
}

// fromJson's own error names the field inside the schedule; this one adds
// the key, so the line says which metadata holds it.
DecaySchedule savedSchedule(const Metadata& metadata, const char* api) {
  const std::string& text = requireKey(metadata, detail::kScheduleKey, api);
  try {
    return DecaySchedule::fromJson(text);
  } catch (const c10::Error& error) {
    TORCH_CHECK_VALUE(false, api, ": ", detail::kScheduleKey, ": ", error.what_without_backtrace());
  }
}

// Every value must be a role name (parseTrackRole): a garbled role could
// not be compared with the tracked one, and no save writes one.
std::map<std::string, TrackRole> savedRoles(const Metadata& metadata, const char* api) {
  const auto it = metadata.find(detail::kRolesKey);
  if (it == metadata.end()) return {};
  const nlohmann::json roles =
      nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK_VALUE(roles.is_object(), api, ": ", detail::kRolesKey, " is not a JSON object");
  std::map<std::string, TrackRole> out;
  for (const auto& [name, role] : roles.items()) {
    TORCH_CHECK_VALUE(role.is_string(), api, ": ", detail::kRolesKey, ": tensor '", name,
                      "' has role ", role.dump(), ", not a role name");
    try {
      out.emplace(name, parseTrackRole(role.get<std::string>()));
    } catch (const c10::Error& error) {
      TORCH_CHECK_VALUE(false, api, ": ", detail::kRolesKey, ": tensor '", name,
                        "': ", error.what_without_backtrace());
    }
  }
  return out;
}

std::string joinNames(const std::vector<std::string>& names) {
  std::ostringstream out;
  const size_t shown = std::min<size_t>(names.size(), 10);
  for (size_t i = 0; i < shown; ++i) out << (i ? ", " : "") << "'" << names[i] << "'";
  if (names.size() > shown) out << " and " << names.size() - shown << " more";
  return out.str();
}

// A value may widen or narrow between floating types (a bf16 deployable
// file into an fp32 EMA), but an integer or bool copy takes only its own
// dtype: an f32 value cast into an int64 step counter would load truncated
// numbers without a word.
void checkLoadableType(const std::string& name, at::ScalarType given, at::ScalarType held) {
  const bool heldFloating = at::isFloatingType(held);
  TORCH_CHECK_TYPE(heldFloating ? at::isFloatingType(given) : given == held,
                   "Averager::loadEmaValues: tensor '", name, "' is ", given,
                   " but is kept here as ", held,
                   heldFloating ? " (a floating value is needed)" : " (the same dtype is needed)",
                   "; the value belongs to another tensor or another model");
}

// The keys a load takes its meaning from, in the order they are digested:
// an edit of any of them to another valid value (a copy's role made
// "average", another schedule, another step) passes every check of the
// value itself, and only the Averager loaded into could tell.
constexpr const char* kStateKeys[] = {detail::kKindKey,        detail::kStepKey,
                                      detail::kInitializedKey, detail::kLastDecayKey,
                                      detail::kScheduleKey,    detail::kRolesKey};

std::string stateKeysText() {
  std::string text;
  for (const char* key : kStateKeys) text += std::string(text.empty() ? "" : ", ") + key;
  return text + " and " + detail::kProfilesKey + " when present";
}

// XXH64 of each state key and its value, NUL-separated (an absent key
// differs from an empty value), so a file without one no longer matches.
uint64_t stateDigest(const Metadata& metadata) {
  Xxh64 hash;
  for (const char* key : kStateKeys) {
    const auto it = metadata.find(key);
    hash.update(key, std::strlen(key) + 1);
    const std::string value = it == metadata.end() ? std::string("\x01" "absent") : it->second;
    hash.update(value.data(), value.size() + 1);
  }
  // Hashed only where present, so a state of one profile (and one saved
  // before profiles were saved) keeps its digest. A state that lost the key
  // fails on its profile tensors instead, which nothing then expects.
  const auto profiles = metadata.find(detail::kProfilesKey);
  if (profiles != metadata.end()) {
    hash.update(detail::kProfilesKey, std::strlen(detail::kProfilesKey) + 1);
    hash.update(profiles->second.data(), profiles->second.size() + 1);
  }
  return hash.digest();
}

// Checked last, so a value that is invalid on its own is named by its own
// check first; absent in files of older versions and other writers.
void checkStateDigest(const Metadata& metadata, const char* api) {
  const auto it = metadata.find(detail::kStateChecksumKey);
  if (it == metadata.end()) return;
  uint64_t recorded = 0;
  try {
    recorded = parseChecksumHex(it->second);
  } catch (const c10::ValueError& error) {
    TORCH_CHECK_VALUE(false, api, ": ", detail::kStateChecksumKey, ": ",
                      error.what_without_backtrace());
  }
  const uint64_t computed = stateDigest(metadata);
  TORCH_CHECK_VALUE(computed == recorded, api, ": ", detail::kStateChecksumKey, " is ", it->second,
                    " but the keys it covers (", stateKeysText(), ") give ", checksumHex(computed),
                    ": one was edited or corrupted after the save");
}

}  // namespace

AveragerStateInfo checkAveragerStateMetadata(const Metadata& metadata, const char* api) {
  const std::string& kind = requireKey(metadata, kKindKey, api);
  TORCH_CHECK_VALUE(kind == kAveragerKind, api, ": ", kKindKey, " is '", kind, "', expected '",
                    kAveragerKind, "'");
  AveragerStateInfo info;
  info.schedule = savedSchedule(metadata, api);
  // Strict parses: a negative or garbled step, or a decay that is NaN or
  // outside [0, 1], would resume an EMA that no save could have written.
  const std::string& stepText = requireKey(metadata, detail::kStepKey, api);
  TORCH_CHECK_VALUE(detail::parseDecimalDigits(stepText, &info.step), api, ": ", detail::kStepKey,
                    " (metadata key '", detail::kStepKey, "' is '", stepText,
                    "') must be a non-negative integer");
  const std::string& decayText = requireKey(metadata, detail::kLastDecayKey, api);
  TORCH_CHECK_VALUE(detail::parseFiniteDecimal(decayText, &info.lastDecay) &&
                        info.lastDecay >= 0.0 && info.lastDecay <= 1.0,
                    api, ": ", detail::kLastDecayKey, " (metadata key '", detail::kLastDecayKey,
                    "' is '", decayText, "') must be a number in [0, 1]");
  const std::string& initialized = requireKey(metadata, detail::kInitializedKey, api);
  TORCH_CHECK_VALUE(initialized == "true" || initialized == "false", api, ": ",
                    detail::kInitializedKey, " must be true or false, got '", initialized, "'");
  info.initialized = initialized == "true";
  info.roles = savedRoles(metadata, api);
  info.profiles = detail::savedProfiles(metadata, {info.schedule, info.lastDecay}, api);
  checkStateDigest(metadata, api);
  return info;
}

// A tensor averaged in one run and copied in the other would silently change
// meaning on resume, so a strict load insists the roles agree.
void Averager::checkRoles(const std::map<std::string, TrackRole>& saved) const {
  for (const TrackedTensor& t : tracked_) {
    const auto role = saved.find(t.name);
    if (role == saved.end()) continue;
    TORCH_CHECK_VALUE(role->second == t.role, "Averager::loadState: tensor '", t.name,
                      "' was saved with role ", trackRoleName(role->second),
                      " but is tracked here with role ", trackRoleName(t.role),
                      "; use the same TrackingPolicy or load non-strictly");
  }
}

// Another number of profiles, or another schedule for one, would resume
// EMAs that are not the ones this Averager's profiles name.
void Averager::checkSavedProfiles(const std::vector<AveragerStateInfo::Profile>& saved) const {
  TORCH_CHECK_VALUE(static_cast<int>(saved.size()) == numProfiles(),
                    "Averager::loadState: the state holds ", saved.size(), " profile",
                    saved.size() == 1 ? "" : "s", " but this Averager keeps ", numProfiles(),
                    "; build it with the saved schedules or load non-strictly");
  for (size_t p = 1; p < saved.size(); ++p) {
    const DecaySchedule& here = schedule(static_cast<int>(p));
    TORCH_CHECK_VALUE(saved[p].schedule == here, "Averager::loadState: profile ", p,
                      " was saved with schedule ", saved[p].schedule.describe(),
                      " but this Averager's is ", here.describe(),
                      "; build it with the saved schedules or load non-strictly");
  }
}

LoadReport Averager::loadEmaValues(const std::vector<std::pair<std::string, at::Tensor>>& values,
                                   LoadStrictness strictness, int profile) {
  checkProfile(profile, "loadEmaValues");
  settle("loadEmaValues");
  const LoadReport report = checkValues(values, strictness, /*averagedOnly=*/false);
  writeValues(values, profile);
  return report;
}

LoadReport Averager::checkValues(const std::vector<std::pair<std::string, at::Tensor>>& values,
                                 LoadStrictness strictness, bool averagedOnly) const {
  std::vector<std::string> trackedNames;
  for (const TrackedTensor& t : tracked_) {
    if (!averagedOnly || isAveragingRole(t.role)) trackedNames.push_back(t.name);
  }
  const LoadReport report = detail::matchLoadTargets(
      values, trackedNames,
      [&](const std::string& name) -> const at::Tensor* {
        const auto it = index_.find(name);
        return it == index_.end() ? nullptr : &store_->storage(it->second, 0);
      },
      "Averager::loadEmaValues", "the tracked tensor");
  for (const auto& [name, tensor] : values) {
    const auto it = index_.find(name);
    if (it != index_.end()) {
      checkLoadableType(name, tensor.scalar_type(), store_->storage(it->second, 0).scalar_type());
    }
  }
  if (strictness == LoadStrictness::kStrict) {
    TORCH_CHECK_VALUE(report.missing.empty(), "Averager::loadEmaValues: missing tensors ",
                      joinNames(report.missing),
                      " (tracked but not given; load non-strictly to keep them)");
    TORCH_CHECK_VALUE(report.unexpected.empty(), "Averager::loadEmaValues: unexpected tensors ",
                      joinNames(report.unexpected),
                      " (given but not tracked; load non-strictly to ignore them)");
  }
  return report;
}

void Averager::writeValues(const std::vector<std::pair<std::string, at::Tensor>>& values,
                           int profile) {
  for (const auto& [name, tensor] : values) {
    const auto it = index_.find(name);
    if (it != index_.end()) store_->storage(it->second, profile).copy_(tensor);
  }
}

TensorFile Averager::state() const {
  TensorFile file;
  file.tensors = emaTensors();
  // Copies are one tensor shared by every profile: saved once, above.
  for (int p = 1; p < numProfiles(); ++p) {
    const std::vector<std::pair<std::string, at::Tensor>> profile = emaTensors(p);
    for (size_t i = 0; i < profile.size(); ++i) {
      if (isAveragingRole(tracked_[i].role)) {
        file.tensors.emplace_back(profileTensorName(profile[i].first, p), profile[i].second);
      }
    }
  }
  file.metadata = stateMetadata();
  return file;
}

std::map<std::string, std::string> Averager::stateMetadata() const {
  nlohmann::json roles = nlohmann::json::object();
  for (const TrackedTensor& t : tracked_) roles[t.name] = trackRoleName(t.role);
  std::map<std::string, std::string> metadata;
  metadata[kKindKey] = kAveragerKind;
  metadata[detail::kStepKey] = std::to_string(step_);
  metadata[detail::kInitializedKey] = initialized_ ? "true" : "false";
  metadata[detail::kLastDecayKey] = detail::formatDecimal17(lastDecay_);
  metadata[detail::kScheduleKey] = options_.schedule.toJson();
  metadata[detail::kRolesKey] = roles.dump();
  if (numProfiles() > 1) {
    std::vector<AveragerStateInfo::Profile> profiles;
    for (int p = 0; p < numProfiles(); ++p) profiles.push_back({schedule(p), lastDecay(p)});
    metadata[detail::kProfilesKey] = detail::profilesJson(profiles);
  }
  metadata[detail::kStateChecksumKey] = checksumHex(stateDigest(metadata));
  return metadata;
}

LoadReport Averager::loadState(const TensorFile& file, LoadStrictness strictness) {
  store("loadState");  // a moved-from Averager has nothing to load into
  // A failed Averager may load (that is how it recovers); an update still
  // in flight is finished first, its error only marking us failed.
  if (failure_.empty()) {
    try {
      settle("loadState");
    } catch (const c10::Error&) {
    }
  }
  // The checks `shardema inspect` makes too (checkAveragerStateMetadata).
  const AveragerStateInfo saved = checkAveragerStateMetadata(file.metadata, "Averager::loadState");
  TORCH_CHECK_VALUE(strictness == LoadStrictness::kNonStrict || saved.schedule == options_.schedule,
                    "Averager::loadState: the state was saved with schedule ",
                    saved.schedule.describe(), " but this Averager uses ",
                    options_.schedule.describe(),
                    "; build it with the saved schedule or load non-strictly");
  if (strictness == LoadStrictness::kStrict) {
    checkRoles(saved.roles);
    checkSavedProfiles(saved.profiles);
  }
  // Each stored tensor to its profile; one of a profile this Averager lacks
  // (a non-strict load of more profiles) is reported, not loaded.
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> byProfile(numProfiles());
  std::vector<std::string> otherProfiles;
  for (const auto& [stored, tensor] : file.tensors) {
    std::string name;
    const int p = profileOfStoredName(stored, &name);
    const auto it = index_.find(name);
    const bool averaged = it != index_.end() && isAveragingRole(tracked_[it->second].role);
    // p > 0 holds averaged tensors only (a copy is shared, saved once).
    if (p == 0 ||
        (p > 0 && p < numProfiles() && p < static_cast<int>(saved.profiles.size()) && averaged)) {
      byProfile[p].emplace_back(name, tensor);
    } else {
      otherProfiles.push_back(stored);
    }
  }
  TORCH_CHECK_VALUE(strictness == LoadStrictness::kNonStrict || otherProfiles.empty(),
                    "Averager::loadState: unexpected tensors ", joinNames(otherProfiles),
                    " (of a profile the state does not record)");
  // Everything is checked before the first write, so a failed load leaves
  // the Averager as it was.
  LoadReport report = checkValues(byProfile[0], strictness, /*averagedOnly=*/false);
  std::vector<LoadReport> more;
  for (int p = 1; p < static_cast<int>(byProfile.size()); ++p) {
    more.push_back(checkValues(byProfile[p], strictness, /*averagedOnly=*/true));
    if (p >= static_cast<int>(saved.profiles.size())) continue;  // kept: none saved
    for (const std::string& n : more.back().missing) {
      report.missing.push_back(profileTensorName(n, p));
    }
    for (const std::string& n : more.back().unexpected) {
      report.unexpected.push_back(profileTensorName(n, p));
    }
  }
  report.unexpected.insert(report.unexpected.end(), otherProfiles.begin(), otherProfiles.end());
  for (int p = 0; p < static_cast<int>(byProfile.size()); ++p) writeValues(byProfile[p], p);
  step_ = saved.step;
  lastDecay_ = saved.lastDecay;
  for (size_t p = 1; p < saved.profiles.size() && p < moreLastDecays_.size() + 1; ++p) {
    moreLastDecays_[p - 1] = saved.profiles[p].lastDecay;
  }
  initialized_ = saved.initialized;
  // Only a state that covered every tensor replaces a partly updated EMA.
  if (report.missing.empty()) failure_.clear();
  writesToJudge_ = false;  // what the last update read was replaced
  return report;
}

void Averager::save(const std::string& path) const { writeTensorFile(path, state()); }

// readTensorFile names the file in its own errors; what loadState finds
// wrong with the contents is prefixed with it here, keeping the error type.
LoadReport Averager::load(const std::string& path, LoadStrictness strictness) {
  const TensorFile file = readTensorFile(path);
  try {
    return loadState(file, strictness);
  } catch (const c10::TypeError& e) {
    TORCH_CHECK_TYPE(false, path, ": ", e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    TORCH_CHECK_VALUE(false, path, ": ", e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    TORCH_CHECK_INDEX(false, path, ": ", e.what_without_backtrace());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": ", e.what_without_backtrace());
  }
}

}  // namespace shardema
