#include "shardema/core/output_path.h"

#include <c10/util/Exception.h>

#include "shardema/core/file_system.h"

namespace shardema::detail {
namespace {

// Whether `inner` is `outer` or lies below it, component by component (so
// "ckpt2" is not inside "ckpt"). Both are weaklyCanonical: absolute, with
// no trailing separator but for "/".
bool within(const std::string& inner, const std::string& outer) {
  if (outer == "/" || inner == outer) return true;
  return inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
         inner[outer.size()] == '/';
}

}  // namespace

void refuseOutputOverInput(const std::string& api, const std::string& output,
                           const std::vector<std::string>& inputs) {
  const std::string out = weaklyCanonical(output);
  for (const std::string& input : inputs) {
    const std::string in = weaklyCanonical(input);
    TORCH_CHECK_VALUE(out != in, api, ": the output ", output, " is the input ", input,
                      " itself; writing it would destroy what is being read (write it elsewhere)");
    TORCH_CHECK_VALUE(!within(out, in), api, ": the output ", output, " lies inside the input ",
                      input,
                      "; writing there would change what is being read (write it elsewhere)");
  }
}

}  // namespace shardema::detail
