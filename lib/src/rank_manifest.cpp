#include "shardema/detail/rank_manifest.h"

#include <c10/util/Exception.h>
#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <unordered_set>

#include "shardema/core/atomic_file.h"
#include "shardema/core/checksum.h"
#include "shardema/core/file_system.h"
#include "shardema/core/regular_file.h"

namespace shardema {
namespace {

using nlohmann::json;

std::string joinPath(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

const json& field(const json& object, const char* key, json::value_t type,
                  const std::string& source) {
  const auto it = object.find(key);
  TORCH_CHECK_VALUE(it != object.end(), source, ": key '", key, "' is missing");
  const bool numberOk = type == json::value_t::number_unsigned &&
                        it->type() == json::value_t::number_integer && it->get<int64_t>() >= 0;
  const bool negative = it->type() == json::value_t::number_integer && it->get<int64_t>() < 0;
  TORCH_CHECK_VALUE(type != json::value_t::number_unsigned || !negative, source, ": key '", key,
                    "' is ", it->dump(), ", a negative number; it must be an integer >= 0");
  TORCH_CHECK_VALUE(it->type() == type || numberOk, source, ": key '", key, "' has type ",
                    it->type_name());
  return *it;
}

// A non-negative integer that fits int64_t: JSON numbers above INT64_MAX
// parse as unsigned and would wrap negative in get<int64_t>().
int64_t int64Field(const json& object, const char* key, const std::string& source) {
  const json& value = field(object, key, json::value_t::number_unsigned, source);
  TORCH_CHECK_VALUE(
      value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), source,
      ": key '", key, "' is ", value.dump(), ", above ", std::numeric_limits<int64_t>::max());
  return value.get<int64_t>();
}

RankFileRecord recordFromJson(const json& entry, int64_t rank, const std::string& source) {
  const std::string where = source + ": files[" + std::to_string(rank) + "]";
  TORCH_CHECK_VALUE(entry.is_object(), where, " is not an object");
  RankFileRecord record;
  record.rank = int64Field(entry, "rank", where);
  record.name = field(entry, "name", json::value_t::string, where).get<std::string>();
  record.size = field(entry, "size", json::value_t::number_unsigned, where).get<uint64_t>();
  try {
    record.checksum =
        parseChecksumHex(field(entry, "xxh64", json::value_t::string, where).get<std::string>());
  } catch (const c10::ValueError& error) {
    TORCH_CHECK_VALUE(false, where, ": ", error.what_without_backtrace());
  }
  TORCH_CHECK_VALUE(record.rank == rank && isRankFileName(record.name, rank), where,
                    " must be rank ", rank, " named rank_", rankFileName(rank).substr(5, 5),
                    "[.SAVE].safetensors (a plain name), found rank ", record.rank, " named '",
                    record.name, "'");
  return record;
}

// A manifest lists one small record per rank file and the layout (a few
// hundred bytes per tensor): 64 MiB is far above any real one, and bounds
// what a hostile one makes us allocate and parse (a 300 MiB one took 1.4 GB).
constexpr uint64_t kMaxManifestBytes = uint64_t{64} << 20;

std::string readWholeFile(const std::string& path) {
  return detail::readSmallRegularFile(path, "manifest", kMaxManifestBytes);
}

// "non_persistent": [names of layout tensors], absent when there are none.
std::set<std::string> nonPersistentFromJson(const json& root, const shard::ShardLayout& layout,
                                            const std::string& source) {
  std::set<std::string> out;
  if (!root.contains("non_persistent")) return out;
  const json& names = field(root, "non_persistent", json::value_t::array, source);
  std::unordered_set<std::string> tensors;
  for (const shard::ShardSpec& spec : layout.specs) tensors.insert(spec.name);
  for (const json& name : names) {
    TORCH_CHECK_VALUE(name.is_string() && tensors.count(name.get<std::string>()), source,
                      ": non_persistent holds ", name.dump(), ", which is no tensor of the layout");
    out.insert(name.get<std::string>());
  }
  return out;
}

// "aliases": {name: [other names]}, absent in manifests without tied tensors.
std::map<std::string, std::vector<std::string>> aliasesFromJson(const json& root,
                                                                const std::string& source) {
  std::map<std::string, std::vector<std::string>> out;
  if (!root.contains("aliases")) return out;
  const json& aliases = field(root, "aliases", json::value_t::object, source);
  for (const auto& [name, names] : aliases.items()) {
    TORCH_CHECK_VALUE(names.is_array(), source, ": aliases of '", name, "' is ", names.dump(),
                      ", not a list of names");
    for (const json& alias : names) {
      TORCH_CHECK_VALUE(alias.is_string(), source, ": aliases of '", name, "' holds ", alias.dump(),
                        ", not a name");
      out[name].push_back(alias.get<std::string>());
    }
  }
  return out;
}

bool endsWith(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::string rankFileName(int64_t rank) {
  char name[48];
  std::snprintf(name, sizeof(name), "rank_%05lld.safetensors", static_cast<long long>(rank));
  return name;
}

std::string rankFileName(int64_t rank, int64_t step, uint64_t saveId) {
  char name[96];
  std::snprintf(name, sizeof(name), "rank_%05lld.step_%lld.%016llx.safetensors",
                static_cast<long long>(rank), static_cast<long long>(step),
                static_cast<unsigned long long>(saveId));
  return name;
}

uint64_t newSaveId() {
  // random_device alone may be deterministic on some platforms; the clock
  // keeps two saves of one process apart anyway.
  std::random_device device;
  const uint64_t clock =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  std::mt19937_64 mix((static_cast<uint64_t>(device()) << 32) ^ device() ^ clock);
  return mix();
}

bool isRankFileName(const std::string& name, int64_t rank) {
  const std::string exact = rankFileName(rank);  // rank_XXXXX.safetensors
  const std::string prefix = exact.substr(0, exact.size() - std::strlen("safetensors"));
  if (name == exact) return true;
  return name.size() > prefix.size() + std::strlen(".safetensors") &&
         name.compare(0, prefix.size(), prefix) == 0 && endsWith(name, ".safetensors") &&
         name.find('/') == std::string::npos && name.find("..") == std::string::npos &&
         name.find('\0') == std::string::npos;
}

void removeUnreferencedRankFiles(const std::string& dir, const RankManifest& manifest) {
  std::unordered_set<std::string> keep;
  for (const RankFileRecord& record : manifest.files) keep.insert(record.name);
  for (const std::string& name : detail::directoryNames(dir, nullptr)) {
    const bool ours =
        name.rfind("rank_", 0) == 0 && (endsWith(name, ".safetensors") || endsWith(name, ".tmp"));
    if (ours && keep.count(name) == 0) detail::removePath(joinPath(dir, name));
  }
}

void checkTensorAliases(const shard::ShardLayout& layout,
                        const std::map<std::string, std::vector<std::string>>& aliases,
                        const std::string& source) {
  std::unordered_set<std::string> names;
  for (const shard::ShardSpec& spec : layout.specs) names.insert(spec.name);
  std::unordered_set<std::string> taken = names;
  for (const auto& [name, others] : aliases) {
    TORCH_CHECK_VALUE(names.count(name), source, ": aliases are given for '", name,
                      "', which is no tensor of the layout");
    for (const std::string& alias : others) {
      TORCH_CHECK_VALUE(!alias.empty(), source, ": an alias of '", name, "' is empty");
      TORCH_CHECK_VALUE(taken.insert(alias).second, source, ": '", alias, "', an alias of '", name,
                        "', is already the name of a tensor or of another alias");
    }
  }
}

std::string RankManifest::toJson() const {
  json files = json::array();
  for (const RankFileRecord& record : this->files) {
    files.push_back({{"rank", record.rank},
                     {"name", record.name},
                     {"size", record.size},
                     {"xxh64", checksumHex(record.checksum)}});
  }
  json root = {{"format", 1},
               {"kind", kShardedStateKind},
               {"step", step},
               {"schedule", json::parse(schedule.toJson())},
               {"world_size", worldSize()},
               {"layout", json::parse(layout.toJson())},
               {"layout_fingerprint", layout.fingerprint()},
               {"files", files}};
  if (!aliases.empty()) root["aliases"] = aliases;
  if (!nonPersistent.empty()) root["non_persistent"] = nonPersistent;
  return root.dump(2) + "\n";
}

RankManifest RankManifest::fromJson(const std::string& text, const std::string& source) {
  const json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK_VALUE(root.is_object(), source, ": not a JSON object (corrupt or truncated)");
  TORCH_CHECK_VALUE(field(root, "format", json::value_t::number_unsigned, source) == 1, source,
                    ": format must be 1, found ", root["format"].dump());
  TORCH_CHECK_VALUE(field(root, "kind", json::value_t::string, source) == kShardedStateKind, source,
                    ": kind must be '", kShardedStateKind, "', found ", root["kind"].dump());
  RankManifest manifest;
  manifest.step = int64Field(root, "step", source);
  try {
    manifest.schedule =
        DecaySchedule::fromJson(field(root, "schedule", json::value_t::object, source).dump());
    manifest.layout =
        shard::ShardLayout::fromJson(field(root, "layout", json::value_t::object, source).dump());
  } catch (const c10::ValueError& error) {
    TORCH_CHECK_VALUE(false, source, ": ", error.what_without_backtrace());
  }
  const std::string fingerprint =
      field(root, "layout_fingerprint", json::value_t::string, source).get<std::string>();
  TORCH_CHECK_VALUE(fingerprint == manifest.layout.fingerprint(), source, ": layout_fingerprint ",
                    fingerprint, " does not match its layout (", manifest.layout.fingerprint(),
                    ")");
  const json& files = field(root, "files", json::value_t::array, source);
  const int64_t worldSize = int64Field(root, "world_size", source);
  TORCH_CHECK_VALUE(worldSize >= 1 && static_cast<int64_t>(files.size()) == worldSize &&
                        (manifest.layout.specs.empty() || manifest.layout.worldSize() == worldSize),
                    source, ": world_size ", worldSize, " disagrees with ", files.size(),
                    " files and a layout for ", manifest.layout.worldSize(), " ranks");
  for (int64_t rank = 0; rank < worldSize; ++rank) {
    manifest.files.push_back(recordFromJson(files[rank], rank, source));
  }
  manifest.aliases = aliasesFromJson(root, source);
  checkTensorAliases(manifest.layout, manifest.aliases, source);
  manifest.nonPersistent = nonPersistentFromJson(root, manifest.layout, source);
  return manifest;
}

void writeManifest(const std::string& dir, const RankManifest& manifest) {
  const std::string text = manifest.toJson();
  writeFileAtomically(joinPath(dir, kManifestFileName), text.data(), text.size());
}

RankManifest readManifest(const std::string& dir) {
  const std::string path = joinPath(dir, kManifestFileName);
  struct stat info {};
  // errno read at once: a symlink loop or a folder we may not enter is not a
  // missing manifest.
  const int error = ::stat(path.c_str(), &info) == 0 ? 0 : errno;
  TORCH_CHECK_VALUE(
      error == 0, "no valid checkpoint at ", dir, ": ", kManifestFileName,
      error == ENOENT ? std::string(" missing") : ": " + std::string(std::strerror(error)));
  TORCH_CHECK_VALUE(S_ISREG(info.st_mode), "no valid checkpoint at ", dir, ": ", path,
                    " is not a regular file");
  return RankManifest::fromJson(readWholeFile(path), path);
}

void verifyRankFile(const std::string& dir, const RankFileRecord& record) {
  const std::string path = joinPath(dir, record.name);
  struct stat info {};
  TORCH_CHECK_VALUE(::stat(path.c_str(), &info) == 0, path, ": rank ", record.rank,
                    " file listed in the manifest is missing");
  TORCH_CHECK_VALUE(static_cast<uint64_t>(info.st_size) == record.size, path, ": size ",
                    info.st_size, " bytes, but the manifest records ", record.size,
                    " (truncated or replaced)");
  const uint64_t checksum = fileChecksum(path);
  TORCH_CHECK_VALUE(checksum == record.checksum, path, ": XXH64 ", checksumHex(checksum),
                    ", but the manifest records ", checksumHex(record.checksum), " (corrupted)");
}

RankManifest verifyRankFiles(const std::string& dir) {
  RankManifest manifest = readManifest(dir);
  for (const RankFileRecord& record : manifest.files) verifyRankFile(dir, record);
  return manifest;
}

}  // namespace shardema
