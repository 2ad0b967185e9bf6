// ShardLayout: canonical JSON, fingerprints (checked against the xxhsum
// command-line tool's XXH64 of the same text), validation, relayout.
#include "shardema/shard/shard_layout.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardema/shard/flat_param_layout.h"
#include "support/value_error.h"

namespace shardema::shard {
namespace {

ShardLayout smallLayout() {
  return {{fsdp2Spec("w", {3, 2}, c10::kFloat, 2), rankZeroSpec("b", {}, c10::kBFloat16, 2)}};
}

// Every kind, odd sizes, 0-dim and empty tensors, one world size.
ShardLayout mixedLayout(int64_t world) {
  ShardLayout layout;
  layout.specs.push_back(fsdp2Spec("layers.0.weight", {13, 7}, c10::kBFloat16, world));
  layout.specs.push_back(replicatedSpec("layers.0.bias", {13}, c10::kFloat, world));
  layout.specs.push_back(rankZeroSpec("step_scale", {}, c10::kFloat, world));
  layout.specs.push_back(fsdp2Spec("empty", {0, 4}, c10::kHalf, world));
  const FlatParamLayout flat({{"unit.a", {5, 3}}, {"unit.b", {}}, {"unit.c", {29}}}, c10::kFloat,
                             world);
  for (const ShardSpec& spec : flat.specs()) layout.specs.push_back(spec);
  layout.specs.push_back(perRankSpec("norm.running_var", {4}, c10::kFloat, world));
  return layout;
}

// The text was fed to `xxhsum -H64` (xxhash 0.8.1) by hand: 6bf692d94951b081.
constexpr const char* kSmallJson =
    R"({"format":1,"world_size":2,"tensors":[{"name":"w","kind":"fsdp2","dtype":"F32",)"
    R"("shape":[3,2],"ranges":[[0,4],[4,6]]},{"name":"b","kind":"rank0","dtype":"BF16",)"
    R"("shape":[],"ranges":[[0,1],[1,1]]}]})";

TEST(ShardLayoutTest, CanonicalJsonAndFingerprintAreFixed) {
  EXPECT_EQ(smallLayout().toJson(), kSmallJson);
  EXPECT_EQ(smallLayout().fingerprint(), "6bf692d94951b081");
  EXPECT_EQ(ShardLayout{}.toJson(), R"({"format":1,"world_size":0,"tensors":[]})");
}

TEST(ShardLayoutTest, JsonRoundTripsEveryKind) {
  for (int64_t world = 1; world <= 8; ++world) {
    const ShardLayout layout = mixedLayout(world);
    EXPECT_NO_THROW(layout.check());
    const ShardLayout back = ShardLayout::fromJson(layout.toJson());
    EXPECT_EQ(back.specs, layout.specs) << "W " << world;
    EXPECT_EQ(back.toJson(), layout.toJson());
    EXPECT_EQ(back.fingerprint(), layout.fingerprint());
  }
  const ShardLayout empty = ShardLayout::fromJson(ShardLayout{}.toJson());
  EXPECT_TRUE(empty.specs.empty());
  EXPECT_EQ(empty.worldSize(), 0);
  // Whitespace and key order do not matter to the reader; the canonical
  // text (and so the fingerprint) is re-derived.
  const std::string spaced =
      R"({ "tensors": [ {"ranges": [[0,4],[4,6]], "shape": [3, 2], "dtype": "F32", "kind": "fsdp2",)"
      R"( "name": "w"}, {"name":"b","kind":"rank0","dtype":"BF16","shape":[],"ranges":[[0,1],[1,1]]}],)"
      R"( "world_size": 2, "format": 1 })";
  EXPECT_EQ(ShardLayout::fromJson(spaced).fingerprint(), "6bf692d94951b081");
}

TEST(ShardLayoutTest, AnyFieldChangeChangesFingerprint) {
  const ShardLayout base = mixedLayout(3);
  EXPECT_EQ(base.fingerprint(), mixedLayout(3).fingerprint());
  EXPECT_EQ(base.fingerprint().size(), 16u);
  std::vector<ShardLayout> variants(9, base);
  variants[0].specs[0].name = "layers.0.weightx";
  variants[1].specs[0].globalShape = {7, 13};
  variants[1].specs[0] = fsdp2Spec("layers.0.weight", {7, 13}, c10::kBFloat16, 3);
  variants[2].specs[1].dtype = c10::kHalf;
  variants[3].specs[1].kind = LayoutKind::kFsdp2;
  variants[4].specs[4].ranges[0].end -= 1;
  variants[4].specs[4].ranges[1].begin -= 1;
  variants[5] = mixedLayout(4);
  std::swap(variants[6].specs[0], variants[6].specs[1]);  // order is part of the layout
  variants[7].specs.pop_back();
  variants[8].specs.back().kind = LayoutKind::kRankZero;  // the same ranges as per_rank
  std::vector<std::string> seen = {base.fingerprint()};
  for (size_t i = 0; i < variants.size(); ++i) {
    const std::string fingerprint = variants[i].fingerprint();
    for (const std::string& other : seen) EXPECT_NE(fingerprint, other) << "variant " << i;
    seen.push_back(fingerprint);
  }
}

TEST(ShardLayoutTest, CheckAndAtNameTheTensor) {
  ShardLayout layout = mixedLayout(2);
  EXPECT_EQ(layout.worldSize(), 2);
  EXPECT_EQ(layout.at("unit.c").globalShape, (std::vector<int64_t>{29}));
  EXPECT_THROW(layout.at("missing"), c10::IndexError);
  layout.specs.push_back(fsdp2Spec("empty", {3}, c10::kFloat, 2));
  EXPECT_VALUE_ERROR(layout.check(), "'empty' appears twice");
  layout = mixedLayout(2);
  layout.specs.push_back(fsdp2Spec("extra", {3}, c10::kFloat, 3));
  EXPECT_VALUE_ERROR(layout.check(), "'extra' is split over 3 ranks");
  layout = mixedLayout(2);
  layout.specs[2].ranges[1] = {0, 1};
  EXPECT_VALUE_ERROR(layout.check(), "step_scale");
}

TEST(ShardLayoutTest, MalformedJsonIsRejectedNamingTheEntry) {
  const std::string good = kSmallJson;
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return text.replace(at, from.size(), to);
  };
  EXPECT_VALUE_ERROR(ShardLayout::fromJson("{\"format\":1,"), "not valid JSON");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson("[]"), "must be an object");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("\"format\":1", "\"format\":2")), "format 2");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("\"format\":1,", "")), "no \"format\"");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("\"world_size\":2", "\"world_size\":3")),
                     "tensor 0 ('w') has 2 ranges but world_size is 3");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("\"F32\"", "\"float32\"")),
                     "tensor 0 ('w'): unknown dtype");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("\"rank0\"", "\"zero\"")), "tensor 1 ('b')");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("[4,6]", "[5,6]")), "'w'");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("[4,6]", "[4,6,7]")), "[begin, end]");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("[3,2]", "[3,2.5]")), "must be an integer");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("[3,2]", "[3,-2]")), "negative dim");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("[[0,4]", "[[0,18446744073709551615]")),
                     "must be an integer");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("\"name\":\"b\"", "\"name\":\"w\"")),
                     "'w' appears twice");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("\"name\":\"b\",", "")),
                     "tensor 1 has no \"name\"");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("\"name\":\"b\",", "\"name\":\"b\",\"x\":1,")),
                     "unknown key \"x\"");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(replaced("\"name\":\"b\"", "\"name\":\"\"")),
                     "empty name");
  EXPECT_VALUE_ERROR(ShardLayout::fromJson(R"({"format":1,"world_size":2,"tensors":[]})"),
                     "world_size 0");
}

