#pragma once
// Python's side of the enums and file dicts: the package passes a choice as
// a word ("pinned_host", "ema_pytorch") and a file as {"tensors": {...},
// "metadata": {...}}. One parser for every word, so each refusal names the
// parameter and the words it accepts in the same way.
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>
#include <string>

#include "shardema/averager.h"
#include "shardema/core/decay_schedule.h"
#include "shardema/offload/engine_choice.h"
#include "shardema/posthoc_callback.h"
#include "shardema/tracking_policy.h"

namespace shardema::python {

EmaStorage parseEmaStorage(const std::string& word);         // pinned_host | device
offload::EngineChoice parseEngine(const std::string& word);  // auto | host | cuda
PostHocLayout parsePostHocLayout(const std::string& word);   // rank0 | sharded
TrackingPolicy parsePolicy(const std::string& word);         // versatil | ema_pytorch
BetaConvention parseConvention(const std::string& word);     // nitrous | edm2

/// A byte size as transformers' save_pretrained(max_shard_size=) takes it:
/// None (nullopt), an int of bytes (>= 1), or a string parseByteSize reads
/// ("5GB", "500MiB"). c10::TypeError for another type (bool included),
/// c10::ValueError for a bad value, each naming `parameter`.
std::optional<int64_t> byteSizeOf(const pybind11::handle& value, const char* parameter);

/// {"tensors": {name: tensor}, "metadata": {key: value}}, in file order.
template <class NamedTensors, class Metadata>
pybind11::dict tensorsAndMetadata(const NamedTensors& tensors, const Metadata& metadata) {
  pybind11::dict tensorDict;
  for (const auto& [name, tensor] : tensors) tensorDict[pybind11::str(name)] = tensor;
  pybind11::dict metadataDict;
  for (const auto& [key, value] : metadata) metadataDict[pybind11::str(key)] = value;
  pybind11::dict out;
  out["tensors"] = tensorDict;
  out["metadata"] = metadataDict;
  return out;
}

}  // namespace shardema::python
