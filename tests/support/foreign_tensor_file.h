#pragma once
// A safetensors file as another tool (or a Python writer) makes it: our
// header layout, no "shardema.xxh64" checksums. For tests of what readers
// do with files that carry no checksums.
#include <ATen/ATen.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "shardema/core/safetensors_header.h"
#include "shardema/core/tensor_dtype.h"
#include "support/file_bytes.h"

namespace shardema::testing {

inline void writeForeignTensorFile(const std::string& path,
                                   const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                   const std::map<std::string, std::string>& metadata = {}) {
  std::vector<TensorEntry> entries;
  std::string data;
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor host = tensor.contiguous();
    TensorEntry entry;
    entry.name = name;
    entry.dtype = host.scalar_type() == at::kFloat  ? FileDType::kF32
                  : host.scalar_type() == at::kBool ? FileDType::kBool
                                                    : FileDType::kI64;
    entry.shape = host.sizes().vec();
    entries.push_back(entry);
    data.append(static_cast<const char*>(host.data_ptr()), host.nbytes());
  }
  writeFileBytes(path, buildSafetensorsHeader(entries, metadata) + data);
}

}  // namespace shardema::testing
