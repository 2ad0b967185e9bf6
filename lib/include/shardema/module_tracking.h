#pragma once
// Bridges torch::nn::Module and the Averager: which tensors a module has,
// what role each gets, and loading named tensors back into a module.
#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "shardema/averager.h"
#include "shardema/tracking_policy.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace shardema {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Parameters and buffers of `module` in state_dict order (each module's own
/// parameters, then its buffers, then its children), dotted names. A tensor
/// shared by two modules appears once, under its first name. Handles, not
/// copies. Undefined (optional) parameters/buffers are skipped.
NamedTensors moduleTensors(const torch::nn::Module& module);

/// moduleTensors() with the role `policy` gives each (see TrackingPolicy).
std::vector<TrackedTensor> trackModule(const torch::nn::Module& module,
                                       TrackingPolicy policy = TrackingPolicy::kVersatil);

/// Copies `values` into the module's parameters/buffers of the same name
/// (dtype/device converted, outside autograd). Shapes must match; strict
/// mode rejects missing/unexpected names before writing anything.
LoadReport loadIntoModule(torch::nn::Module& module, const NamedTensors& values,
                          LoadStrictness strictness = LoadStrictness::kStrict);

/// Deep copies (clone, detached) of moduleTensors().
NamedTensors cloneModuleTensors(const torch::nn::Module& module);

}  // namespace shardema
