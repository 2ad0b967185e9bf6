#include "shardema/core/output_path.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "support/temp_dir.h"

namespace shardema::detail {
namespace {

std::string refusal(const std::string& output, const std::string& input) {
  try {
    refuseOutputOverInput("export", output, {input});
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(OutputPathTest, RefusesTheInputItselfAndAnythingInsideIt) {
  testing::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  std::filesystem::create_directories(ckpt);
  std::ofstream(ckpt + "/manifest.json") << "{}";
  EXPECT_NE(refusal(ckpt + "/manifest.json", ckpt).find("lies inside the input " + ckpt),
            std::string::npos);
  EXPECT_NE(refusal(ckpt + "/new.safetensors", ckpt).find("lies inside"), std::string::npos);
  EXPECT_NE(refusal(ckpt, ckpt).find("is the input " + ckpt + " itself"), std::string::npos);
  EXPECT_NE(refusal(ckpt + "/", ckpt).find("itself"), std::string::npos);
  const std::string file = dir.file("weights.safetensors");
  std::ofstream(file) << "x";
  EXPECT_NE(refusal(file, file).find("itself"), std::string::npos);
}

TEST(OutputPathTest, SeesThroughOtherSpellingsAndLinks) {
  testing::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  std::filesystem::create_directories(ckpt + "/sub");
  EXPECT_NE(refusal(ckpt + "/sub/../manifest.json", ckpt).find("lies inside"), std::string::npos);
  const std::string link = dir.file("alias");
  std::filesystem::create_directory_symlink(ckpt, link);
  EXPECT_NE(refusal(link + "/manifest.json", ckpt).find("lies inside"), std::string::npos);
  EXPECT_NE(refusal(ckpt + "/x.safetensors", link).find("lies inside"), std::string::npos);
}

TEST(OutputPathTest, AcceptsSiblingsAndParents) {
  testing::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  std::filesystem::create_directories(ckpt);
  EXPECT_EQ(refusal(dir.file("ckpt2"), ckpt), "");  // a prefix, not a parent
  EXPECT_EQ(refusal(dir.file("ckpt.safetensors"), ckpt), "");
  EXPECT_EQ(refusal(dir.path(), ckpt), "");  // a folder above the input
}

}  // namespace
}  // namespace shardema::detail
