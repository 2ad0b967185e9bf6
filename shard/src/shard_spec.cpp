#include "shardema/shard/shard_spec.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace shardema {
namespace shard {
namespace {

// Product of the dims with overflow and sign checks; `api` and `name` go
// into the message.
int64_t checkedNumel(const std::vector<int64_t>& shape, const char* api, const std::string& name) {
  int64_t numel = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    TORCH_CHECK_VALUE(shape[d] >= 0, api, ": tensor '", name, "' has negative dim ", d, " (",
                      shape[d], ")");
    TORCH_CHECK_VALUE(!__builtin_mul_overflow(numel, shape[d], &numel), api, ": tensor '", name,
                      "' has more elements than int64 can count");
  }
  return numel;
}

void checkWorld(int64_t worldSize, const char* api, const std::string& name) {
  TORCH_CHECK_VALUE(worldSize >= 1, api, ": tensor '", name, "': world size must be >= 1, got ",
                    worldSize);
}

ShardSpec chunkedSpec(const std::string& name, const std::vector<int64_t>& globalShape,
                      c10::ScalarType dtype, int64_t worldSize, LayoutKind kind, const char* api) {
  checkWorld(worldSize, api, name);
  checkedNumel(globalShape, api, name);  // names the tensor before fsdp2Range could fail
  ShardSpec spec;
  spec.name = name;
  spec.globalShape = globalShape;
  spec.dtype = dtype;
  spec.kind = kind;
  spec.ranges.reserve(static_cast<size_t>(worldSize));
  for (int64_t r = 0; r < worldSize; ++r)
    spec.ranges.push_back(fsdp2Range(globalShape, r, worldSize));
  return spec;
}

// Rank 0 [0, numel), the others [numel, numel): kRankZero's and kPerRank's.
ShardSpec rankZeroRangesSpec(const std::string& name, const std::vector<int64_t>& globalShape,
                             c10::ScalarType dtype, int64_t worldSize, LayoutKind kind,
                             const char* api) {
  checkWorld(worldSize, api, name);
  const int64_t numel = checkedNumel(globalShape, api, name);
  ShardSpec spec;
  spec.name = name;
  spec.globalShape = globalShape;
  spec.dtype = dtype;
  spec.kind = kind;
  spec.ranges.assign(static_cast<size_t>(worldSize), ElementRange{numel, numel});
  spec.ranges[0] = {0, numel};
  return spec;
}

}  // namespace

ElementRange intersect(const ElementRange& a, const ElementRange& b) {
  const int64_t begin = std::max(a.begin, b.begin);
  return {begin, std::max(begin, std::min(a.end, b.end))};
}

