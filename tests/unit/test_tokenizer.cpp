// Byte-level BPE tokenizer: parity with Hugging Face `tokenizers` on golden encodings (regenerate
// them with tools/golden/tokenizer_goldens.py), lossless round trips, batch == serial, added-token
// handling and the errors every malformed tokenizer.json gets.

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/data/tokenizer_bpe.h"
#include "glmtune/data/tokenizer_regex.h"
#include "glmtune/data/tokenizer_unicode.h"

namespace glmtune::data {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Ids = std::vector<std::int32_t>;

const std::string kRoot = GLMTUNE_SOURCE_DIR;
const std::string kTinyPath = kRoot + "/examples/tiny/tokenizer/tokenizer.json";
const std::string kGoldenDir = kRoot + "/tests/golden/tokenizer";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

const Tokenizer& tiny() {
  static const Tokenizer tok = Tokenizer::from_file(kTinyPath);
  return tok;
}

struct GoldenCase {
  std::string name, text;
  Ids ids;
  std::string decoded, decoded_skip_special;
};

std::vector<GoldenCase> load_goldens(const std::string& file) {
  const json j = json::parse(read_file(kGoldenDir + "/" + file));
  std::vector<GoldenCase> cases;
  for (const json& c : j.at("cases")) {
    cases.push_back({c.at("name"), c.at("text"), c.at("ids").get<Ids>(), c.at("decoded"),
                     c.at("decoded_skip_special")});
  }
  return cases;
}

// HF decodes with String::from_utf8_lossy: each maximal invalid subsequence becomes one U+FFFD.
// glmtune returns the exact bytes; this converts them for comparison.
std::string utf8_lossy(std::string_view s) {
  std::string out;
  for (std::size_t i = 0; i < s.size();) {
    const detail::Utf8Char ch = detail::decode_utf8(s, i);
    if (ch.valid) {
      out.append(s.substr(i, static_cast<std::size_t>(ch.len)));
      i += static_cast<std::size_t>(ch.len);
      continue;
    }
    // Length of the maximal prefix of a well-formed sequence starting at i.
    const auto b0 = static_cast<unsigned char>(s[i]);
    std::size_t need = b0 >= 0xC2 && b0 <= 0xDF   ? 2
                       : b0 >= 0xE0 && b0 <= 0xEF ? 3
                       : b0 >= 0xF0 && b0 <= 0xF4 ? 4
                                                  : 1;
    std::size_t len = 1;
    while (len < need && i + len < s.size()) {
      const auto b = static_cast<unsigned char>(s[i + len]);
      unsigned char lo = 0x80, hi = 0xBF;
      if (len == 1) {
        if (b0 == 0xE0) lo = 0xA0;
        if (b0 == 0xED) hi = 0x9F;
        if (b0 == 0xF0) lo = 0x90;
        if (b0 == 0xF4) hi = 0x8F;
      }
      if (b < lo || b > hi) break;
      ++len;
    }
    out += "\xEF\xBF\xBD";
    i += len;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Golden parity

TEST(TokenizerGolden, TinyEncodeMatchesHuggingFace) {
  const auto cases = load_goldens("tiny_encodings.json");
  ASSERT_GE(cases.size(), 40u);
  for (const GoldenCase& c : cases) {
    EXPECT_EQ(tiny().encode(c.text), c.ids) << "case: " << c.name;
  }
}

TEST(TokenizerGolden, TinyDecodeMatchesHuggingFace) {
  for (const GoldenCase& c : load_goldens("tiny_encodings.json")) {
    EXPECT_EQ(utf8_lossy(tiny().decode(c.ids)), c.decoded) << "case: " << c.name;
    EXPECT_EQ(utf8_lossy(tiny().decode(c.ids, /*skip_special=*/true)), c.decoded_skip_special)
        << "case: " << c.name;
    EXPECT_EQ(tiny().decode(tiny().encode(c.text)), c.text) << "case: " << c.name;
  }
}

TEST(TokenizerGolden, Gpt2StyleMatchesHuggingFace) {
  // NFC normalizer, bare ByteLevel with its regex and add_prefix_space, and added tokens with
  // single_word / lstrip / rstrip / normalized.
  const Tokenizer tok = Tokenizer::from_file(kGoldenDir + "/gpt2_style_tokenizer.json");
  const auto cases = load_goldens("gpt2_style_encodings.json");
  ASSERT_GE(cases.size(), 20u);
  for (const GoldenCase& c : cases) {
    EXPECT_EQ(tok.encode(c.text), c.ids) << "case: " << c.name;
    EXPECT_EQ(utf8_lossy(tok.decode(c.ids)), c.decoded) << "case: " << c.name;
    EXPECT_EQ(utf8_lossy(tok.decode(c.ids, true)), c.decoded_skip_special) << "case: " << c.name;
  }
}

TEST(TokenizerGolden, TinyBatchMatchesSerial) {
  std::vector<std::string> texts;
  for (const GoldenCase& c : load_goldens("tiny_encodings.json")) texts.push_back(c.text);
  const auto batch = tiny().encode_batch(texts);
  ASSERT_EQ(batch.size(), texts.size());
  for (std::size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(batch[i], tiny().encode(texts[i]));
}

// The released GLM-5.3-Flash tokenizer.json is not bundled (20 MB). Point GLMTUNE_GLM_TOKENIZER
// at it to check the encodings published for it.
TEST(TokenizerGolden, ReleasedGlmFileWhenAvailable) {
  const char* path = std::getenv("GLMTUNE_GLM_TOKENIZER");
  if (path == nullptr || *path == '\0') {
    GTEST_SKIP() << "set GLMTUNE_GLM_TOKENIZER to the released tokenizer.json to run this";
  }
  const Tokenizer tok = Tokenizer::from_file(path);
  EXPECT_EQ(tok.require_id("<|endoftext|>"), 154820);
  EXPECT_EQ(tok.require_id("<|video|>"), 154855);
  EXPECT_EQ(tok.vocab_size(), 154856);
  EXPECT_EQ(tok.encode("你好，世界。工具调用"), (Ids{109377, 3837, 99011, 1773, 100764, 110462}));
  EXPECT_EQ(tok.encode("1234567 3.14159 -42 0x1F 1e-9"),
            (Ids{108714, 100461, 21, 22, 220, 18,  13, 122804, 102573, 481, 101961,
                 220,    15,     87, 16, 37,  220, 16, 68,     12,     24}));
  EXPECT_EQ(tok.encode("  leading\n\n\ttabs   trailing  \r\n\r\n end"),
            (Ids{220, 6388, 271, 3244, 3435, 256, 27654, 72185, 835}));
  EXPECT_EQ(tok.encode("[gMASK]<sop><|system|>Sys<|user|>Hallo<|assistant|><think>kurz</think>"
                       "Antwort<|observation|><tool_response>ok</tool_response><|endoftext|>"),
            (Ids{154822, 154824, 154826, 32639, 154827, 77451, 154828, 154841, 67820, 89, 154842,
                 17098, 31023, 154829, 154845, 562, 154846, 154820}));
  EXPECT_EQ(
      tok.encode("[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>Du bist ein hilfreicher "
                 "Assistent.<|user|>Wie groß ist der Monitor? 🦅<|assistant|><think>"),
      (Ids{154822, 154824, 154826, 25062, 287,   29905, 371,   25,     7487,   154826, 41836,
           76909,  4368,   50989,  24640, 27968, 2688,  18100, 13,     154827, 65355,  66237,
           5999,   2694,   23454,  30,    11157, 99,    227,   154828, 154841}));
  const std::string kept = tok.decode(tok.encode("<|user|>a<think>b</think><tool_call>"), true);
  EXPECT_EQ(kept, "a<think>b</think><tool_call>");
}

// ---------------------------------------------------------------------------------------------
// Round trips on random input

class RandomText {
 public:
  explicit RandomText(std::uint32_t seed) : rng_(seed) {}

  std::string utf8(std::size_t max_units) {
    static const std::vector<std::string> kFragments = {
        "'s",
        "'T",
        "'LL",
        "'re",
        "'Ve",
        " ",
        "  ",
        "\t",
        "\n",
        "\r\n",
        "\r",
        "\n\n",
        "\v",
        "\f",
        "\xC2\xA0",
        "\xE3\x80\x80",
        "\xE2\x80\xA8",
        "\xC2\x85",
        "\xE1\xA0\x8E",
        "\xE2\x80\x8D",
        "\xEF\xB8\x8F",
        "<|user|>",
        "<think>",
        "</think>",
        "[gMASK]",
        "<sop>",
        "<|endoftext|>",
        "<tool_call>",
        "/nothink",
        "<|",
        "|>",
        "<",
        "[",
        "123",
        "4567",
        "0x1F",
        "3.14",
    };
    std::string s;
    const std::size_t units = pick(0, max_units);
    for (std::size_t u = 0; u < units; ++u) {
      switch (pick(0, 9)) {
        case 0:
          s += kFragments[pick(0, kFragments.size() - 1)];
          break;
        case 1:
          detail::append_utf8(s, static_cast<char32_t>(pick(0x20, 0x7E)));
          break;
        case 2:
          detail::append_utf8(s, static_cast<char32_t>(pick(0, 0x1F)));
          break;
        case 3:
          detail::append_utf8(s, static_cast<char32_t>(pick(0xA0, 0x24F)));
          break;
        case 4:
          detail::append_utf8(s, static_cast<char32_t>(pick(0x300, 0x36F)));
          break;
        case 5:
          detail::append_utf8(s, static_cast<char32_t>(pick(0x4E00, 0x9FFF)));
          break;
        case 6:
          detail::append_utf8(s, static_cast<char32_t>(pick(0x3000, 0x303F)));
          break;
        case 7:
          detail::append_utf8(s, static_cast<char32_t>(pick(0x1F300, 0x1FAFF)));
          break;
        case 8: {
          // Any scalar value, surrogates excluded.
          char32_t cp = static_cast<char32_t>(pick(0, 0x10FFFF - 0x800));
          if (cp >= 0xD800) cp += 0x800;
          detail::append_utf8(s, cp);
          break;
        }
        default:
          s += std::string(pick(1, 12), "aZ0 é"[pick(0, 4)]);
      }
    }
    return s;
  }

  std::string bytes(std::size_t max_len) {
    std::string s(pick(0, max_len), '\0');
    for (char& c : s) c = static_cast<char>(pick(0, 255));
    return s;
  }

  std::size_t pick(std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(rng_);
  }

 private:
  std::mt19937 rng_;
};

std::uint32_t test_seed() {
  if (const char* env = std::getenv("GLMTUNE_TEST_SEED")) {
    return static_cast<std::uint32_t>(std::strtoul(env, nullptr, 10));
  }
  return 20260921u;
}

TEST(TokenizerRoundTrip, RandomUtf8) {
  const std::uint32_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) +
               " (rerun with GLMTUNE_TEST_SEED=" + std::to_string(seed) + ")");
  RandomText gen(seed);
  for (int i = 0; i < 3000; ++i) {
    const std::string text = gen.utf8(60);
    const Ids ids = tiny().encode(text);
    ASSERT_EQ(tiny().decode(ids), text) << "iteration " << i;
    for (std::int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tiny().vocab_size());
  }
}

TEST(TokenizerRoundTrip, ArbitraryBytesIncludingInvalidUtf8) {
  const std::uint32_t seed = test_seed() + 1;
  SCOPED_TRACE("seed " + std::to_string(seed));
  RandomText gen(seed);
  for (int i = 0; i < 2000; ++i) {
    const std::string bytes = gen.bytes(40);
    ASSERT_EQ(tiny().decode(tiny().encode(bytes)), bytes) << "iteration " << i;
  }
  const std::string truncated = "ab\xE4\xBD";  // a CJK character cut short
  EXPECT_EQ(tiny().decode(tiny().encode(truncated)), truncated);
}

TEST(TokenizerRoundTrip, VeryLongRuns) {
  // Long single-class runs stress the regex engine's backtracking and the heap merge path.
  for (const std::string& text : {std::string(1 << 20, ' '), std::string(1 << 20, 'a'),
                                  std::string(300000, '\n'), std::string(200000, '7')}) {
    EXPECT_EQ(tiny().decode(tiny().encode(text)), text);
  }
}

TEST(TokenizerBatch, MatchesSerialOnRandomTexts) {
  const std::uint32_t seed = test_seed() + 2;
  SCOPED_TRACE("seed " + std::to_string(seed));
  RandomText gen(seed);
  std::vector<std::string> texts;
  for (int i = 0; i < 1500; ++i) texts.push_back(gen.utf8(80));
  const auto batch = tiny().encode_batch(texts);
  ASSERT_EQ(batch.size(), texts.size());
  // Compare against a fresh tokenizer so the batch's shared cache cannot hide a divergence.
  const Tokenizer fresh = Tokenizer::from_file(kTinyPath);
  for (std::size_t i = 0; i < texts.size(); ++i) {
    ASSERT_EQ(batch[i], fresh.encode(texts[i])) << "text " << i;
  }
  EXPECT_TRUE(tiny().encode_batch({}).empty());
}

// ---------------------------------------------------------------------------------------------
// Added tokens and vocabulary queries

const std::vector<std::pair<std::string, bool>> kAddedTokens = {
    {"<|endoftext|>", true},
    {"[MASK]", true},
    {"[gMASK]", true},
    {"[sMASK]", true},
    {"<sop>", true},
    {"<eop>", true},
    {"<|system|>", true},
    {"<|user|>", true},
    {"<|assistant|>", true},
    {"<|observation|>", true},
    {"<|begin_of_image|>", true},
    {"<|end_of_image|>", true},
    {"<|begin_of_video|>", true},
    {"<|end_of_video|>", true},
    {"<|begin_of_audio|>", true},
    {"<|end_of_audio|>", true},
    {"<|begin_of_transcription|>", true},
    {"<|end_of_transcription|>", true},
    {"<|code_prefix|>", true},
    {"<|code_middle|>", true},
    {"<|code_suffix|>", true},
    {"<think>", false},
    {"</think>", false},
    {"<tool_call>", false},
    {"</tool_call>", false},
    {"<tool_response>", false},
    {"</tool_response>", false},
    {"<arg_key>", false},
    {"</arg_key>", false},
    {"<arg_value>", false},
    {"</arg_value>", false},
    {"/nothink", true},
    {"<|begin_of_box|>", true},
    {"<|end_of_box|>", true},
    {"<|image|>", true},
    {"<|video|>", true},
};

TEST(TokenizerAddedTokens, SameTokensAndOrderAsGlm) {
  ASSERT_EQ(kAddedTokens.size(), 36u);
  EXPECT_EQ(tiny().vocab_size(), 2036);
  for (std::size_t i = 0; i < kAddedTokens.size(); ++i) {
    const auto& [content, special] = kAddedTokens[i];
    const auto id = static_cast<std::int32_t>(2000 + i);
    EXPECT_EQ(tiny().token_to_id(content), id) << content;
    EXPECT_EQ(tiny().require_id(content), id) << content;
    EXPECT_EQ(tiny().id_to_token(id), content);
    EXPECT_EQ(tiny().encode(content), Ids{id}) << "an added token must never be split";
    EXPECT_EQ(tiny().decode({id}), content);
    EXPECT_EQ(tiny().decode({id}, /*skip_special=*/true), special ? "" : content) << content;
  }
}

TEST(TokenizerAddedTokens, MatchedInsideText) {
  const Tokenizer& tok = tiny();
  const Ids ids = tok.encode("x<|user|>y");
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[1], tok.require_id("<|user|>"));
  // Longest match wins where contents share a prefix, and a partial marker stays text.
  EXPECT_EQ(tok.encode("</think>")[0], tok.require_id("</think>"));
  for (std::int32_t id : tok.encode("<|user| <think")) EXPECT_LT(id, 2000);
  // Skipping special tokens keeps the reasoning and tool markers.
  EXPECT_EQ(tok.decode(tok.encode("[gMASK]<sop><|user|>hi<|assistant|><think>t</think>"
                                  "<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value>"
                                  "</tool_call><|endoftext|>"),
                       true),
            "hi<think>t</think><tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value>"
            "</tool_call>");
}

TEST(TokenizerAddedTokens, VocabularyQueries) {
  const Tokenizer& tok = tiny();
  EXPECT_EQ(tok.token_to_id("Ġ"), 220);  // the byte-level space
  EXPECT_EQ(tok.id_to_token(220), "Ġ");
  EXPECT_EQ(tok.token_to_id("no such token"), std::nullopt);
  EXPECT_EQ(tok.id_to_token(-1), std::nullopt);
  EXPECT_EQ(tok.id_to_token(tok.vocab_size()), std::nullopt);
  // Ids without a token are skipped by decode, as in HF.
  EXPECT_EQ(tok.decode({-5, tok.require_id("H"), 999999, tok.require_id("i")}), "Hi");
  try {
    tok.require_id("<|nope|>");
    FAIL() << "require_id accepted an unknown token";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"<|nope|>\""), std::string::npos) << e.what();
    EXPECT_NE(e.where().find("tokenizer.json"), std::string::npos);
  }
}

