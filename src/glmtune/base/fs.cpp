#include "glmtune/base/fs.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <system_error>

#include "glmtune/base/error.h"

namespace glmtune {
namespace fs = std::filesystem;

std::string read_text_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error(what + " file does not exist", path, "check the path");
  if (fs::is_directory(path, ec))
    throw Error("is a directory, expected a " + what + " file", path, "point at the file itself");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw Error(std::string("cannot open: ") + std::strerror(errno), path,
                "check the file's permissions");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void fsync_directory(const std::string& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // not fatal: some file systems do not allow opening directories
  ::fsync(fd);
  ::close(fd);
}

const std::string& temporary_host_tag() {
  static const std::string tag = [] {
    char name[256] = {};
    std::string out;
    if (::gethostname(name, sizeof name - 1) == 0)
      for (const char* c = name; *c && *c != '.'; ++c)
        if (std::isalnum(static_cast<unsigned char>(*c)) || *c == '-') out += *c;
    if (out.size() > 48) out.resize(48);  // names stay well inside the 255-byte limit
    return out.empty() ? std::string("localhost") : out;
  }();
  return tag;
}

fs::path temporary_path(const fs::path& path) {
  return fs::path(path.string() + ".tmp." + temporary_host_tag() + "." +
                  std::to_string(::getpid()));
}

RemoveOnExit::~RemoveOnExit() {
  if (path_.empty()) return;
  std::error_code ec;
  fs::remove(path_, ec);
}

size_t remove_stale_temporary_files(const fs::path& dir, const std::vector<std::string>& names) {
  // NAME.tmp.<host>.<pid>, or NAME.tmp.<pid> of older versions.
  static const std::regex re(R"(^(.+)\.tmp\.(?:([A-Za-z0-9-]+)\.)?(\d{1,9})$)");
  size_t removed = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir.empty() ? fs::path(".") : dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, re)) continue;
    std::error_code st;
    const bool is_dir = entry.is_directory(st);
    // Directories only in the hidden form of checkpoint writers (.NAME.tmp.<host>.<pid>).
    if (!(entry.is_regular_file(st) || (is_dir && name.front() == '.'))) continue;
    if (!names.empty() && std::find(names.begin(), names.end(), m[1].str()) == names.end())
      continue;
    if (m[2].matched && m[2].str() != temporary_host_tag()) continue;  // another machine's
    const pid_t pid = static_cast<pid_t>(std::stol(m[3].str()));
    if (pid <= 0 || pid == ::getpid()) continue;
    if (::kill(pid, 0) == 0 || errno == EPERM) continue;  // a running process owns it
    std::error_code size_ec;
    const uintmax_t bytes = is_dir ? 0 : entry.file_size(size_ec);
    std::error_code rm;
    if (is_dir)
      fs::remove_all(entry.path(), rm);
    else
      fs::remove(entry.path(), rm);
    if (rm) {
      spdlog::warn(
          "could not remove {}, a temporary {} left by process {}, which is no longer "
          "running: {}",
          entry.path().string(), is_dir ? "directory" : "file", pid, rm.message());
      continue;
    }
    ++removed;
    spdlog::info(
        "removed {}{}: a temporary {} left by process {} of this host, which is no "
        "longer running (killed while writing {})",
        entry.path().string(), is_dir ? std::string() : fmt::format(" ({} bytes)", bytes),
        is_dir ? "directory" : "file", pid, m[1].str());
  }
  return removed;
}

namespace {

std::string errno_text(int err) { return std::system_category().message(err); }

void close_fd_quietly(int fd) {
  if (fd >= 0) ::close(fd);
}

// The fix line for a failed write, fsync or close, by cause.
std::string write_fix(int err) {
  if (err == ENOSPC || err == EDQUOT) return "free disk space or write elsewhere";
  if (err == EFBIG) return "raise the file-size limit (ulimit -f) or write elsewhere";
  return {};
}

}  // namespace

OutputFile::OutputFile(const fs::path& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const int err = errno;
    std::string fix;
    if (err == ENOENT)
      fix = "create the parent directory first";
    else if (err == EACCES || err == EPERM || err == EROFS)
      fix = "make the directory writable by this user, or write elsewhere";
    else if (err == EISDIR)
      fix = "a directory has this name: remove it or write elsewhere";
    else if (err == EMFILE || err == ENFILE)
      fix = "raise the open-file limit (ulimit -n)";
    else if (err == ENOSPC || err == EDQUOT)
      fix = "free disk space or write elsewhere";
    throw Error("cannot create file (" + errno_text(err) + ")", path.string(), fix);
  }
}

OutputFile::~OutputFile() { close_quietly(); }

void OutputFile::close_quietly() noexcept {
  close_fd_quietly(fd_);
  fd_ = -1;
}

