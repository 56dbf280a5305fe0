#include "glmtune/data/token_cache.h"

#include <fmt/format.h>

#include <array>
#include <chrono>
#include <cstring>
#include <fstream>
#include <system_error>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/io/mmap_file.h"

namespace glmtune::data {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'G', 'L', 'M', 'T', 'C', 'A', 'C', 'H'};
constexpr size_t kHeaderSize = 96;
// Index record: int64 token_offset, int64 line, uint64 byte_offset, int32 length, int32 file,
// uint32 flags, uint32 reserved (zero).
constexpr size_t kEntrySize = 40;
constexpr uint32_t kFlagTruncated = 1;

constexpr uint64_t kFnvOffset = 1469598103934665603ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;

uint64_t fnv1a(uint64_t h, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= kFnvPrime;
  }
  return h;
}

// The three sections are hashed separately (ids and mask are written to different files at the
// same time) and combined here.
uint64_t combine_checksum(uint64_t ids, uint64_t mask, uint64_t index) {
  uint64_t parts[3] = {ids, mask, index};
  return fnv1a(kFnvOffset, reinterpret_cast<const uint8_t*>(parts), sizeof(parts));
}

constexpr size_t align8(size_t n) { return (n + 7) & ~size_t{7}; }

template <typename T>
void put(uint8_t* dst, size_t offset, T value) {
  std::memcpy(dst + offset, &value, sizeof(T));
}
template <typename T>
T get(const uint8_t* src, size_t offset) {
  T value;
  std::memcpy(&value, src + offset, sizeof(T));
  return value;
}

int64_t mtime_ns(const fs::path& p) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             fs::last_write_time(p).time_since_epoch())
      .count();
}

const char* format_name(SampleFormat f) {
  switch (f) {
    case SampleFormat::kChat:
      return "chat";
    case SampleFormat::kText:
      return "text";
    case SampleFormat::kAuto:
      break;
  }
  return "auto";
}

// Header fields, in file order after the magic.
struct Header {
  uint32_t version = 0, header_size = 0;
  uint64_t tokenizer_hash = 0;
  uint64_t num_samples = 0;
  uint64_t num_tokens = 0;
  uint64_t ids_offset = 0;
  uint64_t mask_offset = 0;
  uint64_t index_offset = 0;
  uint64_t meta_offset = 0;
  uint64_t meta_size = 0;
  uint64_t file_size = 0;
  uint64_t checksum = 0;
};

// The 64-bit fields, stored one after the other from byte 16 on.
constexpr uint64_t Header::*kWideFields[] = {
    &Header::tokenizer_hash, &Header::num_samples,  &Header::num_tokens,  &Header::ids_offset,
    &Header::mask_offset,    &Header::index_offset, &Header::meta_offset, &Header::meta_size,
    &Header::file_size,      &Header::checksum};

std::array<uint8_t, kHeaderSize> encode_header(const Header& h) {
  std::array<uint8_t, kHeaderSize> b{};
  std::memcpy(b.data(), kMagic, 8);
  put(b.data(), 8, h.version);
  put(b.data(), 12, h.header_size);
  for (size_t i = 0; i < std::size(kWideFields); ++i) put(b.data(), 16 + 8 * i, h.*kWideFields[i]);
  return b;
}

Header decode_header(const uint8_t* b) {
  Header h;
  h.version = get<uint32_t>(b, 8);
  h.header_size = get<uint32_t>(b, 12);
  for (size_t i = 0; i < std::size(kWideFields); ++i)
    h.*kWideFields[i] = get<uint64_t>(b, 16 + 8 * i);
  return h;
}

constexpr const char* kRebuildFix = "run `glmtune data prepare` again to rebuild the cache";

