#pragma once
// Bitwise comparison that is defined for empty buffers (memcmp with a null
// pointer is undefined even for zero bytes, and UBSan says so).
#include <cstddef>
#include <cstring>

namespace shardema::testing {

inline bool sameBytes(const void* a, const void* b, size_t bytes) {
  return bytes == 0 || std::memcmp(a, b, bytes) == 0;
}

}  // namespace shardema::testing
