#include "flag_parser.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace shardema::cli {
namespace {

std::string dashed(const std::string& name) { return "--" + name; }

const FlagSpec* findSpec(const std::vector<FlagSpec>& specs, const std::string& name) {
  for (const FlagSpec& spec : specs) {
    if (spec.name == name) return &spec;
  }
  return nullptr;
}

bool isBoolWord(const std::string& token) { return token == "true" || token == "false"; }

// Resolves the value of one flag occurrence; `next` is the index of the
// token after the flag and is advanced past a consumed value.
std::optional<std::string> takeValue(const FlagSpec& spec,
                                     const std::optional<std::string>& attached,
                                     const std::vector<std::string>& args, size_t& next) {
  const std::string flag = dashed(spec.name);
  switch (spec.arity) {
    case FlagArity::kNone:
      if (attached) throw UsageError(flag + " takes no value (got '" + *attached + "')");
      return std::nullopt;
    case FlagArity::kOptionalBool:
      if (attached && !isBoolWord(*attached)) {
        throw UsageError(flag + " takes no value or true/false (got '" + *attached + "')");
      }
      if (attached) return attached;
      if (next < args.size() && isBoolWord(args[next])) return args[next++];
      return std::nullopt;
    case FlagArity::kValue:
      if (attached) return attached;
      if (next >= args.size() || args[next].rfind("--", 0) == 0) {
        throw UsageError(flag + " needs a value");
      }
      return args[next++];
  }
  return std::nullopt;
}

}  // namespace

bool ParsedFlags::has(const std::string& name) const { return find(name) != nullptr; }

std::vector<std::string> ParsedFlags::names() const {
  std::vector<std::string> result;
  for (const auto& entry : values_) result.push_back(entry.first);
  return result;
}

const std::optional<std::string>* ParsedFlags::find(const std::string& name) const {
  for (const auto& entry : values_) {
    if (entry.first == name) return &entry.second;
  }
  return nullptr;
}

const std::string& ParsedFlags::text(const std::string& name) const {
  const std::optional<std::string>* value = find(name);
  if (value == nullptr || !value->has_value()) throw UsageError(dashed(name) + " needs a value");
  return **value;
}

double ParsedFlags::number(const std::string& name) const { return parseNumber(name, text(name)); }

int64_t ParsedFlags::integer(const std::string& name) const {
  return parseInteger(name, text(name));
}

bool ParsedFlags::boolean(const std::string& name) const {
  const std::optional<std::string>* value = find(name);
  if (value == nullptr) return false;
  return !value->has_value() || **value == "true";
}

ParsedFlags parseFlags(const std::vector<FlagSpec>& specs, const std::vector<std::string>& args) {
  ParsedFlags parsed;
  size_t next = 0;
  while (next < args.size()) {
    const std::string& token = args[next++];
    if (token.rfind("--", 0) != 0 || token.size() == 2) {
      throw UsageError("unexpected argument '" + token + "' (flags start with --)");
    }
    const size_t equals = token.find('=');
    const std::string name = token.substr(2, equals == std::string::npos ? equals : equals - 2);
    std::optional<std::string> attached;
    if (equals != std::string::npos) attached = token.substr(equals + 1);
    const FlagSpec* spec = findSpec(specs, name);
    if (spec == nullptr) throw UsageError("unknown flag " + dashed(name));
    if (parsed.has(name)) throw UsageError(dashed(name) + " given more than once");
    parsed.values_.emplace_back(name, takeValue(*spec, attached, args, next));
  }
  return parsed;
}

double parseNumber(const std::string& flag, const std::string& token) {
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(token.c_str(), &end);
  // strtod accepts "inf"/"nan" and leading blanks; neither is a useful option value.
  if (token.empty() || std::isspace(static_cast<unsigned char>(token[0])) ||
      end != token.c_str() + token.size() || !std::isfinite(value) || errno == ERANGE) {
    throw UsageError(dashed(flag) + ": '" + token + "' is not a finite number");
  }
  return value;
}

int64_t parseInteger(const std::string& flag, const std::string& token) {
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(token.c_str(), &end, 10);
  if (token.empty() || std::isspace(static_cast<unsigned char>(token[0])) ||
      end != token.c_str() + token.size() || errno == ERANGE) {
    throw UsageError(dashed(flag) + ": '" + token + "' is not an integer");
  }
  return static_cast<int64_t>(value);
}

std::vector<std::string> splitList(const std::string& flag, const std::string& text,
                                   char separator) {
  std::vector<std::string> items;
  size_t start = 0;
  while (true) {
    const size_t stop = text.find(separator, start);
    std::string item = text.substr(start, stop == std::string::npos ? stop : stop - start);
    if (item.empty()) throw UsageError(dashed(flag) + ": empty item in '" + text + "'");
    items.push_back(std::move(item));
    if (stop == std::string::npos) break;
    start = stop + 1;
  }
  return items;
}

}  // namespace shardema::cli
