// Replays the manifest fuzzer's seeds (tests/fuzz/manifest_corpus/) and the
// manifests that once broke or could break the parser
// (tests/data/fuzz_regressions/manifest/): each parses or is refused with a
// one-line c10::ValueError naming its source, never another exception.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "shardema/detail/rank_manifest.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> filesIn(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& item : fs::directory_iterator(dir)) {
    if (item.is_regular_file()) files.push_back(item.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

TEST(ManifestRegressionTest, ParserSurvivesEveryInput) {
  std::vector<fs::path> files =
      filesIn(fs::path(SHARDEMA_TEST_DATA_DIR) / "fuzz_regressions" / "manifest");
  const std::vector<fs::path> seeds =
      filesIn(fs::path(SHARDEMA_TEST_SOURCE_DIR) / "fuzz" / "manifest_corpus");
  ASSERT_GE(files.size(), 5u);
  ASSERT_FALSE(seeds.empty());
  files.insert(files.end(), seeds.begin(), seeds.end());
  for (const fs::path& path : files) {
    SCOPED_TRACE(path.filename().string());
    std::ifstream in(path, std::ios::binary);
    const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    try {
      const RankManifest manifest = RankManifest::fromJson(text, path.string());
      EXPECT_EQ(RankManifest::fromJson(manifest.toJson()).toJson(), manifest.toJson());
    } catch (const c10::ValueError& error) {
      const std::string message = error.what_without_backtrace();
      EXPECT_EQ(message.rfind(path.string() + ": ", 0), 0u) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  }
}

TEST(ManifestRegressionTest, NegativeValueIsNamedAsSuch) {
  const fs::path path =
      fs::path(SHARDEMA_TEST_DATA_DIR) / "fuzz_regressions" / "manifest" / "step_negative.json";
  std::ifstream in(path, std::ios::binary);
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  try {
    RankManifest::fromJson(text, "m.json");
    FAIL() << "expected an error";
  } catch (const c10::ValueError& error) {
    EXPECT_NE(std::string(error.what_without_backtrace())
                  .find("m.json: key 'step' is -3, a negative number; it must be an integer >= 0"),
              std::string::npos)
        << error.what_without_backtrace();
  }
}

}  // namespace
}  // namespace shardema
