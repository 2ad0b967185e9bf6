#include "shardema/core/safetensors_header.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <unordered_set>

// Only nlohmann and c10's exception header here (no ATen): the fuzzer
// compiles this file on its own.

namespace shardema {
namespace {

using nlohmann::json;

constexpr const char* kMetadataKey = "__metadata__";
constexpr size_t kLengthBytes = 8;
// Names in messages are cut so a hostile 100 MiB name stays a readable line.
constexpr size_t kMaxQuotedBytes = 120;

// JSON-quotes a string for an error message: escapes control characters so
// the message stays one line, replaces invalid UTF-8 rather than throwing.
std::string jsonQuoted(const std::string& text) {
  std::string cut = text.size() > kMaxQuotedBytes ? text.substr(0, kMaxQuotedBytes) : text;
  std::string out = json(cut).dump(-1, ' ', false, json::error_handler_t::replace);
  if (cut.size() < text.size()) out += "...";
  return out;
}

// nlohmann quotes the raw bytes it choked on, which may be invalid UTF-8.
std::string asciiOnly(std::string text) {
  for (char& c : text) {
    if (static_cast<unsigned char>(c) >= 0x80 || static_cast<unsigned char>(c) < 0x20) c = '?';
  }
  return text;
}

// First pass over the header text. nlohmann's DOM silently keeps one of two
// duplicate keys, and its callback parser rescans a parent on every child
// (quadratic in the tensor count), so duplicates, nesting depth and the
// order of the top-level keys are checked here with a SAX handler.
class KeyChecker {
 public:
  explicit KeyChecker(const std::string& source) : source_(source) {}

  const std::vector<std::string>& rootKeys() const { return rootKeys_; }

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t) { return true; }
  bool number_unsigned(json::number_unsigned_t) { return true; }
  bool number_float(json::number_float_t, const json::string_t&) { return true; }
  bool string(json::string_t&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool start_object(size_t) {
    objects_.push_back({depth_ + 1, {}});
    return enter();
  }
  bool key(json::string_t& key) {
    ObjectKeys& object = objects_.back();
    if (!object.keys.insert(key).second) {
      const std::string where = object.depth == 1 || rootKeys_.empty()
                                    ? std::string(" (a tensor name)")
                                    : " inside " + jsonQuoted(rootKeys_.back());
      TORCH_CHECK_VALUE(false, source_, ": duplicate key ", jsonQuoted(key), where,
                        " in the header");
    }
    if (object.depth == 1) rootKeys_.push_back(key);
    return true;
  }
  bool end_object() {
    objects_.pop_back();
    return leave();
  }
  bool start_array(size_t) { return enter(); }
  bool end_array() { return leave(); }
  bool parse_error(size_t, const std::string&, const nlohmann::detail::exception& error) {
    TORCH_CHECK_VALUE(false, source_, ": header is not valid JSON: ", asciiOnly(error.what()));
    return false;
  }

 private:
  struct ObjectKeys {
    int depth;
    std::unordered_set<std::string> keys;
  };

  bool enter() {
    ++depth_;
    TORCH_CHECK_VALUE(depth_ <= kMaxSafetensorsJsonDepth, source_,
                      ": header JSON is nested deeper than ", kMaxSafetensorsJsonDepth, " levels");
    return true;
  }
  bool leave() {
    --depth_;
    return true;
  }

  const std::string& source_;
  int depth_ = 0;
  std::vector<ObjectKeys> objects_;
  std::vector<std::string> rootKeys_;
};

// shape x element size in bytes, or nullopt when it overflows int64. Zero
// dimensions count as one in the overflow test, so [2^62, 2^62, 0] is
// refused too: no real tensor has it, and code that multiplies the
// dimensions in another order (ours, ATen's, a Python reader's) overflows.
std::optional<uint64_t> shapeBytes(const std::vector<int64_t>& shape, FileDType dtype) {
  uint64_t bytes = static_cast<uint64_t>(fileDTypeSize(dtype));
  bool empty = false;
  for (int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    empty = empty || dim == 0;
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(std::max<int64_t>(dim, 1)), &bytes)) {
      return std::nullopt;
    }
  }
  if (bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return empty ? 0 : bytes;
}

// A number as written, anything else by its type: messages stay short.
std::string scalarText(const json& value) {
  return value.is_number() ? value.dump() : std::string(value.type_name());
}

// "[2, 3]"; long shapes are cut, a message stays short.
std::string shapeText(const std::vector<int64_t>& shape) {
  constexpr size_t kMaxDims = 8;
  std::string out = "[";
  for (size_t i = 0; i < shape.size() && i < kMaxDims; ++i) {
    out += (i > 0 ? ", " : "") + std::to_string(shape[i]);
  }
  return out + (shape.size() > kMaxDims ? ", ...]" : "]");
}

// nlohmann stores "-0" as a signed zero integer: accepted, as serde does.
std::optional<uint64_t> nonNegativeInteger(const json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() == 0) return 0;
  return std::nullopt;
}