// The metadata is read with nlohmann's typed accessors (the staleness check of the sources, the
// trainer's comparison of the config), which throw on another type: check the shape once here so
// that a damaged cache is refused by name instead.
void check_metadata(const nlohmann::json& meta, const std::string& where) {
  auto corrupt = [&](const std::string& what) {
    throw Error("token cache metadata is corrupt: " + what, where, kRebuildFix);
  };
  if (!meta.is_object()) corrupt(fmt::format("expected a JSON object, got {}", meta.type_name()));
  if (meta.contains("config") && !meta["config"].is_object())
    corrupt(fmt::format("\"config\" is {}, not an object", meta["config"].type_name()));
  if (!meta.contains("sources")) return;
  const nlohmann::json& sources = meta["sources"];
  if (!sources.is_array())
    corrupt(fmt::format("\"sources\" is {}, not a list", sources.type_name()));
  for (size_t i = 0; i < sources.size(); ++i) {
    const nlohmann::json& s = sources[i];
    if (!s.is_object()) corrupt(fmt::format("sources[{}] is {}, not an object", i, s.type_name()));
    auto field = [&](const char* key, bool ok, const char* type) {
      if (s.contains(key) && !ok)
        corrupt(fmt::format("sources[{}].{} is {}, not {}", i, key, s[key].type_name(), type));
    };
    field("path", s.contains("path") && s["path"].is_string(), "a string");
    field("size", s.contains("size") && s["size"].is_number_unsigned(), "a byte count");
    field("mtime_ns", s.contains("mtime_ns") && s["mtime_ns"].is_number_integer(), "an integer");
  }
}

}  // namespace

uint64_t tokenizer_file_hash(const fs::path& tokenizer_json) {
  std::ifstream in(tokenizer_json, std::ios::binary);
  if (!in) throw Error("cannot read tokenizer file", tokenizer_json.string());
  uint64_t h = kFnvOffset;
  std::vector<char> buf(1 << 16);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    h = fnv1a(h, reinterpret_cast<const uint8_t*>(buf.data()), static_cast<size_t>(in.gcount()));
  }
  return h;
}

std::string hash_hex(uint64_t hash) { return fmt::format("{:016x}", hash); }

fs::path resolve_tokenizer_json(const fs::path& path) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return path;
  if (fs::is_regular_file(path / "tokenizer.json", ec)) return path / "tokenizer.json";
  throw Error("no tokenizer.json found", path.string(),
              "give a tokenizer directory (holding tokenizer.json) or the tokenizer.json itself");
}

// ---------------------------------------------------------------------------------------------

TokenCacheWriter::TokenCacheWriter(fs::path path, const DatasetConfig& config,
                                   const fs::path& tokenizer_json)
    : path_(std::move(path)),
      mask_tmp_path_(temporary_path(path_.string() + ".mask")),
      tokenizer_hash_(tokenizer_file_hash(tokenizer_json)),
      ids_hash_(kFnvOffset),
      mask_hash_(kFnvOffset) {
  nlohmann::json sources = nlohmann::json::array();
  for (const auto& f : config.files) {
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    if (ec) throw Error("cannot read data file", f, "check the --input paths");
    sources.push_back({{"path", f}, {"size", size}, {"mtime_ns", mtime_ns(f)}});
  }
  meta_ = {{"format_version", kTokenCacheVersion},
           {"tokenizer", {{"path", tokenizer_json.string()}, {"hash", hash_hex(tokenizer_hash_)}}},
           {"sources", sources},
           {"config",
            {{"format", format_name(config.format)},
             {"max_length", config.max_length},
             {"on_bad_line", config.on_bad_line == BadLinePolicy::kSkip ? "skip" : "fail"},
             {"on_overlong", config.on_overlong == OverlongPolicy::kDrop ? "drop" : "truncate"},
             {"chat_template", "glm5.3"},
             {"reasoning_effort", config.reasoning_effort ? nlohmann::json(*config.reasoning_effort)
                                                          : nlohmann::json()},
             {"clear_thinking", config.clear_thinking}}}};
  // The destructor does not run for a constructor that throws: the mask's guard removes its
  // file; the cache itself is an AtomicFile (a member), which removes its own temporary file.
  out_ = std::make_unique<AtomicFile>(path_);
  RemoveOnExit mask_guard(mask_tmp_path_);
  mask_ = std::make_unique<OutputFile>(mask_tmp_path_);
  // The header is written last (finish), once the offsets are known.
  std::array<uint8_t, kHeaderSize> zeros{};
  out_->write(zeros.data(), zeros.size());
  mask_guard.release();
}

