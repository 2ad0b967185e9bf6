#include "shardema/core/file_metadata.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace shardema {
namespace {

using detail::DeployableInfo;

uint64_t bitsOf(double value) {
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

TEST(FileMetadataTest, Decimal17RoundTripsBitExactly) {
  const double values[] = {
      0.0, 1.0, 0.1, 1.0 / 3.0, 6.94, 1e-300, 1e300, std::nextafter(1.0, 2.0), -2.5, 5e-324};
  for (double value : values) {
    const std::string text = detail::formatDecimal17(value);
    double parsed = 0;
    ASSERT_TRUE(detail::parseFiniteDecimal(text, &parsed)) << text;
    EXPECT_EQ(bitsOf(parsed), bitsOf(value)) << text;
  }
  // The spelling is printf's, not merely some round-tripping one.
  EXPECT_EQ(detail::formatDecimal17(0.1), "0.10000000000000001");
  EXPECT_EQ(detail::formatDecimal17(2.0), "2");
}

TEST(FileMetadataTest, ParseFiniteDecimalRefusesWhatStrtodWouldTake) {
  for (const char* text : {"", " 6.9", "0x1p3", "inf", "nan", "6.9abc", "1e999", "6.9 "}) {
    double value = 42.0;
    EXPECT_FALSE(detail::parseFiniteDecimal(text, &value)) << text;
    EXPECT_EQ(value, 42.0) << text;
  }
}

TEST(FileMetadataTest, ParseDecimalDigitsHasOneSpellingPerNumber) {
  int64_t value = 0;
  EXPECT_TRUE(detail::parseDecimalDigits("0", &value));
  EXPECT_EQ(value, 0);
  EXPECT_TRUE(detail::parseDecimalDigits("9223372036854775807", &value));
  EXPECT_EQ(value, std::numeric_limits<int64_t>::max());
  for (const char* text : {"", "00", "012", "+1", "-1", "1 ", "1.0", "9223372036854775808"}) {
    value = 7;
    EXPECT_FALSE(detail::parseDecimalDigits(text, &value)) << text;
    EXPECT_EQ(value, 7) << text;
  }
}

TEST(FileMetadataTest, ExportedDeployableMetadataMatchesDesignSection5) {
  DeployableInfo info;
  info.step = 12;
  info.exported = DeployableInfo::Exported{"{\"kind\":\"constant\"}", 4};
  const std::map<std::string, std::string> expected = {
      {"format", "pt"},  // transformers' from_pretrained requires it
      {"shardema.kind", "deployable_weights"},
      {"shardema.step", "12"},
      {"shardema.schedule", "{\"kind\":\"constant\"}"},
      {"shardema.source_world_size", "4"}};
  EXPECT_EQ(detail::deployableMetadata(info), expected);
}

TEST(FileMetadataTest, SynthesizedDeployableMetadataMatchesDesignSection5) {
  DeployableInfo info;
  info.step = 300;
  info.synthesized = DeployableInfo::Synthesized{0.1, 6.94, true};
  const std::map<std::string, std::string> expected = {
      {"format", "pt"},
      {"shardema.kind", "deployable_weights"},
      {"shardema.step", "300"},
      {"shardema.sigma_rel", "0.10000000000000001"},
      {"shardema.gamma", "6.9400000000000004"},
      {"shardema.synthesis", "normalized"}};
  EXPECT_EQ(detail::deployableMetadata(info), expected);
  info.synthesized->normalized = false;
  EXPECT_EQ(detail::deployableMetadata(info).at("shardema.synthesis"), "raw");
}

TEST(FileMetadataTest, DeployableMetadataNeedsExactlyOneSource) {
  DeployableInfo neither;
  EXPECT_THROW(detail::deployableMetadata(neither), c10::Error);
  DeployableInfo both;
  both.exported = DeployableInfo::Exported{};
  both.synthesized = DeployableInfo::Synthesized{};
  EXPECT_THROW(detail::deployableMetadata(both), c10::Error);
}

}  // namespace
}  // namespace shardema