namespace {

// Writes all of `bytes` to `fd`, at `offset` when given (pwrite) or at the file position,
// retrying short writes and interrupted calls.
void write_fully(int fd, const std::filesystem::path& path, const void* data, size_t bytes,
                 std::optional<uint64_t> offset) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const size_t chunk = std::min<size_t>(bytes, size_t(1) << 30);
    const ssize_t n = offset ? ::pwrite(fd, p, chunk, off_t(*offset)) : ::write(fd, p, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      throw Error("write failed (" + errno_text(err) + ")", path.string(), write_fix(err));
    }
    p += n;
    bytes -= size_t(n);
    if (offset) *offset += uint64_t(n);
  }
}

}  // namespace

void OutputFile::write(const void* data, size_t bytes) {
  write_fully(fd_, path_, data, bytes, std::nullopt);
}

void OutputFile::pwrite(const void* data, size_t bytes, uint64_t offset) {
  write_fully(fd_, path_, data, bytes, offset);
}

void OutputFile::truncate(uint64_t length) {
  if (::ftruncate(fd_, off_t(length)) != 0) {
    const int err = errno;
    throw Error("cannot set file length (" + errno_text(err) + ")", path_.string(), write_fix(err));
  }
}

void OutputFile::sync() {
  if (::fsync(fd_) != 0) {
    const int err = errno;
    throw Error("fsync failed (" + errno_text(err) + ")", path_.string(), write_fix(err));
  }
}

void OutputFile::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  // A failing close can report a delayed write error (NFS); it must not be ignored.
  if (::close(fd) != 0) {
    const int err = errno;
    throw Error("close failed (" + errno_text(err) + ")", path_.string(), write_fix(err));
  }
}

AtomicFile::AtomicFile(fs::path target)
    : OutputFile(temporary_path(target)), target_(std::move(target)) {}

AtomicFile::~AtomicFile() {
  if (committed_) return;
  close_quietly();
  std::error_code ec;
  fs::remove(path(), ec);
}

void AtomicFile::commit() {
  GLMTUNE_ASSERT(!committed_, "{} committed twice", target_.string());
  sync();
  close();
  if (::rename(path().c_str(), target_.c_str()) != 0) {
    const int err = errno;
    std::string fix;
    if (err == EISDIR || err == ENOTEMPTY || err == EEXIST)
      fix = "a directory has this name: remove it or write elsewhere";
    else if (err == EACCES || err == EPERM || err == EROFS)
      fix = "make the directory writable by this user, or write elsewhere";
    else
      fix = "check the directory's permissions and free space";
    throw Error(fmt::format("cannot rename the finished {} into place ({})", path().string(),
                            errno_text(err)),
                target_.string(), fix);
  }
  committed_ = true;
  fsync_directory(target_.parent_path().string());
}

void write_file_atomic(const std::string& path, std::string_view content) {
  AtomicFile file(path);
  file.write(content);
  file.commit();
}

void create_output_directory(const fs::path& dir, const std::string& key) {
  std::error_code ec;
  if (fs::is_directory(dir, ec)) return;
  fs::create_directories(dir, ec);
  if (!ec && fs::is_directory(dir)) return;
  // Walk the path: a component that exists but is no directory blocks it, else the nearest
  // existing directory is where the OS said no.
  fs::path walked, nearest = dir.is_absolute() ? fs::path("/") : fs::path(".");
  for (const auto& part : dir.lexically_normal()) {
    walked /= part;
    std::error_code st_ec;
    const auto st = fs::status(walked, st_ec);
    if (!fs::exists(st)) break;
    if (!fs::is_directory(st))
      throw Error(fmt::format("cannot create the directory {}: {} is a file, not a directory",
                              dir.string(), walked.string()),
                  key,
                  fmt::format("give {} a path that does not pass through a file, or move {} away",
                              key, walked.string()));
    nearest = walked;
  }
  const int err = ec.value();
  const std::string reason = ec ? ec.message() : "it exists and is not a directory";
  std::string fix;
  if (err == EROFS)
    fix = fmt::format("{} is on a read-only file system: point {} at a writable location",
                      nearest.string(), key);
  else if (err == EACCES || err == EPERM)
    fix = fmt::format(
        "{} is not writable by this user: point {} at a writable location, or give this user "
        "write permission on {}",
        nearest.string(), key, nearest.string());
  else if (err == ENOSPC || err == EDQUOT)
    fix = fmt::format("free space on the file system of {}, or point {} elsewhere",
                      nearest.string(), key);
  else
    fix = fmt::format("check the path given as {}", key);
  throw Error(fmt::format("cannot create the directory {} ({})", dir.string(), reason), key, fix);
}

void create_parent_directory(const fs::path& path, const std::string& key) {
  fs::path p = path.lexically_normal();
  if (p.filename().empty()) p = p.parent_path();  // "dir/" names dir
  const fs::path parent = p.parent_path();
  if (!parent.empty()) create_output_directory(parent, key);
}

}  // namespace glmtune
