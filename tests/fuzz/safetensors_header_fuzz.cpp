// libFuzzer entry point: the input is a whole file. Beyond "no crash", an
// accepted header must satisfy the parser's promises, and rebuilding it with
// buildSafetensorsHeader must give a header that parses to the same tensors.
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "shardema/core/safetensors_header.h"

namespace {

using shardema::SafetensorsHeader;
using shardema::TensorEntry;

void require(bool condition) {
  if (!condition) std::abort();
}

// Offsets tile the data area in order; sizes agree with shapes.
void checkPromises(const SafetensorsHeader& header, size_t size) {
  require(header.dataOffset <= size && header.dataOffset + header.dataSize == size);
  uint64_t covered = 0;
  for (const TensorEntry& entry : header.tensors) {
    require(entry.begin == covered && entry.begin <= entry.end && !entry.name.empty());
    require(static_cast<uint64_t>(entry.numel()) * shardema::fileDTypeSize(entry.dtype) ==
            entry.byteSize());
    covered = entry.end;
  }
  require(covered == header.dataSize);
}

void checkRebuild(const SafetensorsHeader& header) {
  std::vector<TensorEntry> entries = header.tensors;
  std::string rebuilt;
  try {
    rebuilt = shardema::buildSafetensorsHeader(entries, header.metadata, "rebuild");
  } catch (const c10::Error& error) {
    // Only an over-long header may be refused: ours pads and escapes, so it
    // can grow past the limit the original was under.
    require(error.msg().find("header would be") != std::string::npos);
    return;
  }
  const SafetensorsHeader again =
      shardema::parseSafetensorsHeader(reinterpret_cast<const uint8_t*>(rebuilt.data()),
                                       rebuilt.size(), rebuilt.size() + header.dataSize, "rebuild");
  require(again.metadata == header.metadata && again.tensors.size() == header.tensors.size());
  for (size_t i = 0; i < again.tensors.size(); ++i) {
    const TensorEntry& a = again.tensors[i];
    const TensorEntry& b = header.tensors[i];
    require(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.begin == b.begin &&
            a.end == b.end);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  SafetensorsHeader header;
  try {
    header = shardema::parseSafetensorsHeader(data, size, size, "fuzz");
  } catch (const c10::Error&) {
    return 0;
  }
  checkPromises(header, size);
  checkRebuild(header);
  return 0;
}
