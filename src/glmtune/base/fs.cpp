#include "glmtune/base/fs.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
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

void write_file_atomic(const std::string& path, const std::string& content) {
  const fs::path target(path);
  const fs::path tmp =
      target.parent_path() / (target.filename().string() + ".tmp." + std::to_string(::getpid()));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw Error(std::string("cannot create: ") + std::strerror(errno), tmp.string(),
                "check that the directory exists and is writable");
  size_t done = 0;
  while (done < content.size()) {
    ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error(std::string("write failed: ") + std::strerror(err), tmp.string(),
                  "check free disk space");
    }
    done += size_t(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw Error(std::string("cannot flush: ") + std::strerror(err), tmp.string(),
                "check free disk space");
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw Error(std::string("cannot rename into place: ") + std::strerror(err), path,
                "check the directory's permissions");
  }
  fsync_directory(target.parent_path().string());
}

}  // namespace glmtune
