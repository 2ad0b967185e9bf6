#include "shardema/core/atomic_file.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
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

TEST(AtomicFileWriterTest, FinishKeepsTheTempNameUntilCommit) {
  testing::TempDir dir;
  const std::string path = dir.file("a.bin");
  testing::writeFileBytes(path, "old content");
  {
    AtomicFileWriter writer(path);
    writer.write("new", 3);
    writer.finish();
    EXPECT_EQ(testing::readFileBytes(path + ".tmp"), "new");  // durable, not published
    EXPECT_EQ(testing::readFileBytes(path), "old content");
    EXPECT_THROW(writer.write("x", 1), c10::Error);
    EXPECT_THROW(writer.finish(), c10::Error);
    writer.commit();
  }
  EXPECT_EQ(testing::readFileBytes(path), "new");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  {
    AtomicFileWriter writer(path);  // finished, never committed: discarded
    writer.write("lost", 4);
    writer.finish();
  }
  EXPECT_EQ(testing::readFileBytes(path), "new");
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
  // The temp file vanishes before commit (someone cleaned the folder):
  // the rename fails and the old target stays as it was.
  const std::string path = dir.file("target");
  std::ofstream(path) << "old";
  {
    AtomicFileWriter writer(path);
    writer.write("x", 1);
    ASSERT_EQ(::unlink((path + ".tmp").c_str()), 0);
    try {
      writer.commit();
      ADD_FAILURE() << "rename of a missing temp file succeeded";
    } catch (const c10::Error& error) {
      EXPECT_NE(error.msg().find(path), std::string::npos) << error.msg();
      EXPECT_NE(error.msg().find("rename"), std::string::npos) << error.msg();
    }
  }
  EXPECT_EQ(testing::readFileBytes(path), "old");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

// What rename() would replace without a word: a folder, a FIFO, a device
// node, a symbolic link. Each is refused before anything is written, and
// stays as it was.
TEST(AtomicFileWriterTest, RefusesToReplaceAnythingButARegularFile) {
  testing::TempDir dir;
  const std::string folder = dir.file("folder");
  fs::create_directories(folder + "/child");
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string link = dir.file("link");
  std::ofstream(dir.file("real")) << "real";
  fs::create_symlink(dir.file("real"), link);
  const std::pair<std::string, std::string> cases[] = {
      {folder, "a folder"}, {fifo, "a FIFO"}, {link, "a symbolic link"}, {"/dev/null", "a device"}};
  for (const auto& [path, kind] : cases) {
    try {
      AtomicFileWriter writer(path);
      ADD_FAILURE() << path << " was accepted as an output";
    } catch (const c10::ValueError& error) {
      EXPECT_NE(error.msg().find(path + ": the output exists and is " + kind), std::string::npos)
          << error.msg();
    }
    EXPECT_FALSE(fs::exists(path + ".tmp")) << path;
  }
  EXPECT_TRUE(fs::is_directory(folder + "/child"));
  EXPECT_TRUE(fs::is_fifo(fifo));
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
}

TEST(AtomicFileWriterTest, ATargetThatBecomesAFolderBeforeCommitIsNotReplaced) {
  testing::TempDir dir;
  const std::string path = dir.file("target");
  AtomicFileWriter writer(path);
  writer.write("x", 1);
  fs::create_directories(path + "/child");
  EXPECT_THROW(writer.commit(), c10::ValueError);
  EXPECT_TRUE(fs::is_directory(path + "/child"));
}

TEST(AtomicFileWriterTest, AFifoUnderTheTempNameIsRefusedWithoutBlocking) {
  testing::TempDir dir;
  const std::string path = dir.file("out.safetensors");
  ASSERT_EQ(::mkfifo((path + ".tmp").c_str(), 0600), 0);
  try {
    AtomicFileWriter writer(path);
    ADD_FAILURE() << "a FIFO temp file was opened";
  } catch (const c10::ValueError& error) {
    EXPECT_NE(error.msg().find("the temporary file exists and is a FIFO"), std::string::npos)
        << error.msg();
  }
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
