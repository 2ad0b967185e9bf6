#include "shardema/core/tensor_checksums.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

namespace shardema::detail {

TensorDigest::TensorDigest(FileDType dtype, const std::vector<int64_t>& shape) {
  std::string prefix = std::string(fileDTypeName(dtype)) + "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    prefix += (i == 0 ? "" : ",") + std::to_string(shape[i]);
  }
  prefix += "]";
  hash_.update(prefix.data(), prefix.size());
}

std::string formatTensorChecksums(const std::vector<std::pair<std::string, uint64_t>>& digests) {
  // ordered_json keeps file order, so the placeholder and the final text
  // have their digests at the same offsets.
  nlohmann::ordered_json object = nlohmann::ordered_json::object();
  for (const auto& [name, digest] : digests) object[name] = checksumHex(digest);
  return object.dump();
}

std::string placeholderTensorChecksums(const std::vector<std::string>& names) {
  std::vector<std::pair<std::string, uint64_t>> zeros;
  zeros.reserve(names.size());
  for (const std::string& name : names) zeros.emplace_back(name, 0);
  return formatTensorChecksums(zeros);
}

std::map<std::string, uint64_t> parseTensorChecksums(const std::string& text,
                                                     const std::string& path) {
  const nlohmann::json object = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK_VALUE(object.is_object(), path, ": metadata ", kTensorChecksumsKey,
                    " is not a JSON object of tensor checksums");
  std::map<std::string, uint64_t> out;
  for (const auto& [name, value] : object.items()) {
    TORCH_CHECK_VALUE(value.is_string(), path, ": metadata ", kTensorChecksumsKey,
                      ": the checksum of tensor '", name, "' is not a string");
    try {
      out[name] = parseChecksumHex(value.get<std::string>());
    } catch (const c10::ValueError&) {
      TORCH_CHECK_VALUE(false, path, ": metadata ", kTensorChecksumsKey,
                        ": the checksum of tensor '", name, "' is not 16 hex digits");
    }
  }
  return out;
}

TensorChecksums::TensorChecksums(const std::map<std::string, std::string>& metadata,
                                 const std::vector<std::string>& tensorNames,
                                 const std::string& path)
    : path_(path) {
  const auto found = metadata.find(kTensorChecksumsKey);
  if (found == metadata.end()) return;
  present_ = true;
  expected_ = parseTensorChecksums(found->second, path);
  for (const std::string& name : tensorNames) {
    TORCH_CHECK_VALUE(expected_.count(name) == 1, path, ": metadata ", kTensorChecksumsKey,
                      " has no checksum for tensor '", name, "' (the header was edited?)");
  }
  TORCH_CHECK_VALUE(expected_.size() == tensorNames.size(), path, ": metadata ",
                    kTensorChecksumsKey, " lists ", expected_.size(), " tensors, the file has ",
                    tensorNames.size(), " (the header was edited?)");
}

void TensorChecksums::check(const std::string& name, uint64_t computed) const {
  if (!present_) return;
  const uint64_t expected = expected_.at(name);
  TORCH_CHECK_VALUE(computed == expected, path_, ": tensor '", name, "' fails its checksum (",
                    kTensorChecksumsKey, " ", checksumHex(expected), ", computed ",
                    checksumHex(computed),
                    "): its bytes, dtype or shape changed since it was written");
}

}  // namespace shardema::detail
