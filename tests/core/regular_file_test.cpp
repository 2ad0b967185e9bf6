#include "shardema/core/regular_file.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <string>

#include "shardema/core/checksum.h"
#include "shardema/core/tensor_file.h"
#include "shardema/core/tensor_file_reader.h"
#include "support/temp_dir.h"

namespace shardema {
namespace {

// Runs `read` on another thread and returns its error message. A reader
// that blocks in open() on the FIFO (the defect) is released by opening the
// FIFO's write end, so the test fails instead of hanging the suite.
std::string errorWithin(const std::string& fifo, const std::function<void()>& read) {
  auto done = std::async(std::launch::async, [&]() -> std::string {
    try {
      read();
    } catch (const c10::ValueError& e) {
      return e.what_without_backtrace();
    } catch (const std::exception& e) {
      return std::string("wrong exception type: ") + e.what();
    }
    return "no error";
  });
  if (done.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    const int writer = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    done.wait();
    if (writer >= 0) ::close(writer);
    return "blocked on the FIFO for 5 s";
  }
  return done.get();
}

class RegularFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    fifo_ = dir_.file("x.safetensors");
    ASSERT_EQ(::mkfifo(fifo_.c_str(), 0600), 0);
  }
  void expectRefused(const std::function<void()>& read) {
    const std::string message = errorWithin(fifo_, read);
    EXPECT_NE(message.find(fifo_), std::string::npos) << message;
    EXPECT_NE(message.find("not a regular file (a FIFO)"), std::string::npos) << message;
  }
  testing::TempDir dir_;
  std::string fifo_;
};

TEST_F(RegularFileTest, EveryReaderRefusesAFifoWithoutBlocking) {
  expectRefused([&] { readTensorFile(fifo_); });
  expectRefused([&] { readTensorFileHeader(fifo_); });
  expectRefused([&] { TensorFileReader reader(fifo_); });
  expectRefused([&] { fileChecksum(fifo_); });
  expectRefused([&] { detail::readSmallRegularFile(fifo_, "manifest", 1 << 20); });
}

TEST_F(RegularFileTest, AFolderIsRefusedByName) {
  try {
    readTensorFile(dir_.path());
    FAIL() << "a folder was read";
  } catch (const c10::ValueError& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("not a regular file (a folder)"), std::string::npos) << message;
  }
}

TEST_F(RegularFileTest, ASmallFileIsReadWholeAndALargeOneRefusedBeforeReading) {
  const std::string path = dir_.file("manifest.json");
  std::ofstream(path) << "{\"step\": 3}";
  EXPECT_EQ(detail::readSmallRegularFile(path, "manifest", 11), "{\"step\": 3}");
  try {
    detail::readSmallRegularFile(path, "manifest", 10);
    FAIL() << "an 11-byte file passed a 10-byte bound";
  } catch (const c10::ValueError& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find(path + ": the manifest is 11 bytes, more than the 10"),
              std::string::npos)
        << message;
  }
}

TEST_F(RegularFileTest, ARegularFileStillLoads) {
  const std::string path = dir_.file("ok.safetensors");
  TensorFile file;
  file.tensors.emplace_back("w", at::arange(6, at::kFloat));
  writeTensorFile(path, file);
  const TensorFile back = readTensorFile(path);
  ASSERT_EQ(back.tensors.size(), 1u);
  EXPECT_TRUE(at::equal(back.tensors[0].second, at::arange(6, at::kFloat)));
  // The streamed file checksum equals the one-shot digest of its bytes.
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(fileChecksum(path), xxh64(bytes.data(), bytes.size()));
}

}  // namespace
}  // namespace shardema
