// The hostile-file corpus (tests/tools/hostile_files.py): damaged copies of
// a good tensor file and of a good per-rank checkpoint folder (truncated,
// bit-flipped, oversized headers, wrong offsets, dtype edits, manifest
// edits, paths outside the folder, FIFOs, symlinks and loops) each make
// `shardema inspect` and `shardema export` exit 2 with one line naming
// the file, under a timeout: no crash, no hang.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "support/temp_dir.h"
#include "tools/checkpoint_cli_fixture.h"

namespace shardema {
namespace {

TEST(HostileFilesTest, EveryDamagedFileIsOneLineExitTwo) {
  testing::TempDir dir;
  TensorFile good;
  good.tensors = {{"enc.weight", at::arange(48, at::kFloat).reshape({6, 8})},
                  {"enc.bias", at::arange(6, at::kBFloat16)},
                  {"steps", at::full({1}, 7, at::kLong)}};
  good.metadata = {{"shardema.kind", "averager_state"}, {"shardema.step", "7"}};
  writeTensorFile(dir.file("good.safetensors"), good);
  testing::HandCheckpoint::write(dir.file("good_ckpt"));
  const std::string command = std::string(SHARDEMA_TEST_PYTHON) + " " + SHARDEMA_TEST_SOURCE_DIR +
                              "/tools/hostile_files.py --cli " + SHARDEMA_CLI_PATH + " --file " +
                              dir.file("good.safetensors") + " --checkpoint " +
                              dir.file("good_ckpt") + " --work " + dir.path() + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buffer[4096];
  for (size_t got; (got = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) out.append(buffer, got);
  EXPECT_EQ(::pclose(pipe), 0) << out;
  EXPECT_NE(out.find(" 0 failed"), std::string::npos) << out;
}

}  // namespace
}  // namespace shardema
