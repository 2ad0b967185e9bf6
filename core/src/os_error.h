#pragma once
// The text of an errno value for the file layer's messages ("No such file
// or directory"), one definition for every source that reports one.
#include <string>
#include <system_error>

namespace shardema::detail {

inline std::string osError(int error) { return std::generic_category().message(error); }

}  // namespace shardema::detail
