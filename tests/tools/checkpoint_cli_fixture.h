#pragma once
// For the export/inspect CLI tests: runs the real `shardema` binary, and
// writes a per-rank checkpoint folder by hand from the documented format
// (DESIGN.md section 5, rank_manifest.h, ShardLayout::toJson's canonical form)
// with core pieces only, so the CLI is checked against the contract rather
// than against the code that writes it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardema/core/checksum.h"
#include "shardema/core/decay_schedule.h"
#include "shardema/core/tensor_file.h"
#include "shardema/core/tensor_file_reader.h"
#include "support/file_bytes.h"
#include "tools/cli_run.h"

namespace shardema::testing {

inline size_t countLines(const std::string& text) {
  size_t lines = 0;
  for (char c : text) lines += c == '\n';
  return lines;
}

/// The toy checkpoint: "w" [3, 2] and "b" [3] over 2 ranks (FSDP2 rows:
/// w rows 0-1 | 2, b elements 0-1 | 2), values w = 0..5, b = 10..12.
struct HandCheckpoint {
  static at::Tensor fullW() { return at::arange(6, at::kFloat).reshape({3, 2}); }
  static at::Tensor fullB() { return at::arange(10, 13, at::kFloat); }

  static std::string layoutJson() {
    return R"({"format":1,"world_size":2,"tensors":[)"
           R"({"name":"w","kind":"fsdp2","dtype":"F32","shape":[3,2],"ranges":[[0,4],[4,6]]},)"
           R"({"name":"b","kind":"fsdp2","dtype":"F32","shape":[3],"ranges":[[0,2],[2,3]]}]})";
  }

  /// The per-save names a save writes: rank_XXXXX.step_S.ID.safetensors.
  static std::string name(int r) {
    return "rank_0000" + std::to_string(r) + ".step_42.00000000000000a1.safetensors";
  }

  /// Writes dir/name(0), dir/name(1) and dir/manifest.json at step 42.
  static void write(const std::string& dir) {
    std::filesystem::create_directories(dir);
    const std::string schedule = DecaySchedule::warmup().toJson();
    const std::string fingerprint = checksumHex(xxh64(layoutJson().data(), layoutJson().size()));
    nlohmann::json files = nlohmann::json::array();
    const std::vector<std::pair<int64_t, int64_t>> w = {{0, 4}, {4, 6}}, b = {{0, 2}, {2, 3}};
    for (int r = 0; r < 2; ++r) {
      TensorFile file;
      file.tensors = {{"w", fullW().reshape({-1}).slice(0, w[r].first, w[r].second)},
                      {"b", fullB().slice(0, b[r].first, b[r].second)}};
      // The Averager state's keys (docs/files.md), which inspect checks as
      // Averager::load does, plus the rank's.
      file.metadata = {{"shardema.kind", "averager_state"},
                       {"shardema.step", "42"},
                       {"shardema.schedule", schedule},
                       {"shardema.initialized", "true"},
                       {"shardema.last_decay", "0.90000000000000002"},
                       {"shardema.roles", R"({"w":"average","b":"average"})"},
                       {"shardema.rank", std::to_string(r)},
                       {"shardema.world_size", "2"},
                       {"shardema.layout_fingerprint", fingerprint}};
      const std::string name = HandCheckpoint::name(r);
      writeTensorFile(dir + "/" + name, file);
      files.push_back({{"rank", r},
                       {"name", name},
                       {"size", std::filesystem::file_size(dir + "/" + name)},
                       {"xxh64", checksumHex(fileChecksum(dir + "/" + name))}});
    }
    const nlohmann::json manifest = {{"format", 1},
                                     {"kind", "sharded_averager_state"},
                                     {"step", 42},
                                     {"schedule", nlohmann::json::parse(schedule)},
                                     {"world_size", 2},
                                     {"layout", nlohmann::json::parse(layoutJson())},
                                     {"layout_fingerprint", fingerprint},
                                     {"files", files}};
    writeFileBytes(dir + "/manifest.json", manifest.dump(2));
  }
};

/// The issue's tampering: XORs the first data byte of `tensor` in dir's rank
/// r file with 0xff (7.0f would read 7.0001216f), then writes the file's new
/// size and XXH64 into the manifest, so the file-level check passes and only
/// the tensor's own checksum can catch it. Returns the rank file's path.
inline std::string flipDataByteUnderAReSignedManifest(const std::string& dir, int r,
                                                      const std::string& tensor) {
  auto manifest = nlohmann::json::parse(readFileBytes(dir + "/manifest.json"));
  const std::string path = dir + "/" + manifest["files"][r]["name"].get<std::string>();
  std::string bytes = readFileBytes(path);
  {
    const TensorFileReader reader(path);
    bytes[reader.header().dataOffset + reader.entry(tensor).begin] ^= static_cast<char>(0xff);
  }
  writeFileBytes(path, bytes);
  manifest["files"][r]["size"] = std::filesystem::file_size(path);
  manifest["files"][r]["xxh64"] = checksumHex(fileChecksum(path));
  writeFileBytes(dir + "/manifest.json", manifest.dump(2));
  return path;
}

/// dir's rank r file as its manifest names it.
inline std::string rankFileIn(const std::string& dir, int r) {
  const auto manifest = nlohmann::json::parse(readFileBytes(dir + "/manifest.json"));
  return dir + "/" + manifest["files"][r]["name"].get<std::string>();
}

}  // namespace shardema::testing
