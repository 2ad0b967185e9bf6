#include "posthoc_set_aside.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "sharded_internal.h"
#include "shardema/core/file_system.h"
#include "shardema/core/posthoc_snapshot.h"

namespace shardema::detail {
namespace {

constexpr const char* kSetAsideApi = "PostHocCallback";

// A rename is durable only once its folder is: without this a crash could
// bring a moved snapshot back into the synthesis set.
void fsyncFolder(const std::string& folder) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, kSetAsideApi, ": cannot open ", folder,
              " to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, kSetAsideApi, ": fsync of ", folder, " failed: ", std::strerror(error));
}

// superseded/resumed_at_{calls}, or the first of _2, _3, ... not taken: a
// second resume at the same call keeps the first one's files apart.
std::string freshSupersededFolder(const std::string& snapshotFolder, int64_t calls) {
  const std::string base =
      joinPath(joinPath(snapshotFolder, kSupersededFolder), "resumed_at_" + std::to_string(calls));
  std::string candidate = base;
  for (int n = 2; pathExists(candidate); ++n) candidate = base + "_" + std::to_string(n);
  return candidate;
}

void moveInto(const std::string& from, const std::string& folder, const std::string& name) {
  const std::string to = joinPath(folder, name);
  TORCH_CHECK(!pathExists(to), kSetAsideApi, ": cannot set ", from, " aside: ", to, " exists");
  TORCH_CHECK(std::rename(from.c_str(), to.c_str()) == 0, kSetAsideApi, ": cannot move ", from,
              " to ", to, ": ", std::strerror(errno));
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

SetAsideSnapshots setAsideSupersededSnapshots(const std::string& snapshotFolder,
                                              const std::string& resumeFolder, int64_t calls,
                                              int64_t checkpointEvery) {
  SetAsideSnapshots moved;
  if (!isDirectory(snapshotFolder)) return moved;
  const bool offGrid = calls % checkpointEvery != 0;
  std::string listError;
  const std::vector<std::string> names = directoryNames(snapshotFolder, &listError);
  TORCH_CHECK(listError.empty(), kSetAsideApi, ": cannot list ", snapshotFolder, ": ", listError);
  for (const std::string& name : names) {
    int64_t step = 0;
    if (!isRegularFile(joinPath(snapshotFolder, name)) ||
        !parseSnapshotFileName(name, nullptr, &step)) {
      continue;
    }
    if (step == calls && offGrid && !pathExists(joinPath(resumeFolder, name))) {
      moved.intoResumeFolder.push_back(name);
    } else if (step > calls || (step == calls && offGrid)) {
      moved.superseded.push_back(name);
    }
  }
  std::sort(moved.intoResumeFolder.begin(), moved.intoResumeFolder.end());
  std::sort(moved.superseded.begin(), moved.superseded.end());
  if (!moved.intoResumeFolder.empty()) {
    ensureDirectory(resumeFolder, kSetAsideApi);
    for (const std::string& name : moved.intoResumeFolder) {
      moveInto(joinPath(snapshotFolder, name), resumeFolder, name);
    }
    fsyncFolder(resumeFolder);
  }
  if (!moved.superseded.empty()) {
    moved.supersededFolder = freshSupersededFolder(snapshotFolder, calls);
    ensureDirectory(moved.supersededFolder, kSetAsideApi);
    for (const std::string& name : moved.superseded) {
      moveInto(joinPath(snapshotFolder, name), moved.supersededFolder, name);
    }
    fsyncFolder(moved.supersededFolder);
  }
  if (!moved.empty()) fsyncFolder(snapshotFolder);
  return moved;
}

std::string describeSetAside(const std::string& snapshotFolder, const std::string& resumeFolder,
                             int64_t calls, const SetAsideSnapshots& moved) {
  std::ostringstream out;
  out << "post-hoc snapshots in " << snapshotFolder << ": resuming at step " << calls
      << " moved the snapshots the resumed run supersedes out of the synthesis set: ";
  if (!moved.intoResumeFolder.empty()) {
    out << joined(moved.intoResumeFolder) << " (the final snapshot of the run that ended at step "
        << calls << ") to " << resumeFolder;
  }
  if (!moved.superseded.empty()) {
    out << (moved.intoResumeFolder.empty() ? "" : "; ") << joined(moved.superseded) << " to "
        << moved.supersededFolder;
  }
  return out.str();
}

}  // namespace shardema::detail
