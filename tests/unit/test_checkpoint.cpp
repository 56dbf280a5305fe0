// Sharded checkpoints: the streaming writer (size-limited shards, index, atomic replacement) and
// the lazy reader with its index cross-checks.

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/io/checkpoint.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using namespace glmtune;
using namespace glmtune::io;

namespace {

using glmtune::test::read_text;
using glmtune::test::TempDir;
using glmtune::test::write_text;

const fs::path kGolden = fs::path(GLMTUNE_SOURCE_DIR) / "tests" / "golden" / "safetensors";

std::vector<std::string> dir_entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

Tensor filled(int64_t n, double base, DType dtype = DType::f32) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = base + double(i) * 0.25;
  return Tensor::from_doubles(v, {n}, dtype);
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  Tensor c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return {p, p + c.nbytes()};
}

template <typename Fn>
void expect_error(Fn&& fn, const std::string& expected) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing: " << expected;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << "message: " << e.what();
  }
}

// A valid 2-shard checkpoint: a,b in shard 1, c in shard 2.
void write_two_shards(const fs::path& dir) {
  CheckpointWriterOptions options;
  options.max_shard_bytes = 64;
  CheckpointWriter w(dir, options);
  w.add("a", filled(8, 1));  // 32 bytes
  w.add("b", filled(8, 2));  // 32 bytes
  w.add("c", filled(8, 3));  // would make 96 > 64: new shard
  w.finish();
}

}  // namespace

TEST(CheckpointWriter, ShardsBySizeAndWritesTheIndex) {
  TempDir tmp;
  const fs::path dir = tmp / "ckpt";
  CheckpointWriterOptions options;
  options.max_shard_bytes = 100;
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"model.embed.weight", filled(10, 0.5)},             // 40 B
      {"model.layers.0.w", filled(10, 1.5, DType::bf16)},  // 20 B   -> shard 1: 60
      {"model.layers.1.w", filled(12, 2.5)},               // 48 B   -> 108 > 100: shard 2
      {"model.layers.2.big", filled(40, 3.5)},             // 160 B  -> alone in shard 3
      {"lm_head.weight", filled(4, 4.5, DType::bf16)},     // 8 B    -> shard 4
  };
  {
    CheckpointWriter w(dir, options);
    for (const auto& [name, t] : tensors) w.add(name, t);
    w.finish();
    EXPECT_EQ(w.num_shards(), 4u);
    EXPECT_EQ(w.total_bytes(), 40u + 20 + 48 + 160 + 8);
  }
  EXPECT_EQ(dir_entries(dir),
            (std::vector<std::string>{
                "glmtune-checksums.json", "model-00001-of-00004.safetensors",
                "model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors",
                "model-00004-of-00004.safetensors", "model.safetensors.index.json"}));
  // Nothing temporary is left beside the checkpoint.
  EXPECT_EQ(dir_entries(tmp.path()), (std::vector<std::string>{"ckpt"}));

  const std::string index_text = read_text(dir / "model.safetensors.index.json");
  auto index = nlohmann::json::parse(index_text);
  EXPECT_EQ(index["metadata"]["total_size"], 276);
  EXPECT_EQ(index["metadata"]["total_parameters"], 10 + 10 + 12 + 40 + 4);
  EXPECT_EQ(index["weight_map"]["model.layers.0.w"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["model.layers.1.w"], "model-00002-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["model.layers.2.big"], "model-00003-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["lm_head.weight"], "model-00004-of-00004.safetensors");
  // transformers' formatting: json.dumps(index, indent=2, sort_keys=True) + "\n".
  EXPECT_EQ(index_text, index.dump(2) + "\n");
  EXPECT_EQ(index_text.rfind("{\n  \"metadata\": {\n    \"total_parameters\": 76,\n", 0), 0u)
      << index_text;

  auto reader = CheckpointReader::open(dir);
  reader.validate();
  EXPECT_TRUE(reader.sharded());
  EXPECT_EQ(reader.names().size(), tensors.size());
  EXPECT_TRUE(std::is_sorted(reader.names().begin(), reader.names().end()));
  EXPECT_EQ(reader.index_total_size(), 276u);
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    EXPECT_EQ(bytes_of(reader.tensor(name)), bytes_of(t));
    EXPECT_EQ(reader.info(name).dtype, t.dtype());
  }
  EXPECT_EQ(reader.shard_of("model.embed.weight"), "model-00001-of-00004.safetensors");
  EXPECT_EQ(reader.names_in_shard("model-00001-of-00004.safetensors"),
            (std::vector<std::string>{"model.embed.weight", "model.layers.0.w"}));
  // Every shard carries the metadata transformers writes.
  EXPECT_EQ(reader.shard("model-00002-of-00004.safetensors").metadata().at("format"), "pt");
}

