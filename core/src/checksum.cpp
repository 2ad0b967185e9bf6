#include "shardema/core/checksum.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <system_error>
#include <vector>

#include "os_error.h"
#include "shardema/core/regular_file.h"

namespace shardema {
namespace {

constexpr XXH64_hash_t kSeed = 0;
// Large enough that the syscall cost vanishes, small enough to be a fixed,
// modest buffer whatever the file size.
constexpr size_t kFileChunk = size_t{4} << 20;

using detail::osError;

int hexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

struct Xxh64::State {
  State() : state(XXH64_createState()) {
    TORCH_CHECK(state != nullptr, "Xxh64: out of memory for the hash state");
    XXH64_reset(state, kSeed);
  }
  ~State() { XXH64_freeState(state); }
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  XXH64_state_t* state;
};

Xxh64::Xxh64() : state_(std::make_unique<State>()) {}
Xxh64::~Xxh64() = default;
Xxh64::Xxh64(Xxh64&& other) noexcept = default;
Xxh64& Xxh64::operator=(Xxh64&& other) noexcept = default;

void Xxh64::update(const void* data, size_t size) {
  TORCH_CHECK(state_ != nullptr, "Xxh64::update: used after a move");
  if (size == 0) return;
  XXH64_update(state_->state, data, size);
}

uint64_t Xxh64::digest() const {
  TORCH_CHECK(state_ != nullptr, "Xxh64::digest: used after a move");
  return XXH64_digest(state_->state);
}

uint64_t xxh64(const void* data, size_t size) {
  // XXH64 of zero bytes never reads the pointer, but a null one is not
  // promised to be accepted.
  static const char kEmpty = 0;
  return XXH64(size == 0 ? &kEmpty : data, size, kSeed);
}

std::string checksumHex(uint64_t digest) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(digest));
  return std::string(text, 16);
}

uint64_t parseChecksumHex(const std::string& text) {
  TORCH_CHECK_VALUE(text.size() == 16, "parseChecksumHex: expected 16 hex digits, got \"", text,
                    "\"");
  uint64_t value = 0;
  for (char c : text) {
    const int digit = hexValue(c);
    TORCH_CHECK_VALUE(digit >= 0, "parseChecksumHex: expected 16 hex digits, got \"", text, "\"");
    value = (value << 4) | static_cast<uint64_t>(digit);
  }
  return value;
}

uint64_t fileChecksum(const std::string& path) {
  const detail::RegularFile file(path, "file to checksum");
  const int fd = file.fd();
  std::vector<char> buffer(kFileChunk);
  Xxh64 hash;
  uint64_t offset = 0;
  while (true) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK_VALUE(n >= 0, path, ": read at byte ", offset, " failed: ", osError(errno));
    if (n == 0) break;
    hash.update(buffer.data(), static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return hash.digest();
}

}  // namespace shardema
