#pragma once
// Shared by the gather tests: tensors whose values encode (tensor, element),
// the layouts of the sweep, and exact comparisons that name what differs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "shardema/shard/communicator.h"
#include "shardema/shard/flat_param_layout.h"
#include "shardema/shard/gather.h"
#include "shardema/shard/shard_layout.h"
#include "support/thread_ranks.h"

namespace shardema::shard::gather_fixture {

using shardema::testing::runThreadRanks;

// Tensor t's element g holds the bit pattern (t * 4099 + g * 7) % 30000
// (finite in fp16 and bf16) or, in fp32, t * 65536 + g: a wrong element
// names the tensor and index it came from.
inline at::Tensor pattern(int64_t t, const std::vector<int64_t>& shape, at::ScalarType dtype) {
  at::Tensor g = at::arange(c10::multiply_integers(shape), at::kLong);
  if (dtype == at::kFloat) {
    return (g + t * 65536).to(at::kFloat).reshape(shape);
  }
  return ((g * 7 + t * 4099) % 30000).to(at::kShort).view(dtype).reshape(shape);
}

inline std::string firstMismatch(const at::Tensor& expected, const at::Tensor& actual) {
  if (expected.sizes() != actual.sizes() || expected.dtype() != actual.dtype()) {
    return "shape/dtype differ";
  }
  const auto bits = [](const at::Tensor& x) {
    return x.reshape({-1}).view(x.element_size() == 4 ? at::kInt : at::kShort).to(at::kLong);
  };
  at::Tensor differ = (bits(expected) != bits(actual)).nonzero();
  if (differ.numel() == 0) {
    return "";
  }
  const int64_t i = differ[0][0].item<int64_t>();
  return "element " + std::to_string(i) + ": expected bits " +
         std::to_string(bits(expected)[i].item<int64_t>()) + ", got " +
         std::to_string(bits(actual)[i].item<int64_t>());
}

// The shapes of the sweep: numel 0 and 1, 0-dim, primes, d0 < W, d0 = W,
// d0 = W*k +- 1.
inline std::vector<std::vector<int64_t>> sweepShapes(int64_t w) {
  return {
      {0},         {1},    {},   {7},      {13, 3}, {w > 1 ? w - 1 : 1, 5}, {w, 3}, {3 * w + 1, 2},
      {3 * w - 1}, {0, 4}, {31}, {2, 3, 5}};
}

inline ShardLayout makeLayout(const std::string& kind, int64_t w) {
  ShardLayout layout;
  const auto shapes = sweepShapes(w);
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  if (kind == "fsdp1") {
    std::vector<FlatParamMember> members;
    for (size_t i = 0; i < shapes.size(); ++i) {
      members.push_back({"unit.p" + std::to_string(i), shapes[i]});
    }
    layout.specs = FlatParamLayout(members, at::kFloat, w).specs();
    return layout;
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    const std::string name = kind + ".t" + std::to_string(i);
    const at::ScalarType dtype = dtypes[i % 3];
    layout.specs.push_back(kind == "fsdp2"        ? fsdp2Spec(name, shapes[i], dtype, w)
                           : kind == "replicated" ? replicatedSpec(name, shapes[i], dtype, w)
                           : kind == "per_rank"   ? perRankSpec(name, shapes[i], dtype, w)
                                                  : rankZeroSpec(name, shapes[i], dtype, w));
  }
  return layout;
}

inline std::vector<at::Tensor> fullTensors(const ShardLayout& layout, at::ScalarType fsdp1Dtype) {
  std::vector<at::Tensor> full;
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    const ShardSpec& spec = layout.specs[i];
    const at::ScalarType dtype = spec.kind == LayoutKind::kFsdp1 ? fsdp1Dtype : dtypes[i % 3];
    full.push_back(pattern(static_cast<int64_t>(i), spec.globalShape, dtype));
  }
  return full;
}

inline std::vector<at::Tensor> localsOf(const ShardLayout& layout,
                                        const std::vector<at::Tensor>& full, int64_t rank) {
  std::vector<at::Tensor> locals;
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    const ElementRange range = layout.specs[i].rangeOf(rank);
    locals.push_back(full[i].reshape({-1}).narrow(0, range.begin, range.size()).clone());
  }
  return locals;
}

inline void expectSame(const std::vector<at::Tensor>& expected,
                       const std::vector<std::pair<std::string, at::Tensor>>& actual,
                       const ShardLayout& layout, const std::string& where) {
  ASSERT_EQ(actual.size(), expected.size()) << where;
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(actual[i].first, layout.specs[i].name) << where;
    EXPECT_EQ(firstMismatch(expected[i], actual[i].second), "")
        << where << " tensor " << layout.specs[i].name;
  }
}

// gatherFull to `root` through a buffer of `bufferBytes`: the root (every
// rank for -1) gets `full` back bit for bit, the other ranks nothing.
inline void expectGathered(Communicator& comm, const ShardLayout& layout,
                           const std::vector<at::Tensor>& locals,
                           const std::vector<at::Tensor>& full, int64_t root, int64_t bufferBytes,
                           const std::string& where) {
  GatherOptions options;
  options.root = root;
  options.bufferBytes = bufferBytes;
  const auto gathered = gatherFull(comm, layout, locals, options);
  if (root < 0 || root == comm.rank()) {
    expectSame(full, gathered, layout, where);
  } else {
    EXPECT_TRUE(gathered.empty()) << where;
  }
}
}  // namespace shardema::shard::gather_fixture
