#include "glmtune/io/mmap_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

#include "glmtune/base/error.h"

namespace glmtune::io {
namespace {

std::string errno_text(int err) { return std::system_category().message(err); }

// The fix line for an open() failure, by cause.
std::string open_fix(int err) {
  switch (err) {
    case ENOENT:
      return "check the path; the file does not exist";
    case EACCES:
    case EPERM:
      return "make the file readable by this user (chmod/chown) or run as its owner";
    case EISDIR:
      return "pass a file, not a directory";
    case EMFILE:
    case ENFILE:
      return "raise the open-file limit (ulimit -n)";
    default:
      return {};
  }
}

void close_quietly(int fd) {
  if (fd >= 0) ::close(fd);
}

}  // namespace

std::shared_ptr<const MappedFile> MappedFile::open(const std::filesystem::path& path) {
  const std::string where = path.string();
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    std::string what = err == ENOENT                     ? "file not found"
                       : (err == EACCES || err == EPERM) ? "permission denied"
                                                         : "cannot open (" + errno_text(err) + ")";
    throw Error(what, where, open_fix(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    close_quietly(fd);
    throw Error("cannot stat (" + errno_text(err) + ")", where);
  }
  if (S_ISDIR(st.st_mode)) {
    close_quietly(fd);
    throw Error("is a directory, not a file", where, "pass the path of a file inside it");
  }
  if (!S_ISREG(st.st_mode)) {
    close_quietly(fd);
    throw Error("is not a regular file (a device, pipe or socket cannot be mapped)", where);
  }
  size_t size = size_t(st.st_size);
  const uint8_t* data = nullptr;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      close_quietly(fd);
      throw Error("mmap of " + std::to_string(size) + " bytes failed (" + errno_text(err) + ")",
                  where,
                  err == ENOMEM ? "raise the address-space limit (ulimit -v) or free memory" : "");
    }
    data = static_cast<const uint8_t*>(p);
  }
  // The mapping stays valid after the descriptor is closed; keeping no fd avoids running out of
  // descriptors on checkpoints with many shards.
  close_quietly(fd);
  return std::shared_ptr<const MappedFile>(new MappedFile(path, data, size));
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

void MappedFile::release(size_t offset, size_t length) const {
  if (!data_ || length == 0 || offset >= size_) return;
  length = std::min(length, size_ - offset);
  // madvise wants page-aligned starts. Rounding outward may drop pages shared with a neighbouring
  // tensor; for a read-only file mapping that only costs a re-read from the page cache.
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  size_t begin = offset / page * page;
  size_t end = std::min(size_, (offset + length + page - 1) / page * page);
  ::madvise(const_cast<uint8_t*>(data_) + begin, end - begin, MADV_DONTNEED);
}

void MappedFile::advise_sequential() const {
  if (data_) ::madvise(const_cast<uint8_t*>(data_), size_, MADV_SEQUENTIAL);
}

void sync_directory(const std::filesystem::path& dir) {
  std::filesystem::path d = dir.empty() ? std::filesystem::path(".") : dir;
  int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    throw Error("cannot open directory to sync it (" + errno_text(err) + ")", d.string());
  }
  // Some filesystems refuse fsync on directories (EINVAL); their renames are durable anyway.
  if (::fsync(fd) != 0 && errno != EINVAL) {
    int err = errno;
    close_quietly(fd);
    throw Error("fsync of directory failed (" + errno_text(err) + ")", d.string());
  }
  close_quietly(fd);
}

std::string read_text_file(const std::filesystem::path& path) {
  auto file = MappedFile::open(path);
  return file->size() ? std::string(reinterpret_cast<const char*>(file->data()), file->size())
                      : std::string();
}

}  // namespace glmtune::io
