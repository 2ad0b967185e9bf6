#pragma once
// A TensorFile of one tensor per (dtype, shape) row, for the file-format
// tests: tensor i is "t<i>" and holds 3 * element + i (booleans mod 2), so a
// value read from the wrong tensor or the wrong place shows.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "shardema/tensor_file.h"

namespace shardema::testing {

using TensorRow = std::pair<at::ScalarType, std::vector<int64_t>>;

inline TensorFile tensorFileOfRows(const std::vector<TensorRow>& rows) {
  TensorFile file;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& [dtype, shape] = rows[i];
    at::Tensor values = at::arange(c10::multiply_integers(shape), at::kDouble) * 3 + double(i);
    if (dtype == at::kBool) values = values.fmod(2);
    file.tensors.emplace_back("t" + std::to_string(i), values.to(dtype).reshape(shape));
  }
  return file;
}

}  // namespace shardema::testing