TEST(TokenizerAddedTokens, MovedTokenizerStillWorks) {
  Tokenizer a = Tokenizer::from_file(kTinyPath);
  const Ids before = a.encode("move me <|user|>");
  Tokenizer b = std::move(a);
  EXPECT_EQ(b.encode("move me <|user|>"), before);
  Tokenizer c = Tokenizer::from_file(kGoldenDir + "/gpt2_style_tokenizer.json");
  c = std::move(b);
  EXPECT_EQ(c.encode("move me <|user|>"), before);
}

// ---------------------------------------------------------------------------------------------
// Loading: accepted variants and every malformed-file error

// A small valid byte-level BPE tokenizer.json: the 256 byte characters, two merges, two added
// tokens, and the GLM pre-tokenizer layout.
json minimal_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) {
    vocab[detail::bytes_to_byte_level(std::string(1, static_cast<char>(b)))] = b;
  }
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  return json{{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", json::array({json{{"id", 258},
                                                 {"content", "<|user|>"},
                                                 {"single_word", false},
                                                 {"lstrip", false},
                                                 {"rstrip", false},
                                                 {"normalized", false},
                                                 {"special", true}},
                                            json{{"id", 259},
                                                 {"content", "<think>"},
                                                 {"single_word", false},
                                                 {"lstrip", false},
                                                 {"rstrip", false},
                                                 {"normalized", false},
                                                 {"special", false}}})},
              {"normalizer", nullptr},
              {"pre_tokenizer",
               {{"type", "Sequence"},
                {"pretokenizers",
                 json::array({json{{"type", "Split"},
                                   {"pattern", {{"Regex", R"(\p{N}{1,3}|\s+|[^\s\p{N}]+)"}}},
                                   {"behavior", "Isolated"},
                                   {"invert", false}},
                              json{{"type", "ByteLevel"},
                                   {"add_prefix_space", false},
                                   {"trim_offsets", true},
                                   {"use_regex", false}}})}}},
              {"post_processor", nullptr},
              {"decoder", {{"type", "ByteLevel"}}},
              {"model",
               {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", json::array({json::array({"a", "b"}), json::array({"ab", "c"})})}}}};
}

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("glmtune_tokenizer_test_" +
             std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
             std::to_string(reinterpret_cast<std::uintptr_t>(this)));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string write(const std::string& name, const std::string& content) const {
    const fs::path p = path_ / name;
    std::ofstream(p, std::ios::binary) << content;
    return p.string();
  }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
};