const char* layoutKindName(LayoutKind kind) {
  switch (kind) {
    case LayoutKind::kReplicated:
      return "replicated";
    case LayoutKind::kRankZero:
      return "rank0";
    case LayoutKind::kFsdp2:
      return "fsdp2";
    case LayoutKind::kFsdp1:
      return "fsdp1";
    case LayoutKind::kPerRank:
      return "per_rank";
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled LayoutKind ", static_cast<int>(kind));
}

LayoutKind parseLayoutKind(const std::string& name) {
  for (LayoutKind kind : {LayoutKind::kReplicated, LayoutKind::kRankZero, LayoutKind::kFsdp2,
                          LayoutKind::kFsdp1, LayoutKind::kPerRank}) {
    if (name == layoutKindName(kind)) return kind;
  }
  TORCH_CHECK_VALUE(false, "parseLayoutKind: unknown layout kind \"", name,
                    "\" (expected replicated, rank0, fsdp2, fsdp1 or per_rank)");
}

int64_t ShardSpec::numel() const { return checkedNumel(globalShape, "ShardSpec::numel", name); }

const ElementRange& ShardSpec::rangeOf(int64_t rank) const {
  TORCH_CHECK_INDEX(rank >= 0 && rank < worldSize(), "ShardSpec::rangeOf: tensor '", name, "' has ",
                    worldSize(), " ranks, asked for rank ", rank);
  return ranges[static_cast<size_t>(rank)];
}

ElementRange ShardSpec::heldRange(int64_t rank) const {
  const ElementRange& range = rangeOf(rank);
  return kind == LayoutKind::kPerRank ? ElementRange{0, numel()} : range;
}

bool ShardSpec::operator==(const ShardSpec& other) const {
  return name == other.name && globalShape == other.globalShape && dtype == other.dtype &&
         kind == other.kind && ranges == other.ranges;
}

void checkShardSpec(const ShardSpec& spec) {
  constexpr const char* kApi = "checkShardSpec";
  TORCH_CHECK_VALUE(!spec.name.empty(), kApi, ": a tensor has an empty name");
  const int64_t numel = checkedNumel(spec.globalShape, kApi, spec.name);
  TORCH_CHECK_VALUE(!spec.ranges.empty(), kApi, ": tensor '", spec.name,
                    "' has no ranges (world size 0)");
  // The ranges tile [0, numel) in rank order; an empty range sits where the
  // previous one ended. One canonical form per split keeps equality and
  // fingerprints meaningful and lets a gather concatenate in rank order.
  int64_t cursor = 0;
  for (size_t r = 0; r < spec.ranges.size(); ++r) {
    const ElementRange& range = spec.ranges[r];
    TORCH_CHECK_VALUE(range.begin <= range.end, kApi, ": tensor '", spec.name, "': rank ", r,
                      "'s range [", range.begin, ", ", range.end, ") ends before it begins");
    TORCH_CHECK_VALUE(range.begin == cursor, kApi, ": tensor '", spec.name, "': rank ", r,
                      "'s range [", range.begin, ", ", range.end, ") must begin at ", cursor,
                      ", where rank ", r, " - 1's ends (ranges tile [0, numel) in rank order)");
    cursor = range.end;
  }
  TORCH_CHECK_VALUE(cursor == numel, kApi, ": tensor '", spec.name, "': the ranges cover [0, ",
                    cursor, ") but the tensor has ", numel, " elements");
  // Rank 0's copy stands for a per-rank tensor: it alone has a range, so a
  // gather, a file or a reshard takes it and no other rank's.
  TORCH_CHECK_VALUE(spec.kind != LayoutKind::kPerRank || spec.ranges[0].size() == numel, kApi,
                    ": tensor '", spec.name, "' is per_rank, so rank 0's range must be [0, ", numel,
                    ") and the others' empty; rank 0 has [", spec.ranges[0].begin, ", ",
                    spec.ranges[0].end, ")");
}

ElementRange fsdp2Range(const std::vector<int64_t>& globalShape, int64_t rank, int64_t worldSize) {
  constexpr const char* kApi = "fsdp2Range";
  checkWorld(worldSize, kApi, "<shape>");
  TORCH_CHECK_VALUE(rank >= 0 && rank < worldSize, kApi, ": rank ", rank,
                    " outside [0, world size ", worldSize, ")");
  const int64_t numel = checkedNumel(globalShape, kApi, "<shape>");
  // 0-dim tensors have no dim 0 to chunk: rank 0 owns the element.
  if (globalShape.empty()) return rank == 0 ? ElementRange{0, 1} : ElementRange{1, 1};
  const int64_t d0 = globalShape[0];
  const int64_t inner = d0 == 0 ? 0 : numel / d0;
  // torch.chunk: chunk size ceil(d0 / W); trailing chunks may be empty.
  // Written so nothing overflows for d0 near INT64_MAX: d0 + W - 1 and
  // r * chunk could; a row past d0 clamps to d0, and row * inner <= numel.
  const int64_t chunk = d0 / worldSize + (d0 % worldSize != 0 ? 1 : 0);
  const auto rowAt = [&](int64_t r) {
    int64_t row = 0;
    return __builtin_mul_overflow(r, chunk, &row) ? d0 : std::min(row, d0);
  };
  return {rowAt(rank) * inner, rowAt(rank + 1) * inner};
}

ShardSpec fsdp2Spec(const std::string& name, const std::vector<int64_t>& globalShape,
                    c10::ScalarType dtype, int64_t worldSize) {
  return chunkedSpec(name, globalShape, dtype, worldSize, LayoutKind::kFsdp2, "fsdp2Spec");
}

ShardSpec replicatedSpec(const std::string& name, const std::vector<int64_t>& globalShape,
                         c10::ScalarType dtype, int64_t worldSize) {
  return chunkedSpec(name, globalShape, dtype, worldSize, LayoutKind::kReplicated,
                     "replicatedSpec");
}

ShardSpec rankZeroSpec(const std::string& name, const std::vector<int64_t>& globalShape,
                       c10::ScalarType dtype, int64_t worldSize) {
  return rankZeroRangesSpec(name, globalShape, dtype, worldSize, LayoutKind::kRankZero,
                            "rankZeroSpec");
}

ShardSpec perRankSpec(const std::string& name, const std::vector<int64_t>& globalShape,
                      c10::ScalarType dtype, int64_t worldSize) {
  return rankZeroRangesSpec(name, globalShape, dtype, worldSize, LayoutKind::kPerRank,
                            "perRankSpec");
}

ShardSpec layoutSpec(const std::string& name, const std::vector<int64_t>& globalShape,
                     c10::ScalarType dtype, LayoutKind kind, int64_t worldSize) {
  switch (kind) {
    case LayoutKind::kFsdp2:
      return fsdp2Spec(name, globalShape, dtype, worldSize);
    case LayoutKind::kReplicated:
      return replicatedSpec(name, globalShape, dtype, worldSize);
    case LayoutKind::kRankZero:
      return rankZeroSpec(name, globalShape, dtype, worldSize);
    case LayoutKind::kPerRank:
      return perRankSpec(name, globalShape, dtype, worldSize);
    case LayoutKind::kFsdp1:
      break;
  }
  TORCH_CHECK_VALUE(false, "layoutSpec: '", name,
                    "': fsdp1 specs come from a FlatParamLayout (its specs())");
}

}  // namespace shard
}  // namespace shardema
