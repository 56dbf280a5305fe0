#pragma once
// The safetensors format (https://huggingface.co/docs/safetensors): an 8-byte little-endian
// header length N, N bytes of JSON header, then the data section. The header maps each tensor
// name to {dtype, shape, data_offsets: [begin, end)} (offsets relative to the data section) and may
// carry "__metadata__" (string -> string).
//
// Reading is zero-copy: a file is mmap'd and tensors view the mapping. Validation follows the rules
// of the reference implementation (the `safetensors` crate) and is strict enough that no header,
// however malformed, can make a reader touch a byte outside the file: every problem is a
// glmtune::Error naming the file and what is wrong.
//
// Writing mirrors `safetensors.torch.save_file` byte for byte: tensors ordered by descending dtype
// alignment then by name, compact JSON, header padded with spaces to a multiple of 8. One
// difference: HF writes `__metadata__` in hash order; we write its keys sorted, so files agree
// whenever there is at most one metadata key (transformers writes {"format": "pt"}).

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "glmtune/base/fs.h"
#include "glmtune/io/mmap_file.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::io {

// The format's limit on the header size (the reference implementation refuses larger headers).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

using Metadata = std::map<std::string, std::string>;
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  // Byte range [begin, end) within the data section.
  uint64_t begin = 0;
  uint64_t end = 0;

  uint64_t nbytes() const { return end - begin; }
  int64_t numel() const { return shape_numel(shape); }
};

class SafetensorsFile {
 public:
  // Maps and validates `path`.
  static SafetensorsFile open(const std::filesystem::path& path);
  // Validates a whole file held in memory. `source` names it in errors. `owner` keeps `bytes`
  // alive for tensors made by tensor(); it may be null when the caller guarantees the lifetime, in
  // which case tensor() copies.
  static SafetensorsFile parse(std::span<const uint8_t> bytes, std::string source,
                               std::shared_ptr<const void> owner = nullptr);

  const std::string& source() const { return source_; }
  // Tensors in data-section order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // Names in data-section order.
  std::vector<std::string> names() const;
  size_t size() const { return tensors_.size(); }
  bool contains(std::string_view name) const { return find(name) != nullptr; }
  // Null when absent.
  const TensorInfo* find(std::string_view name) const;
  // Throws glmtune::Error naming the file and the tensor when absent.
  const TensorInfo& info(std::string_view name) const;
  const Metadata& metadata() const { return metadata_; }

  // The raw little-endian bytes of a tensor (inside the mapping).
  std::span<const uint8_t> bytes(std::string_view name) const;
  const uint8_t* data(std::string_view name) const { return bytes(name).data(); }
  // A CPU tensor viewing the file (no copy); it keeps the mapping alive. The mapping is read-only:
  // clone() before writing. When the bytes are not aligned to the element size (possible in files
  // from other writers) or there is no owner, the tensor is an aligned copy instead.
  Tensor tensor(std::string_view name) const;

  // Lets go of the resident pages of a tensor that has been consumed (see MappedFile::release);
  // `offset` / `length` (bytes within the tensor) limit it to a part.
  void release(std::string_view name, uint64_t offset = 0, uint64_t length = UINT64_MAX) const;

  uint64_t header_size() const { return header_size_; }
  uint64_t data_offset() const { return 8 + header_size_; }
  uint64_t file_size() const { return file_.size(); }
  // Null for parse()d buffers.
  const std::shared_ptr<const MappedFile>& mapping() const { return mapping_; }

 private:
  SafetensorsFile() = default;

  std::string source_;
  std::shared_ptr<const MappedFile> mapping_;
  std::shared_ptr<const void> owner_;
  std::span<const uint8_t> file_;
  uint64_t header_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  Metadata metadata_;
};

// What a tensor will be, before its bytes exist (for planned, streaming writes).
struct TensorSpec {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;

  uint64_t nbytes() const { return uint64_t(shape_numel(shape)) * dtype_size(dtype); }
};

// The exact file a writer produces for these tensors: header text and data offsets.
struct SafetensorsLayout {
  std::string header;               // JSON, padded with spaces to a multiple of 8 bytes
  std::vector<TensorInfo> tensors;  // in data-section order
  uint64_t data_bytes = 0;

  uint64_t data_offset() const { return 8 + header.size(); }
  uint64_t file_bytes() const { return data_offset() + data_bytes; }
  const TensorInfo* find(std::string_view name) const;
};

// Throws glmtune::Error for duplicate names, the reserved name "__metadata__", names or metadata
// that are not valid UTF-8, and negative dimensions.
SafetensorsLayout plan_safetensors(std::vector<TensorSpec> specs, const Metadata& metadata = {});

// How a SafetensorsWriter puts its file at `path`: written there directly (a file inside a
// directory that is itself swapped in whole, such as a checkpoint's shards), or as an AtomicFile
// renamed over `path` by finish() (an unfinished writer leaves `path` as it was).
enum class WriteMode { kInPlace, kAtomic };

// Writes a safetensors file whose layout is fixed up front, taking the tensors one at a time in
// any order, so that memory holds at most one tensor.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::filesystem::path& path, std::vector<TensorSpec> specs,
                    const Metadata& metadata = {}, WriteMode mode = WriteMode::kInPlace);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // `tensor` must match the planned dtype and shape; it may be strided or on a CUDA device.
  void write(std::string_view name, const Tensor& tensor);
  // Raw little-endian bytes, exactly the planned size.
  void write_bytes(std::string_view name, std::span<const uint8_t> bytes);
  // Bytes [offset, offset + size) of a tensor, for producers that stream a large tensor in parts.
  // The parts of a tensor must not overlap; it counts as written once they cover it.
  void write_part(std::string_view name, uint64_t offset, std::span<const uint8_t> bytes);
  // Fails naming any tensor that was not written; then fsyncs and closes the file (kAtomic: and
  // renames it into place).
  void finish();

  const SafetensorsLayout& layout() const { return layout_; }
  // The file's final name.
  const std::filesystem::path& path() const { return path_; }

 private:
  size_t slot(std::string_view name, uint64_t nbytes);

  SafetensorsLayout layout_;
  std::map<std::string, size_t, std::less<>> index_;
  std::vector<uint64_t> written_;  // bytes written per tensor
  std::filesystem::path path_;
  WriteMode mode_;
  std::unique_ptr<OutputFile> out_;  // an AtomicFile in WriteMode::kAtomic
  bool finished_ = false;
};

// Writes `tensors` to `path` atomically (temporary file, fsync, rename, directory fsync).
// Tensors may be non-contiguous or on a CUDA device.
void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                      const Metadata& metadata = {});
// The bytes save_safetensors would write, in memory.
std::vector<uint8_t> serialize_safetensors(const NamedTensors& tensors,
                                           const Metadata& metadata = {});

// Safetensors' dtype order (the reference implementation's enum order, by alignment); the writer
// sorts tensors by descending rank.
int safetensors_dtype_rank(DType dtype);

// Parses JSON text, failing (glmtune::Error naming `source`, with `fix` as the advice) on invalid
// JSON and on a key repeated within one object: nlohmann keeps the last value of a repeated key
// silently, which would hide a tensor listed twice.
nlohmann::json parse_json_strict(std::string_view text, const std::string& source,
                                 const std::string& fix);
nlohmann::ordered_json parse_ordered_json_strict(std::string_view text, const std::string& source,
                                                 const std::string& fix);

// True when `text` is well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
// On failure `bad_offset` (if given) receives the offset of the first offending byte.
bool is_valid_utf8(std::string_view text, size_t* bad_offset = nullptr);

}  // namespace glmtune::io