uint64_t jsonOffset(const json& value, const std::string& source, const std::string& name) {
  const auto offset = nonNegativeInteger(value);
  TORCH_CHECK_VALUE(offset, source, ": tensor ", jsonQuoted(name),
                    ": data_offsets must hold non-negative integers, found ", scalarText(value));
  return *offset;
}

std::vector<int64_t> parseShape(const json& entry, const std::string& source,
                                const std::string& name) {
  auto found = entry.find("shape");
  TORCH_CHECK_VALUE(found != entry.end() && found->is_array(), source, ": tensor ",
                    jsonQuoted(name), ": \"shape\" must be an array of integers");
  std::vector<int64_t> shape;
  shape.reserve(found->size());
  for (const json& dim : *found) {
    const auto value = nonNegativeInteger(dim);
    TORCH_CHECK_VALUE(value && *value <= uint64_t{std::numeric_limits<int64_t>::max()}, source,
                      ": tensor ", jsonQuoted(name),
                      ": shape dimensions must be non-negative integers below 2^63, found ",
                      scalarText(dim));
    shape.push_back(static_cast<int64_t>(*value));
  }
  return shape;
}

TensorEntry parseEntry(const std::string& name, const json& value, uint64_t dataSize,
                       const std::string& source) {
  TORCH_CHECK_VALUE(!name.empty(), source, ": a tensor has an empty name");
  TORCH_CHECK_VALUE(value.is_object(), source, ": tensor ", jsonQuoted(name),
                    ": entry must be a JSON object, found ", value.type_name());
  TensorEntry entry;
  entry.name = name;

  auto dtype = value.find("dtype");
  TORCH_CHECK_VALUE(dtype != value.end() && dtype->is_string(), source, ": tensor ",
                    jsonQuoted(name), ": \"dtype\" must be a string");
  auto parsed = parseFileDType(dtype->get<std::string>());
  TORCH_CHECK_VALUE(parsed, source, ": tensor ", jsonQuoted(name), ": unknown dtype ",
                    jsonQuoted(dtype->get<std::string>()));
  entry.dtype = *parsed;
  entry.shape = parseShape(value, source, name);

  auto offsets = value.find("data_offsets");
  TORCH_CHECK_VALUE(offsets != value.end() && offsets->is_array() && offsets->size() == 2, source,
                    ": tensor ", jsonQuoted(name), ": \"data_offsets\" must be [begin, end]");
  entry.begin = jsonOffset((*offsets)[0], source, name);
  entry.end = jsonOffset((*offsets)[1], source, name);
  TORCH_CHECK_VALUE(entry.begin <= entry.end, source, ": tensor ", jsonQuoted(name),
                    ": data_offsets begin ", entry.begin, " is after end ", entry.end);
  TORCH_CHECK_VALUE(entry.end <= dataSize, source, ": tensor ", jsonQuoted(name),
                    ": data_offsets end ", entry.end, " is past the data area of ", dataSize,
                    " bytes (file truncated?)");

  auto bytes = shapeBytes(entry.shape, entry.dtype);
  TORCH_CHECK_VALUE(bytes, source, ": tensor ", jsonQuoted(name), ": shape ",
                    shapeText(entry.shape), " of ", fileDTypeName(entry.dtype),
                    " overflows 2^63 bytes");
  TORCH_CHECK_VALUE(*bytes == entry.byteSize(), source, ": tensor ", jsonQuoted(name), ": shape ",
                    shapeText(entry.shape), " of ", fileDTypeName(entry.dtype), " needs ", *bytes,
                    " bytes but data_offsets span ", entry.byteSize());
  return entry;
}