TEST(ShardLayoutTest, DescribeIsOneLine) {
  const std::string text = smallLayout().describe();
  EXPECT_EQ(text, "fsdp2+rank0 over 2 ranks, 2 tensors, fingerprint 6bf692d94951b081");
  EXPECT_EQ(text.find('\n'), std::string::npos);
  ShardLayout fsdp2;
  for (int i = 0; i < 12; ++i) {
    fsdp2.specs.push_back(fsdp2Spec("t" + std::to_string(i), {5}, c10::kFloat, 4));
  }
  EXPECT_EQ(fsdp2.describe().rfind("fsdp2 over 4 ranks, 12 tensors, fingerprint ", 0), 0u);
}

TEST(ShardLayoutTest, RelayoutKeepsTensorsAndRederivesRanges) {
  const ShardLayout from = mixedLayout(4);
  for (int64_t world = 1; world <= 8; ++world) {
    const ShardLayout to = relayout(from, world);
    EXPECT_NO_THROW(to.check());
    EXPECT_EQ(to.worldSize(), world);
    ASSERT_EQ(to.specs.size(), from.specs.size());
    for (size_t i = 0; i < to.specs.size(); ++i) {
      const ShardSpec& a = from.specs[i];
      const ShardSpec& b = to.specs[i];
      EXPECT_EQ(b.name, a.name);
      EXPECT_EQ(b.globalShape, a.globalShape);
      EXPECT_EQ(b.dtype, a.dtype);
      EXPECT_EQ(b.kind, a.kind == LayoutKind::kFsdp1 ? LayoutKind::kFsdp2 : a.kind);
    }
    EXPECT_EQ(to.at("layers.0.weight"),
              fsdp2Spec("layers.0.weight", {13, 7}, c10::kBFloat16, world));
    EXPECT_EQ(to.at("unit.a"), fsdp2Spec("unit.a", {5, 3}, c10::kFloat, world));
    EXPECT_EQ(to.at("step_scale").ranges[0], (ElementRange{0, 1}));
    EXPECT_EQ(to.at("norm.running_var"), perRankSpec("norm.running_var", {4}, c10::kFloat, world));
  }
  EXPECT_EQ(relayout(smallLayout(), 2).specs, smallLayout().specs);  // same W: same layout
  EXPECT_VALUE_ERROR(relayout(from, 0), "world size");
}

}  // namespace
}  // namespace shardema::shard