TokenCacheWriter::~TokenCacheWriter() {
  std::error_code ec;
  out_.reset();  // an unfinished cache's temporary file goes with it
  mask_.reset();
  fs::remove(mask_tmp_path_, ec);
}

void TokenCacheWriter::add(const Sample& sample) {
  const auto& ids = sample.tokens.input_ids;
  const auto& labels = sample.tokens.labels;
  GLMTUNE_ASSERT(ids.size() == labels.size(), "sample has {} ids but {} labels", ids.size(),
                 labels.size());
  GLMTUNE_ASSERT(ids.size() <= INT32_MAX, "sample of {} tokens", ids.size());
  std::vector<uint8_t> mask(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    GLMTUNE_ASSERT(labels[i] == ids[i] || labels[i] == kIgnoreIndex,
                   "label {} at token {} is neither its id {} nor ignored", labels[i], i, ids[i]);
    mask[i] = labels[i] != kIgnoreIndex ? 1 : 0;
  }
  const auto* id_bytes = reinterpret_cast<const uint8_t*>(ids.data());
  out_->write(id_bytes, ids.size() * sizeof(int32_t));
  mask_->write(mask.data(), mask.size());
  ids_hash_ = fnv1a(ids_hash_, id_bytes, ids.size() * sizeof(int32_t));
  mask_hash_ = fnv1a(mask_hash_, mask.data(), mask.size());

  uint8_t rec[kEntrySize] = {};
  put<int64_t>(rec, 0, tokens_);
  put<int64_t>(rec, 8, sample.line);
  put<uint64_t>(rec, 16, sample.offset);
  put<int32_t>(rec, 24, static_cast<int32_t>(ids.size()));
  put<int32_t>(rec, 28, sample.file);
  put<uint32_t>(rec, 32, sample.truncated ? kFlagTruncated : 0);
  packed_index_.insert(packed_index_.end(), rec, rec + kEntrySize);
  tokens_ += static_cast<int64_t>(ids.size());
  ++samples_;
}

void TokenCacheWriter::finish(const DatasetStats& stats) {
  GLMTUNE_ASSERT(!finished_, "finish() called twice for {}", path_.string());
  // Pad the mask so that the index starts 8-byte aligned.
  const size_t mask_bytes = static_cast<size_t>(tokens_);
  const size_t pad = align8(mask_bytes) - mask_bytes;
  const uint8_t zeros[8] = {};
  mask_->write(zeros, pad);
  mask_hash_ = fnv1a(mask_hash_, zeros, pad);
  mask_->close();
  mask_.reset();

  Header h;
  h.version = kTokenCacheVersion;
  h.header_size = kHeaderSize;
  h.tokenizer_hash = tokenizer_hash_;
  h.num_samples = static_cast<uint64_t>(samples_);
  h.num_tokens = static_cast<uint64_t>(tokens_);
  h.ids_offset = kHeaderSize;
  h.mask_offset = h.ids_offset + 4 * h.num_tokens;
  h.index_offset = h.mask_offset + align8(mask_bytes);
  h.meta_offset = h.index_offset + packed_index_.size();

  // Copy the mask section in (mapped, so it never needs to fit in memory at once).
  if (mask_bytes + pad > 0) {
    auto mapped = io::MappedFile::open(mask_tmp_path_);
    mapped->advise_sequential();
    constexpr size_t kChunk = 64 << 20;
    for (size_t at = 0; at < mapped->size(); at += kChunk) {
      const size_t n = std::min(kChunk, mapped->size() - at);
      out_->write(mapped->data() + at, n);
      mapped->release(at, n);
    }
  }
  out_->write(packed_index_.data(), packed_index_.size());
  const uint64_t index_hash = fnv1a(kFnvOffset, packed_index_.data(), packed_index_.size());

  nlohmann::json meta = meta_;
  meta["stats"] = stats.to_json();
  meta["samples"] = samples_;
  meta["tokens"] = tokens_;
  const std::string meta_text = meta.dump();
  out_->write(meta_text);
  h.meta_size = meta_text.size();
  h.file_size = h.meta_offset + h.meta_size;
  h.checksum = combine_checksum(ids_hash_, mask_hash_, index_hash);
  const auto header = encode_header(h);
  out_->pwrite(header.data(), header.size(), 0);
  out_->commit();
  out_.reset();
  finished_ = true;
}

