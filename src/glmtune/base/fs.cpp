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
#include <regex>
#include <sstream>

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

void write_file_atomic(const std::string& path, const std::string& content) {
  const fs::path target(path);
  const fs::path tmp = temporary_path(target);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw Error(std::string("cannot create: ") + std::strerror(errno), tmp.string(),
                "check that the directory exists and is writable");
  RemoveOnExit guard(tmp);
  size_t done = 0;
  while (done < content.size()) {
    ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      throw Error(std::string("write failed: ") + std::strerror(err), tmp.string(),
                  "check free disk space");
    }
    done += size_t(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    throw Error(std::string("cannot flush: ") + std::strerror(err), tmp.string(),
                "check free disk space");
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    int err = errno;
    throw Error(std::string("cannot rename into place: ") + std::strerror(err), path,
                "check the directory's permissions");
  }
  guard.release();
  fsync_directory(target.parent_path().string());
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
