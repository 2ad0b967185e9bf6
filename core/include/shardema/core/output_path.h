#pragma once
// Where a command may write: never over or inside what it reads. An export
// whose --out named its own checkpoint's manifest once finished "fine" and
// left the checkpoint unreadable.
#include <string>
#include <vector>

namespace shardema::detail {

/// c10::ValueError naming `api`, the output and the input when `output` (a
/// file or folder about to be written) is one of `inputs` or lies inside
/// one of them. Paths are compared after resolving "..", "." and symbolic
/// links of the parts that exist, so another spelling of the same place is
/// caught.
void refuseOutputOverInput(const std::string& api, const std::string& output,
                           const std::vector<std::string>& inputs);

}  // namespace shardema::detail
