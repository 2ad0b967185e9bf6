#include "shardema/tensor_file.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

#include "shardema/atomic_file.h"

// Tensor bytes go between memory and the file as they are: the format is
// little-endian, so is every host we build for; a big-endian port would
// need byte swapping here.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "shardema's tensor files assume a little-endian host");

namespace shardema {
namespace {

constexpr size_t kMaxReadChunk = size_t{1} << 30;

std::string osError(int error) { return std::generic_category().message(error); }

at::ScalarType toScalarType(FileDType dtype) {
  switch (dtype) {
    case FileDType::kF64:
      return at::kDouble;
    case FileDType::kF32:
      return at::kFloat;
    case FileDType::kF16:
      return at::kHalf;
    case FileDType::kBF16:
      return at::kBFloat16;
    case FileDType::kI64:
      return at::kLong;
    case FileDType::kI32:
      return at::kInt;
    case FileDType::kI16:
      return at::kShort;
    case FileDType::kI8:
      return at::kChar;
    case FileDType::kU8:
      return at::kByte;
    case FileDType::kBool:
      return at::kBool;
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled FileDType");
}

FileDType toFileDType(at::ScalarType type, const std::string& path, const std::string& name) {
  switch (type) {
    case at::kDouble:
      return FileDType::kF64;
    case at::kFloat:
      return FileDType::kF32;
    case at::kHalf:
      return FileDType::kF16;
    case at::kBFloat16:
      return FileDType::kBF16;
    case at::kLong:
      return FileDType::kI64;
    case at::kInt:
      return FileDType::kI32;
    case at::kShort:
      return FileDType::kI16;
    case at::kChar:
      return FileDType::kI8;
    case at::kByte:
      return FileDType::kU8;
    case at::kBool:
      return FileDType::kBool;
    default:
      break;
  }
  TORCH_CHECK_TYPE(false, path, ": tensor '", name, "' has dtype ", type,
                   ", which tensor files cannot hold (use float64/32/16, bfloat16, int64/32/16/8, "
                   "uint8 or bool)");
}

// Owns a read-only descriptor and knows the file's size and name.
class InputFile {
 public:
  explicit InputFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TORCH_CHECK_VALUE(fd_ >= 0, path, ": cannot open: ", osError(errno));
    struct stat info {};
    if (::fstat(fd_, &info) != 0) {
      const int error = errno;
      ::close(fd_);
      TORCH_CHECK_VALUE(false, path, ": cannot stat: ", osError(error));
    }
    if (!S_ISREG(info.st_mode)) {
      ::close(fd_);
      TORCH_CHECK_VALUE(false, path, ": not a regular file");
    }
    size_ = static_cast<uint64_t>(info.st_size);
  }
  ~InputFile() { ::close(fd_); }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  uint64_t size() const { return size_; }

  // Reads exactly `size` bytes at `offset`; a short read means the file
  // shrank after we sized it, reported as truncation.
  void readAt(void* data, size_t size, uint64_t offset, const char* what) const {
    char* bytes = static_cast<char*>(data);
    while (size > 0) {
      const ssize_t n =
          ::pread(fd_, bytes, std::min(size, kMaxReadChunk), static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      TORCH_CHECK_VALUE(n >= 0, path_, ": read of ", what, " at byte ", offset,
                        " failed: ", osError(errno));
      TORCH_CHECK_VALUE(n > 0, path_, ": file ends at byte ", offset, " while reading ", what,
                        " (truncated?)");
      bytes += n;
      size -= static_cast<size_t>(n);
      offset += static_cast<uint64_t>(n);
    }
  }

  SafetensorsHeader readHeader() const {
    std::vector<uint8_t> prefix(8);
    if (size_ >= prefix.size()) readAt(prefix.data(), prefix.size(), 0, "the header length");
    // Checked before the buffer is sized from it: a corrupt length must not
    // become a huge allocation.
    const uint64_t length =
        checkedSafetensorsHeaderLength(prefix.data(), prefix.size(), size_, path_);
    prefix.resize(prefix.size() + length);
    readAt(prefix.data() + 8, length, 8, "the header");
    return parseSafetensorsHeader(prefix.data(), prefix.size(), size_, path_);
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// ATen assumes bool bytes are 0 or 1; any other byte is undefined behaviour
// in later kernels, so a file holding one is refused as corrupt.
void checkBoolBytes(const at::Tensor& tensor, const std::string& path, const std::string& name) {
  const auto* bytes = static_cast<const uint8_t*>(tensor.data_ptr());
  const auto* end = bytes + tensor.numel();
  const auto* bad = std::find_if(bytes, end, [](uint8_t b) { return b > 1; });
  TORCH_CHECK_VALUE(bad == end, path, ": tensor '", name, "': BOOL element ", bad - bytes,
                    " is byte ", static_cast<int>(bad == end ? 0 : *bad), ", not 0 or 1");
}

at::Tensor readEntry(const InputFile& file, const SafetensorsHeader& header,
                     const TensorEntry& entry, const std::string& path) {
  at::Tensor tensor = at::empty(entry.shape, at::TensorOptions().dtype(toScalarType(entry.dtype)));
  TORCH_INTERNAL_ASSERT(tensor.nbytes() == entry.byteSize(), "size mismatch for ", entry.name);
  if (entry.byteSize() > 0) {
    const std::string what = "tensor '" + entry.name + "'";
    file.readAt(tensor.data_ptr(), entry.byteSize(), header.dataOffset + entry.begin, what.c_str());
  }
  if (entry.dtype == FileDType::kBool) checkBoolBytes(tensor, path, entry.name);
  return tensor;
}

// Everything that can be refused is refused here, before the temp file
// exists.
std::vector<TensorEntry> entriesToWrite(const std::string& path, const TensorFile& file) {
  std::vector<TensorEntry> entries;
  entries.reserve(file.tensors.size());
  for (const auto& [name, tensor] : file.tensors) {
    TORCH_CHECK_VALUE(tensor.defined(), path, ": tensor '", name, "' is undefined");
    TORCH_CHECK_TYPE(tensor.layout() == at::kStrided, path, ": tensor '", name, "' has layout ",
                     tensor.layout(), "; only dense (strided) tensors can be written");
    TensorEntry entry;
    entry.name = name;
    entry.dtype = toFileDType(tensor.scalar_type(), path, name);
    entry.shape = tensor.sizes().vec();
    entries.push_back(std::move(entry));
  }
  return entries;
}

std::map<std::string, std::string> metadataToWrite(const std::string& path,
                                                   const TensorFile& file) {
  std::map<std::string, std::string> metadata = file.metadata;
  auto [found, inserted] = metadata.emplace(kFormatKey, kFormatVersion);
  TORCH_CHECK_VALUE(inserted || found->second == kFormatVersion, path, ": metadata ", kFormatKey,
                    " is reserved and must be \"", kFormatVersion, "\", got \"", found->second,
                    "\"");
  return metadata;
}

// A dense row-major host copy, made only when the tensor is not one already.
at::Tensor hostBytes(const at::Tensor& tensor, const std::string& path, const std::string& name) {
  try {
    at::Tensor host = tensor.is_cpu() ? tensor : tensor.cpu();
    if (host.is_neg()) host = host.resolve_neg();
    return host.contiguous();
  } catch (const c10::Error& error) {
    TORCH_CHECK(false, path, ": cannot copy tensor '", name, "' to host memory: ", error.msg());
  }
  return at::Tensor();  // not reached: the check above always throws
}

}  // namespace

const at::Tensor& TensorFile::at(const std::string& name) const {
  auto found = std::find_if(tensors.begin(), tensors.end(),
                            [&](const auto& item) { return item.first == name; });
  TORCH_CHECK_INDEX(found != tensors.end(), "TensorFile: no tensor named '", name, "' among ",
                    tensors.size(), " tensors");
  return found->second;
}

bool TensorFile::contains(const std::string& name) const {
  return std::any_of(tensors.begin(), tensors.end(),
                     [&](const auto& item) { return item.first == name; });
}

void writeTensorFile(const std::string& path, const TensorFile& file) {
  std::vector<TensorEntry> entries = entriesToWrite(path, file);
  const std::string header = buildSafetensorsHeader(entries, metadataToWrite(path, file), path);

  AtomicFileWriter writer(path);
  writer.write(header.data(), header.size());
  // One host copy alive at a time: memory stays at one tensor's size.
  for (size_t i = 0; i < entries.size(); ++i) {
    const at::Tensor host = hostBytes(file.tensors[i].second, path, entries[i].name);
    TORCH_INTERNAL_ASSERT(host.nbytes() == entries[i].byteSize(), "size mismatch for ",
                          entries[i].name);
    if (host.nbytes() > 0) writer.write(host.data_ptr(), host.nbytes());
  }
  TORCH_INTERNAL_ASSERT(writer.size() ==
                        header.size() + (entries.empty() ? 0 : entries.back().end));
  writer.commit();
}

TensorFile readTensorFile(const std::string& path) {
  InputFile input(path);
  const SafetensorsHeader header = input.readHeader();
  TensorFile file;
  file.metadata = header.metadata;
  file.tensors.reserve(header.tensors.size());
  for (const TensorEntry& entry : header.tensors) {
    file.tensors.emplace_back(entry.name, readEntry(input, header, entry, path));
  }
  return file;
}

SafetensorsHeader readTensorFileHeader(const std::string& path) {
  return InputFile(path).readHeader();
}

}  // namespace shardema