std::map<std::string, std::string> parseMetadata(const json& value, const std::string& source) {
  TORCH_CHECK_VALUE(value.is_object(), source, ": \"__metadata__\" must be an object, found ",
                    value.type_name());
  std::map<std::string, std::string> metadata;
  for (const auto& item : value.items()) {
    TORCH_CHECK_VALUE(item.value().is_string(), source, ": metadata ", jsonQuoted(item.key()),
                      " must be a string, found ", item.value().type_name());
    metadata.emplace(item.key(), item.value().get<std::string>());
  }
  return metadata;
}

// Sorts by offset and requires the tensors to tile the data area exactly, as
// the reference does: no overlap, no hole, no trailing bytes.
void sortAndCheckCover(std::vector<TensorEntry>& tensors, uint64_t dataSize,
                       const std::string& source) {
  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry& entry : tensors) {
    TORCH_CHECK_VALUE(entry.begin >= covered, source, ": tensor ", jsonQuoted(entry.name),
                      " (bytes ", entry.begin, "-", entry.end, ") overlaps tensor ",
                      jsonQuoted(previous ? previous->name : std::string()), " (ending at ",
                      covered, ")");
    TORCH_CHECK_VALUE(entry.begin == covered, source, ": bytes ", covered, "-", entry.begin,
                      " of the data area belong to no tensor (hole before tensor ",
                      jsonQuoted(entry.name), ")");
    covered = entry.end;
    previous = &entry;
  }
  TORCH_CHECK_VALUE(covered == dataSize, source, ": data area is ", dataSize,
                    " bytes but the tensors cover only ", covered, " (trailing bytes)");
}

json parseDocument(const char* begin, const char* end, const std::string& source,
                   std::vector<std::string>& rootKeys) {
  KeyChecker checker(source);
  json::sax_parse(begin, end, &checker);
  rootKeys = checker.rootKeys();
  try {
    return json::parse(begin, end);
  } catch (const json::exception& error) {
    TORCH_CHECK_VALUE(false, source, ": header is not valid JSON: ", asciiOnly(error.what()));
  }
  return json();  // not reached: the check above always throws
}

