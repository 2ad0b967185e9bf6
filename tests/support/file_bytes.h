#pragma once
// Whole-file reads and writes for tests that inspect or forge file bytes.
#include <fstream>
#include <sstream>
#include <string>

namespace shardema::testing {

inline std::string readFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

inline void writeFileBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

}  // namespace shardema::testing