TEST(CheckpointWriter, PlannedShardsStreamOneTensorAtATime) {
  TempDir tmp;
  const fs::path dir = tmp / "planned";
  Tensor x = filled(6, 1, DType::bf16), y = filled(3, 2), z = filled(5, 3);
  {
    CheckpointWriter w(dir);
    w.begin_shard({{"x", DType::bf16, {6}}, {"y", DType::f32, {3}}});
    w.write("y", y);  // any order
    w.write_bytes("x", bytes_of(x));
    w.end_shard();
    w.add("z", z);  // buffered tensors may follow
    w.add_file("config.json", "{\"a\": 1}\n");
    w.finish();
  }
  auto reader = CheckpointReader::open(dir);
  reader.validate();
  EXPECT_EQ(reader.shard_files(), (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                            "model-00002-of-00002.safetensors"}));
  EXPECT_EQ(bytes_of(reader.tensor("x")), bytes_of(x));
  EXPECT_EQ(bytes_of(reader.tensor("y")), bytes_of(y));
  EXPECT_EQ(bytes_of(reader.tensor("z")), bytes_of(z));
  EXPECT_EQ(reader.shard_of("z"), "model-00002-of-00002.safetensors");
  EXPECT_EQ(read_text(dir / "config.json"), "{\"a\": 1}\n");
}

TEST(CheckpointWriter, MisuseIsAnError) {
  TempDir tmp;
  CheckpointWriter w(tmp / "m");
  w.add("a", filled(2, 1));
  expect_error([&] { w.add("a", filled(2, 1)); }, "tensor \"a\" is written twice");
  w.begin_shard({{"b", DType::f32, {2}}});
  expect_error([&] { w.add("c", filled(2, 1)); }, "while a planned shard is open");
  expect_error([&] { w.finish(); }, "call end_shard()");
  expect_error([&] { w.end_shard(); }, "\"b\" was planned but never written");
  expect_error([&] { w.add_file("../evil", "x"); }, "must be a plain file name");
  expect_error([&] { w.add_file("model.safetensors.index.json", "x"); }, "would clash");
  CheckpointWriter empty(tmp / "e");
  expect_error([&] { empty.finish(); }, "no tensors were written");
}

TEST(CheckpointWriter, NothingAppearsWithoutFinish) {
  TempDir tmp;
  const fs::path dir = tmp / "ckpt";
  {
    CheckpointWriterOptions options;
    options.max_shard_bytes = 16;
    CheckpointWriter w(dir, options);
    for (int i = 0; i < 5; ++i) w.add("t" + std::to_string(i), filled(4, i));  // flushes shards
    w.add_file("config.json", "{}");
    EXPECT_TRUE(fs::exists(w.temporary_dir()));
    EXPECT_FALSE(fs::exists(dir));
    // Destroyed without finish(), as after an exception.
  }
  EXPECT_TRUE(fs::is_empty(tmp.path())) << "left: " << dir_entries(tmp.path()).front();
}

TEST(CheckpointWriter, ReplacesPreviousContentOnlyOnFinish) {
  TempDir tmp;
  const fs::path dir = tmp / "ckpt";
  write_two_shards(dir);
  write_text(dir / "stale.txt", "old");
  const auto before = dir_entries(dir);
  {
    CheckpointWriter w(dir);
    w.add("new", filled(4, 9));
    // Still the old checkpoint while the new one is being written...
    EXPECT_EQ(dir_entries(dir), before);
  }
  // ...and after an abandoned write.
  EXPECT_EQ(dir_entries(dir), before);
  EXPECT_EQ(dir_entries(tmp.path()), (std::vector<std::string>{"ckpt"}));
  {
    CheckpointWriter w(dir);
    w.add("new", filled(4, 9));
    w.finish();
  }
  // The whole directory is replaced: no shard or file of the old checkpoint survives.
  EXPECT_EQ(dir_entries(dir),
            (std::vector<std::string>{"glmtune-checksums.json", "model-00001-of-00001.safetensors",
                                      "model.safetensors.index.json"}));
  EXPECT_EQ(dir_entries(tmp.path()), (std::vector<std::string>{"ckpt"}));
  auto reader = CheckpointReader::open(dir);
  EXPECT_EQ(reader.names(), (std::vector<std::string>{"new"}));
}

