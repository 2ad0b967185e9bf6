#pragma once
// Which values of a load go where: shared by Averager::loadEmaValues and
// loadIntoModule, so both name unexpected and missing tensors, and refuse a
// wrong shape, in one way. Nothing is written here: callers check all of
// it before their first write, so a refused load changes nothing.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "shardema/averager.h"  // LoadReport

namespace shardema::detail {

/// `targetOf(name)` is the tensor that receives `name`, or nullptr when
/// none does (the name is unexpected). Every matched value must have its
/// target's shape, else c10::ValueError "API: tensor 'NAME' has shape [..]
/// but WHOSE has shape [..]". Targets no value names are missing, in the
/// order of `targetNames`.
template <class TargetOf>
LoadReport matchLoadTargets(const std::vector<std::pair<std::string, at::Tensor>>& values,
                            const std::vector<std::string>& targetNames, TargetOf&& targetOf,
                            const char* api, const char* whose) {
  LoadReport report;
  std::unordered_set<std::string> given;
  for (const auto& [name, value] : values) {
    given.insert(name);
    const at::Tensor* target = targetOf(name);
    if (target == nullptr) {
      report.unexpected.push_back(name);
      continue;
    }
    TORCH_CHECK_VALUE(value.sizes() == target->sizes(), api, ": tensor '", name, "' has shape ",
                      value.sizes(), " but ", whose, " has shape ", target->sizes());
  }
  for (const std::string& name : targetNames) {
    if (!given.count(name)) report.missing.push_back(name);
  }
  return report;
}

}  // namespace shardema::detail
