#pragma once
// The profiles of an Averager state (Averager::state, loadState and
// checkAveragerStateMetadata): the shardema.profiles metadata key, written
// and checked in one place. Profile p > 0 tensors' names:
// profileTensorName (averager.h).
#include <map>
#include <string>
#include <vector>

#include "shardema/averager.h"

namespace shardema::detail {

/// shardema.profiles' text for `profiles` (profile 0 first): a JSON array
/// of {"schedule": {...}, "last_decay": "<17 digits>"}.
std::string profilesJson(const std::vector<AveragerStateInfo::Profile>& profiles);

/// The profiles a state's metadata records: shardema.profiles when present
/// (checked: an array of 2 to kMaxProfiles valid entries whose first
/// repeats `first`, the state's own schedule and last decay), else
/// `first` alone. c10::ValueError "<api>: shardema.profiles ..." naming
/// the entry.
std::vector<AveragerStateInfo::Profile> savedProfiles(
    const std::map<std::string, std::string>& metadata, const AveragerStateInfo::Profile& first,
    const char* api);

}  // namespace shardema::detail
