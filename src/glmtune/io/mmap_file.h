#pragma once
// Read-only memory maps of whole files, plus the directory fsync that the checkpoint writers
// share. Files are written through OutputFile / AtomicFile of base/fs.h.
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

// Flushes a directory entry change (create, rename) of `dir` to disk.
void sync_directory(const std::filesystem::path& dir);

// Reads a whole (small) file into a string; glmtune::Error naming the path on failure.
std::string read_text_file(const std::filesystem::path& path);

}  // namespace glmtune::io
