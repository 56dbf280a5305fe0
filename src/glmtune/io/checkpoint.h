#pragma once
// Hugging Face checkpoints on disk: a directory holding either `model.safetensors.index.json`
// (`weight_map`: tensor name -> shard file, `metadata.total_size`) with its shards, or a single
// `model.safetensors`.
//
// The reader opens shards lazily, so listing or reading a few tensors of a 62-shard checkpoint maps
// only the shards involved. The writer streams: memory holds at most one shard's worth of pending
// tensors (with planned shards, one tensor or one part of one), and the directory is replaced
// atomically on finish(): until then a crash or an exception leaves the previous content
// untouched.
//
// Checksums: the writer records the XXH3-64 hash of every tensor's stored bytes, computed from the
// finished shard as it lies on disk, in `glmtune-checksums.json` beside the index (a file
// transformers ignores, so the directory stays a plain Hugging Face checkpoint):
//   {"format": "glmtune-checksums", "format_version": 1, "algorithm": "xxh3-64",
//    "files": {"model-00001-of-00002.safetensors": {"bytes": N, "tensors": {"NAME": "<16 hex>"}}}}
// verify_checkpoint() checks a directory against it; one without it (a released model, a
// checkpoint of an older glmtune) is checked for structure only and reported as unverified.

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "glmtune/io/safetensors.h"

namespace glmtune::io {

inline constexpr std::string_view kIndexFileName = "model.safetensors.index.json";
inline constexpr std::string_view kSingleFileName = "model.safetensors";
inline constexpr std::string_view kChecksumsFileName = "glmtune-checksums.json";

// XXH3-64 of `bytes`, and how glmtune prints it (16 lower-case hex digits).
uint64_t content_hash(std::span<const uint8_t> bytes);
std::string hash_hex(uint64_t hash);

// One thing wrong with a checkpoint: `file` relative to the checkpoint directory, `tensor` empty
// when the problem is the file's as a whole.
struct VerifyProblem {
  std::string file;
  std::string tensor;
  std::string problem;
  std::string str() const;  // "FILE: tensor \"NAME\": PROBLEM"
};

struct VerifyReport {
  // False when the directory has no checksums file: only its structure (index, shard headers and
  // sizes) was checked, and its tensors are unverified.
  bool has_checksums = false;
  int64_t tensors_verified = 0;
  uint64_t bytes_verified = 0;
  std::vector<VerifyProblem> problems;

  bool ok() const { return problems.empty(); }
  // The first `max` problems, one a line, each prefixed by `indent`.
  std::string describe(size_t max = 20, const std::string& indent = "  ") const;
  // Appends `other`'s problems with `prefix` ("model/") put before their file names.
  void merge(const VerifyReport& other, const std::string& prefix);
};

// Checks a checkpoint directory (or a single .safetensors file) without loading it: the index
// against the shards, every shard's header and size, and, when the checksums file is there, the
// hash of every tensor's bytes against the recorded one. Reads every tensor once (mapped, pages
// released as it goes). Never throws for a damaged checkpoint: every problem is in the report.
VerifyReport verify_checkpoint(const std::filesystem::path& path);

class CheckpointReader {
 public:
  // `path` is a checkpoint directory, or a single .safetensors file. Parses the index and checks
  // that every shard it names exists; throws glmtune::Error naming the file and the problem for a
  // missing directory, a malformed index (not JSON, no weight_map, a non-string entry, a name
  // listed twice, a shard path leaving the directory) or a missing shard.
  static CheckpointReader open(const std::filesystem::path& path);

  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;
  ~CheckpointReader();

  // Opens every shard's header and cross-checks it with the index: each indexed tensor is in its
  // shard, no tensor sits in two shards, no shard holds a tensor the index does not list.
  // Reads only headers (cheap even for hundreds of GB). Warns when metadata.total_size disagrees.
  void validate() const;

  const std::filesystem::path& dir() const;
  // True when read through an index (false for a single model.safetensors).
  bool sharded() const;
  // All tensor names, sorted.
  const std::vector<std::string>& names() const;
  bool contains(std::string_view name) const;
  // The shard file (name relative to dir()) holding `name`.
  const std::string& shard_of(std::string_view name) const;
  // Shard files, sorted.
  const std::vector<std::string>& shard_files() const;
  // Names the index assigns to `file`, sorted.
  std::vector<std::string> names_in_shard(std::string_view file) const;
  // metadata.total_size of the index, when it has one.
  std::optional<uint64_t> index_total_size() const;

  // The opened shard (opened on first use).
  const SafetensorsFile& shard(std::string_view file) const;
  // Throws glmtune::Error when the name is unknown or missing from its shard.
  const TensorInfo& info(std::string_view name) const;
  std::span<const uint8_t> bytes(std::string_view name) const;
  // A CPU tensor viewing the shard's mapping (see SafetensorsFile::tensor).
  Tensor tensor(std::string_view name) const;
  // Drops the resident pages of a consumed tensor, or of bytes [offset, offset + length) of it
  // (see MappedFile::release).
  void release(std::string_view name, uint64_t offset = 0, uint64_t length = UINT64_MAX) const;
  // Unmaps a shard once nothing more is needed from it (tensors made from it stay valid).
  void close_shard(std::string_view file) const;