void appendLittleEndian(std::string& out, uint64_t value) {
  for (size_t i = 0; i < kLengthBytes; ++i)
    out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

// dump() refuses invalid UTF-8 (type_error 316); nullopt then.
std::optional<std::string> dumpUtf8(const json& value) {
  try {
    return value.dump();
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

std::string entryJson(const TensorEntry& entry, const std::string& source) {
  std::optional<std::string> name = dumpUtf8(json(entry.name));
  TORCH_CHECK_VALUE(name, source, ": tensor name ", jsonQuoted(entry.name), " is not valid UTF-8");
  // Written by hand, not as a json object: nlohmann objects are either
  // sorted (std::map) or quadratic to build (ordered_map), and the writer's
  // order must be kept.
  return *name + ":{\"dtype\":\"" + fileDTypeName(entry.dtype) +
         "\",\"shape\":" + json(entry.shape).dump() + ",\"data_offsets\":[" +
         std::to_string(entry.begin) + "," + std::to_string(entry.end) + "]}";
}

void checkEntriesToBuild(std::vector<TensorEntry>& entries, const std::string& source) {
  std::unordered_set<std::string> names;
  uint64_t offset = 0;
  for (TensorEntry& entry : entries) {
    TORCH_CHECK_VALUE(!entry.name.empty(), source, ": a tensor has an empty name");
    TORCH_CHECK_VALUE(entry.name != kMetadataKey, source,
                      ": \"__metadata__\" is reserved and cannot name a tensor");
    TORCH_CHECK_VALUE(names.insert(entry.name).second, source, ": duplicate tensor name ",
                      jsonQuoted(entry.name));
    auto bytes = shapeBytes(entry.shape, entry.dtype);
    TORCH_CHECK_VALUE(bytes, source, ": tensor ", jsonQuoted(entry.name),
                      ": shape has a negative dimension or overflows 2^63 bytes");
    entry.begin = offset;
    TORCH_CHECK_VALUE(!__builtin_add_overflow(offset, *bytes, &offset), source,
                      ": tensors total more than 2^64 bytes");
    entry.end = offset;
  }
}

}  // namespace

int64_t TensorEntry::numel() const {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

const TensorEntry* SafetensorsHeader::find(const std::string& name) const {
  auto found = std::find_if(tensors.begin(), tensors.end(),
                            [&](const TensorEntry& entry) { return entry.name == name; });
  return found == tensors.end() ? nullptr : &*found;
}

uint64_t readSafetensorsHeaderLength(const uint8_t* prefix, size_t prefixSize,
                                     const std::string& source) {
  TORCH_CHECK_VALUE(prefixSize >= kLengthBytes, source, ": ", prefixSize,
                    " bytes is too short for the 8-byte header length of a safetensors file");
  // Decoded byte by byte: the format is little-endian whatever the host is.
  uint64_t length = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) length |= uint64_t{prefix[i]} << (8 * i);
  return length;
}

uint64_t checkedSafetensorsHeaderLength(const uint8_t* prefix, size_t prefixSize, uint64_t fileSize,
                                        const std::string& source) {
  TORCH_CHECK_VALUE(fileSize >= kLengthBytes, source, ": file is ", fileSize,
                    " bytes, too short for the 8-byte header length of a safetensors file");
  const uint64_t length = readSafetensorsHeaderLength(prefix, prefixSize, source);
  TORCH_CHECK_VALUE(length <= kMaxSafetensorsHeaderBytes, source, ": header length ", length,
                    " exceeds the ", kMaxSafetensorsHeaderBytes,
                    "-byte limit (corrupt or not a safetensors file)");
  TORCH_CHECK_VALUE(length <= fileSize - kLengthBytes, source, ": header length ", length,
                    " exceeds the ", fileSize - kLengthBytes,
                    " bytes that follow it (truncated or corrupt file)");
  return length;
}

SafetensorsHeader parseSafetensorsHeader(const uint8_t* prefix, size_t prefixSize,
                                         uint64_t fileSize, const std::string& source) {
  const uint64_t length = checkedSafetensorsHeaderLength(prefix, prefixSize, fileSize, source);
  TORCH_CHECK_VALUE(prefixSize - kLengthBytes >= length, source, ": only ", prefixSize,
                    " bytes of the ", kLengthBytes + length, "-byte header were given");
  SafetensorsHeader header;
  header.dataOffset = kLengthBytes + length;
  header.dataSize = fileSize - header.dataOffset;

  const char* text = reinterpret_cast<const char*>(prefix) + kLengthBytes;
  std::vector<std::string> rootKeys;
  const json document = parseDocument(text, text + length, source, rootKeys);
  TORCH_CHECK_VALUE(document.is_object(), source, ": header must be a JSON object, found ",
                    document.type_name());
  header.tensors.reserve(rootKeys.size());
  for (const std::string& key : rootKeys) {
    const json& value = document.at(key);
    if (key == kMetadataKey) {
      header.metadata = parseMetadata(value, source);
    } else {
      header.tensors.push_back(parseEntry(key, value, header.dataSize, source));
    }
  }
  sortAndCheckCover(header.tensors, header.dataSize, source);
  return header;
}

std::string buildSafetensorsHeader(std::vector<TensorEntry>& entries,
                                   const std::map<std::string, std::string>& metadata,
                                   const std::string& source) {
  checkEntriesToBuild(entries, source);
  std::string text = "{";
  if (!metadata.empty()) {
    std::optional<std::string> dumped = dumpUtf8(json(metadata));
    TORCH_CHECK_VALUE(dumped, source, ": a metadata key or value is not valid UTF-8");
    text += "\"__metadata__\":" + *dumped;
  }
  for (const TensorEntry& entry : entries) {
    if (text.size() > 1) text += ',';
    text += entryJson(entry, source);
  }
  text += '}';
  // Spaces (JSON whitespace) pad the header so the data area starts 8-byte
  // aligned, as the safetensors reference writer does.
  text.append((kLengthBytes - text.size() % kLengthBytes) % kLengthBytes, ' ');
  TORCH_CHECK_VALUE(text.size() <= kMaxSafetensorsHeaderBytes, source, ": header would be ",
                    text.size(), " bytes, more than the ", kMaxSafetensorsHeaderBytes,
                    " readers accept");
  std::string out;
  out.reserve(kLengthBytes + text.size());
  appendLittleEndian(out, text.size());
  out += text;
  return out;
}

}  // namespace shardema
