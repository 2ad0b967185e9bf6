// XXH64 against known answers (printed by xxhsum -H64, xxhash 0.8.1, and the
// reference value for empty input), and fileChecksum against the xxhsum
// command-line tool when it is installed.
#include "shardema/core/checksum.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "support/file_bytes.h"
#include "support/temp_dir.h"
#include "support/value_error.h"

namespace shardema {
namespace {

// The bytes (i * 31 + 7) mod 256.
std::string pattern(size_t size) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>((i * 31 + 7) % 256);
  return bytes;
}

TEST(ChecksumTest, KnownAnswers) {
  EXPECT_EQ(xxh64(nullptr, 0), 0xef46db3751d8e999ull);
  EXPECT_EQ(xxh64("a", 1), 0xd24ec4f1a98c6e5bull);
  EXPECT_EQ(xxh64("abc", 3), 0x44bc2cf5ad770999ull);
  const char* fox = "The quick brown fox jumps over the lazy dog";
  EXPECT_EQ(xxh64(fox, std::strlen(fox)), 0x0b242d361fda71bcull);
  const std::string bytes = pattern(1000);
  EXPECT_EQ(xxh64(bytes.data(), bytes.size()), 0x99594f4828043d35ull);
  EXPECT_EQ(Xxh64().digest(), 0xef46db3751d8e999ull);
}

TEST(ChecksumTest, IncrementalEqualsOneShotForAnySplit) {
  const std::string bytes = pattern(5000);
  const uint64_t whole = xxh64(bytes.data(), bytes.size());
  std::mt19937 random(7);
  for (int trial = 0; trial < 50; ++trial) {
    Xxh64 hash;
    size_t at = 0;
    while (at < bytes.size()) {
      const size_t step = std::min(bytes.size() - at, size_t(random() % 97));
      hash.update(bytes.data() + at, step);  // step 0 included
      at += step;
    }
    EXPECT_EQ(hash.digest(), whole);
  }
  Xxh64 hash;
  hash.update("ab", 2);
  EXPECT_EQ(hash.digest(), xxh64("ab", 2));  // digest does not end the stream
  hash.update("c", 1);
  EXPECT_EQ(hash.digest(), 0x44bc2cf5ad770999ull);
  Xxh64 moved(std::move(hash));
  EXPECT_EQ(moved.digest(), 0x44bc2cf5ad770999ull);
}

TEST(ChecksumTest, HexIsSixteenLowercaseDigits) {
  EXPECT_EQ(checksumHex(0xef46db3751d8e999ull), "ef46db3751d8e999");
  EXPECT_EQ(checksumHex(0x0b242d361fda71bcull), "0b242d361fda71bc");
  EXPECT_EQ(checksumHex(0), "0000000000000000");
  EXPECT_EQ(checksumHex(~0ull), "ffffffffffffffff");
  for (uint64_t value : {0ull, 1ull, 0x0b242d361fda71bcull, ~0ull}) {
    EXPECT_EQ(parseChecksumHex(checksumHex(value)), value);
  }
  EXPECT_EQ(parseChecksumHex("EF46DB3751D8E999"), 0xef46db3751d8e999ull);
  EXPECT_VALUE_ERROR(parseChecksumHex("ef46db3751d8e99"), "ef46db3751d8e99");
  EXPECT_VALUE_ERROR(parseChecksumHex("ef46db3751d8e99g"), "16 hex digits");
  EXPECT_VALUE_ERROR(parseChecksumHex(" ef46db3751d8e99"), "16 hex digits");
}

TEST(ChecksumTest, FileChecksumStreamsAnySize) {
  testing::TempDir dir;
  const size_t chunk = size_t{4} << 20;  // the implementation's read size
  for (size_t size :
       {size_t{0}, size_t{1}, size_t{1000}, chunk - 1, chunk, chunk + 1, 2 * chunk + 12345}) {
    const std::string bytes = pattern(size);
    const std::string path = dir.file("f.bin");
    testing::writeFileBytes(path, bytes);
    EXPECT_EQ(fileChecksum(path), xxh64(bytes.data(), bytes.size())) << size;
  }
  EXPECT_VALUE_ERROR(fileChecksum(dir.file("missing.bin")), "missing.bin");
  EXPECT_VALUE_ERROR(fileChecksum(dir.path()), "not a regular file");
}

// The xxhsum tool (Debian package xxhash) is an independent implementation
// of the same digest.
TEST(ChecksumTest, FileChecksumMatchesXxhsumTool) {
  if (std::system("command -v xxhsum >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "xxhsum not installed (apt-get install xxhash)";
  }
  testing::TempDir dir;
  const std::string path = dir.file("tool.bin");
  testing::writeFileBytes(path, pattern(3 * 1000 * 1000 + 17));
  FILE* pipe = ::popen(("xxhsum -H64 '" + path + "' 2>/dev/null").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  char line[512] = {};
  ASSERT_NE(std::fgets(line, sizeof(line), pipe), nullptr);
  ::pclose(pipe);
  EXPECT_EQ(std::string(line).substr(0, 16), checksumHex(fileChecksum(path))) << line;
}

}  // namespace
}  // namespace shardema
