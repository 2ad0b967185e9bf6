#include "tensor_file_io.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <system_error>
#include <vector>

#include "os_error.h"
#include "shardema/core/tensor_file.h"

namespace shardema {
namespace detail {
namespace {

constexpr size_t kMaxReadChunk = size_t{1} << 30;

}  // namespace

c10::ScalarType toScalarType(FileDType dtype) {
  switch (dtype) {
    case FileDType::kF64:
      return c10::kDouble;
    case FileDType::kF32:
      return c10::kFloat;
    case FileDType::kF16:
      return c10::kHalf;
    case FileDType::kBF16:
      return c10::kBFloat16;
    case FileDType::kI64:
      return c10::kLong;
    case FileDType::kI32:
      return c10::kInt;
    case FileDType::kI16:
      return c10::kShort;
    case FileDType::kI8:
      return c10::kChar;
    case FileDType::kU8:
      return c10::kByte;
    case FileDType::kBool:
      return c10::kBool;
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled FileDType");
}

namespace {

std::optional<FileDType> fileDTypeOf(c10::ScalarType type) {
  switch (type) {
    case c10::kDouble:
      return FileDType::kF64;
    case c10::kFloat:
      return FileDType::kF32;
    case c10::kHalf:
      return FileDType::kF16;
    case c10::kBFloat16:
      return FileDType::kBF16;
    case c10::kLong:
      return FileDType::kI64;
    case c10::kInt:
      return FileDType::kI32;
    case c10::kShort:
      return FileDType::kI16;
    case c10::kChar:
      return FileDType::kI8;
    case c10::kByte:
      return FileDType::kU8;
    case c10::kBool:
      return FileDType::kBool;
    default:
      return std::nullopt;
  }
}

}  // namespace

FileDType toFileDType(c10::ScalarType type, const std::string& path, const std::string& name) {
  const std::optional<FileDType> dtype = fileDTypeOf(type);
  if (dtype) return *dtype;
  TORCH_CHECK_TYPE(false, path, ": tensor '", name, "' has dtype ", type,
                   ", which tensor files cannot hold (use float64/32/16, bfloat16, int64/32/16/8, "
                   "uint8 or bool)");
}

std::map<std::string, std::string> metadataWithFormat(
    const std::string& path, const std::map<std::string, std::string>& metadata) {
  std::map<std::string, std::string> out = metadata;
  auto [found, inserted] = out.emplace(kFormatKey, kFormatVersion);
  TORCH_CHECK_VALUE(inserted || found->second == kFormatVersion, path, ": metadata ", kFormatKey,
                    " is reserved and must be \"", kFormatVersion, "\", got \"", found->second,
                    "\"");
  return out;
}

void checkBoolBytes(const uint8_t* bytes, size_t count, int64_t firstElement,
                    const std::string& path, const std::string& name) {
  const uint8_t* end = bytes + count;
  const uint8_t* bad = std::find_if(bytes, end, [](uint8_t b) { return b > 1; });
  TORCH_CHECK_VALUE(bad == end, path, ": tensor '", name, "': BOOL element ",
                    firstElement + (bad - bytes), " is byte ",
                    static_cast<int>(bad == end ? 0 : *bad), ", not 0 or 1");
}

InputFile::InputFile(const std::string& path) : file_(path, "safetensors file") {}

InputFile::~InputFile() = default;

// A short read means the file shrank after we sized it: reported as
// truncation.
void InputFile::readAt(void* data, size_t size, uint64_t offset, const std::string& what) const {
  char* bytes = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n =
        ::pread(file_.fd(), bytes, std::min(size, kMaxReadChunk), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK_VALUE(n >= 0, path(), ": read of ", what, " at byte ", offset,
                      " failed: ", osError(errno));
    TORCH_CHECK_VALUE(n > 0, path(), ": file ends at byte ", offset, " while reading ", what,
                      " (truncated?)");
    bytes += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

SafetensorsHeader InputFile::readHeader() const {
  std::vector<uint8_t> prefix(8);
  if (size() >= prefix.size()) readAt(prefix.data(), prefix.size(), 0, "the header length");
  // Checked before the buffer is sized from it: a corrupt length must not
  // become a huge allocation.
  const uint64_t length =
      checkedSafetensorsHeaderLength(prefix.data(), prefix.size(), size(), path());
  prefix.resize(prefix.size() + length);
  readAt(prefix.data() + 8, length, 8, "the header");
  return parseSafetensorsHeader(prefix.data(), prefix.size(), size(), path());
}

}  // namespace detail

bool tensorFilesCanHold(c10::ScalarType dtype) { return detail::fileDTypeOf(dtype).has_value(); }

}  // namespace shardema
