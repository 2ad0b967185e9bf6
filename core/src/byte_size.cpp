#include "shardema/core/byte_size.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>

namespace shardema {
namespace {

constexpr std::pair<const char*, double> kUnits[] = {
    {"KIB", 1024.0},    {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0},
    {"KB", 1e3},        {"MB", 1e6},        {"GB", 1e9},           {"TB", 1e12},
};

std::string trimmed(const std::string& text) {
  const size_t begin = text.find_first_not_of(" \t");
  if (begin == std::string::npos) return {};
  return text.substr(begin, text.find_last_not_of(" \t") - begin + 1);
}

std::string upper(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return text;
}

// Digits with at most one '.', at least one digit: what %g-free people
// write. strtod alone would take "inf", hex and exponents.
bool isPlainNumber(const std::string& text) {
  const auto digits = std::count_if(text.begin(), text.end(),
                                    [](unsigned char c) { return std::isdigit(c) != 0; });
  const auto dots = std::count(text.begin(), text.end(), '.');
  return digits > 0 && dots <= 1 && digits + dots == static_cast<std::ptrdiff_t>(text.size());
}

}  // namespace

int64_t parseByteSize(const std::string& text, const std::string& what) {
  const std::string spelled = trimmed(text);
  const std::string unitless = upper(spelled);
  double multiplier = 1.0;
  std::string number = spelled;
  for (const auto& [unit, bytes] : kUnits) {
    const size_t length = std::char_traits<char>::length(unit);
    if (unitless.size() > length && unitless.compare(unitless.size() - length, length, unit) == 0) {
      multiplier = bytes;
      number = trimmed(spelled.substr(0, spelled.size() - length));
      break;
    }
  }
  bool valid = false;
  int64_t bytes = 0;
  if (multiplier == 1.0) {
    // Plain bytes are exact: no trip through a double.
    errno = 0;
    const long long value = number.empty() || number.find_first_not_of("0123456789") !=
                                                  std::string::npos
                                ? 0
                                : std::strtoll(number.c_str(), nullptr, 10);
    valid = errno == 0 && value >= 1;
    bytes = value;
  } else if (isPlainNumber(number)) {
    const double value = std::strtod(number.c_str(), nullptr) * multiplier;
    // 2^63 as a double: anything at or above it does not fit.
    constexpr double kTooLarge = 9223372036854775808.0;
    valid = std::isfinite(value) && value >= 1.0 && value < kTooLarge;
    bytes = valid ? static_cast<int64_t>(value) : 0;
  }
  TORCH_CHECK_VALUE(valid, what,
                    " must be a positive number of bytes or a size such as \"5GB\" (units KB, "
                    "MB, GB, TB in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024), got '",
                    text, "'");
  return bytes;
}

}  // namespace shardema
