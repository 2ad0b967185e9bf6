#include "shardema/core/output_path.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

namespace shardema::detail {
namespace {

namespace fs = std::filesystem;

fs::path resolved(const std::string& path) {
  std::error_code error;
  fs::path out = fs::weakly_canonical(fs::absolute(path), error);
  return error ? fs::absolute(path).lexically_normal() : out;
}

// Whether `inner` is `outer` or lies below it, component by component (so
// "ckpt2" is not inside "ckpt").
bool within(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

}  // namespace

void refuseOutputOverInput(const std::string& api, const std::string& output,
                           const std::vector<std::string>& inputs) {
  const fs::path out = resolved(output);
  for (const std::string& input : inputs) {
    const fs::path in = resolved(input);
    TORCH_CHECK_VALUE(out != in, api, ": the output ", output, " is the input ", input,
                      " itself; writing it would destroy what is being read (write it elsewhere)");
    TORCH_CHECK_VALUE(!within(out, in), api, ": the output ", output, " lies inside the input ",
                      input,
                      "; writing there would change what is being read (write it elsewhere)");
  }
}

}  // namespace shardema::detail
