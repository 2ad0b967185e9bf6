// FSDP1 flat-parameter layouts against an element-by-element simulation of
// the flat parameter (member elements, alignment padding, end padding) and
// hand-worked examples.
#include "shardema/shard/flat_param_layout.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/value_error.h"

namespace shardema::shard {
namespace {

using Shape = std::vector<int64_t>;

int64_t product(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// One slot of the simulated flat parameter: member index and local element,
// or member -1 for padding.
struct Slot {
  int member;
  int64_t element;
};

// Builds the flat parameter one element at a time, as FSDP's
// _init_flat_param_and_metadata appends padding tensors and params.
std::vector<Slot> simulate(const std::vector<FlatParamMember>& members, int64_t elementBytes,
                           bool aligned, int64_t world) {
  std::vector<Slot> flat;
  for (size_t m = 0; m < members.size(); ++m) {
    while (aligned && (static_cast<int64_t>(flat.size()) * elementBytes) % 16 != 0) {
      flat.push_back({-1, 0});
    }
    for (int64_t e = 0; e < product(members[m].shape); ++e) flat.push_back({int(m), e});
  }
  while (static_cast<int64_t>(flat.size()) % world != 0) flat.push_back({-1, 0});
  return flat;
}

// Every member's spec and local offset agree with the simulation: rank r's
// piece is exactly the member elements found in r's slice, in order.
void expectMatchesSimulation(const FlatParamLayout& layout, int64_t elementBytes, bool aligned) {
  const std::vector<Slot> flat =
      simulate(layout.members(), elementBytes, aligned, layout.worldSize());
  ASSERT_EQ(layout.paddedNumel(), static_cast<int64_t>(flat.size()));
  const int64_t shard = layout.shardNumel();
  ASSERT_EQ(shard * layout.worldSize(), layout.paddedNumel());
  const std::vector<ShardSpec> specs = layout.specs();
  ASSERT_EQ(specs.size(), layout.members().size());
  for (size_t m = 0; m < specs.size(); ++m) {
    const ShardSpec& spec = specs[m];
    EXPECT_EQ(spec.kind, LayoutKind::kFsdp1);
    EXPECT_EQ(spec.name, layout.members()[m].name);
    EXPECT_EQ(spec.globalShape, layout.members()[m].shape);
    EXPECT_NO_THROW(checkShardSpec(spec));
    for (int64_t r = 0; r < layout.worldSize(); ++r) {
      std::vector<int64_t> elements;
      int64_t firstLocal = -1;
      for (int64_t i = r * shard; i < (r + 1) * shard; ++i) {
        if (flat[static_cast<size_t>(i)].member != int(m)) continue;
        if (firstLocal < 0) firstLocal = i - r * shard;
        elements.push_back(flat[static_cast<size_t>(i)].element);
      }
      const ElementRange range = spec.ranges[static_cast<size_t>(r)];
      ASSERT_EQ(range.size(), static_cast<int64_t>(elements.size()))
          << "member " << m << " rank " << r;
      for (size_t k = 0; k < elements.size(); ++k) ASSERT_EQ(elements[k], range.begin + int64_t(k));
      EXPECT_EQ(layout.localOffset(m, r), firstLocal < 0 ? 0 : firstLocal);
    }
  }
  for (size_t m = 0; m < layout.members().size(); ++m) {
    for (size_t i = 0; i < flat.size(); ++i) {
      if (flat[i].member == int(m)) {
        EXPECT_EQ(layout.memberOffset(m), static_cast<int64_t>(i));
        break;
      }
    }
  }
}

std::vector<FlatParamMember> membersOf(const std::vector<Shape>& shapes) {
  std::vector<FlatParamMember> members;
  for (size_t i = 0; i < shapes.size(); ++i)
    members.push_back({"m" + std::to_string(i), shapes[i]});
  return members;
}

TEST(FlatParamLayoutTest, MatchesSimulationOverSweep) {
  const std::vector<std::vector<Shape>> units = {
      {},
      {{}},
      {{0}},
      {{1}},
      {{7}},
      {{3}, {5}, {2, 2}},
      {{}, {13}, {0}, {4, 3}},
      {{97}, {1}, {1}, {31, 2}},
      {{2, 0}, {17}, {}},
      {{11}, {0}},  // a trailing empty member still gets its alignment pad
      {{1009}, {3, 5}, {41}},
  };
  const std::pair<c10::ScalarType, int64_t> dtypes[] = {
      {c10::kFloat, 4}, {c10::kBFloat16, 2}, {c10::kHalf, 2}, {c10::kDouble, 8}};
  for (const auto& shapes : units) {
    for (const auto& [dtype, bytes] : dtypes) {
      for (bool orig : {true, false}) {
        for (int64_t world = 1; world <= 8; ++world) {
          SCOPED_TRACE(::testing::Message() << shapes.size() << " members " << dtype << " orig "
                                            << orig << " W " << world);
          FlatParamOptions options;
          options.useOrigParams = orig;
          const FlatParamLayout layout(membersOf(shapes), dtype, world, options);
          expectMatchesSimulation(layout, bytes, orig);
        }
      }
    }
  }
}

// fp32, use_orig_params: offsets 0, 4, 12; T = 16, padded to 18, S = 6.
TEST(FlatParamLayoutTest, HandWorkedFp32Aligned) {
  const FlatParamLayout layout({{"a", {3}}, {"b", {5}}, {"c", {2, 2}}}, c10::kFloat, 3);
  EXPECT_EQ(layout.memberOffset(0), 0);
  EXPECT_EQ(layout.memberOffset(1), 4);
  EXPECT_EQ(layout.memberOffset(2), 12);
  EXPECT_EQ(layout.unpaddedNumel(), 16);
  EXPECT_EQ(layout.paddedNumel(), 18);
  EXPECT_EQ(layout.shardNumel(), 6);
  const std::vector<ShardSpec> specs = layout.specs();
  EXPECT_EQ(specs[0].ranges, (std::vector<ElementRange>{{0, 3}, {3, 3}, {3, 3}}));
  EXPECT_EQ(specs[1].ranges, (std::vector<ElementRange>{{0, 2}, {2, 5}, {5, 5}}));
  EXPECT_EQ(specs[2].ranges, (std::vector<ElementRange>{{0, 0}, {0, 0}, {0, 4}}));
  EXPECT_EQ(layout.localOffset(1, 0), 4);  // after a (3) and one pad
  EXPECT_EQ(layout.localOffset(1, 1), 0);
  EXPECT_EQ(layout.localOffset(2, 2), 0);
  EXPECT_EQ(layout.localOffset(2, 0), 0);  // empty piece
}

// One parameter cut across three ranks, no alignment: T = 12, S = 4.
TEST(FlatParamLayoutTest, ParameterCutAcrossThreeRanks) {
  FlatParamOptions packed;
  packed.useOrigParams = false;
  const FlatParamLayout layout({{"bias", {2}}, {"weight", {5, 2}}}, c10::kFloat, 3, packed);
  EXPECT_EQ(layout.shardNumel(), 4);
  const std::vector<ShardSpec> specs = layout.specs();
  EXPECT_EQ(specs[1].ranges, (std::vector<ElementRange>{{0, 2}, {2, 6}, {6, 10}}));
  EXPECT_EQ(layout.localOffset(1, 0), 2);
  EXPECT_EQ(layout.localOffset(1, 1), 0);
  EXPECT_EQ(layout.localOffset(1, 2), 0);
}

// bf16 aligns to 8 elements; without use_orig_params nothing is padded but
// the end.
TEST(FlatParamLayoutTest, HandWorkedBf16WithAndWithoutOrigParams) {
  const FlatParamLayout aligned({{"a", {3}}, {"b", {5}}}, c10::kBFloat16, 2);
  EXPECT_EQ(aligned.memberOffset(1), 8);
  EXPECT_EQ(aligned.unpaddedNumel(), 13);
  EXPECT_EQ(aligned.shardNumel(), 7);
  EXPECT_EQ(aligned.specs()[1].ranges, (std::vector<ElementRange>{{0, 0}, {0, 5}}));
  EXPECT_EQ(aligned.localOffset(1, 1), 1);

  FlatParamOptions packed;
  packed.useOrigParams = false;
  const FlatParamLayout plain({{"a", {3}}, {"b", {5}}}, c10::kBFloat16, 2, packed);
  EXPECT_EQ(plain.memberOffset(1), 3);
  EXPECT_EQ(plain.paddedNumel(), 8);
  EXPECT_EQ(plain.specs()[1].ranges, (std::vector<ElementRange>{{0, 1}, {1, 5}}));
  EXPECT_EQ(plain.localOffset(1, 0), 3);
  // fp32 aligns to 4 elements: b starts at 4.
  EXPECT_EQ(FlatParamLayout({{"a", {3}}, {"b", {5}}}, c10::kFloat, 2).memberOffset(1), 4);
}

TEST(FlatParamLayoutTest, RejectsBadMembers) {
  EXPECT_VALUE_ERROR(FlatParamLayout({{"a", {3}}, {"a", {2}}}, c10::kFloat, 2),
                     "'a' appears twice");
  EXPECT_VALUE_ERROR(FlatParamLayout({{"", {3}}}, c10::kFloat, 2), "empty name");
  EXPECT_VALUE_ERROR(FlatParamLayout({{"neg", {3, -1}}}, c10::kFloat, 2), "neg");
  EXPECT_VALUE_ERROR(FlatParamLayout({{"a", {3}}}, c10::kFloat, 0), "world size");
  const FlatParamLayout layout({{"a", {3}}}, c10::kFloat, 2);
  EXPECT_THROW(layout.memberOffset(1), c10::IndexError);
  EXPECT_THROW(layout.localOffset(0, 2), c10::IndexError);
}

}  // namespace
}  // namespace shardema::shard
