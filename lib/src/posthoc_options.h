#pragma once
// The checks of PostHocCallback's constructor arguments (not installed):
// every field when it is given, so a bad value fails at construction, not
// at the first hook that reads it.
#include "shardema/posthoc_callback.h"

namespace shardema::detail {

/// Every field of `options`: c10::ValueError naming the field as
/// PostHocCallbackOptions spells it, its allowed range and the value.
void checkPostHocOptions(const PostHocCallbackOptions& options);

/// `ranks` (rank within worldSize, the communicator agreeing with them, a
/// communicator for the sharded layout on several ranks): c10::ValueError.
void checkPostHocRanks(const PostHocRanks& ranks, PostHocLayout layout);

}  // namespace shardema::detail