TEST(CheckpointReader, ReadsHuggingFaceShardsAndSingleFiles) {
  auto sharded = CheckpointReader::open(kGolden / "sharded");
  sharded.validate();
  EXPECT_EQ(sharded.names().size(), 4u);
  EXPECT_EQ(sharded.shard_of("layers.2.weight"), "model-00002-of-00002.safetensors");
  EXPECT_EQ(sharded.index_total_size(), 256u);
  // Values from tools/golden/make_safetensors_golden.py: ((i * 7) % 23 - 11) / 4 + k.
  auto t = sharded.tensor("layers.3.weight").to_doubles();
  for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(t[size_t(i)], double((i * 7) % 23 - 11) / 4 + 3);

  TempDir tmp;
  fs::create_directory(tmp / "single");
  fs::copy_file(kGolden / "all_dtypes.safetensors", tmp / "single" / "model.safetensors");
  auto single = CheckpointReader::open(tmp / "single");
  single.validate();
  EXPECT_FALSE(single.sharded());
  EXPECT_EQ(single.names().size(), 10u);
  EXPECT_EQ(single.tensor("scalar").item(), 1.5);
  // A lone file path works too.
  auto file = CheckpointReader::open(kGolden / "all_dtypes.safetensors");
  EXPECT_EQ(file.names(), single.names());
}

TEST(CheckpointReader, IndexErrors) {
  TempDir tmp;
  const fs::path dir = tmp / "c";
  write_two_shards(dir);
  const fs::path index = dir / "model.safetensors.index.json";
  const std::string good = read_text(index);
  const std::string s1 = "model-00001-of-00002.safetensors",
                    s2 = "model-00002-of-00002.safetensors";
  auto with_index = [&](const std::string& text) {
    write_text(index, text);
    return CheckpointReader::open(dir);
  };
  auto map_json = [&](const std::string& entries) {
    return "{\"metadata\": {\"total_size\": 96}, \"weight_map\": {" + entries + "}}";
  };

  // Opening checks the index itself and that every shard exists.
  expect_error([&] { with_index("{\"weight_map\": "); }, "malformed index: not valid JSON");
  expect_error([&] { with_index("[]"); }, "malformed index: not a JSON object");
  expect_error([&] { with_index("{\"metadata\": {}}"); }, "no \"weight_map\"");
  expect_error([&] { with_index("{\"weight_map\": [1]}"); }, "\"weight_map\" is not an object");
  expect_error([&] { with_index("{\"weight_map\": {}}"); }, "lists no tensors");
  expect_error([&] { with_index(map_json("\"a\": 3")); },
               "the entry for \"a\" is not a shard file name");
  expect_error([&] { with_index(map_json("\"a\": \"../x.safetensors\"")); },
               "is not a file inside the checkpoint directory");
  expect_error([&] { with_index(map_json("\"a\": \"" + s1 + "\", \"a\": \"" + s2 + "\"")); },
               "duplicate key \"a\"");
  expect_error(
      [&] {
        with_index("{\"metadata\": {\"total_size\": -1}, \"weight_map\": {\"a\": \"" + s1 + "\"}}");
      },
      "total_size\" is not a non-negative integer");
  expect_error([&] { with_index(map_json("\"a\": \"model-00009-of-00009.safetensors\"")); },
               "the index names shard \"model-00009-of-00009.safetensors\", which does not exist");

  // validate() cross-checks the shards' headers.
  expect_error(
      [&] {
        with_index(map_json("\"a\": \"" + s1 + "\", \"b\": \"" + s2 + "\", \"c\": \"" + s2 + "\""))
            .validate();
      },
      "the index maps \"b\" to \"" + s2 + "\", but it is in \"" + s1 + "\"");
  expect_error(
      [&] { with_index(map_json("\"a\": \"" + s1 + "\", \"c\": \"" + s2 + "\"")).validate(); },
      "shard \"" + s1 + "\" holds tensor \"b\" that the index does not list");
  // c is only in shard 2, which this index never names.
  expect_error(
      [&] {
        with_index(map_json("\"a\": \"" + s1 + "\", \"b\": \"" + s1 + "\", \"c\": \"" + s1 + "\""))
            .validate();
      },
      "the index maps \"c\" to \"" + s1 + "\", but \"" + s1 + "\" has no such tensor");
  expect_error(
      [&] {
        with_index(map_json("\"a\": \"" + s1 + "\", \"b\": \"" + s1 + "\", \"c\": \"" + s2 +
                            "\", \"d\": \"" + s2 + "\""))
            .validate();
      },
      "the index maps \"d\" to \"" + s2 + "\", but \"" + s2 + "\" has no such tensor");
  // The same problem is caught lazily by a reader that never validated.
  expect_error(
      [&] {
        with_index(map_json("\"a\": \"" + s1 + "\", \"b\": \"" + s1 + "\", \"c\": \"" + s2 +
                            "\", \"d\": \"" + s2 + "\""))
            .tensor("d");
      },
      "has no such tensor");
  expect_error([&] { with_index(good).tensor("zzz"); }, "no tensor named \"zzz\"");

  // A tensor present in two shards: copy shard 1 over shard 2's content.
  write_text(index, good);
  fs::copy_file(dir / s1, dir / s2, fs::copy_options::overwrite_existing);
  expect_error([&] { CheckpointReader::open(dir).validate(); },
               "tensor \"a\" is present in two shards: \"" + s1 + "\" and \"" + s2 + "\"");

  // Directories that are not checkpoints.
  expect_error([&] { CheckpointReader::open(tmp / "missing"); }, "checkpoint not found");
  fs::create_directory(tmp / "emptydir");
  expect_error([&] { CheckpointReader::open(tmp / "emptydir"); },
               "no model.safetensors.index.json or model.safetensors in this directory");
  // A shard that is not a safetensors file fails with the shard's name.
  write_two_shards(tmp / "d");
  write_text(tmp / "d" / s2, "garbage");
  expect_error([&] { CheckpointReader::open(tmp / "d").validate(); }, s2);
}

