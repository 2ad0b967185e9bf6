// ShardSpec arithmetic against independent references: a row-by-row
// re-statement of torch.chunk, Python's torch.chunk itself, and the
// hand-worked examples of docs/spec/shard_layouts.md.
#include "shardema/shard/shard_spec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/command_output.h"
#include "support/value_error.h"

namespace shardema::shard {
namespace {

using Shape = std::vector<int64_t>;

// The sweep of the spec: 0, 1, primes, d0 < W, d0 = W, d0 = W*k +- 1 (every
// d0 up to 41 covers those for W <= 8, k <= 5), a few large primes.
std::vector<int64_t> sweepD0() {
  std::vector<int64_t> d0s;
  for (int64_t d0 = 0; d0 <= 41; ++d0) d0s.push_back(d0);
  for (int64_t prime : {43, 47, 53, 97, 101, 1009}) d0s.push_back(prime);
  return d0s;
}
const std::vector<Shape> kInnerShapes = {{}, {1}, {3}, {2, 5}, {0}};

// Every shape of the sweep, 0-dim included.
std::vector<Shape> sweepShapes() {
  std::vector<Shape> shapes = {{}};
  for (int64_t d0 : sweepD0()) {
    for (const Shape& inner : kInnerShapes) {
      Shape shape = {d0};
      shape.insert(shape.end(), inner.begin(), inner.end());
      shapes.push_back(shape);
    }
  }
  return shapes;
}

int64_t product(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// torch.chunk re-stated: take chunks of ceil(d0 / W) rows until the rows
// run out; ranks past the last chunk get none.
std::vector<int64_t> chunkRows(int64_t d0, int64_t world) {
  std::vector<int64_t> rows(static_cast<size_t>(world), 0);
  const int64_t size = (d0 + world - 1) / world;
  size_t rank = 0;
  for (int64_t start = 0; start < d0; start += size) rows[rank++] = std::min(size, d0 - start);
  return rows;
}

// Disjoint, covering, and each element owned by exactly one rank: checked
// element by element, not through checkShardSpec.
void expectPartition(const ShardSpec& spec) {
  const int64_t numel = product(spec.globalShape);
  std::vector<int> owners(static_cast<size_t>(numel), 0);
  for (const ElementRange& range : spec.ranges) {
    ASSERT_LE(0, range.begin);
    ASSERT_LE(range.begin, range.end);
    ASSERT_LE(range.end, numel);
    for (int64_t i = range.begin; i < range.end; ++i) ++owners[static_cast<size_t>(i)];
  }
  for (int64_t i = 0; i < numel; ++i)
    ASSERT_EQ(owners[static_cast<size_t>(i)], 1) << "element " << i;
  EXPECT_NO_THROW(checkShardSpec(spec));
  EXPECT_EQ(spec.numel(), numel);
}

// Values encode the element index; scatter = slice by ranges, gather =
// place each piece at its range.
std::vector<std::vector<int64_t>> scatter(const std::vector<int64_t>& full, const ShardSpec& spec) {
  std::vector<std::vector<int64_t>> pieces;
  for (const ElementRange& range : spec.ranges) {
    pieces.emplace_back(full.begin() + range.begin, full.begin() + range.end);
  }
  return pieces;
}

std::vector<int64_t> gather(const std::vector<std::vector<int64_t>>& pieces,
                            const ShardSpec& spec) {
  std::vector<int64_t> full(static_cast<size_t>(product(spec.globalShape)), -1);
  for (size_t r = 0; r < pieces.size(); ++r) {
    std::copy(pieces[r].begin(), pieces[r].end(), full.begin() + spec.ranges[r].begin);
  }
  return full;
}

ShardSpec makeSpec(LayoutKind kind, const Shape& shape, int64_t world) {
  switch (kind) {
    case LayoutKind::kFsdp2:
      return fsdp2Spec("t", shape, c10::kFloat, world);
    case LayoutKind::kReplicated:
      return replicatedSpec("t", shape, c10::kFloat, world);
    case LayoutKind::kRankZero:
      return rankZeroSpec("t", shape, c10::kFloat, world);
    case LayoutKind::kPerRank:
      return perRankSpec("t", shape, c10::kFloat, world);
    default:
      ADD_FAILURE() << "not a per-tensor kind";
      return {};
  }
}

constexpr LayoutKind kPerTensorKinds[] = {LayoutKind::kFsdp2, LayoutKind::kReplicated,
                                          LayoutKind::kRankZero, LayoutKind::kPerRank};

TEST(ShardSpecTest, Fsdp2MatchesChunkRestatementOverSweep) {
  for (const Shape& shape : sweepShapes()) {
    for (int64_t world = 1; world <= 8; ++world) {
      SCOPED_TRACE(::testing::Message() << "d0 " << (shape.empty() ? -1 : shape[0]) << " rank "
                                        << shape.size() << " W " << world);
      const int64_t inner = shape.empty() ? 1 : product(Shape(shape.begin() + 1, shape.end()));
      const std::vector<int64_t> rows =
          shape.empty() ? std::vector<int64_t>{} : chunkRows(shape[0], world);
      int64_t row = 0;
      for (int64_t r = 0; r < world; ++r) {
        const ElementRange range = fsdp2Range(shape, r, world);
        if (shape.empty()) {  // 0-dim: rank 0 owns the one element
          EXPECT_EQ(range, (r == 0 ? ElementRange{0, 1} : ElementRange{1, 1}));
          continue;
        }
        EXPECT_EQ(range, (ElementRange{row * inner, (row + rows[r]) * inner})) << "rank " << r;
        row += rows[r];
      }
    }
  }
}

TEST(ShardSpecTest, HandWorkedChunksFromSpec) {
  auto rowsOf = [](int64_t d0, int64_t world) {
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < world; ++r) rows.push_back(fsdp2Range({d0, 3}, r, world).size() / 3);
    return rows;
  };
  EXPECT_EQ(rowsOf(5, 4), (std::vector<int64_t>{2, 2, 1, 0}));  // not array_split's 2,1,1,1
  EXPECT_EQ(rowsOf(6, 4), (std::vector<int64_t>{2, 2, 2, 0}));
  EXPECT_EQ(rowsOf(3, 4), (std::vector<int64_t>{1, 1, 1, 0}));
  EXPECT_EQ(rowsOf(9, 4), (std::vector<int64_t>{3, 3, 3, 0}));
  EXPECT_EQ(rowsOf(10, 4), (std::vector<int64_t>{3, 3, 3, 1}));
  // Empty trailing ranges sit at the end: [numel, numel).
  EXPECT_EQ(fsdp2Range({5, 3}, 3, 4), (ElementRange{15, 15}));
  EXPECT_EQ(fsdp2Range({5, 3}, 2, 4), (ElementRange{12, 15}));
}

TEST(ShardSpecTest, EveryKindPartitionsEveryTensorOfSweep) {
  for (LayoutKind kind : kPerTensorKinds) {
    for (const Shape& shape : sweepShapes()) {
      for (int64_t world = 1; world <= 8; ++world) {
        SCOPED_TRACE(::testing::Message()
                     << layoutKindName(kind) << " numel " << product(shape) << " W " << world);
        const ShardSpec spec = makeSpec(kind, shape, world);
        EXPECT_EQ(spec.kind, kind);
        EXPECT_EQ(spec.worldSize(), world);
        EXPECT_EQ(spec.globalShape, shape);
        expectPartition(spec);
        if (kind == LayoutKind::kRankZero || kind == LayoutKind::kPerRank) {
          EXPECT_EQ(spec.ranges[0].size(), product(shape));
        }
        // What each rank's local holds: its range, or the whole (per_rank).
        for (int64_t r = 0; r < world; ++r) {
          const ElementRange whole{0, product(shape)};
          EXPECT_EQ(spec.heldRange(r),
                    kind == LayoutKind::kPerRank ? whole : spec.ranges[static_cast<size_t>(r)]);
        }
        if (kind == LayoutKind::kReplicated) {
          EXPECT_EQ(spec.ranges, fsdp2Spec("t", shape, c10::kFloat, world).ranges);
        }
      }
    }
  }
}

TEST(ShardSpecTest, ScatterGatherAndReshardAreIdentity) {
  for (LayoutKind kind : kPerTensorKinds) {
    for (const Shape& shape : {Shape{}, Shape{0}, Shape{1}, Shape{7, 3}, Shape{13}, Shape{9, 2, 2},
                               Shape{17, 0}, Shape{41}}) {
      std::vector<int64_t> full(static_cast<size_t>(product(shape)));
      for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<int64_t>(i) * 10 + 7;
      for (int64_t from = 1; from <= 8; ++from) {
        const ShardSpec a = makeSpec(kind, shape, from);
        ASSERT_EQ(gather(scatter(full, a), a), full);
        for (int64_t to = 1; to <= 8; ++to) {
          SCOPED_TRACE(::testing::Message() << layoutKindName(kind) << " " << from << "->" << to);
          const ShardSpec b = makeSpec(kind, shape, to);
          EXPECT_EQ(gather(scatter(gather(scatter(full, a), a), b), b), full);
        }
      }
    }
  }
}

TEST(ShardSpecTest, IntersectIsEmptyWhenDisjoint) {
  EXPECT_EQ(intersect({0, 10}, {4, 20}), (ElementRange{4, 10}));
  EXPECT_EQ(intersect({4, 20}, {0, 10}), (ElementRange{4, 10}));
  EXPECT_TRUE(intersect({0, 3}, {5, 9}).empty());
  EXPECT_TRUE(intersect({5, 9}, {0, 3}).empty());
  EXPECT_EQ(intersect({5, 9}, {0, 3}).size(), 0);
  EXPECT_EQ(intersect({2, 2}, {0, 9}), (ElementRange{2, 2}));
}

TEST(ShardSpecTest, KindNamesRoundTrip) {
  for (LayoutKind kind : {LayoutKind::kReplicated, LayoutKind::kRankZero, LayoutKind::kFsdp2,
                          LayoutKind::kFsdp1, LayoutKind::kPerRank}) {
    EXPECT_EQ(parseLayoutKind(layoutKindName(kind)), kind);
  }
  EXPECT_STREQ(layoutKindName(LayoutKind::kRankZero), "rank0");
  EXPECT_STREQ(layoutKindName(LayoutKind::kPerRank), "per_rank");
  EXPECT_VALUE_ERROR(parseLayoutKind("FSDP2"), "FSDP2");
}

// d0 near INT64_MAX: ceil(d0 / W) and r * chunk, restated in 128-bit
// arithmetic, where neither can overflow; every range must match and the
// ranges must tile [0, d0) (a 1-D tensor, and d0 x 1).
TEST(ShardSpecTest, Fsdp2RangesDoNotOverflowNearInt64Max) {
  const int64_t d0 = std::numeric_limits<int64_t>::max() - 1;
  for (int64_t world : {3, 7, 64}) {
    const __int128 chunk = (static_cast<__int128>(d0) + world - 1) / world;
    for (const Shape& shape : {Shape{d0}, Shape{d0, 1}}) {
      SCOPED_TRACE(::testing::Message() << "W " << world << " dims " << shape.size());
      int64_t cursor = 0;
      for (int64_t r = 0; r < world; ++r) {
        const auto row = [&](int64_t k) {
          return static_cast<int64_t>(std::min<__int128>(k * chunk, d0));
        };
        const ElementRange range = fsdp2Range(shape, r, world);
        EXPECT_EQ(range, (ElementRange{row(r), row(r + 1)})) << "rank " << r;
        EXPECT_EQ(range.begin, cursor) << "rank " << r;
        cursor = range.end;
      }
      EXPECT_EQ(cursor, d0);
      const ShardSpec spec = fsdp2Spec("w.huge", shape, c10::kByte, world);
      EXPECT_NO_THROW(checkShardSpec(spec));
      EXPECT_EQ(spec.numel(), d0);
    }
  }
  // d0 * inner past INT64_MAX: a ValueError naming the tensor, not a wrap.
  EXPECT_VALUE_ERROR(fsdp2Spec("w.wide", {d0, 3}, c10::kFloat, 7), "w.wide");
}

TEST(ShardSpecTest, RejectsBadArguments) {
  EXPECT_VALUE_ERROR(fsdp2Range({4}, 4, 4), "rank 4");
  EXPECT_VALUE_ERROR(fsdp2Range({4}, -1, 4), "rank -1");
  EXPECT_VALUE_ERROR(fsdp2Range({4}, 0, 0), "world size");
  EXPECT_VALUE_ERROR(fsdp2Spec("w.neg", {4, -2}, c10::kFloat, 2), "w.neg");
  EXPECT_VALUE_ERROR(rankZeroSpec("w.zero", {4}, c10::kFloat, 0), "w.zero");
  EXPECT_VALUE_ERROR(replicatedSpec("w.big", {int64_t{1} << 40, int64_t{1} << 40}, c10::kFloat, 2),
                     "w.big");
  const ShardSpec spec = fsdp2Spec("w", {5}, c10::kFloat, 2);
  EXPECT_THROW(spec.rangeOf(2), c10::IndexError);
  EXPECT_EQ(spec.rangeOf(1), (ElementRange{3, 5}));
}

TEST(ShardSpecTest, CheckNamesTheBrokenInvariant) {
  ShardSpec good = fsdp2Spec("layer.w", {5, 2}, c10::kBFloat16, 3);  // [0,4) [4,8) [8,10)
  EXPECT_NO_THROW(checkShardSpec(good));
  ShardSpec spec = good;
  spec.name = "";
  EXPECT_VALUE_ERROR(checkShardSpec(spec), "empty name");
  spec = good;
  spec.ranges.clear();
  EXPECT_VALUE_ERROR(checkShardSpec(spec), "no ranges");
  spec = good;
  spec.ranges[1] = {5, 8};  // hole [4, 5)
  EXPECT_VALUE_ERROR(checkShardSpec(spec), "rank 1");
  spec = good;
  spec.ranges[1] = {3, 8};  // overlap
  EXPECT_VALUE_ERROR(checkShardSpec(spec), "layer.w");
  spec = good;
  spec.ranges[2] = {8, 9};  // short of numel
  EXPECT_VALUE_ERROR(checkShardSpec(spec), "10 elements");
  spec = good;
  spec.ranges[2] = {8, 11};  // past numel
  EXPECT_VALUE_ERROR(checkShardSpec(spec), "10 elements");
  spec = good;
  spec.ranges[1] = {4, 3};
  EXPECT_VALUE_ERROR(checkShardSpec(spec), "ends before");
  spec = good;
  spec.globalShape = {5, -2};
  EXPECT_VALUE_ERROR(checkShardSpec(spec), "negative dim");
  spec = good;  // out of rank order: rank 0 holds the tail
  spec.ranges = {{4, 10}, {0, 4}, {10, 10}};
  EXPECT_VALUE_ERROR(checkShardSpec(spec), "rank 0");
}

TEST(ShardSpecTest, EqualityComparesEveryField) {
  const ShardSpec base = fsdp2Spec("w", {5, 2}, c10::kFloat, 2);
  EXPECT_EQ(base, fsdp2Spec("w", {5, 2}, c10::kFloat, 2));
  ShardSpec other = base;
  other.name = "v";
  EXPECT_NE(base, other);
  other = base;
  other.globalShape = {10};
  EXPECT_NE(base, other);
  other = base;
  other.dtype = c10::kBFloat16;
  EXPECT_NE(base, other);
  other = base;
  other.kind = LayoutKind::kReplicated;
  EXPECT_NE(base, other);
  other = base;
  other.ranges[0].end = 5;
  EXPECT_NE(base, other);
}

// A per-rank tensor: every rank holds all of its own copy; rank 0's alone
// has a range (what gathers, files and reshards take). Its spec must say so.
TEST(ShardSpecTest, PerRankHoldsTheWholeOnEveryRankAndRankZeroStandsForIt) {
  const ShardSpec spec = perRankSpec("norm.running_mean", {6}, c10::kFloat, 3);
  EXPECT_EQ(spec.kind, LayoutKind::kPerRank);
  EXPECT_EQ(spec.ranges, (std::vector<ElementRange>{{0, 6}, {6, 6}, {6, 6}}));
  for (int64_t r = 0; r < 3; ++r) EXPECT_EQ(spec.heldRange(r), (ElementRange{0, 6})) << r;
  EXPECT_THROW(spec.heldRange(3), c10::IndexError);
  EXPECT_EQ(layoutSpec("norm.running_mean", {6}, c10::kFloat, LayoutKind::kPerRank, 3), spec);
  // The same ranges as rank 0 full copy, but another kind: not equal.
  EXPECT_EQ(spec.ranges, rankZeroSpec("norm.running_mean", {6}, c10::kFloat, 3).ranges);
  EXPECT_NE(spec, rankZeroSpec("norm.running_mean", {6}, c10::kFloat, 3));
  EXPECT_EQ(perRankSpec("n", {}, c10::kLong, 2).heldRange(1), (ElementRange{0, 1}));  // 0-dim
  EXPECT_EQ(perRankSpec("e", {0, 3}, c10::kFloat, 2).heldRange(1), (ElementRange{0, 0}));
  // Ranges that tile but give rank 1 a part: not a per-rank tensor.
  ShardSpec split = replicatedSpec("norm.running_mean", {6}, c10::kFloat, 3);
  split.kind = LayoutKind::kPerRank;
  EXPECT_VALUE_ERROR(checkShardSpec(split), "'norm.running_mean' is per_rank, so rank 0's range");
  EXPECT_VALUE_ERROR(perRankSpec("w.zero", {4}, c10::kFloat, 0), "w.zero");
}

// Python torch.chunk, the split fully_shard uses, row for row.
TEST(ShardSpecTest, Fsdp2MatchesPythonTorchChunk) {
  const std::string python = SHARDEMA_TEST_PYTHON;
  const std::string command =
      "'" + python + "' '" + SHARDEMA_TEST_SOURCE_DIR + "/python/chunk_ranges.py' 41 8 2>&1";
  const testing::CommandResult result = testing::runCommand(command);
  ASSERT_EQ(result.exitCode, 0) << result.output;
  const nlohmann::json cases = nlohmann::json::parse(result.output);
  ASSERT_EQ(cases.size(), 42u * 8u);
  for (const auto& item : cases) {
    const int64_t d0 = item["d0"].get<int64_t>();
    const int64_t world = item["w"].get<int64_t>();
    for (int64_t r = 0; r < world; ++r) {
      EXPECT_EQ(fsdp2Range({d0, 3}, r, world).size(), 3 * item["rows"][r].get<int64_t>())
          << "d0 " << d0 << " W " << world << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace shardema::shard