 private:
  struct Impl;
  explicit CheckpointReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct CheckpointWriterOptions {
  // A shard is closed when adding the next tensor would take it past this size; a tensor larger
  // than the limit gets a shard of its own. 5 GB is the Hugging Face default.
  uint64_t max_shard_bytes = 5'000'000'000;
  // `__metadata__` of every shard (transformers writes {"format": "pt"}).
  Metadata shard_metadata = {{"format", "pt"}};
};

// Writes a sharded checkpoint into a temporary sibling directory and swaps it into place on
// finish(). Shards are named model-0000N-of-0000M.safetensors once their count is known, and
// model.safetensors.index.json is written as transformers writes it (sorted keys, indent 2,
// metadata.total_size and metadata.total_parameters). An index is written even for one shard.
class CheckpointWriter {
 public:
  // Creates the parent directory of `dir` if needed. `dir` itself may exist: its content is
  // replaced by finish() and untouched before.
  explicit CheckpointWriter(std::filesystem::path dir, CheckpointWriterOptions options = {});
  // Without finish(): removes the temporary directory; `dir` keeps its previous content.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Buffered mode: the tensor (a reference, no copy) waits until its shard is full, then the shard
  // is written. Tensors may be strided or on a CUDA device.
  void add(std::string name, Tensor tensor);

  // Planned mode, for producers that create each tensor just before writing it: declare a
  // shard's tensors, write each once (any order), close the shard. Memory holds one tensor.
  void begin_shard(std::vector<TensorSpec> specs);
  void write(std::string_view name, const Tensor& tensor);
  void write_bytes(std::string_view name, std::span<const uint8_t> bytes);
  // A part of a tensor (see SafetensorsWriter::write_part): a large tensor in bounded memory.
  void write_part(std::string_view name, uint64_t offset, std::span<const uint8_t> bytes);
  void end_shard();

  // Streaming mode, for producers that hold one whole tensor at a time (a tensor gathered from the
  // ranks that hold its parts): declare every tensor up front, in the order add() would have been
  // given them; put() then takes them in that order and each shard is written as soon as its last
  // tensor arrives. The shards, their names and the index are exactly what add() makes of the same
  // sequence, while memory holds one tensor instead of one shard's worth.
  void plan_in_order(std::vector<TensorSpec> specs);
  void put(std::string_view name, const Tensor& tensor);

  // A non-weight file (config.json, tokenizer, ...) to appear with the shards.
  void add_file(const std::string& relative_name, std::string_view content);
  void copy_file(const std::filesystem::path& source, const std::string& relative_name);

  // Writes the pending shard, renames the shards, writes the index and atomically replaces `dir`.
  void finish();

  uint64_t total_bytes() const { return total_bytes_; }
  uint64_t total_parameters() const { return total_parameters_; }
  size_t num_shards() const { return shards_.size(); }
  const std::filesystem::path& dir() const { return dir_; }
  const std::filesystem::path& temporary_dir() const { return tmp_; }

 private:
  struct Shard {
    std::filesystem::path temp_name;
    std::vector<std::string> names;
    std::map<std::string, uint64_t> hashes;  // of the finished file's tensors
  };
  void flush_pending();
  void close_shard(Shard shard);
  std::filesystem::path next_shard_path();
  void check_new_name(const std::string& name);
  void check_file_name(const std::string& relative_name) const;

  std::filesystem::path dir_;
  std::filesystem::path tmp_;
  CheckpointWriterOptions options_;
  std::vector<Shard> shards_;
  NamedTensors pending_;
  uint64_t pending_bytes_ = 0;
  std::unique_ptr<SafetensorsWriter> planned_;
  // Streaming mode: the shards add() would make, and which of them is open.
  std::vector<std::vector<TensorSpec>> streamed_shards_;
  std::map<std::string, size_t, std::less<>> streamed_shard_of_;
  size_t streamed_next_ = 0;
  std::map<std::string, size_t> name_to_shard_;
  std::vector<std::string> extra_files_;
  uint64_t total_bytes_ = 0;
  uint64_t total_parameters_ = 0;
  bool finished_ = false;
};

// "model-00003-of-00014.safetensors"
std::string shard_file_name(size_t index, size_t count);

// Copies the files `glmtune eval` and the data pipeline expect next to the weights
// (tokenizer.json, tokenizer_config.json, chat_template.jinja, processor_config.json) from one
// model directory to another, those that exist.
void copy_tokenizer_files(const std::filesystem::path& from, const std::filesystem::path& to);

}  // namespace glmtune::io
