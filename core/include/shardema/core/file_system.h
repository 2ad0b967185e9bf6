#pragma once
// The few file-system operations shardema performs (list a folder, make
// one, remove a file, stat, and path arithmetic), on POSIX calls and plain
// '/'-separated strings.
//
// Why not std::filesystem: PyPI's torch exports unversioned copies of
// std::filesystem's functions (pytorch/pytorch#133437; libtorch.so and
// libtorch_cpu.so), and the dynamic loader binds a call to the first
// definition in its lookup order, which depends on the program, on
// DT_NEEDED order and on what torch loaded RTLD_GLOBAL. libtorch.so's
// remove_all jumps to address 0. Code that calls none of std::filesystem
// cannot be bound to those copies, in our programs, in shardema._C or in a
// user's program linking the library; tests/python/test_module_linkage.py
// checks that the module imports no std::filesystem symbol.
//
// Nothing here throws (but std::bad_alloc); each call blocks on the system
// calls it makes; any thread.
#include <string>
#include <vector>

namespace shardema::detail {

/// Whether `path` is a folder / a regular file / anything at all, following
/// symbolic links (stat), as std::filesystem::is_directory, is_regular_file
/// and exists do. False when it cannot be stat'ed.
bool isDirectory(const std::string& path);
bool isRegularFile(const std::string& path);
bool pathExists(const std::string& path);

/// The names of the entries of folder `dir`, without "." and "..", sorted.
/// When the folder cannot be read: empty, and `*error` (when given) says
/// why ("No such file or directory").
std::vector<std::string> directoryNames(const std::string& dir, std::string* error);

/// Creates folder `dir` and its missing parents (mkdir -p, mode 0777 less
/// the umask). True when `dir` is a folder afterwards; otherwise false and
/// `*error` (when given) says why.
bool createDirectories(const std::string& dir, std::string* error);

/// Removes a file, a symbolic link or an empty folder, as
/// std::filesystem::remove. False when nothing was removed.
bool removePath(const std::string& path);

// Path arithmetic on strings; no file-system access unless said.

/// `path` when absolute, else the current folder joined with it (no
/// normalisation), as std::filesystem::absolute. Reads the current folder.
std::string absolutePath(const std::string& path);

/// `path` with ".", "..", and repeated separators resolved lexically, as
/// std::filesystem::path::lexically_normal, but with no trailing separator
/// (except for "/"): "a/./b/../c/" -> "a/c", "a/.." -> ".", "" -> "".
std::string lexicallyNormal(const std::string& path);

/// As std::filesystem::path::parent_path: "a/b" -> "a", "b" -> "", "/a" ->
/// "/", "a/b/" -> "a/b".
std::string parentPath(const std::string& path);

/// As std::filesystem::path::filename: "a/b" -> "b", "a/" -> "", "/" -> "".
std::string fileName(const std::string& path);

/// As std::filesystem::weakly_canonical(absolute(path)), without a trailing
/// separator: the longest leading part that exists resolved (symbolic
/// links, "..": realpath), the rest appended and normalised lexically.
/// Reads the file system.
std::string weaklyCanonical(const std::string& path);

}  // namespace shardema::detail
