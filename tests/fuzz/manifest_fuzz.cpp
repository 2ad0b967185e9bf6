// libFuzzer target for the manifest parser (RankManifest::fromJson): the
// input is a whole manifest.json. It must parse or be refused with a
// c10::Error; anything else (a crash, another exception type, which
// libFuzzer reports as a deadly signal) is a finding. An accepted manifest
// must keep its promises: one file per rank, in rank order, with a rank
// file's name, and toJson() of it parses back to the same manifest.
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "shardema/detail/rank_manifest.h"

namespace {

void require(bool condition) {
  if (!condition) std::abort();
}

void checkPromises(const shardema::RankManifest& manifest) {
  require(manifest.worldSize() >= 1 && manifest.step >= 0);
  for (int64_t rank = 0; rank < manifest.worldSize(); ++rank) {
    const shardema::RankFileRecord& record = manifest.files[static_cast<size_t>(rank)];
    require(record.rank == rank && shardema::isRankFileName(record.name, rank));
  }
  const shardema::RankManifest again = shardema::RankManifest::fromJson(manifest.toJson(), "again");
  require(again.step == manifest.step && again.worldSize() == manifest.worldSize() &&
          again.layout.fingerprint() == manifest.layout.fingerprint() &&
          again.schedule == manifest.schedule);
  for (size_t i = 0; i < again.files.size(); ++i) {
    require(again.files[i].name == manifest.files[i].name &&
            again.files[i].size == manifest.files[i].size &&
            again.files[i].checksum == manifest.files[i].checksum);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  shardema::RankManifest manifest;
  try {
    manifest = shardema::RankManifest::fromJson(
        std::string(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const c10::Error&) {
    return 0;
  }
  checkPromises(manifest);
  return 0;
}
