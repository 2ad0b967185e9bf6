#include "shardema/atomic_file.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace shardema {
namespace {

namespace fs = std::filesystem;

// A fresh folder per test, removed afterwards.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / ("shardema_" + std::string(test->test_suite_name()) + "_" +
                                         test->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  std::string file(const std::string& leaf) const { return (path_ / leaf).string(); }

 private:
  fs::path path_;
};

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

void put(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

TEST(AtomicFileWriterTest, CommitReplacesContent) {
  ScratchDir dir;
  const std::string path = dir.file("a.bin");
  put(path, "old content");
  {
    AtomicFileWriter writer(path);
    writer.write("new ", 4);
    writer.write("bytes", 5);
    EXPECT_EQ(writer.size(), 9u);
    EXPECT_EQ(contents(path), "old content");  // untouched until commit
    writer.commit();
  }
  EXPECT_EQ(contents(path), "new bytes");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(AtomicFileWriterTest, DestroyWithoutCommitKeepsOldFileAndRemovesTmp) {
  ScratchDir dir;
  const std::string path = dir.file("a.bin");
  put(path, "old content");
  {
    AtomicFileWriter writer(path);
    writer.write("partial", 7);
    EXPECT_TRUE(fs::exists(path + ".tmp"));
  }
  EXPECT_EQ(contents(path), "old content");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(AtomicFileWriterTest, DestroyWithoutCommitCreatesNothing) {
  ScratchDir dir;
  const std::string path = dir.file("new.bin");
  { AtomicFileWriter writer(path); }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(AtomicFileWriterTest, ExceptionMidWriteKeepsOldFile) {
  ScratchDir dir;
  const std::string path = dir.file("a.bin");
  put(path, "old content");
  try {
    AtomicFileWriter writer(path);
    writer.write("half", 4);
    throw std::runtime_error("producer failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(contents(path), "old content");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(AtomicFileWriterTest, WritesLargeBuffersAndEmptyFiles) {
  ScratchDir dir;
  std::vector<char> big(3 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 31 + 7);
  writeFileAtomically(dir.file("big.bin"), big.data(), big.size());
  EXPECT_EQ(contents(dir.file("big.bin")), std::string(big.begin(), big.end()));
  writeFileAtomically(dir.file("empty.bin"), nullptr, 0);
  EXPECT_TRUE(fs::exists(dir.file("empty.bin")));
  EXPECT_EQ(fs::file_size(dir.file("empty.bin")), 0u);
}

TEST(AtomicFileWriterTest, MissingFolderErrorNamesPathAndReason) {
  ScratchDir dir;
  const std::string path = dir.file("no_such_folder/a.bin");
  try {
    AtomicFileWriter writer(path);
    ADD_FAILURE() << "opened a file in a missing folder";
  } catch (const c10::Error& error) {
    EXPECT_NE(error.msg().find(path), std::string::npos) << error.msg();
    EXPECT_NE(error.msg().find("No such file or directory"), std::string::npos) << error.msg();
  }
}

TEST(AtomicFileWriterTest, CommitTwiceAndWriteAfterCommitThrow) {
  ScratchDir dir;
  AtomicFileWriter writer(dir.file("a.bin"));
  writer.commit();
  EXPECT_THROW(writer.commit(), c10::Error);
  EXPECT_THROW(writer.write("x", 1), c10::Error);
  EXPECT_TRUE(fs::exists(dir.file("a.bin")));
}

TEST(AtomicFileWriterTest, RenameFailureKeepsTargetAndRemovesTmp) {
  ScratchDir dir;
  // A non-empty folder cannot be replaced by rename(): commit must fail.
  const std::string path = dir.file("target");
  fs::create_directories(path + "/child");
  {
    AtomicFileWriter writer(path);
    writer.write("x", 1);
    try {
      writer.commit();
      ADD_FAILURE() << "rename over a non-empty folder succeeded";
    } catch (const c10::Error& error) {
      EXPECT_NE(error.msg().find(path), std::string::npos) << error.msg();
      EXPECT_NE(error.msg().find("rename"), std::string::npos) << error.msg();
    }
  }
  EXPECT_TRUE(fs::is_directory(path + "/child"));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(AtomicFileWriterTest, MoveTransfersTheTempFile) {
  ScratchDir dir;
  const std::string path = dir.file("a.bin");
  AtomicFileWriter first(path);
  first.write("abc", 3);
  AtomicFileWriter second(std::move(first));
  second.write("d", 1);
  EXPECT_EQ(second.size(), 4u);
  EXPECT_THROW(first.write("x", 1), c10::Error);  // NOLINT(bugprone-use-after-move)
  second.commit();
  EXPECT_EQ(contents(path), "abcd");
}

TEST(AtomicFileWriterTest, RelativePathCommitsInCurrentFolder) {
  ScratchDir dir;
  const fs::path previous = fs::current_path();
  fs::current_path(fs::path(dir.file("")));
  writeFileAtomically("rel.bin", "xyz", 3);
  fs::current_path(previous);
  EXPECT_EQ(contents(dir.file("rel.bin")), "xyz");
}

}  // namespace
}  // namespace shardema
