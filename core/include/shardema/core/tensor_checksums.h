#pragma once
// Per-tensor checksums carried in a tensor file's own metadata, so a single
// file (an Averager::save, a training checkpoint, a snapshot, a deployable
// export) is verified on load the way a manifest verifies rank files.
//
// Key "shardema.xxh64"; value: a JSON object as plain string metadata,
// {"<tensor name>": "<16 hex digits>", ...}, one entry per tensor. Each
// digest is XXH64 (seed 0) of the tensor's dtype and shape as text, e.g.
// "F32[2,3]" ("BF16[]" for a 0-dim tensor), followed by its data bytes: an
// edit of the dtype or the shape in the header fails like a flipped data
// byte. Python can check it with the xxhash package; readers of files
// without the key (other tools, Python writers) skip the check.
//
// Writers put the header before the data, so they write the key with every
// digest zero (placeholderTensorChecksums: the same length as the final
// text) and overwrite the header once the data is written.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "shardema/core/checksum.h"
#include "shardema/core/tensor_dtype.h"

namespace shardema::detail {

constexpr const char* kTensorChecksumsKey = "shardema.xxh64";

/// The digest of one tensor, fed its data in any split.
class TensorDigest {
 public:
  TensorDigest(FileDType dtype, const std::vector<int64_t>& shape);
  void update(const void* data, size_t size) { hash_.update(data, size); }
  uint64_t digest() const { return hash_.digest(); }

 private:
  Xxh64 hash_;
};

/// The metadata value for (name, digest) pairs in file order.
std::string formatTensorChecksums(const std::vector<std::pair<std::string, uint64_t>>& digests);
/// formatTensorChecksums with every digest 0.
std::string placeholderTensorChecksums(const std::vector<std::string>& names);
/// Parses the metadata value; c10::ValueError naming the file when it is not
/// an object of 16-hex-digit strings.
std::map<std::string, uint64_t> parseTensorChecksums(const std::string& text,
                                                     const std::string& path);

/// What a reader checks against, built once per file from its metadata:
/// empty (no key) means the file carries no checksums. c10::ValueError
/// naming the file when the key is malformed or does not list exactly the
/// file's tensors.
class TensorChecksums {
 public:
  TensorChecksums(const std::map<std::string, std::string>& metadata,
                  const std::vector<std::string>& tensorNames, const std::string& path);
  bool present() const { return present_; }
  /// c10::ValueError "<path>: tensor '<name>' fails its checksum ..." when
  /// the computed digest differs; nothing when the file has no checksums.
  void check(const std::string& name, uint64_t computed) const;

 private:
  std::string path_;
  std::map<std::string, uint64_t> expected_;
  bool present_ = false;
};

}  // namespace shardema::detail
