#include "shardema/core/file_system.h"

#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>

#include "os_error.h"

namespace shardema::detail {
namespace {

bool statOf(const std::string& path, struct stat* info) {
  return !path.empty() && ::stat(path.c_str(), info) == 0;
}

void setError(std::string* error, int code) {
  if (error != nullptr) *error = osError(code);
}

// The non-empty parts between separators.
std::vector<std::string> partsOf(const std::string& path) {
  std::vector<std::string> parts;
  size_t begin = 0;
  while (begin <= path.size()) {
    size_t end = path.find('/', begin);
    if (end == std::string::npos) end = path.size();
    if (end > begin) parts.push_back(path.substr(begin, end - begin));
    begin = end + 1;
  }
  return parts;
}

std::string joined(const std::string& head, const std::string& tail) {
  if (head.empty()) return tail;
  if (tail.empty()) return head;
  return head.back() == '/' ? head + tail : head + "/" + tail;
}

std::string stripTrailingSeparators(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

}  // namespace

bool isDirectory(const std::string& path) {
  struct stat info {};
  return statOf(path, &info) && S_ISDIR(info.st_mode);
}

bool isRegularFile(const std::string& path) {
  struct stat info {};
  return statOf(path, &info) && S_ISREG(info.st_mode);
}

bool pathExists(const std::string& path) {
  struct stat info {};
  return statOf(path, &info);
}

std::vector<std::string> directoryNames(const std::string& dir, std::string* error) {
  std::vector<std::string> names;
  std::unique_ptr<DIR, int (*)(DIR*)> folder(::opendir(dir.c_str()), &::closedir);
  if (!folder) {
    setError(error, errno);
    return names;
  }
  errno = 0;
  while (const struct dirent* entry = ::readdir(folder.get())) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  if (errno != 0) {
    setError(error, errno);
    return {};
  }
  std::sort(names.begin(), names.end());
  return names;
}

bool createDirectories(const std::string& dir, std::string* error) {
  if (dir.empty()) {
    setError(error, ENOENT);
    return false;
  }
  std::string prefix = dir.front() == '/' ? "/" : "";
  for (const std::string& part : partsOf(dir)) {
    prefix = joined(prefix, part);
    if (::mkdir(prefix.c_str(), 0777) == 0) continue;
    const int code = errno;  // an existing folder may answer EACCES or EROFS, not EEXIST
    if (!isDirectory(prefix)) {
      setError(error, code == EEXIST ? ENOTDIR : code);
      return false;
    }
  }
  return true;
}

bool removePath(const std::string& path) {
  // C's remove(): unlink, or rmdir for a folder.
  return !path.empty() && ::remove(path.c_str()) == 0;
}

std::string absolutePath(const std::string& path) {
  if (!path.empty() && path.front() == '/') return path;
  std::unique_ptr<char, void (*)(void*)> cwd(::getcwd(nullptr, 0), &::free);
  return joined(cwd ? std::string(cwd.get()) : std::string("."), path);
}

std::string lexicallyNormal(const std::string& path) {
  if (path.empty()) return path;
  const bool rooted = path.front() == '/';
  std::vector<std::string> kept;
  for (const std::string& part : partsOf(path)) {
    if (part == ".") continue;
    if (part == ".." && !kept.empty() && kept.back() != "..") {
      kept.pop_back();
    } else if (part != ".." || !rooted) {
      kept.push_back(part);  // a ".." above a relative start stays; above "/" it is "/"
    }
  }
  std::string out = rooted ? "/" : "";
  for (const std::string& part : kept) out = joined(out, part);
  return out.empty() ? "." : out;
}

std::string parentPath(const std::string& path) {
  const size_t last = path.rfind('/');
  if (last == std::string::npos) return "";
  if (path.find_first_not_of('/') == std::string::npos) return path;  // the root is its own parent
  if (last + 1 == path.size()) return stripTrailingSeparators(path);  // "a/b/": the name is empty
  const std::string head = stripTrailingSeparators(path.substr(0, last));
  return head.empty() ? "/" : head;
}

std::string fileName(const std::string& path) {
  const size_t last = path.rfind('/');
  return last == std::string::npos ? path : path.substr(last + 1);
}

std::string weaklyCanonical(const std::string& path) {
  const std::vector<std::string> parts = partsOf(absolutePath(path));
  for (size_t existing = parts.size() + 1; existing-- > 0;) {
    std::string prefix = "/";
    for (size_t i = 0; i < existing; ++i) prefix = joined(prefix, parts[i]);
    std::unique_ptr<char, void (*)(void*)> real(::realpath(prefix.c_str(), nullptr), &::free);
    if (!real) continue;
    std::string out = real.get();
    for (size_t i = existing; i < parts.size(); ++i) out = joined(out, parts[i]);
    return lexicallyNormal(out);
  }
  return lexicallyNormal(absolutePath(path));
}

}  // namespace shardema::detail
