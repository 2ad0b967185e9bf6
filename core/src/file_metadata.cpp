#include "shardema/core/file_metadata.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace shardema {
namespace detail {

std::string formatDecimal17(double value) {
  char buffer[40];
  std::snprintf(buffer, sizeof(buffer), "%.17g", value);
  return buffer;
}

bool parseFiniteDecimal(const std::string& text, double* value) {
  // strtod accepts leading spaces, hex, "inf" and "nan": refuse what %.17g
  // of a finite double never produces before strtod sees it.
  if (text.empty() || text.find_first_not_of("0123456789.eE+-") != std::string::npos) {
    return false;
  }
  char* end = nullptr;
  const double parsed = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || !std::isfinite(parsed)) return false;
  *value = parsed;
  return true;
}

bool parseDecimalDigits(const std::string& text, int64_t* value) {
  if (text.empty() || (text.size() > 1 && text[0] == '0')) return false;
  int64_t result = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    const int digit = c - '0';
    if (result > (std::numeric_limits<int64_t>::max() - digit) / 10) return false;
    result = result * 10 + digit;
  }
  *value = result;
  return true;
}

std::map<std::string, std::string> deployableMetadata(const DeployableInfo& info) {
  TORCH_INTERNAL_ASSERT(info.exported.has_value() != info.synthesized.has_value(),
                        "deployableMetadata: set exactly one of exported and synthesized");
  std::map<std::string, std::string> metadata{{kSafetensorsFormatKey, kPyTorchFormat},
                                              {kKindKey, kDeployableKind},
                                              {kStepKey, std::to_string(info.step)}};
  if (info.exported) {
    metadata[kScheduleKey] = info.exported->scheduleJson;
    metadata[kSourceWorldSizeKey] = std::to_string(info.exported->sourceWorldSize);
  } else {
    metadata[kSigmaRelKey] = formatDecimal17(info.synthesized->sigmaRel);
    metadata[kGammaKey] = formatDecimal17(info.synthesized->gamma);
    metadata[kSynthesisKey] = info.synthesized->normalized ? kNormalizedSynthesis : kRawSynthesis;
  }
  return metadata;
}

}  // namespace detail
}  // namespace shardema
