#pragma once
// Token cache: a dataset tokenized once (`glmtune data prepare`) and stored as one binary file that
// training memory-maps, so that later runs neither parse JSON nor run the tokenizer again.
//
// Layout (little-endian; every section starts 8-byte aligned):
//   header      96 bytes: magic "GLMTCACH", format version, header size, the 64-bit hash of the
//               tokenizer.json the cache was built with, sample and token counts, the offset of
//               each section below, the total file size and a checksum of the data sections
//   ids         int32[num_tokens]: all samples' token ids, end to end
//   loss_mask   uint8[num_tokens]: 1 where the token is trained (its label is its id), else 0;
//               zero-padded to a multiple of 8 bytes
//   index       IndexEntry[num_samples]: where each sample's tokens start, its length, and where
//               it came from (file, line, byte offset, truncated)
//   metadata    JSON: tokenizer path and hash, source files with size and mtime, the dataset
//               settings and the DatasetStats of the preparing pass
//
// The file is written under a temporary name and renamed into place, so a crash never leaves a
// half-written cache under the final name. Opening checks the structure (magic, version, sizes,
// offsets, index); `verify()` additionally recomputes the checksum, which reads the whole file.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "glmtune/data/dataset.h"

namespace glmtune {
class AtomicFile;
class OutputFile;
}  // namespace glmtune
namespace glmtune::io {
class MappedFile;
}  // namespace glmtune::io

namespace glmtune::data {

inline constexpr uint32_t kTokenCacheVersion = 1;

// FNV-1a 64 of the file's bytes: a stable identity of a tokenizer.json. Throws glmtune::Error
// naming the file if it cannot be read.
uint64_t tokenizer_file_hash(const std::filesystem::path& tokenizer_json);
// "0123456789abcdef": how hashes are printed in metadata and errors.
std::string hash_hex(uint64_t hash);

// The tokenizer.json of `path`: `path` itself when it is a file, else `path/tokenizer.json`.
// Throws glmtune::Error naming `path` when neither exists.
std::filesystem::path resolve_tokenizer_json(const std::filesystem::path& path);

// Streams samples into a new cache file.
class TokenCacheWriter {
 public:
  // `config` describes how the samples were made and `tokenizer_json` which tokenizer made them;
  // both go into the metadata (the source files' sizes and mtimes are read now). Nothing appears
  // at `path` until finish().
  TokenCacheWriter(std::filesystem::path path, const DatasetConfig& config,
                   const std::filesystem::path& tokenizer_json);
  // Removes the temporary files if finish() was not reached (an error mid-way).
  ~TokenCacheWriter();
  TokenCacheWriter(const TokenCacheWriter&) = delete;
  TokenCacheWriter& operator=(const TokenCacheWriter&) = delete;

  // Appends one sample. Its labels must be unshifted (each either its id or kIgnoreIndex), as the
  // dataset produces them; anything else is an internal error since the mask could not hold it.
  void add(const Sample& sample);
  // Writes index and metadata (with `stats`), syncs, and renames the file into place.
  void finish(const DatasetStats& stats);

  int64_t samples() const { return samples_; }
  int64_t tokens() const { return tokens_; }

 private:
  std::filesystem::path path_, mask_tmp_path_;
  nlohmann::json meta_;
  uint64_t tokenizer_hash_ = 0;
  std::unique_ptr<AtomicFile> out_;   // header placeholder, then the ids as they come
  std::unique_ptr<OutputFile> mask_;  // the mask, appended to `out_` by finish()
  std::vector<uint8_t> packed_index_;
  int64_t samples_ = 0;
  int64_t tokens_ = 0;
  uint64_t ids_hash_ = 0, mask_hash_ = 0;  // running checksums of the two streamed sections
  bool finished_ = false;
};

// A prepared cache, memory-mapped. It is a SampleSource, so packing reads it like any dataset.
class TokenCache : public SampleSource {
 public:
  // Maps and checks `path`. With `expected_tokenizer_hash`, a cache built with a different
  // tokenizer is refused. Throws glmtune::Error naming the file for a missing, truncated or
  // corrupt file, a wrong magic or version, or a tokenizer mismatch.
  static TokenCache open(const std::filesystem::path& path,
                         std::optional<uint64_t> expected_tokenizer_hash = std::nullopt);

  int64_t size() const override { return num_samples_; }
  int64_t length(int64_t i) const override;
  std::vector<TokenizedSample> load(const std::vector<int64_t>& indices) const override;

  // Sample i as the JSONL reader yielded it (tokens, file index, line, byte offset, truncated).
  Sample sample(int64_t i) const;
  // Zero-copy views of sample i.
  std::span<const int32_t> ids(int64_t i) const;
  std::span<const uint8_t> loss_mask(int64_t i) const;

  int64_t num_tokens() const { return num_tokens_; }
  // Tokens whose mask is 1 (reads the whole mask).
  int64_t num_trained_tokens() const;
  uint64_t tokenizer_hash() const { return tokenizer_hash_; }
  const nlohmann::json& metadata() const { return meta_; }
  // Source files (as given to prepare) whose size or mtime differ from the recorded ones, or that
  // are gone: the cache no longer reflects them.
  std::vector<std::string> stale_sources() const;
  // Recomputes the checksum and checks every mask byte; throws glmtune::Error naming the file.
  void verify() const;
  const std::filesystem::path& path() const;

 private:
  TokenCache() = default;
  const uint8_t* entry(int64_t i) const;  // the i-th index record

  std::shared_ptr<const io::MappedFile> file_;
  int64_t num_samples_ = 0;
  int64_t num_tokens_ = 0;
  uint64_t tokenizer_hash_ = 0;
  uint64_t checksum_ = 0;
  const int32_t* ids_ = nullptr;
  const uint8_t* mask_ = nullptr;
  const uint8_t* index_ = nullptr;
  size_t data_begin_ = 0, data_end_ = 0;  // the checksummed byte range
  nlohmann::json meta_;
};

}  // namespace glmtune::data
