#pragma once
// XXH64 checksums (Debian's libxxhash) of byte streams and files: what a
// per-rank checkpoint manifest records for each file. The digest is the
// standard XXH64 with seed 0, so `xxhsum -H64 FILE` prints the same value.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace shardema {

/// Incremental XXH64 (seed 0). update() in any split gives the digest of the
/// concatenation. Not thread-safe: one object per stream. Movable, not copyable.
class Xxh64 {
 public:
  Xxh64();
  ~Xxh64();
  Xxh64(const Xxh64&) = delete;
  Xxh64& operator=(const Xxh64&) = delete;
  Xxh64(Xxh64&& other) noexcept;
  Xxh64& operator=(Xxh64&& other) noexcept;

  /// Feeds `size` bytes (size 0 with any pointer, null included, is a no-op).
  void update(const void* data, size_t size);
  /// Digest of everything fed so far; feeding may continue afterwards.
  uint64_t digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// XXH64 (seed 0) of one buffer.
uint64_t xxh64(const void* data, size_t size);

/// 16 lowercase hex digits, most significant first (xxhsum's spelling).
std::string checksumHex(uint64_t digest);

/// Parses checksumHex() output (exactly 16 hex digits, either case);
/// c10::ValueError naming the text otherwise.
uint64_t parseChecksumHex(const std::string& text);

/// XXH64 of a whole file, read in bounded chunks (memory does not grow with
/// the file). Blocks. c10::ValueError naming the file when it cannot be
/// opened or read, or is not a regular file.
uint64_t fileChecksum(const std::string& path);

}  // namespace shardema
