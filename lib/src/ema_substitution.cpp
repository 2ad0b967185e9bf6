#include "shardema/ema_substitution.h"

#include <c10/util/Exception.h>

#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace shardema {
namespace {

std::string shapeText(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

}  // namespace

EmaSubstitution substituteEma(NamedTensors& slots, const NamedTensors& ema,
                              const std::vector<std::string>& rawKept, bool adoptEma) {
  std::unordered_map<std::string, const at::Tensor*> emaByName;
  for (const auto& [name, tensor] : ema) emaByName[name] = &tensor;
  const std::unordered_set<std::string> kept(rawKept.begin(), rawKept.end());

  // Decide and check every slot first, so a refusal leaves the checkpoint
  // as it was.
  std::vector<std::pair<size_t, const at::Tensor*>> chosen;  // slot index, its EMA
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto& [name, slot] = slots[i];
    const auto it = emaByName.find(name);
    if (it == emaByName.end()) continue;
    const at::Tensor& average = *it->second;
    TORCH_CHECK_VALUE(!kept.count(name), "substituteEma: the checkpoint already keeps the raw "
                      "value of '", name, "'; substitute the EMA once per checkpoint, or the "
                      "EMA would be kept as the raw weights");
    TORCH_CHECK_VALUE(slot.defined() && slot.sizes() == average.sizes(), "substituteEma: '",
                      name, "' is ", slot.defined() ? shapeText(slot) : std::string("undefined"),
                      " in the checkpoint but its EMA is ", shapeText(average),
                      "; the checkpoint is not of the model the EMA tracks");
    chosen.emplace_back(i, &average);
  }

  EmaSubstitution out;
  for (const auto& [index, emaOfSlot] : chosen) {
    const std::string& name = slots[index].first;
    at::Tensor& slot = slots[index].second;
    const at::Tensor average = emaOfSlot->detach();
    out.raw.emplace_back(name, slot.detach().clone());
    // The bf16/fp16 value is rounded from float32; keep what it came from.
    if (average.scalar_type() == at::kFloat && slot.scalar_type() != at::kFloat) {
      out.float32Ema.emplace_back(name, adoptEma ? average : average.clone());
    }
    slot = average.to(average.device(), slot.scalar_type(), /*non_blocking=*/false,
                      /*copy=*/!adoptEma);
  }
  return out;
}

}  // namespace shardema
