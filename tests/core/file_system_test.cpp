// shardema/core/file_system.h against std::filesystem, the reference it
// replaces: the same answers on a corpus of path spellings and on a real
// tree with files, folders, links and a missing tail.
#include "shardema/core/file_system.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/temp_dir.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

const std::vector<std::string>& spellings() {
  static const std::vector<std::string> paths = {
      "", ".", "..", "/", "//", "a", "a/", "a//", "/a", "//a", "a/b", "a//b", "a/b/", "/a/b/",
      "./a", "a/.", "a/./b", "a/..", "a/../..", "../a", "../a/..", "/..", "/../a", "a/b/../../c",
      "a/./b/../c/", "/a/b/c/../../d", "ckpt", "run/ema_ckpts", "run/ema_ckpts/", ".hidden/x"};
  return paths;
}

std::string withoutTrailingSeparator(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

TEST(FileSystemTest, LexicallyNormalIsStdsWithoutATrailingSeparator) {
  for (const std::string& path : spellings()) {
    const std::string expected = withoutTrailingSeparator(fs::path(path).lexically_normal());
    EXPECT_EQ(detail::lexicallyNormal(path), expected) << "'" << path << "'";
  }
}

TEST(FileSystemTest, ParentPathAndFileNameAreStds) {
  for (const std::string& path : spellings()) {
    EXPECT_EQ(detail::parentPath(path), fs::path(path).parent_path().string()) << "'" << path << "'";
    EXPECT_EQ(detail::fileName(path), fs::path(path).filename().string()) << "'" << path << "'";
  }
}

TEST(FileSystemTest, AbsolutePathIsStds) {
  for (const std::string& path : spellings()) {
    if (path.empty()) continue;  // std::filesystem::absolute("") reports an error
    EXPECT_EQ(detail::absolutePath(path), fs::absolute(path).string()) << "'" << path << "'";
  }
}

// A tree: dir/ with a file, a folder, a link to the folder and a link
// that dangles.
class FileSystemTreeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    std::ofstream(dir_.file("file")) << "x";
    ASSERT_EQ(::mkdir(dir_.file("folder").c_str(), 0777), 0);
    ASSERT_EQ(::symlink(dir_.file("folder").c_str(), dir_.file("link").c_str()), 0);
    ASSERT_EQ(::symlink(dir_.file("nothing").c_str(), dir_.file("dangling").c_str()), 0);
  }
  TempDir dir_;
};

TEST_F(FileSystemTreeTest, KindsFollowLinksAsStdDoes) {
  for (const std::string name : {"file", "folder", "link", "dangling", "nothing"}) {
    const std::string path = dir_.file(name);
    EXPECT_EQ(detail::isDirectory(path), fs::is_directory(path)) << name;
    EXPECT_EQ(detail::isRegularFile(path), fs::is_regular_file(path)) << name;
    EXPECT_EQ(detail::pathExists(path), fs::exists(path)) << name;
  }
  EXPECT_FALSE(detail::pathExists(""));
}

TEST_F(FileSystemTreeTest, DirectoryNamesAreStdsEntriesSorted) {
  std::vector<std::string> expected;
  for (const auto& entry : fs::directory_iterator(dir_.path())) {
    expected.push_back(entry.path().filename());
  }
  std::sort(expected.begin(), expected.end());
  std::string error = "unset";
  EXPECT_EQ(detail::directoryNames(dir_.path(), &error), expected);
  EXPECT_EQ(error, "unset");  // untouched on success
  EXPECT_TRUE(detail::directoryNames(dir_.file("nothing"), &error).empty());
  EXPECT_EQ(error, "No such file or directory");
  EXPECT_TRUE(detail::directoryNames(dir_.file("file"), &error).empty());
  EXPECT_EQ(error, "Not a directory");
}

TEST_F(FileSystemTreeTest, CreateDirectoriesMakesEveryMissingLevel) {
  std::string error;
  EXPECT_TRUE(detail::createDirectories(dir_.file("a/b/c"), &error)) << error;
  EXPECT_TRUE(fs::is_directory(dir_.file("a/b/c")));
  EXPECT_TRUE(detail::createDirectories(dir_.file("a/b/c/"), &error)) << error;  // exists
  EXPECT_TRUE(detail::createDirectories(dir_.file("link/x"), &error)) << error;  // through a link
  EXPECT_TRUE(fs::is_directory(dir_.file("folder/x")));
  EXPECT_FALSE(detail::createDirectories(dir_.file("file/x"), &error));
  EXPECT_EQ(error, "Not a directory");
  EXPECT_FALSE(detail::createDirectories(dir_.file("file"), &error));
  EXPECT_EQ(error, "Not a directory");
  EXPECT_FALSE(detail::createDirectories("", &error));
}

TEST_F(FileSystemTreeTest, RemovePathRemovesFilesLinksAndEmptyFoldersOnly) {
  ASSERT_TRUE(detail::createDirectories(dir_.file("full/inner"), nullptr));
  EXPECT_FALSE(detail::removePath(dir_.file("full")));  // not empty
  EXPECT_TRUE(detail::removePath(dir_.file("full/inner")));
  EXPECT_TRUE(detail::removePath(dir_.file("link")));  // the link, not the folder
  EXPECT_TRUE(fs::is_directory(dir_.file("folder")));
  EXPECT_TRUE(detail::removePath(dir_.file("file")));
  EXPECT_FALSE(fs::exists(dir_.file("file")));
  EXPECT_FALSE(detail::removePath(dir_.file("file")));
}

TEST_F(FileSystemTreeTest, WeaklyCanonicalIsStdsWithoutATrailingSeparator) {
  const std::string cwd = fs::current_path();
  ASSERT_EQ(::chdir(dir_.path().c_str()), 0);
  for (const std::string& path :
       {dir_.file("link/../file"), dir_.file("link/x/../y/"), dir_.file("missing/../folder"),
        dir_.file("folder/./a/b/.."), std::string("link/new"), std::string("./file"),
        std::string("../") + fs::path(dir_.path()).filename().string() + "/link", dir_.path()}) {
    const std::string expected =
        withoutTrailingSeparator(fs::weakly_canonical(fs::absolute(path)).string());
    EXPECT_EQ(detail::weaklyCanonical(path), expected) << path;
  }
  ASSERT_EQ(::chdir(cwd.c_str()), 0);
}

}  // namespace
}  // namespace shardema
