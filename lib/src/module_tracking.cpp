#include "shardema/module_tracking.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>

#include <unordered_map>
#include <unordered_set>

#include "load_matching.h"

namespace shardema {
namespace {

struct ModuleTensor {
  std::string name;
  at::Tensor tensor;
  TensorTraits traits;
};

bool isBatchNorm(const torch::nn::Module& module) {
  // The C++ counterparts of Python's _BatchNorm subclasses.
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module) != nullptr;
}

void collect(const torch::nn::Module& module, const std::string& prefix,
             std::unordered_set<const void*>& seen, std::vector<ModuleTensor>& out) {
  const bool batchNorm = isBatchNorm(module);
  auto add = [&](const std::string& name, const at::Tensor& tensor, bool isBuffer) {
    if (!tensor.defined() || !seen.insert(tensor.unsafeGetTensorImpl()).second) return;
    TensorTraits traits;
    traits.isBuffer = isBuffer;
    traits.isFloating = at::isFloatingType(tensor.scalar_type());
    traits.requiresGrad = tensor.requires_grad();
    traits.inBatchNorm = batchNorm;
    out.push_back(ModuleTensor{prefix + name, tensor, traits});
  };
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    add(item.key(), item.value(), /*isBuffer=*/false);
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    add(item.key(), item.value(), /*isBuffer=*/true);
  }
  for (const auto& child : module.named_children()) {
    collect(*child.value(), prefix + child.key() + ".", seen, out);
  }
}

std::vector<ModuleTensor> collectModule(const torch::nn::Module& module) {
  std::unordered_set<const void*> seen;
  std::vector<ModuleTensor> out;
  collect(module, "", seen, out);
  return out;
}

}  // namespace

NamedTensors moduleTensors(const torch::nn::Module& module) {
  NamedTensors out;
  for (ModuleTensor& t : collectModule(module)) out.emplace_back(std::move(t.name), t.tensor);
  return out;
}

std::vector<TrackedTensor> trackModule(const torch::nn::Module& module, TrackingPolicy policy) {
  std::vector<TrackedTensor> out;
  for (ModuleTensor& t : collectModule(module)) {
    // Buffers (BatchNorm running statistics, counters) change in forward().
    out.push_back(TrackedTensor{std::move(t.name), t.tensor, roleFor(policy, t.traits),
                                /*changesInForward=*/t.traits.isBuffer});
  }
  return out;
}

NamedTensors cloneModuleTensors(const torch::nn::Module& module) {
  NamedTensors out = moduleTensors(module);
  for (auto& entry : out) entry.second = entry.second.detach().clone();
  return out;
}

LoadReport loadIntoModule(torch::nn::Module& module, const NamedTensors& values,
                          LoadStrictness strictness) {
  NamedTensors targets = moduleTensors(module);
  std::unordered_map<std::string, at::Tensor> byName(targets.begin(), targets.end());
  std::vector<std::string> targetNames;
  for (const auto& entry : targets) targetNames.push_back(entry.first);
  const LoadReport report = detail::matchLoadTargets(
      values, targetNames,
      [&](const std::string& name) -> const at::Tensor* {
        const auto it = byName.find(name);
        return it == byName.end() ? nullptr : &it->second;
      },
      "loadIntoModule", "the module's");
  TORCH_CHECK_VALUE(
      strictness == LoadStrictness::kNonStrict ||
          (report.missing.empty() && report.unexpected.empty()),
      "loadIntoModule: ", report.missing.size(), " missing and ", report.unexpected.size(),
      " unexpected tensors",
      report.missing.empty() ? "" : ", first missing: '" + report.missing[0] + "'",
      report.unexpected.empty() ? "" : ", first unexpected: '" + report.unexpected[0] + "'");
  c10::NoGradGuard noGrad;
  for (const auto& [name, value] : values) {
    const auto it = byName.find(name);
    if (it != byName.end()) it->second.detach().copy_(value);
  }
  return report;
}

}  // namespace shardema