TEST(CheckpointReader, ClosingAShardKeepsTensorsValid) {
  TempDir tmp;
  write_two_shards(tmp / "c");
  auto reader = CheckpointReader::open(tmp / "c");
  Tensor c = reader.tensor("c");
  reader.release("c");
  reader.close_shard(reader.shard_of("c"));
  EXPECT_EQ(bytes_of(c), bytes_of(filled(8, 3)));
  // The shard reopens on demand.
  EXPECT_EQ(bytes_of(reader.tensor("c")), bytes_of(filled(8, 3)));
}

// Flips one bit of byte `at` of `file` in place: the size stays, only the content changes.
void flip_bit(const fs::path& file, uint64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(at));
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x10);
  f.seekp(std::streamoff(at));
  f.write(&c, 1);
}

// Where tensor `name`'s bytes start in its shard.
uint64_t data_offset_of(const fs::path& dir, const std::string& name) {
  const auto reader = CheckpointReader::open(dir);
  const SafetensorsFile& sf = reader.shard(reader.shard_of(name));
  return sf.data_offset() + sf.info(name).begin;
}

TEST(CheckpointChecksums, EveryTensorIsRecordedAndVerifies) {
  TempDir tmp("ckpt");
  const fs::path dir = tmp / "ckpt";
  write_two_shards(dir);
  const auto sums = nlohmann::json::parse(read_text(dir / kChecksumsFileName));
  EXPECT_EQ(sums["algorithm"], "xxh3-64");
  const auto& shard1 = sums["files"]["model-00001-of-00002.safetensors"];
  EXPECT_EQ(shard1["bytes"].get<uint64_t>(),
            fs::file_size(dir / "model-00001-of-00002.safetensors"));
  // The recorded hash is that of the tensor's bytes.
  const Tensor a = filled(8, 1);
  EXPECT_EQ(shard1["tensors"]["a"], hash_hex(content_hash(bytes_of(a))));
  EXPECT_EQ(sums["files"]["model-00002-of-00002.safetensors"]["tensors"].size(), 1u);

  const VerifyReport r = verify_checkpoint(dir);
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_TRUE(r.has_checksums);
  EXPECT_EQ(r.tensors_verified, 3);
  EXPECT_EQ(r.bytes_verified, 96u);
  // The index ignores the checksums file: the directory is an ordinary Hugging Face checkpoint.
  EXPECT_EQ(CheckpointReader::open(dir).names(), (std::vector<std::string>{"a", "b", "c"}));
}

