// Replays tests/data/fuzz_regressions/: inputs the fuzzer (tests/fuzz/) once
// crashed on, plus hand-made nasty ones. Each must parse or be refused with
// a c10::Error; a crash or another exception type fails the test.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "shardema/core/safetensors_header.h"
#include "shardema/core/tensor_file.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> regressionFiles() {
  std::vector<fs::path> files;
  for (const auto& item :
       fs::directory_iterator(fs::path(SHARDEMA_TEST_DATA_DIR) / "fuzz_regressions")) {
    if (item.is_regular_file()) files.push_back(item.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string bytesOf(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(FuzzRegressionTest, HeaderParserSurvivesEveryInput) {
  const std::vector<fs::path> files = regressionFiles();
  ASSERT_FALSE(files.empty());
  for (const fs::path& path : files) {
    SCOPED_TRACE(path.filename().string());
    const std::string bytes = bytesOf(path);
    try {
      const SafetensorsHeader header =
          parseSafetensorsHeader(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                 bytes.size(), path.filename().string());
      uint64_t covered = 0;
      for (const TensorEntry& entry : header.tensors) covered += entry.byteSize();
      EXPECT_EQ(covered, header.dataSize);
    } catch (const c10::Error& error) {
      EXPECT_EQ(error.msg().find('\n'), std::string::npos) << error.msg();
    }
  }
}

TEST(FuzzRegressionTest, FileReaderSurvivesEveryInput) {
  for (const fs::path& path : regressionFiles()) {
    SCOPED_TRACE(path.filename().string());
    try {
      readTensorFile(path.string());
    } catch (const c10::ValueError& error) {
      EXPECT_EQ(error.msg().rfind(path.string() + ": ", 0), 0u) << error.msg();
    }
  }
}

}  // namespace
}  // namespace shardema
