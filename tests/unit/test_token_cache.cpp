// Token cache: prepare -> read gives exactly the samples the JSONL reader yields (ids, labels and
// provenance), packing reads it like any sample source, and damaged, foreign or mismatched caches
// are refused with errors that name the file.

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/dataset.h"
#include "glmtune/data/packing.h"
#include "glmtune/data/token_cache.h"
#include "glmtune/data/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using namespace glmtune::data;

const std::string kTokenizerJson =
    std::string(GLMTUNE_SOURCE_DIR) + "/examples/tiny/tokenizer/tokenizer.json";

const Tokenizer& tiny_tokenizer() {
  static const std::unique_ptr<Tokenizer> tok =
      std::make_unique<Tokenizer>(Tokenizer::from_file(kTokenizerJson));
  return *tok;
}

class TokenCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           (std::string("glmtune_token_cache_") + info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static DatasetConfig example_config() {
    DatasetConfig cfg;
    cfg.files = {std::string(GLMTUNE_SOURCE_DIR) + "/examples/tiny/data/chat.jsonl",
                 std::string(GLMTUNE_SOURCE_DIR) + "/examples/tiny/data/text.jsonl"};
    cfg.batch_lines = 7;  // several batches per file
    return cfg;
  }

  // Streams the dataset into a cache at `out`; returns the samples as the reader yielded them.
  static std::vector<Sample> prepare(const DatasetConfig& cfg, const std::string& out,
                                     DatasetStats* stats = nullptr) {
    JsonlSampleReader reader(cfg, tiny_tokenizer());
    TokenCacheWriter writer(out, cfg, kTokenizerJson);
    std::vector<Sample> samples;
    while (auto s = reader.next()) {
      writer.add(*s);
      samples.push_back(std::move(*s));
    }
    writer.finish(reader.stats());
    if (stats) *stats = reader.stats();
    return samples;
  }

  // The cache built from the examples, written to `name`.
  std::string example_cache(const std::string& name = "c.cache") {
    const std::string out = path(name);
    prepare(example_config(), out);
    return out;
  }

  static std::string read_bytes(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  static void write_bytes(const std::string& p, const std::string& bytes) {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
  }

  fs::path dir_;
};

// The error message of opening (and verifying) `file`, or "" when it opens cleanly.
std::string open_error(const std::string& file, std::optional<uint64_t> hash = std::nullopt) {
  try {
    TokenCache::open(file, hash).verify();
  } catch (const glmtune::Error& e) {
    EXPECT_EQ(e.where(), file) << e.what();
    return e.what();
  }
  return "";
}

#define EXPECT_CONTAINS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

TEST_F(TokenCacheTest, RoundTripIsByteIdenticalToTokenizingDirectly) {
  DatasetConfig cfg = example_config();
  cfg.max_length = 48;  // some samples are truncated: the flag must survive too
  DatasetStats stats;
  const std::string out = path("c.cache");
  const auto direct = prepare(cfg, out, &stats);
  ASSERT_GT(direct.size(), 50u);
  ASSERT_GT(stats.truncated, 0);

  const auto cache = TokenCache::open(out, tokenizer_file_hash(kTokenizerJson));
  cache.verify();
  ASSERT_EQ(cache.size(), static_cast<int64_t>(direct.size()));
  int64_t tokens = 0, trained = 0, truncated = 0;
  for (size_t i = 0; i < direct.size(); ++i) {
    const auto& d = direct[i];
    const Sample c = cache.sample(static_cast<int64_t>(i));
    ASSERT_EQ(c.tokens.input_ids, d.tokens.input_ids) << "sample " << i;
    ASSERT_EQ(c.tokens.labels, d.tokens.labels) << "sample " << i;
    EXPECT_EQ(c.file, d.file);
    EXPECT_EQ(c.line, d.line);
    EXPECT_EQ(c.offset, d.offset);
    EXPECT_EQ(c.truncated, d.truncated);
    // The mapped ids are the very bytes of the tokenizer's output.
    const auto ids = cache.ids(static_cast<int64_t>(i));
    ASSERT_EQ(ids.size(), d.tokens.input_ids.size());
    EXPECT_EQ(std::memcmp(ids.data(), d.tokens.input_ids.data(), ids.size_bytes()), 0);
    EXPECT_EQ(cache.length(static_cast<int64_t>(i)), static_cast<int64_t>(ids.size()));
    tokens += static_cast<int64_t>(ids.size());
    for (int32_t l : d.tokens.labels) trained += l != kIgnoreIndex;
    truncated += d.truncated;
  }
  EXPECT_EQ(cache.num_tokens(), tokens);
  EXPECT_EQ(cache.num_trained_tokens(), trained);
  EXPECT_EQ(truncated, stats.truncated);
  EXPECT_EQ(cache.metadata()["stats"], stats.to_json());
  EXPECT_EQ(cache.metadata()["config"]["max_length"], 48);
  EXPECT_EQ(cache.metadata()["sources"].size(), 2u);
  EXPECT_TRUE(cache.stale_sources().empty());

  // load() (what packing calls) returns the same tokens in the requested order.
  const auto loaded = cache.load({3, 0, 3});
  ASSERT_EQ(loaded.size(), 3u);
  EXPECT_EQ(loaded[0].input_ids, direct[3].tokens.input_ids);
  EXPECT_EQ(loaded[1].labels, direct[0].tokens.labels);
  EXPECT_EQ(loaded[2].labels, direct[3].tokens.labels);

  // Preparing again gives the same file byte for byte.
  prepare(cfg, path("again.cache"));
  EXPECT_EQ(read_bytes(out), read_bytes(path("again.cache")));
}

TEST_F(TokenCacheTest, PackingFromTheCacheEqualsPackingFromMemory) {
  DatasetConfig cfg = example_config();
  cfg.max_length = 200;
  const auto direct = prepare(cfg, path("c.cache"));
  std::vector<TokenizedSample> mem;
  for (const auto& s : direct) mem.push_back(s.tokens);
  InMemorySamples memory(mem);
  const auto cache = TokenCache::open(path("c.cache"));
  EXPECT_EQ(cache.fingerprint(), memory.fingerprint());

  PackingConfig pc;
  pc.pack_max_length = 256;
  pc.seed = 5;
  pc.pad_id = tiny_tokenizer().require_id("<|endoftext|>");
  PackSampler from_cache(cache, pc), from_memory(memory, pc);
  for (int k = 0; k < 2 * from_memory.packs_in_epoch() + 1; ++k) {
    const Pack a = from_cache.next(), b = from_memory.next();
    ASSERT_EQ(a.input_ids, b.input_ids) << "pack " << k;
    ASSERT_EQ(a.labels, b.labels) << "pack " << k;
    ASSERT_EQ(a.cu_seqlens, b.cu_seqlens) << "pack " << k;
    // No document is split: each document of the pack is one whole sample.
    for (size_t d = 0; d < a.sample_indices.size(); ++d)
      EXPECT_EQ(a.cu_seqlens[d + 1] - a.cu_seqlens[d], cache.length(a.sample_indices[d]));
  }
}

TEST_F(TokenCacheTest, EmptyCacheRoundTrips) {
  DatasetConfig cfg = example_config();
  TokenCacheWriter writer(path("e.cache"), cfg, kTokenizerJson);
  writer.finish(DatasetStats{});
  const auto cache = TokenCache::open(path("e.cache"));
  cache.verify();
  EXPECT_EQ(cache.size(), 0);
  EXPECT_EQ(cache.num_tokens(), 0);
}

TEST_F(TokenCacheTest, UnfinishedWriterLeavesNothingBehind) {
  {
    TokenCacheWriter writer(path("x.cache"), example_config(), kTokenizerJson);
    Sample s;
    s.tokens.input_ids = {1, 2, 3};
    s.tokens.labels = {kIgnoreIndex, 2, 3};
    writer.add(s);
  }  // destroyed without finish(), as when an error interrupts prepare
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(TokenCacheTest, FinishReplacesAnExistingCacheAtomically) {
  const std::string out = path("c.cache");
  write_bytes(out, "old contents");
  prepare(example_config(), out);
  EXPECT_EQ(open_error(out), "");
  // Only the cache is left in the directory: no temporary files.
  int64_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 1);
}

TEST_F(TokenCacheTest, RejectsMissingTruncatedAndForeignFiles) {
  const std::string good = example_cache();
  const std::string bytes = read_bytes(good);
  EXPECT_EQ(open_error(good), "");

  EXPECT_NE(open_error(path("missing.cache")), "");

  write_bytes(path("short.cache"), bytes.substr(0, 40));
  EXPECT_CONTAINS(open_error(path("short.cache")), "shorter than the 96-byte header");

  write_bytes(path("cut.cache"), bytes.substr(0, bytes.size() - 10));
  EXPECT_CONTAINS(open_error(path("cut.cache")), "truncated");

  write_bytes(path("json.cache"), std::string(200, '{'));
  EXPECT_CONTAINS(open_error(path("json.cache")), "wrong magic");

  std::string v2 = bytes;
  v2[8] = 2;  // format version
  write_bytes(path("v2.cache"), v2);
  EXPECT_CONTAINS(open_error(path("v2.cache")), "format version 2");
}

TEST_F(TokenCacheTest, DetectsCorruptContents) {
  const std::string good = example_cache();
  const std::string bytes = read_bytes(good);

  std::string flipped = bytes;
  flipped[96 + 4 * 10] ^= 0x01;  // one id bit
  write_bytes(path("flip.cache"), flipped);
  EXPECT_CONTAINS(open_error(path("flip.cache")), "checksum");

  std::string offsets = bytes;
  offsets[48] ^= 0x08;  // mask offset
  write_bytes(path("offsets.cache"), offsets);
  EXPECT_CONTAINS(open_error(path("offsets.cache")), "header is corrupt");

  // The index record of sample 1 claims a different start.
  const uint64_t index_offset = [&] {
    uint64_t v;
    std::memcpy(&v, bytes.data() + 56, 8);
    return v;
  }();
  std::string index = bytes;
  index[index_offset + 40] ^= 0x01;
  write_bytes(path("index.cache"), index);
  EXPECT_CONTAINS(open_error(path("index.cache")), "index is corrupt at sample 1");

  std::string meta = bytes;
  meta[meta.size() - 1] = '#';  // the metadata JSON's closing brace
  write_bytes(path("meta.cache"), meta);
  EXPECT_CONTAINS(open_error(path("meta.cache")), "metadata is corrupt");
}

// Header fields by byte offset (token_cache.cpp, encode_header).
constexpr size_t kNumSamplesAt = 24, kMetaOffsetAt = 64, kMetaSizeAt = 72, kFileSizeAt = 80;

uint64_t header_field(const std::string& bytes, size_t at) {
  uint64_t v;
  std::memcpy(&v, bytes.data() + at, 8);
  return v;
}
void set_header_field(std::string& bytes, size_t at, uint64_t v) {
  std::memcpy(bytes.data() + at, &v, 8);
}

TEST_F(TokenCacheTest, RefusesAMetadataOffsetPastTheEnd) {
  std::string bytes = read_bytes(example_cache());
  const uint64_t size = bytes.size();
  const uint64_t meta_offset = header_field(bytes, kMetaOffsetAt);
  // More samples move the metadata past the end of the file; a metadata size of
  // `size - meta_offset` (wrapped around) makes `meta_offset + meta_size` equal the file size.
  const uint64_t extra = (size - meta_offset) / 40 + 1;
  set_header_field(bytes, kNumSamplesAt, header_field(bytes, kNumSamplesAt) + extra);
  set_header_field(bytes, kMetaOffsetAt, meta_offset + 40 * extra);
  set_header_field(bytes, kMetaSizeAt, size - (meta_offset + 40 * extra));
  ASSERT_GT(meta_offset + 40 * extra, size);
  write_bytes(path("past.cache"), bytes);
  EXPECT_CONTAINS(open_error(path("past.cache")), "header is corrupt");
}

TEST_F(TokenCacheTest, RefusesMetadataOfTheWrongShape) {
  const std::string bytes = read_bytes(example_cache());
  const uint64_t meta_offset = header_field(bytes, kMetaOffsetAt);
  const auto meta = nlohmann::json::parse(bytes.substr(meta_offset));
  ASSERT_EQ(meta["sources"].size(), 2u);  // the index refers to two files
  // The cache with its metadata replaced (the checksum does not cover the metadata).
  auto with_meta = [&](const nlohmann::json& m, const std::string& name) {
    const std::string text = m.dump();
    std::string out = bytes.substr(0, meta_offset) + text;
    set_header_field(out, kMetaSizeAt, text.size());
    set_header_field(out, kFileSizeAt, out.size());
    write_bytes(path(name), out);
    return path(name);
  };
  // The error of opening the cache and checking its sources, or "" when both pass.
  auto error = [](const std::string& file) -> std::string {
    try {
      (void)TokenCache::open(file).stale_sources();
    } catch (const glmtune::Error& e) {
      EXPECT_EQ(e.where(), file);
      EXPECT_CONTAINS(std::string(e.what()), "glmtune data prepare");
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(error(with_meta(meta, "same.cache")), "");

  nlohmann::json m = meta;
  m["sources"] = {1, 2};
  EXPECT_CONTAINS(error(with_meta(m, "number.cache")), "sources[0] is number, not an object");
  m = meta;
  m["sources"][1]["size"] = "12";
  EXPECT_CONTAINS(error(with_meta(m, "size.cache")), "sources[1].size is string");
  m = meta;
  m["sources"][0]["path"] = 3;
  EXPECT_CONTAINS(error(with_meta(m, "path.cache")), "sources[0].path is number");
  m = meta;
  m["sources"][0]["mtime_ns"] = nlohmann::json::array();
  EXPECT_CONTAINS(error(with_meta(m, "mtime.cache")), "sources[0].mtime_ns is array");
  m = meta;
  m["config"] = "auto";
  EXPECT_CONTAINS(error(with_meta(m, "config.cache")), "\"config\" is string");
  EXPECT_CONTAINS(error(with_meta(nlohmann::json::array(), "array.cache")),
                  "expected a JSON object");
}

TEST_F(TokenCacheTest, RefusesACacheBuiltWithAnotherTokenizer) {
  const std::string good = example_cache();
  // A tokenizer.json differing in one byte (formatting) is a different tokenizer file.
  std::string json = read_bytes(kTokenizerJson) + "\n";
  write_bytes(path("tokenizer.json"), json);
  const uint64_t other = tokenizer_file_hash(path("tokenizer.json"));
  ASSERT_NE(other, tokenizer_file_hash(kTokenizerJson));
  EXPECT_EQ(tokenizer_file_hash(kTokenizerJson), tokenizer_file_hash(kTokenizerJson));
  const std::string err = open_error(good, other);
  EXPECT_CONTAINS(err, "different tokenizer");
  EXPECT_CONTAINS(err, hash_hex(other));
  EXPECT_EQ(open_error(good, tokenizer_file_hash(kTokenizerJson)), "");
  EXPECT_EQ(resolve_tokenizer_json(dir_), fs::path(path("tokenizer.json")));
  EXPECT_THROW(resolve_tokenizer_json(dir_ / "nowhere"), glmtune::Error);
}

TEST_F(TokenCacheTest, ReportsChangedSources) {
  DatasetConfig cfg;
  const std::string src = path("d.jsonl");
  write_bytes(src, "{\"text\": \"hello world\"}\n{\"text\": \"again\"}\n");
  cfg.files = {src};
  prepare(cfg, path("c.cache"));
  EXPECT_TRUE(TokenCache::open(path("c.cache")).stale_sources().empty());
  write_bytes(src, "{\"text\": \"hello world\"}\n");
  EXPECT_EQ(TokenCache::open(path("c.cache")).stale_sources(), std::vector<std::string>{src});
  fs::remove(src);
  EXPECT_EQ(TokenCache::open(path("c.cache")).stale_sources(), std::vector<std::string>{src});
}

}  // namespace