TEST(CheckpointChecksums, AFlippedBitNamesTheTensorAndTheFile) {
  TempDir tmp("ckpt");
  const fs::path dir = tmp / "ckpt";
  write_two_shards(dir);
  const fs::path shard = dir / "model-00001-of-00002.safetensors";
  const auto size = fs::file_size(shard);
  // Bit 4 of a byte of "b" (a float32 of 2.0..3.75): still a finite number, same file size.
  flip_bit(shard, data_offset_of(dir, "b") + 5);
  ASSERT_EQ(fs::file_size(shard), size);
  // The header-level check alone does not see it...
  EXPECT_NO_THROW(CheckpointReader::open(dir).validate());
  // ...the checksums do.
  const VerifyReport r = verify_checkpoint(dir);
  ASSERT_EQ(r.problems.size(), 1u) << r.describe();
  EXPECT_EQ(r.problems[0].file, "model-00001-of-00002.safetensors");
  EXPECT_EQ(r.problems[0].tensor, "b");
  EXPECT_NE(r.problems[0].problem.find("checksum mismatch"), std::string::npos);
  EXPECT_EQ(r.tensors_verified, 2);
}

TEST(CheckpointChecksums, TruncatedAndMissingShardsAreNamed) {
  TempDir tmp("ckpt");
  const fs::path dir = tmp / "ckpt";
  write_two_shards(dir);
  const fs::path shard2 = dir / "model-00002-of-00002.safetensors";
  fs::resize_file(shard2, fs::file_size(shard2) - 4);
  VerifyReport r = verify_checkpoint(dir);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.problems[0].file, "model-00002-of-00002.safetensors");
  EXPECT_NE(r.problems[0].problem.find("truncated"), std::string::npos) << r.describe();

  fs::remove(shard2);
  r = verify_checkpoint(dir);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.problems[0].file, "model-00002-of-00002.safetensors");
  EXPECT_NE(r.problems[0].problem.find("missing"), std::string::npos) << r.describe();
  EXPECT_NE(r.problems[0].problem.find("\"c\""), std::string::npos) << r.describe();
}

TEST(CheckpointChecksums, WithoutChecksumsTheStructureIsCheckedAndReportedUnverified) {
  TempDir tmp("ckpt");
  const fs::path dir = tmp / "ckpt";
  write_two_shards(dir);
  fs::remove(dir / kChecksumsFileName);  // as a released model or an older glmtune writes it
  VerifyReport r = verify_checkpoint(dir);
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_FALSE(r.has_checksums);
  EXPECT_EQ(r.tensors_verified, 0);
  // A truncated shard is still found, from its header.
  const fs::path shard2 = dir / "model-00002-of-00002.safetensors";
  fs::resize_file(shard2, fs::file_size(shard2) - 4);
  r = verify_checkpoint(dir);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.problems[0].file, "model-00002-of-00002.safetensors");
}

TEST(CheckpointWriter, AKilledWritersTemporaryDirectoryIsRemovedByTheNextWriter) {
  TempDir tmp("ckpt");
  // What a writer of the same directory killed mid-way left: its pid is no longer running.
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const fs::path stale = tmp / (".ckpt.tmp." + temporary_host_tag() + "." + std::to_string(dead));
  fs::create_directories(stale);
  write_text(stale / "shard-00001.safetensors.partial", std::string(1000, 'x'));
  // Another directory's, and another host's, are not this writer's to remove.
  const fs::path other = tmp / (".other.tmp." + temporary_host_tag() + "." + std::to_string(dead));
  const fs::path remote = tmp / (".ckpt.tmp.otherhost." + std::to_string(dead));
  fs::create_directories(other);
  fs::create_directories(remote);
  write_two_shards(tmp / "ckpt");
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(other));
  EXPECT_TRUE(fs::exists(remote));
}
