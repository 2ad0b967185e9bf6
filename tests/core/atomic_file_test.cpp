#include "shardema/detail/atomic_file.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "support/file_bytes.h"
#include "support/temp_dir.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;

TEST(AtomicFileWriterTest, CommitReplacesContent) {
  testing::TempDir dir;
  const std::string path = dir.file("a.bin");
  testing::writeFileBytes(path, "old content");
  {
    AtomicFileWriter writer(path);
    writer.write("new ", 4);
    writer.write("bytes", 5);
    EXPECT_EQ(writer.size(), 9u);
    EXPECT_EQ(testing::readFileBytes(path), "old content");  // untouched until commit
    writer.commit();
  }
  EXPECT_EQ(testing::readFileBytes(path), "new bytes");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(AtomicFileWriterTest, DestroyWithoutCommitKeepsOldFileAndRemovesTmp) {
  testing::TempDir dir;
  const std::string path = dir.file("a.bin");
  testing::writeFileBytes(path, "old content");
  {
    AtomicFileWriter writer(path);
    writer.write("partial", 7);
    EXPECT_TRUE(fs::exists(path + ".tmp"));
  }
  EXPECT_EQ(testing::readFileBytes(path), "old content");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(AtomicFileWriterTest, DestroyWithoutCommitCreatesNothing) {
  testing::TempDir dir;
  const std::string path = dir.file("new.bin");
  { AtomicFileWriter writer(path); }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(AtomicFileWriterTest, ExceptionMidWriteKeepsOldFile) {
  testing::TempDir dir;
  const std::string path = dir.file("a.bin");
  testing::writeFileBytes(path, "old content");
  try {
    AtomicFileWriter writer(path);
    writer.write("half", 4);
    throw std::runtime_error("producer failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(testing::readFileBytes(path), "old content");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(AtomicFileWriterTest, WritesLargeBuffersAndEmptyFiles) {
  testing::TempDir dir;
  std::vector<char> big(3 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 31 + 7);
  writeFileAtomically(dir.file("big.bin"), big.data(), big.size());
  EXPECT_EQ(testing::readFileBytes(dir.file("big.bin")), std::string(big.begin(), big.end()));
  writeFileAtomically(dir.file("empty.bin"), nullptr, 0);
  EXPECT_TRUE(fs::exists(dir.file("empty.bin")));
  EXPECT_EQ(fs::file_size(dir.file("empty.bin")), 0u);
}

TEST(AtomicFileWriterTest, MissingFolderErrorNamesPathAndReason) {
  testing::TempDir dir;
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
  testing::TempDir dir;
  AtomicFileWriter writer(dir.file("a.bin"));
  writer.commit();
  EXPECT_THROW(writer.commit(), c10::Error);
  EXPECT_THROW(writer.write("x", 1), c10::Error);
  EXPECT_TRUE(fs::exists(dir.file("a.bin")));
}

TEST(AtomicFileWriterTest, RenameFailureKeepsTargetAndRemovesTmp) {
  testing::TempDir dir;
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
  testing::TempDir dir;
  const std::string path = dir.file("a.bin");
  AtomicFileWriter first(path);
  first.write("abc", 3);
  AtomicFileWriter second(std::move(first));
  second.write("d", 1);
  EXPECT_EQ(second.size(), 4u);
  EXPECT_THROW(first.write("x", 1), c10::Error);  // NOLINT(bugprone-use-after-move)
  second.commit();
  EXPECT_EQ(testing::readFileBytes(path), "abcd");
}

TEST(AtomicFileWriterTest, RelativePathCommitsInCurrentFolder) {
  testing::TempDir dir;
  const fs::path previous = fs::current_path();
  fs::current_path(fs::path(dir.file("")));
  writeFileAtomically("rel.bin", "xyz", 3);
  fs::current_path(previous);
  EXPECT_EQ(testing::readFileBytes(dir.file("rel.bin")), "xyz");
}

}  // namespace
}  // namespace shardema
