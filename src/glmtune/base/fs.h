#pragma once
// Small file-system helpers with errors that name the file.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace glmtune {

// Reads a whole (small) file; `what` names it in errors ("config", "recipe", ...).
std::string read_text_file(const std::string& path, const std::string& what);
// Writes `content` to `path` atomically (an AtomicFile written whole and committed). A crash
// leaves either the old file or the new one, never a torn file.
void write_file_atomic(const std::string& path, std::string_view content);
// fsync of a directory, so that renames inside it are durable.
void fsync_directory(const std::string& dir);

// Temporary files. glmtune writes a file under `NAME.tmp.<host>.<pid>` and renames it into place;
// the host and the pid say whose file it is, so that a later run can tell the leftover of a killed
// process (same host, pid no longer running) from a file still being written, also on a file
// system shared by several machines. Older glmtune versions wrote `NAME.tmp.<pid>`.
std::filesystem::path temporary_path(const std::filesystem::path& path);
// This host's part of temporary names: the host name up to its first dot, reduced to
// [A-Za-z0-9-] ("localhost" when it has none).
const std::string& temporary_host_tag();
// Removes the temporary files in `dir` (not recursive) that processes of this host left behind
// when they were killed: `NAME.tmp.<this host>.<pid>` and `NAME.tmp.<pid>` whose pid is not a
// running process. Files of other hosts, and of live processes, are left alone; so are, when
// `names` is not empty, temporary files of any NAME not in it. Directories count only in the
// hidden form checkpoint writers use (.NAME.tmp.<host>.<pid>). Logs each removal (what, size,
// pid) and returns how many were removed.
size_t remove_stale_temporary_files(const std::filesystem::path& dir,
                                    const std::vector<std::string>& names = {});

// Removes a file when it goes out of scope, unless release()d: a temporary file that an error (an
// exception) must not leave behind.
class RemoveOnExit {
 public:
  explicit RemoveOnExit(std::filesystem::path path) : path_(std::move(path)) {}
  ~RemoveOnExit();
  RemoveOnExit(const RemoveOnExit&) = delete;
  RemoveOnExit& operator=(const RemoveOnExit&) = delete;
  void release() { path_.clear(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A file opened for writing; closes on destruction. All writes are complete writes (retrying
// after short writes and EINTR) and fail with a glmtune::Error naming the file.
class OutputFile {
 public:
  // Creates or truncates `path` (mode 0644).
  explicit OutputFile(const std::filesystem::path& path);
  virtual ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  void write(const void* data, size_t bytes);
  void write(std::string_view text) { write(text.data(), text.size()); }
  void pwrite(const void* data, size_t bytes, uint64_t offset);
  // Sets the file length (reserves the data region of a planned file).
  void truncate(uint64_t length);
  void sync();
  void close();
  // The file written to (for an AtomicFile, its temporary name).
  const std::filesystem::path& path() const { return path_; }

 protected:
  void close_quietly() noexcept;

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

// The one way glmtune replaces a single file: the content is written to temporary_path(target)
// in the target's directory, and commit() fsyncs it, renames it over `target` and fsyncs the
// directory. Until commit() returns, `target` is untouched (the old file, or none); after it,
// `target` is the new file whole. A crash in between leaves a temporary file that
// remove_stale_temporary_files recognises; an error or a destruction without commit() removes it.
// Whole directories (checkpoints) are swapped in by their writers instead.
class AtomicFile : public OutputFile {
 public:
  explicit AtomicFile(std::filesystem::path target);
  ~AtomicFile() override;

  // Errors name the file and the fix; the temporary file is removed on failure.
  void commit();
  bool committed() const { return committed_; }
  const std::filesystem::path& target() const { return target_; }

 private:
  std::filesystem::path target_;
  bool committed_ = false;
};

// Creates the directory `dir` (and its parents) for output named by `key` (a recipe key such as
// "recipe.toml: output.dir" or a flag such as "--out"). When it cannot be created, throws
// glmtune::Error naming the key, the path, the operating system's reason and what to do: the
// component that is a file rather than a directory, or the nearest existing directory that is
// read-only or not writable.
void create_output_directory(const std::filesystem::path& dir, const std::string& key);
// The same for the directory a file or checkpoint `path` will be written into.
void create_parent_directory(const std::filesystem::path& path, const std::string& key);

}  // namespace glmtune