TEST(TokenizerLoad, MinimalFileEncodes) {
  const Tokenizer tok = Tokenizer::from_json(minimal_tokenizer().dump(), "minimal");
  EXPECT_EQ(tok.vocab_size(), 260);
  EXPECT_EQ(tok.encode("abc"), Ids{257});
  EXPECT_EQ(tok.encode("abd<|user|>"), (Ids{256, 'd', 258}));  // byte b has id b here
  EXPECT_EQ(tok.decode(tok.encode("abc ab<think>")), "abc ab<think>");
}

TEST(TokenizerLoad, StringAndPairMergesAreEquivalent) {
  json pairs = minimal_tokenizer();
  json strings = pairs;
  strings["model"]["merges"] = json::array({"a b", "ab c"});
  const Tokenizer a = Tokenizer::from_json(pairs.dump(), "pairs");
  const Tokenizer b = Tokenizer::from_json(strings.dump(), "strings");
  for (const char* text : {"abc", "abcabc ab a b c", "xyzabd"}) {
    EXPECT_EQ(a.encode(text), b.encode(text)) << text;
  }
}

TEST(TokenizerLoad, AcceptedVariants) {
  json nfc = minimal_tokenizer();
  nfc["normalizer"] = {{"type", "NFC"}};
  EXPECT_EQ(Tokenizer::from_json(nfc.dump(), "nfc").encode("abc"), Ids{257});

  json seq = minimal_tokenizer();
  seq["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "NFC"}}})}};
  EXPECT_NO_THROW(Tokenizer::from_json(seq.dump(), "nfc sequence"));

  json bare = minimal_tokenizer();
  bare["pre_tokenizer"] = {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", true},
                           {"use_regex", true}};
  // GPT-2's regex splits " abc" off; its space has no merge, so it stays the byte token 32.
  EXPECT_EQ(Tokenizer::from_json(bare.dump(), "bare").encode("abc abc"), (Ids{257, 32, 257}));

  json with_processor = minimal_tokenizer();
  with_processor["post_processor"] = {{"type", "ByteLevel"}, {"trim_offsets", false}};
  EXPECT_EQ(Tokenizer::from_json(with_processor.dump(), "processor").encode("abc"), Ids{257});
}

struct BadFile {
  std::string name;
  std::function<void(json&)> edit;
  std::vector<std::string> expected;  // substrings of the message
};

TEST(TokenizerErrors, MalformedFilesNameFileAndJsonPath) {
  const std::vector<BadFile> cases = {
      {"no model", [](json& j) { j.erase("model"); }, {"no \"model\" section", "at model"}},
      {"model not object", [](json& j) { j["model"] = 3; }, {"at model", "expected an object"}},
      {"wordpiece",
       [](json& j) { j["model"]["type"] = "WordPiece"; },
       {"unsupported model type \"WordPiece\"", "at model.type"}},
      {"no vocab",
       [](json& j) { j["model"].erase("vocab"); },
       {"missing the BPE vocabulary", "at model.vocab"}},
      {"vocab not object",
       [](json& j) { j["model"]["vocab"] = json::array(); },
       {"at model.vocab", "token -> id"}},
      {"negative id",
       [](json& j) { j["model"]["vocab"]["zz"] = -3; },
       {"at model.vocab[\"zz\"]", "out of range"}},
      {"string id",
       [](json& j) { j["model"]["vocab"]["zz"] = "7"; },
       {"at model.vocab[\"zz\"]", "non-negative integer"}},
      {"huge id",
       [](json& j) { j["model"]["vocab"]["zz"] = 2000000000; },
       {"at model.vocab[\"zz\"]", "id 2000000000 is far beyond the 259 vocabulary entries"}},
      {"duplicate id", [](json& j) { j["model"]["vocab"]["zz"] = 5; }, {"id 5 is also used by"}},
      {"no merges", [](json& j) { j["model"].erase("merges"); }, {"at model.merges", "missing"}},
      {"merge unknown token",
       [](json& j) {
         j["model"]["merges"][1] = json::array({"ab", "q\u00e9"});
       },
       {"at model.merges[1]", "merge token \"q\u00e9\" is not in model.vocab"}},
      {"merge unknown string token",
       [](json& j) {
         j["model"]["merges"] = json::array({"a b", "ab zz"});
       },
       {"at model.merges[1]", "\"zz\""}},
      {"merge result missing",
       [](json& j) {
         j["model"]["merges"].push_back(json::array({"b", "c"}));
       },
       {"at model.merges[2]", "merge result \"bc\" is not in model.vocab"}},
      {"merge without space",
       [](json& j) { j["model"]["merges"] = json::array({"ab"}); },
       {"at model.merges[0]", "two tokens separated by one space"}},
      {"merge wrong shape",
       [](json& j) { j["model"]["merges"] = json::array({json::array({"a"})}); },
       {"at model.merges[0]", "\"left right\""}},
      {"dropout",
       [](json& j) { j["model"]["dropout"] = 0.1; },
       {"at model.dropout", "dropout is not supported"}},
      {"unk not in vocab",
       [](json& j) { j["model"]["unk_token"] = "<unk>"; },
       {"at model.unk_token", "\"<unk>\""}},
      {"lowercase normalizer",
       [](json& j) {
         j["normalizer"] = {{"type", "Lowercase"}};
       },
       {"unsupported normalizer \"Lowercase\"", "at normalizer.type"}},
      {"normalizer in sequence",
       [](json& j) {
         j["normalizer"] = {{"type", "Sequence"},
                            {"normalizers", json::array({{{"type", "NFC"}}, {{"type", "NFKC"}}})}};
       },
       {"unsupported normalizer \"NFKC\"", "at normalizer.normalizers[1].type"}},
      {"no pre-tokenizer",
       [](json& j) { j["pre_tokenizer"] = nullptr; },
       {"no pre_tokenizer", "at pre_tokenizer"}},
      {"whitespace pre-tokenizer",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Whitespace"}};
       },
       {"unsupported pre-tokenizer \"Whitespace\"", "at pre_tokenizer.type"}},
      {"sequence without byte level",
       [](json& j) { j["pre_tokenizer"]["pretokenizers"].erase(1); },
       {"must end in ByteLevel", "at pre_tokenizer.pretokenizers[0].type"}},
      {"digits in sequence",
       [](json& j) {
         j["pre_tokenizer"]["pretokenizers"].insert(
             j["pre_tokenizer"]["pretokenizers"].begin(),
             json{{"type", "Digits"}, {"individual_digits", true}});
       },
       {"unsupported pre-tokenizer \"Digits\"", "at pre_tokenizer.pretokenizers[0].type"}},
      {"split removed",
       [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
       {"unsupported Split behavior \"Removed\"", "pre_tokenizer.pretokenizers[0].behavior"}},
      {"split inverted",
       [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["invert"] = true; },
       {"inverted Split", "pre_tokenizer.pretokenizers[0].invert"}},
      {"invalid regex",
       [](json& j) {
         j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(\\p{L}+"}};
       },
       {"invalid regex \"(\\\\p{L}+\"", "missing closing parenthesis",
        "at pre_tokenizer.pretokenizers[0].pattern.Regex"}},
      {"bad pattern object",
       [](json& j) {
         j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Glob", "*"}};
       },
       {"pre_tokenizer.pretokenizers[0].pattern", "{\"Regex\": \"...\"}"}},
      {"no decoder", [](json& j) { j.erase("decoder"); }, {"no decoder", "at decoder"}},
      {"wordpiece decoder",
       [](json& j) {
         j["decoder"] = {{"type", "WordPiece"}};
       },
       {"unsupported decoder \"WordPiece\"", "at decoder.type"}},
      {"added token wrong id",
       [](json& j) { j["added_tokens"][0]["id"] = 300; },
       {"at added_tokens[0].id", "has id 300, but Hugging Face tokenizers assigns it id 258"}},
      {"added token in vocab with other id",
       [](json& j) { j["added_tokens"][0]["content"] = "ab"; },
       {"at added_tokens[0].id", "\"ab\" has id 258", "its id in model.vocab"}},
      {"added token twice",
       [](json& j) { j["added_tokens"][1]["content"] = "<|user|>"; },
       {"at added_tokens[1].content", "listed twice"}},
      {"added token empty",
       [](json& j) { j["added_tokens"][0]["content"] = ""; },
       {"at added_tokens[0].content", "non-empty string"}},
      {"added token without id",
       [](json& j) { j["added_tokens"][0].erase("id"); },
       {"at added_tokens[0]", "missing required key \"id\""}},
      {"added token flag not bool",
       [](json& j) { j["added_tokens"][0]["lstrip"] = "yes"; },
       {"at added_tokens[0].lstrip", "expected true or false"}},
  };
  TempDir dir;
  for (const BadFile& c : cases) {
    json j = minimal_tokenizer();
    c.edit(j);
    const std::string path = dir.write("bad.json", j.dump());
    try {
      Tokenizer::from_file(path);
      ADD_FAILURE() << "accepted: " << c.name;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << c.name << ": " << msg;
      EXPECT_FALSE(e.fix().empty()) << c.name;
      for (const std::string& want : c.expected) {
        EXPECT_NE(msg.find(want), std::string::npos)
            << c.name << ": expected \"" << want << "\" in: " << msg;
      }
    }
  }
}

TEST(TokenizerErrors, UnreadableOrNonJsonFiles) {
  TempDir dir;
  auto expect_error = [](const std::string& path, const std::vector<std::string>& wants) {
    try {
      Tokenizer::from_file(path);
      ADD_FAILURE() << "accepted " << path;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_FALSE(e.fix().empty());
      for (const std::string& want : wants) {
        EXPECT_NE(msg.find(want), std::string::npos) << "expected \"" << want << "\" in: " << msg;
      }
    }
  };
  expect_error(dir.path() + "/missing.json", {"cannot open tokenizer file"});
  expect_error(dir.path(), {"is a directory"});
  expect_error(dir.write("garbage.json", "{ \"model\": nope }"), {"not valid JSON", "line 1"});
  expect_error(dir.write("empty.json", ""), {"not valid JSON"});
  // Valid syntax, but no double holds the number: nlohmann throws out_of_range, not parse_error.
  expect_error(dir.write("huge_number.json", R"({"model": {"vocab": {"a": 1e999}}})"),
               {"number overflow", "1e999"});
  expect_error(dir.write("array.json", "[1, 2]"), {"expected a JSON object at the top level"});
  expect_error(dir.write("truncated.json", minimal_tokenizer().dump().substr(0, 500)),
               {"not valid JSON"});
}

// ---------------------------------------------------------------------------------------------
// Building blocks

TEST(TokenizerUnicode, NfcMatchesReferenceExamples) {
  EXPECT_EQ(detail::nfc("e\xCC\x81"), "\xC3\xA9");                         // e + acute -> é
  EXPECT_EQ(detail::nfc("q\xCC\x87\xCC\xA3"), "q\xCC\xA3\xCC\x87");        // canonical reordering
  EXPECT_EQ(detail::nfc("\xE1\xB8\x8B\xCC\xA3"), "\xE1\xB8\x8D\xCC\x87");  // ḋ + dot below
  EXPECT_EQ(detail::nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // Hangul LVT
  EXPECT_EQ(detail::nfc("\xE2\x84\xAB"), "\xC3\x85");  // Angstrom sign -> Å (singleton)
  EXPECT_EQ(detail::nfc("\xE0\xA5\x98"), "\xE0\xA4\x95\xE0\xA4\xBC");  // excluded from composition
  EXPECT_EQ(detail::nfc("plain ascii"), "plain ascii");
  EXPECT_EQ(detail::nfc("a\xFF\xCC\x81"), "a\xFF\xCC\x81");  // invalid byte blocks composition
}

TEST(TokenizerRegex, OnigurumaEscapesAreRewritten) {
  EXPECT_EQ(detail::onig_to_pcre2(R"(\s+(?!\S))"), R"(\p{White_Space}+(?!\P{White_Space}))");
  EXPECT_EQ(detail::onig_to_pcre2(R"([^\s\p{L}])"), R"([^\p{White_Space}\p{L}])");
  EXPECT_EQ(detail::onig_to_pcre2(R"(\h+)"), "[0-9a-fA-F]+");
  EXPECT_EQ(detail::onig_to_pcre2(R"([]\s])"), R"([]\p{White_Space}])");
  EXPECT_EQ(detail::onig_to_pcre2(R"(\Q\s\E\s)"), R"(\Q\s\E\p{White_Space})");
  EXPECT_EQ(detail::onig_to_pcre2(R"(\\s)"), R"(\\s)");
  EXPECT_THROW(detail::onig_to_pcre2("[a[b]]"), std::invalid_argument);
  EXPECT_THROW(detail::onig_to_pcre2("[a&&b]"), std::invalid_argument);
}

}  // namespace
}  // namespace glmtune::data
