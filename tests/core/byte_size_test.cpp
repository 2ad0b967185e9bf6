// parseByteSize: the sizes transformers' save_pretrained(max_shard_size=)
// takes mean the same bytes here (huggingface_hub's parse_size_to_int for
// KB..TB, transformers' convert_file_size_to_int for KiB..GiB), and every
// other text is one ValueError naming the parameter.
#include "shardema/core/byte_size.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "support/value_error.h"

namespace shardema {
namespace {

TEST(ByteSizeTest, ReadsTheSizesHuggingFaceReads) {
  const std::vector<std::pair<std::string, int64_t>> cases = {
      {"1", 1},
      {"4096", 4096},
      {"9223372036854775807", INT64_MAX},  // plain bytes are exact
      {"5GB", 5000000000},                 // huggingface_hub: 5 * 10**9
      {"5gb", 5000000000},                 // it upper-cases the unit
      {" 5 GB ", 5000000000},              // and strips spaces
      {"1.5GB", 1500000000},               // int(float(value) * unit)
      {"500MB", 500000000},
      {"2KB", 2000},
      {"1TB", 1000000000000},
      {"0.0015KB", 1},  // int(1.5) = 1, as int(value * unit)
      {"2GiB", int64_t{2} << 30},  // transformers: 2 * 2**30
      {"100MiB", int64_t{100} << 20},
      {"3KiB", 3072},
      {"1TiB", int64_t{1} << 40},
  };
  for (const auto& [text, bytes] : cases) {
    EXPECT_EQ(parseByteSize(text, "max_shard_size"), bytes) << text;
  }
}

TEST(ByteSizeTest, RefusesAnythingElseNamingTheParameter) {
  for (const std::string text :
       {"", " ", "0", "0GB", "0.0001KB", "-5GB", "-1", "abc", "5XB", "5B", "GB", "1e9", "1e3MB",
        "inf", "nanGB", "0x10", "1.2.3GB", "5 G B", "9223372036854775808",
        "99999999999999999999", "10000000TB"}) {
    SCOPED_TRACE("'" + text + "'");
    EXPECT_VALUE_ERROR(parseByteSize(text, "--max-shard-size"),
                       "--max-shard-size must be a positive number of bytes or a size such as");
  }
}

}  // namespace
}  // namespace shardema
