#pragma once
// Read-only memory maps of whole files, plus the small POSIX write helpers that the checkpoint
// writers share (full writes, fsync, atomic replace).
//
// A mapping is held through std::shared_ptr so that tensors viewing the file (Tensor::from_external
// with the mapping as owner) keep it alive after the reader that created them is gone.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace glmtune::io {

class MappedFile {
 public:
  // Maps `path` read-only. Throws glmtune::Error naming the path for a missing file, a permission
  // problem, a directory or other non-regular file, or a failed mmap.
  static std::shared_ptr<const MappedFile> open(const std::filesystem::path& path);

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // Null for an empty file (mmap cannot map zero bytes).
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  const std::filesystem::path& path() const { return path_; }

  // Drops the resident pages of [offset, offset + length) from this process. The mapping is
  // read-only and file-backed, so the bytes stay valid: a later access faults them back in from
  // the page cache. Streaming readers call this after each tensor so that their resident set
  // stays at one tensor instead of growing to the whole file.
  void release(size_t offset, size_t length) const;
  // Tells the kernel the file will be read front to back (larger read-ahead).
  void advise_sequential() const;

 private:
  MappedFile(std::filesystem::path path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  std::filesystem::path path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// A file opened for writing; closes on destruction. All writes are complete writes (retrying
// after short writes and EINTR) and fail with a glmtune::Error naming the file.
class OutputFile {
 public:
  // Creates or truncates `path` (mode 0644).
  explicit OutputFile(const std::filesystem::path& path);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  void write(const void* data, size_t bytes);
  void write(std::string_view text) { write(text.data(), text.size()); }
  void pwrite(const void* data, size_t bytes, uint64_t offset);
  // Sets the file length (reserves the data region of a planned file).
  void truncate(uint64_t length);
  void sync();
  void close();
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

// Flushes a directory entry change (create, rename) of `dir` to disk.
void sync_directory(const std::filesystem::path& dir);

// Writes `content` to `path` atomically: `path.tmp.<pid>` is written and fsync'd, then renamed
// over `path`, then the directory is fsync'd. A crash leaves either the old or the new content.
void write_file_atomic(const std::filesystem::path& path, std::string_view content);

// Reads a whole (small) file into a string; glmtune::Error naming the path on failure.
std::string read_text_file(const std::filesystem::path& path);

// "<path>.tmp.<pid>": the temporary name used by atomic writes, unique per process.
std::filesystem::path temporary_sibling(const std::filesystem::path& path);

}  // namespace glmtune::io