// ---------------------------------------------------------------------------------------------

TokenCache TokenCache::open(const fs::path& path, std::optional<uint64_t> expected_tokenizer_hash) {
  const std::string where = path.string();
  TokenCache c;
  c.file_ = io::MappedFile::open(path);
  const uint8_t* b = c.file_->data();
  const size_t size = c.file_->size();
  if (size < kHeaderSize)
    throw Error(fmt::format("not a token cache: {} bytes, shorter than the {}-byte header", size,
                            kHeaderSize),
                where, kRebuildFix);
  if (std::memcmp(b, kMagic, 8) != 0)
    throw Error("not a glmtune token cache (wrong magic bytes)", where,
                "give a file written by `glmtune data prepare`");
  const Header h = decode_header(b);
  if (h.version != kTokenCacheVersion)
    throw Error(fmt::format("token cache format version {}, but this glmtune reads version {}",
                            h.version, kTokenCacheVersion),
                where, kRebuildFix);
  if (h.file_size != size)
    throw Error(fmt::format("token cache is {} bytes but its header says {} (truncated or "
                            "overwritten)",
                            size, h.file_size),
                where, kRebuildFix);
  // Every offset must follow from the counts; this also bounds all reads below.
  const bool counts_sane =
      h.num_tokens < (uint64_t{1} << 56) && h.num_samples < (uint64_t{1} << 56);
  if (!counts_sane || h.header_size != kHeaderSize || h.ids_offset != kHeaderSize ||
      h.mask_offset != h.ids_offset + 4 * h.num_tokens ||
      h.index_offset != h.mask_offset + align8(h.num_tokens) ||
      h.meta_offset != h.index_offset + kEntrySize * h.num_samples ||
      // Not `meta_offset + meta_size == size`: a huge meta_size wraps that sum around to the file
      // size and lets an offset past the end through. The counts bound the offsets above (no
      // wrap-around: < 2^62), and they grow section by section up to meta_offset.
      h.meta_offset > size || h.meta_size != size - h.meta_offset)
    throw Error("token cache header is corrupt (section offsets do not match the counts)", where,
                kRebuildFix);
  if (expected_tokenizer_hash && *expected_tokenizer_hash != h.tokenizer_hash)
    throw Error(fmt::format("token cache was built with a different tokenizer (tokenizer.json "
                            "hash {}, the given one is {})",
                            hash_hex(h.tokenizer_hash), hash_hex(*expected_tokenizer_hash)),
                where, "use the tokenizer the cache was prepared with, or prepare it again");
  try {
    c.meta_ = nlohmann::json::parse(b + h.meta_offset, b + h.meta_offset + h.meta_size);
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("token cache metadata is corrupt: ") + e.what(), where, kRebuildFix);
  }
  check_metadata(c.meta_, where);
  c.num_samples_ = static_cast<int64_t>(h.num_samples);
  c.num_tokens_ = static_cast<int64_t>(h.num_tokens);
  c.tokenizer_hash_ = h.tokenizer_hash;
  c.checksum_ = h.checksum;
  c.ids_ = reinterpret_cast<const int32_t*>(b + h.ids_offset);
  c.mask_ = b + h.mask_offset;
  c.index_ = b + h.index_offset;
  c.data_begin_ = h.ids_offset;
  c.data_end_ = h.meta_offset;
  // The samples must tile the token array in order: then every span handed out is in bounds.
  int64_t expected_offset = 0;
  const int64_t num_files = c.meta_.contains("sources") ? c.meta_["sources"].size() : 0;
  for (int64_t i = 0; i < c.num_samples_; ++i) {
    const uint8_t* e = c.entry(i);
    const int64_t offset = get<int64_t>(e, 0);
    const int32_t length = get<int32_t>(e, 24);
    const int32_t file = get<int32_t>(e, 28);
    if (offset != expected_offset || length < 0 || file < 0 || file >= num_files)
      throw Error(fmt::format("token cache index is corrupt at sample {}", i), where, kRebuildFix);
    expected_offset += length;
  }
  if (expected_offset != c.num_tokens_)
    throw Error(fmt::format("token cache index covers {} tokens, the header says {}",
                            expected_offset, c.num_tokens_),
                where, kRebuildFix);
  return c;
}

