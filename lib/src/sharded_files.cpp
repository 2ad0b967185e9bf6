// File helpers of the per-rank checkpoints and exports. Kept apart from the
// Averager code so the offline tools (and the CLI) link without it.
#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>

#include "sharded_internal.h"
#include "shardema/core/file_metadata.h"
#include "shardema/core/file_system.h"
#include "shardema/detail/rank_manifest.h"

namespace shardema {
namespace detail {

std::string joinPath(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

void ensureDirectory(const std::string& dir, const char* api) {
  std::string error;
  TORCH_CHECK(createDirectories(dir, &error), api, ": cannot create the folder ", dir, " (", error,
              ")");
}

void checkExportDestination(const std::string& path, const char* api) {
  const std::string folder = parentPath(absolutePath(path));
  const bool inCheckpoint = isRegularFile(joinPath(folder, kManifestFileName));
  TORCH_CHECK_VALUE(!inCheckpoint, api, ": ", path, " is inside the checkpoint folder ", folder,
                    " (it holds ", kManifestFileName,
                    "): exporting there would replace the checkpoint's files; export elsewhere");
}

std::string currentErrorMessage() {
  try {
    throw;
  } catch (const c10::Error& error) {
    return error.what_without_backtrace();
  } catch (const std::exception& error) {
    return error.what();
  } catch (...) {
    return "unknown exception";
  }
}

std::string errorMessage(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (...) {
    return currentErrorMessage();
  }
}

std::map<std::string, std::string> rankMetadata(std::map<std::string, std::string> metadata,
                                                int64_t rank, const shard::ShardLayout& layout) {
  metadata[kRankKey] = std::to_string(rank);
  metadata[kWorldSizeKey] = std::to_string(layout.worldSize());
  metadata[kLayoutFingerprintKey] = layout.fingerprint();
  return metadata;
}

namespace {

void checkKey(const std::string& path, const std::map<std::string, std::string>& metadata,
              const char* key, const std::string& expected) {
  const auto it = metadata.find(key);
  TORCH_CHECK_VALUE(it != metadata.end() && it->second == expected, path, ": ", key, " is '",
                    it == metadata.end() ? std::string("absent") : it->second,
                    "' but the manifest records '", expected, "'");
}

}  // namespace

void checkRankMetadata(const std::string& path, const std::map<std::string, std::string>& metadata,
                       int64_t rank, int64_t worldSize, const std::string& layoutFingerprint,
                       int64_t step) {
  checkKey(path, metadata, kRankKey, std::to_string(rank));
  checkKey(path, metadata, kWorldSizeKey, std::to_string(worldSize));
  checkKey(path, metadata, kLayoutFingerprintKey, layoutFingerprint);
  checkKey(path, metadata, kStepKey, std::to_string(step));
}

void checkExportDtype(c10::ScalarType dtype, const char* api) {
  TORCH_CHECK_VALUE(dtype == c10::kFloat || dtype == c10::kBFloat16 || dtype == c10::kHalf, api,
                    ": export dtype must be float32, bfloat16 or float16, got ", dtype);
}

c10::ScalarType exportedDtype(c10::ScalarType stored, c10::ScalarType dtype) {
  return c10::isFloatingType(stored) ? dtype : stored;
}

std::map<std::string, std::string> exportedMetadata(int64_t step, const DecaySchedule& schedule,
                                                    int64_t sourceWorldSize) {
  DeployableInfo info;
  info.step = step;
  info.exported = DeployableInfo::Exported{schedule.toJson(), sourceWorldSize};
  return deployableMetadata(info);
}

at::Tensor rangeOfHeld(const shard::ShardSpec& spec, int64_t rank, const at::Tensor& held) {
  const shard::ElementRange range = spec.rangeOf(rank);
  const int64_t begin = range.begin - spec.heldRange(rank).begin;
  return range.size() == held.numel() ? held : held.narrow(0, begin, range.size());
}

int64_t elementsPerPiece(int64_t bufferBytes, c10::ScalarType dtype) {
  return std::max<int64_t>(1, bufferBytes / static_cast<int64_t>(c10::elementSize(dtype)));
}

}  // namespace detail
}  // namespace shardema
