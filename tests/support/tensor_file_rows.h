#pragma once
// A TensorFile of one tensor per (dtype, shape) row, for the file-format
// tests: tensor i is "t<i>" and holds 3 * element + i (booleans mod 2), so a
// value read from the wrong tensor or the wrong place shows.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "shardema/core/tensor_file.h"

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

/// One tensor of every dtype a safetensors file holds, with a scalar, a
/// 0-element and a multi-dimensional shape among them: the sample of the
/// reader and writer tests.
inline TensorFile everyDtypeFile() {
  return tensorFileOfRows({{at::kFloat, {7, 3}},
                           {at::kBFloat16, {13}},
                           {at::kFloat, {}},
                           {at::kHalf, {0, 4}},
                           {at::kDouble, {5}},
                           {at::kLong, {2, 2}},
                           {at::kBool, {9}},
                           {at::kByte, {0}},
                           {at::kInt, {31}},
                           {at::kShort, {3}},
                           {at::kChar, {1, 1}},
                           {at::kByte, {17}}});
}

}  // namespace shardema::testing