const uint8_t* TokenCache::entry(int64_t i) const {
  if (i < 0 || i >= num_samples_)
    throw Error(fmt::format("sample {} is out of range (the cache has {})", i, num_samples_),
                path().string());
  return index_ + static_cast<size_t>(i) * kEntrySize;
}

const fs::path& TokenCache::path() const { return file_->path(); }

int64_t TokenCache::length(int64_t i) const { return get<int32_t>(entry(i), 24); }

std::span<const int32_t> TokenCache::ids(int64_t i) const {
  const uint8_t* e = entry(i);
  return {ids_ + get<int64_t>(e, 0), static_cast<size_t>(get<int32_t>(e, 24))};
}

std::span<const uint8_t> TokenCache::loss_mask(int64_t i) const {
  const uint8_t* e = entry(i);
  return {mask_ + get<int64_t>(e, 0), static_cast<size_t>(get<int32_t>(e, 24))};
}

Sample TokenCache::sample(int64_t i) const {
  const uint8_t* e = entry(i);
  Sample s;
  const auto id = ids(i);
  const auto mask = loss_mask(i);
  s.tokens.input_ids.assign(id.begin(), id.end());
  s.tokens.labels.resize(id.size());
  for (size_t t = 0; t < id.size(); ++t) s.tokens.labels[t] = mask[t] ? id[t] : kIgnoreIndex;
  s.line = get<int64_t>(e, 8);
  s.offset = get<uint64_t>(e, 16);
  s.file = get<int32_t>(e, 28);
  s.truncated = (get<uint32_t>(e, 32) & kFlagTruncated) != 0;
  return s;
}

std::vector<TokenizedSample> TokenCache::load(const std::vector<int64_t>& indices) const {
  std::vector<TokenizedSample> out;
  out.reserve(indices.size());
  for (int64_t i : indices) out.push_back(std::move(sample(i).tokens));
  return out;
}

int64_t TokenCache::num_trained_tokens() const {
  int64_t n = 0;
  for (int64_t t = 0; t < num_tokens_; ++t) n += mask_[t] != 0;
  return n;
}

std::vector<std::string> TokenCache::stale_sources() const {
  std::vector<std::string> stale;
  if (!meta_.contains("sources")) return stale;
  for (const auto& s : meta_["sources"]) {
    const std::string p = s.value("path", "");
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    if (ec || size != s.value("size", uint64_t{0}) ||
        mtime_ns(p) != s.value("mtime_ns", int64_t{0}))
      stale.push_back(p);
  }
  return stale;
}

void TokenCache::verify() const {
  const uint8_t* b = file_->data();
  const size_t mask_offset = reinterpret_cast<const uint8_t*>(mask_) - b;
  const size_t index_offset = index_ - b;
  const uint64_t ids_hash = fnv1a(kFnvOffset, b + data_begin_, mask_offset - data_begin_);
  const uint64_t mask_hash = fnv1a(kFnvOffset, b + mask_offset, index_offset - mask_offset);
  const uint64_t index_hash = fnv1a(kFnvOffset, b + index_offset, data_end_ - index_offset);
  if (combine_checksum(ids_hash, mask_hash, index_hash) != checksum_)
    throw Error("token cache checksum does not match its contents (the file is corrupt)",
                path().string(), kRebuildFix);
  for (int64_t t = 0; t < num_tokens_; ++t)
    if (mask_[t] > 1)
      throw Error(fmt::format("token cache loss mask holds {} at token {}", mask_[t], t),
                  path().string(), kRebuildFix);
}

}  // namespace glmtune::data
