#include "shardema/shard/shard_layout.h"

#include <c10/util/Exception.h>

#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>

#include "shardema/core/checksum.h"

namespace shardema {
namespace shard {
namespace {

using Json = nlohmann::ordered_json;

constexpr const char* kFromJson = "ShardLayout::fromJson";
constexpr int64_t kLayoutFormat = 1;

// The JSON spells dtypes as safetensors does ("F32", "BF16", ...): the
// layout travels in safetensors metadata, next to tensors spelled so.
struct DTypeName {
  c10::ScalarType type;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {c10::ScalarType::Double, "F64"}, {c10::ScalarType::Float, "F32"},
    {c10::ScalarType::Half, "F16"},   {c10::ScalarType::BFloat16, "BF16"},
    {c10::ScalarType::Long, "I64"},   {c10::ScalarType::Int, "I32"},
    {c10::ScalarType::Short, "I16"},  {c10::ScalarType::Char, "I8"},
    {c10::ScalarType::Byte, "U8"},    {c10::ScalarType::Bool, "BOOL"},
};

const char* dtypeName(c10::ScalarType type, const std::string& tensor) {
  for (const DTypeName& entry : kDTypeNames) {
    if (entry.type == type) return entry.name;
  }
  TORCH_CHECK_VALUE(false, "ShardLayout::toJson: tensor '", tensor, "' has dtype ", type,
                    ", which has no safetensors name");
}

Json specToJson(const ShardSpec& spec) {
  Json ranges = Json::array();
  for (const ElementRange& range : spec.ranges) ranges.push_back({range.begin, range.end});
  Json entry;
  entry["name"] = spec.name;
  entry["kind"] = layoutKindName(spec.kind);
  entry["dtype"] = dtypeName(spec.dtype, spec.name);
  entry["shape"] = spec.globalShape;
  entry["ranges"] = std::move(ranges);
  return entry;
}

// "tensor 3 ('w')" or "tensor 3" before the name is known.
std::string where(size_t index, const std::string& name) {
  std::string text = "tensor " + std::to_string(index);
  if (!name.empty()) text += " ('" + name + "')";
  return text;
}

int64_t readInt(const Json& value, const std::string& what) {
  const bool fits = value.is_number_integer() &&
                    (!value.is_number_unsigned() ||
                     value.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()));
  TORCH_CHECK_VALUE(fits, kFromJson, ": ", what, " must be an integer, got ", value.dump());
  return value.get<int64_t>();
}

const Json& member(const Json& object, const char* key, const std::string& what) {
  auto found = object.find(key);
  TORCH_CHECK_VALUE(found != object.end(), kFromJson, ": ", what, " has no \"", key, "\"");
  return *found;
}

void checkKeys(const Json& object, const std::set<std::string>& allowed, const std::string& what) {
  TORCH_CHECK_VALUE(object.is_object(), kFromJson, ": ", what, " must be an object");
  for (const auto& item : object.items()) {
    TORCH_CHECK_VALUE(allowed.count(item.key()) == 1, kFromJson, ": ", what, " has unknown key \"",
                      item.key(), "\"");
  }
}

c10::ScalarType parseDType(const Json& value, const std::string& what) {
  TORCH_CHECK_VALUE(value.is_string(), kFromJson, ": ", what, ": dtype must be a string");
  for (const DTypeName& entry : kDTypeNames) {
    if (value.get<std::string>() == entry.name) return entry.type;
  }
  TORCH_CHECK_VALUE(false, kFromJson, ": ", what, ": unknown dtype ", value.dump());
}

ShardSpec specFromJson(const Json& entry, size_t index) {
  std::string what = where(index, "");
  checkKeys(entry, {"name", "kind", "dtype", "shape", "ranges"}, what);
  const Json& name = member(entry, "name", what);
  TORCH_CHECK_VALUE(name.is_string(), kFromJson, ": ", what, ": name must be a string");
  ShardSpec spec;
  spec.name = name.get<std::string>();
  what = where(index, spec.name);
  const Json& kind = member(entry, "kind", what);
  TORCH_CHECK_VALUE(kind.is_string(), kFromJson, ": ", what, ": kind must be a string");
  try {
    spec.kind = parseLayoutKind(kind.get<std::string>());
  } catch (const c10::ValueError& error) {
    TORCH_CHECK_VALUE(false, kFromJson, ": ", what, ": ", error.what_without_backtrace());
  }
  spec.dtype = parseDType(member(entry, "dtype", what), what);
  const Json& shape = member(entry, "shape", what);
  TORCH_CHECK_VALUE(shape.is_array(), kFromJson, ": ", what, ": shape must be an array");
  for (const Json& dim : shape) spec.globalShape.push_back(readInt(dim, what + " shape dim"));
  const Json& ranges = member(entry, "ranges", what);
  TORCH_CHECK_VALUE(ranges.is_array(), kFromJson, ": ", what, ": ranges must be an array");
  for (const Json& range : ranges) {
    TORCH_CHECK_VALUE(range.is_array() && range.size() == 2, kFromJson, ": ", what,
                      ": each range must be [begin, end], got ", range.dump());
    spec.ranges.push_back(
        {readInt(range[0], what + " range begin"), readInt(range[1], what + " range end")});
  }
  return spec;
}

Json parseText(const std::string& text) {
  try {
    return Json::parse(text);
  } catch (const Json::exception& error) {
    TORCH_CHECK_VALUE(false, kFromJson, ": not valid JSON: ", error.what());
  }
}

}  // namespace

int64_t ShardLayout::worldSize() const { return specs.empty() ? 0 : specs.front().worldSize(); }

void ShardLayout::check() const {
  std::unordered_set<std::string> names;
  for (const ShardSpec& spec : specs) {
    checkShardSpec(spec);
    TORCH_CHECK_VALUE(names.insert(spec.name).second, "ShardLayout: tensor '", spec.name,
                      "' appears twice");
    TORCH_CHECK_VALUE(spec.worldSize() == worldSize(), "ShardLayout: tensor '", spec.name,
                      "' is split over ", spec.worldSize(), " ranks but tensor '",
                      specs.front().name, "' over ", worldSize());
  }
}

const ShardSpec& ShardLayout::at(const std::string& name) const {
  for (const ShardSpec& spec : specs) {
    if (spec.name == name) return spec;
  }
  TORCH_CHECK_INDEX(false, "ShardLayout: no tensor named '", name, "' among ", specs.size(),
                    " tensors");
}

std::string ShardLayout::toJson() const {
  Json tensors = Json::array();
  for (const ShardSpec& spec : specs) tensors.push_back(specToJson(spec));
  Json root;
  root["format"] = kLayoutFormat;
  root["world_size"] = worldSize();
  root["tensors"] = std::move(tensors);
  try {
    return root.dump();
  } catch (const Json::exception& error) {
    TORCH_CHECK_VALUE(false,
                      "ShardLayout::toJson: a tensor name is not valid UTF-8: ", error.what());
  }
}

ShardLayout ShardLayout::fromJson(const std::string& text) {
  const Json root = parseText(text);
  checkKeys(root, {"format", "world_size", "tensors"}, "the layout");
  const int64_t format = readInt(member(root, "format", "the layout"), "format");
  TORCH_CHECK_VALUE(format == kLayoutFormat, kFromJson, ": layout format ", format,
                    " is not supported (expected ", kLayoutFormat, ")");
  const int64_t world = readInt(member(root, "world_size", "the layout"), "world_size");
  const Json& tensors = member(root, "tensors", "the layout");
  TORCH_CHECK_VALUE(tensors.is_array(), kFromJson, ": tensors must be an array");
  ShardLayout layout;
  for (size_t i = 0; i < tensors.size(); ++i) {
    layout.specs.push_back(specFromJson(tensors[i], i));
    const ShardSpec& spec = layout.specs.back();
    TORCH_CHECK_VALUE(spec.worldSize() == world, kFromJson, ": ", where(i, spec.name), " has ",
                      spec.worldSize(), " ranges but world_size is ", world);
  }
  TORCH_CHECK_VALUE(!layout.specs.empty() || world == 0, kFromJson,
                    ": a layout without tensors has world_size 0, got ", world);
  try {
    layout.check();
  } catch (const c10::ValueError& error) {
    TORCH_CHECK_VALUE(false, kFromJson, ": ", error.what_without_backtrace());
  }
  return layout;
}

std::string ShardLayout::fingerprint() const {
  const std::string text = toJson();
  return checksumHex(xxh64(text.data(), text.size()));
}

std::string ShardLayout::describe() const {
  std::set<std::string> kinds;
  for (const ShardSpec& spec : specs) kinds.insert(layoutKindName(spec.kind));
  std::string kindText;
  for (const std::string& kind : kinds) kindText += (kindText.empty() ? "" : "+") + kind;
  if (kindText.empty()) kindText = "empty";
  return kindText + " over " + std::to_string(worldSize()) + " ranks, " +
         std::to_string(specs.size()) + " tensors, fingerprint " + fingerprint();
}

namespace {

std::string shapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

std::string rangesText(const std::vector<ElementRange>& ranges) {
  std::string text;
  for (const ElementRange& r : ranges) {
    text += (text.empty() ? "" : " ") +
            ("[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")");
  }
  return text;
}

std::string specDifference(const ShardSpec& saved, const ShardSpec& here) {
  const std::string who = "tensor '" + saved.name + "' ";
  if (saved.globalShape != here.globalShape) {
    return who + "has shape " + shapeText(saved.globalShape) + " in the checkpoint but " +
           shapeText(here.globalShape) + " here";
  }
  if (saved.dtype != here.dtype) {
    return who + "has dtype " + std::string(c10::toString(saved.dtype)) +
           " in the checkpoint but " + c10::toString(here.dtype) + " here";
  }
  if (saved.kind != here.kind) {
    return who + "is laid out as " + layoutKindName(saved.kind) + " in the checkpoint but " +
           layoutKindName(here.kind) + " here";
  }
  if (saved.ranges != here.ranges) {
    return who + "is split over ranks as " + rangesText(saved.ranges) + " in the checkpoint but " +
           rangesText(here.ranges) + " here";
  }
  return "";
}

}  // namespace

std::string layoutDifference(const ShardLayout& saved, const ShardLayout& here) {
  for (const ShardSpec& spec : saved.specs) {
    bool found = false;
    for (const ShardSpec& mine : here.specs) {
      if (mine.name != spec.name) continue;
      found = true;
      const std::string difference = specDifference(spec, mine);
      if (!difference.empty()) return difference;
    }
    if (!found) return "tensor '" + spec.name + "' is in the checkpoint but not tracked here";
  }
  for (const ShardSpec& mine : here.specs) {
    bool found = false;
    for (const ShardSpec& spec : saved.specs) found = found || spec.name == mine.name;
    if (!found) return "tensor '" + mine.name + "' is tracked here but not in the checkpoint";
  }
  for (size_t i = 0; i < saved.specs.size() && i < here.specs.size(); ++i) {
    if (saved.specs[i].name != here.specs[i].name) {
      return "the tensors are in another order (position " + std::to_string(i) + ": '" +
             saved.specs[i].name + "' in the checkpoint, '" + here.specs[i].name + "' here)";
    }
  }
  return "";  // every field compared above is equal, so the specs are
}

ShardLayout relayout(const ShardLayout& layout, int64_t worldSize) {
  TORCH_CHECK_VALUE(worldSize >= 1, "relayout: world size must be >= 1, got ", worldSize);
  ShardLayout out;
  out.specs.reserve(layout.specs.size());
  for (const ShardSpec& spec : layout.specs) {
    switch (spec.kind) {
      case LayoutKind::kReplicated:
        out.specs.push_back(replicatedSpec(spec.name, spec.globalShape, spec.dtype, worldSize));
        break;
      case LayoutKind::kRankZero:
        out.specs.push_back(rankZeroSpec(spec.name, spec.globalShape, spec.dtype, worldSize));
        break;
      case LayoutKind::kPerRank:
        out.specs.push_back(perRankSpec(spec.name, spec.globalShape, spec.dtype, worldSize));
        break;
      case LayoutKind::kFsdp2:
      case LayoutKind::kFsdp1:
        // A flat parameter's cut depends on its unit's other members, which
        // a per-tensor spec does not carry: FSDP2 chunks are the target.
        out.specs.push_back(fsdp2Spec(spec.name, spec.globalShape, spec.dtype, worldSize));
        break;
    }
  }
  return out;
}

}  // namespace shard
}  // namespace shardema
