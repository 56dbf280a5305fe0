// Datasets: chat and plain-text JSONL lines to samples, bad lines with file and line numbers under
// both policies, truncation and drop counts, streaming across batch and file boundaries, and the
// indexed dataset's random access.

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/dataset.h"
#include "glmtune/data/packing.h"
#include "glmtune/data/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using glmtune::data::BadLinePolicy;
using glmtune::data::BadLineReason;
using glmtune::data::ChatTemplateKind;
using glmtune::data::DatasetConfig;
using glmtune::data::DatasetStats;
using glmtune::data::JsonlDataset;
using glmtune::data::JsonlSampleReader;
using glmtune::data::kIgnoreIndex;
using glmtune::data::OrderedJson;
using glmtune::data::OverlongPolicy;
using glmtune::data::Sample;
using glmtune::data::SampleFormat;
using glmtune::data::TokenizedSample;
using glmtune::data::Tokenizer;

const Tokenizer& tiny_tokenizer() {
  static const std::unique_ptr<Tokenizer> tok = std::make_unique<Tokenizer>(Tokenizer::from_file(
      std::string(GLMTUNE_SOURCE_DIR) + "/examples/tiny/tokenizer/tokenizer.json"));
  return *tok;
}

class DatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           (std::string("glmtune_dataset_") + info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& content) {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << content;
    return p.string();
  }

  static std::vector<Sample> read_all(const DatasetConfig& cfg, DatasetStats* stats = nullptr) {
    JsonlSampleReader reader(cfg, tiny_tokenizer());
    std::vector<Sample> out;
    while (auto s = reader.next()) out.push_back(std::move(*s));
    if (stats) *stats = reader.stats();
    return out;
  }

  // What the chat pipeline must produce for one line, computed from the template directly.
  static TokenizedSample expected_chat(const std::string& line,
                                       glmtune::data::ChatTemplateOptions opt = {}) {
    OrderedJson doc = OrderedJson::parse(line);
    OrderedJson tools = doc.contains("tools") ? doc["tools"] : OrderedJson();
    auto r = glmtune::data::render_chat(ChatTemplateKind::kGlm53, doc["messages"], tools, opt);
    return glmtune::data::tokenize_segments(r.segments, tiny_tokenizer());
  }

  fs::path dir_;
};

const std::string kChat1 =
    R"({"messages":[{"role":"user","content":"What is 2+3?"},{"role":"assistant","content":"5"}]})";
const std::string kChat2 =
    R"({"messages":[{"role":"system","content":"Be terse."},{"role":"user","content":"Reverse abc"},)"
    R"({"role":"assistant","content":"cba","reasoning_content":"c, b, a"}],"tools":[{"name":"noop"}]})";
const std::string kText1 = R"({"text":"The capital of France is Paris."})";

TEST_F(DatasetTest, ChatAndTextLinesBecomeSamples) {
  DatasetConfig cfg;
  cfg.files = {write("mix.jsonl", kChat1 + "\n" + kText1 + "\n" + kChat2 + "\n")};
  DatasetStats st;
  auto samples = read_all(cfg, &st);
  ASSERT_EQ(samples.size(), 3u);

  EXPECT_EQ(samples[0].tokens.input_ids, expected_chat(kChat1).input_ids);
  EXPECT_EQ(samples[0].tokens.labels, expected_chat(kChat1).labels);
  EXPECT_EQ(samples[2].tokens.input_ids, expected_chat(kChat2).input_ids);
  EXPECT_EQ(samples[2].tokens.labels, expected_chat(kChat2).labels);

  // Plain text: the text, then <|endoftext|>, every token trained.
  const auto& tok = tiny_tokenizer();
  std::vector<int32_t> text_ids = tok.encode("The capital of France is Paris.");
  text_ids.push_back(tok.require_id("<|endoftext|>"));
  EXPECT_EQ(samples[1].tokens.input_ids, text_ids);
  EXPECT_EQ(samples[1].tokens.labels, text_ids);

  EXPECT_EQ(samples[0].line, 1);
  EXPECT_EQ(samples[1].line, 2);
  EXPECT_EQ(samples[2].line, 3);
  EXPECT_EQ(samples[1].offset, kChat1.size() + 1);

  int64_t tokens = 0, targets = 0;
  for (const auto& s : samples) {
    tokens += static_cast<int64_t>(s.tokens.input_ids.size());
    for (size_t i = 1; i < s.tokens.labels.size(); ++i)
      targets += s.tokens.labels[i] != kIgnoreIndex;
  }
  EXPECT_EQ(st.lines, 3);
  EXPECT_EQ(st.samples, 3);
  EXPECT_EQ(st.skipped_total(), 0);
  EXPECT_EQ(st.tokens, tokens);
  EXPECT_EQ(st.trained_tokens, targets);
  EXPECT_EQ(st.trained_tokens, static_cast<int64_t>(text_ids.size()) - 1 +
                                   expected_chat(kChat1).num_trained() +
                                   expected_chat(kChat2).num_trained());
}

TEST_F(DatasetTest, TemplateOptionsFromConfigAndLine) {
  const std::string line_high =
      R"({"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"}],"reasoning_effort":"high"})";
  DatasetConfig cfg;
  cfg.reasoning_effort = "low";
  cfg.files = {write("opts.jsonl", kChat1 + "\n" + line_high + "\n")};
  auto samples = read_all(cfg);
  ASSERT_EQ(samples.size(), 2u);
  const auto& tok = tiny_tokenizer();
  EXPECT_NE(tok.decode(samples[0].tokens.input_ids).find("Reasoning Effort: Low"),
            std::string::npos);
  EXPECT_NE(tok.decode(samples[1].tokens.input_ids).find("Reasoning Effort: High"),
            std::string::npos);
}

// One line of each bad kind, with its 1-based line number and reason.
struct BadLine {
  std::string text;
  BadLineReason reason;
  std::string problem;  // substring of the message
};

std::vector<BadLine> bad_lines() {
  return {
      {"{not json", BadLineReason::kNotJson, "not valid JSON: "},
      {"[1, 2]", BadLineReason::kNotObject, "expected a JSON object, got array"},
      {R"({"msgs": []})", BadLineReason::kMissingField, "has neither \"messages\" nor \"text\""},
      {R"({"text": 5})", BadLineReason::kWrongType, "\"text\" must be a string, got number"},
      {R"({"messages": "hi"})", BadLineReason::kWrongType,
       "\"messages\" must be a list, got string"},
      {R"({"messages": [], "text": "x"})", BadLineReason::kWrongType,
       "has both \"messages\" and \"text\""},
      {R"({"messages": [{"role":"user","content":"q"}], "tools": {"a": 1}})",
       BadLineReason::kWrongType, "\"tools\" must be a list, got object"},
      {R"({"messages": [{"role":"user","content":"q"}], "clear_thinking": "yes"})",
       BadLineReason::kWrongType, "\"clear_thinking\" must be true or false"},
      {R"({"messages": [{"role":"user","content":"q"},{"role":"bot","content":"a"}]})",
       BadLineReason::kTemplate, "message 1: unknown role \"bot\""},
      {R"({"messages": [{"role":"user","content":[{"type":"image","image":"a.png"}]},{"role":"assistant","content":"a"}]})",
       BadLineReason::kMedia, "1 image(s) and 0 video(s)"},
  };
}

TEST_F(DatasetTest, BadLinesSkippedAndCountedWithLineNumbers) {
  std::string content = kChat1 + "\n\n";  // line 2 is blank: counted as a line, not an error
  auto bad = bad_lines();
  for (const auto& b : bad) content += b.text + "\n";
  content += kText1 + "\n";
  const std::string path = write("bad.jsonl", content);
  DatasetConfig cfg;
  cfg.files = {path};
  cfg.on_bad_line = BadLinePolicy::kSkip;
  cfg.batch_lines = 4;  // errors span several batches
  DatasetStats st;
  auto samples = read_all(cfg, &st);
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(samples[1].line, static_cast<int64_t>(bad.size()) + 3);
  EXPECT_EQ(st.lines, static_cast<int64_t>(bad.size()) + 3);
  EXPECT_EQ(st.samples, 2);
  EXPECT_EQ(st.skipped_total(), static_cast<int64_t>(bad.size()));
  std::array<int64_t, glmtune::data::kNumBadLineReasons> by_reason{};
  for (const auto& b : bad) ++by_reason[static_cast<size_t>(b.reason)];
  EXPECT_EQ(st.skipped, by_reason);
  ASSERT_EQ(st.first_errors.size(), bad.size());
  for (size_t i = 0; i < bad.size(); ++i) {
    const std::string prefix = path + ":" + std::to_string(i + 3) + ": ";
    EXPECT_EQ(st.first_errors[i].rfind(prefix, 0), 0u) << st.first_errors[i];
    EXPECT_NE(st.first_errors[i].find(bad[i].problem), std::string::npos) << st.first_errors[i];
  }
  auto j = st.to_json();
  EXPECT_EQ(j["skipped_by_reason"]["wrong_type"],
            by_reason[static_cast<size_t>(BadLineReason::kWrongType)]);
  EXPECT_EQ(j["skipped"], static_cast<int64_t>(bad.size()));
}

TEST_F(DatasetTest, BadLineIsFatalUnderFailPolicy) {
  auto bad = bad_lines();
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(bad[i].text);
    const std::string path =
        write("fatal.jsonl", kChat1 + "\n" + kText1 + "\n" + bad[i].text + "\n" + kChat1 + "\n");
    DatasetConfig cfg;
    cfg.files = {path};
    try {
      read_all(cfg);
      ADD_FAILURE() << "no error";
    } catch (const glmtune::Error& e) {
      EXPECT_EQ(e.where(), path + ":3");
      EXPECT_NE(e.problem().find(bad[i].problem), std::string::npos) << e.problem();
      EXPECT_NE(e.fix().find("on_bad_line"), std::string::npos);
    }
  }
}

TEST_F(DatasetTest, TemplateErrorNamesSampleAndMessage) {
  const std::string path =
      write("tpl.jsonl", kChat1 + "\n" + kChat1 + "\n" +
                             R"({"messages":[{"role":"user","content":"q"},)"
                             R"({"role":"assistant","tool_calls":[{"name":"f"}]}]})"
                             "\n");
  DatasetConfig cfg;
  cfg.files = {path};
  try {
    read_all(cfg);
    ADD_FAILURE() << "no error";
  } catch (const glmtune::Error& e) {
    EXPECT_EQ(e.where(), path + ":3");
    EXPECT_EQ(e.problem(), "sample 2, message 1: tool call 0 (f) has no \"arguments\"");
    EXPECT_EQ(e.fix(),
              "use \"arguments\": {} for a call without arguments; or set on_bad_line = "
              "\"skip\" to skip and count such lines");
  }
}

TEST_F(DatasetTest, FormatIsEnforcedWhenSet) {
  DatasetConfig cfg;
  cfg.files = {write("f.jsonl", kChat1 + "\n" + kText1 + "\n")};
  cfg.on_bad_line = BadLinePolicy::kSkip;
  cfg.format = SampleFormat::kText;
  DatasetStats st;
  EXPECT_EQ(read_all(cfg, &st).size(), 1u);
  EXPECT_EQ(st.skipped[static_cast<size_t>(BadLineReason::kMissingField)], 1);
  EXPECT_NE(st.first_errors.at(0).find("no \"text\" (format is text)"), std::string::npos);
  cfg.format = SampleFormat::kChat;
  EXPECT_EQ(read_all(cfg, &st).size(), 1u);
  EXPECT_NE(st.first_errors.at(0).find("no \"messages\" (format is chat)"), std::string::npos);
}

TEST_F(DatasetTest, TruncateOrDropOverlongSamples) {
  const std::string long_text =
      R"({"text":")" + std::string(300, 'a') + " " + std::string(300, 'b') + R"("})";
  const TokenizedSample full_chat = expected_chat(kChat2);
  DatasetConfig cfg;
  cfg.files = {write("long.jsonl", kText1 + "\n" + long_text + "\n" + kChat2 + "\n")};
  cfg.max_length = static_cast<int64_t>(full_chat.input_ids.size()) - 3;
  DatasetStats all_st;
  {
    DatasetConfig wide = cfg;
    wide.max_length = 100000;
    auto all = read_all(wide, &all_st);
    ASSERT_EQ(all.size(), 3u);
    ASSERT_GT(static_cast<int64_t>(all[1].tokens.input_ids.size()), cfg.max_length);
    ASSERT_LE(static_cast<int64_t>(all[0].tokens.input_ids.size()), cfg.max_length);

    DatasetStats st;
    auto cut = read_all(cfg, &st);
    ASSERT_EQ(cut.size(), 3u);
    EXPECT_EQ(st.truncated, 2);
    EXPECT_FALSE(cut[0].truncated);
    for (int i : {1, 2}) {
      EXPECT_TRUE(cut[static_cast<size_t>(i)].truncated);
      const auto& c = cut[static_cast<size_t>(i)].tokens;
      const auto& f = all[static_cast<size_t>(i)].tokens;
      ASSERT_EQ(static_cast<int64_t>(c.input_ids.size()), cfg.max_length);
      EXPECT_TRUE(std::equal(c.input_ids.begin(), c.input_ids.end(), f.input_ids.begin()));
      EXPECT_TRUE(std::equal(c.labels.begin(), c.labels.end(), f.labels.begin()));
    }
    EXPECT_EQ(st.tokens, static_cast<int64_t>(cut[0].tokens.input_ids.size()) + 2 * cfg.max_length);
  }
  cfg.on_overlong = OverlongPolicy::kDrop;
  DatasetStats st;
  auto kept = read_all(cfg, &st);
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].line, 1);
  EXPECT_EQ(st.dropped_overlong, 2);
  EXPECT_EQ(st.truncated, 0);
  EXPECT_EQ(st.samples, 1);
}

TEST_F(DatasetTest, SamplesWithoutTargetsAreDroppedAndCounted) {
  DatasetConfig cfg;
  cfg.files = {write(
      "untrained.jsonl",
      R"({"messages":[{"role":"user","content":"only a question"}]})"
      "\n"
      R"({"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a","loss":false}]})"
      "\n" +
          kChat1 + "\n")};
  DatasetStats st;
  auto samples = read_all(cfg, &st);
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(samples[0].line, 3);
  EXPECT_EQ(st.dropped_untrained, 2);
  // Truncation that cuts off every trained token also drops the sample.
  cfg.files = {write("cut.jsonl", kChat1 + "\n")};
  cfg.max_length = 5;
  EXPECT_TRUE(read_all(cfg, &st).empty());
  EXPECT_EQ(st.dropped_untrained, 1);
}

TEST_F(DatasetTest, StreamingAcrossBatchesAndFilesIsOrderIndependentOfBatchSize) {
  std::string a, b;
  for (int i = 0; i < 37; ++i) {
    a += R"({"text":"line )" + std::to_string(i) +
         R"("})"
         "\n";
    b += R"({"messages":[{"role":"user","content":"n)" + std::to_string(i) +
         R"("},{"role":"assistant","content":"ok"}]})"
         "\n";
  }
  DatasetConfig cfg;
  cfg.files = {write("a.jsonl", a), write("b.jsonl", b)};
  cfg.batch_lines = 1;
  auto one = read_all(cfg);
  cfg.batch_lines = 10;
  auto ten = read_all(cfg);
  cfg.batch_lines = 1000;
  auto all = read_all(cfg);
  ASSERT_EQ(one.size(), 74u);
  ASSERT_EQ(ten.size(), 74u);
  ASSERT_EQ(all.size(), 74u);
  for (size_t i = 0; i < 74; ++i) {
    EXPECT_EQ(one[i].tokens.input_ids, all[i].tokens.input_ids);
    EXPECT_EQ(ten[i].tokens.labels, all[i].tokens.labels);
    EXPECT_EQ(all[i].file, i < 37 ? 0 : 1);
    EXPECT_EQ(all[i].line, static_cast<int64_t>(i % 37) + 1);  // numbering restarts per file
  }
}

TEST_F(DatasetTest, CrlfBomAndMissingFinalNewline) {
  DatasetConfig cfg;
  cfg.files = {
      write("crlf.jsonl", "\xEF\xBB\xBF" + kText1 + "\r\n" + kChat1 + "\r\n  \r\n" + kText1)};
  DatasetStats st;
  auto samples = read_all(cfg, &st);
  ASSERT_EQ(samples.size(), 3u);
  EXPECT_EQ(samples[0].offset, 3u);
  EXPECT_EQ(samples[2].line, 4);
  EXPECT_EQ(st.lines, 4);
  EXPECT_EQ(samples[0].tokens.input_ids, samples[2].tokens.input_ids);
}

TEST_F(DatasetTest, IndexedDatasetLoadsByOffset) {
  std::string content;
  for (int i = 0; i < 25; ++i) {
    content += (i % 3 == 0 ? kText1 : i % 3 == 1 ? kChat1 : kChat2) + "\n";
    if (i == 10) content += "garbage\n";
  }
  DatasetConfig cfg;
  cfg.files = {write("idx.jsonl", content), write("idx2.jsonl", kChat2 + "\n" + kText1 + "\n")};
  cfg.on_bad_line = BadLinePolicy::kSkip;
  auto streamed = read_all(cfg);
  JsonlDataset ds = JsonlDataset::scan(cfg, tiny_tokenizer());
  ASSERT_EQ(ds.size(), 27);
  ASSERT_EQ(streamed.size(), 27u);
  EXPECT_EQ(ds.stats().skipped_total(), 1);
  EXPECT_EQ(ds.stats().samples, 27);
  std::vector<int64_t> idx = {26, 3, 0, 11, 11, 25, 14};
  auto loaded = ds.load(idx);
  ASSERT_EQ(loaded.size(), idx.size());
  for (size_t k = 0; k < idx.size(); ++k) {
    const auto& want = streamed[static_cast<size_t>(idx[k])].tokens;
    EXPECT_EQ(loaded[k].input_ids, want.input_ids);
    EXPECT_EQ(loaded[k].labels, want.labels);
    EXPECT_EQ(ds.length(idx[k]), static_cast<int64_t>(want.input_ids.size()));
  }
  // A changed file is detected instead of silently feeding other samples.
  write("idx2.jsonl", kText1 + "\n" + kChat2 + "\n");
  try {
    ds.load({25});
    ADD_FAILURE() << "no error";
  } catch (const glmtune::Error& e) {
    EXPECT_NE(e.problem().find("no longer gives the sample"), std::string::npos);
    EXPECT_EQ(e.where(), (dir_ / "idx2.jsonl").string() + ":1");
  }
}

TEST_F(DatasetTest, ConfigErrors) {
  DatasetConfig cfg;
  EXPECT_THROW(JsonlSampleReader(cfg, tiny_tokenizer()), glmtune::Error);
  cfg.files = {(dir_ / "missing.jsonl").string()};
  try {
    JsonlSampleReader reader(cfg, tiny_tokenizer());
    ADD_FAILURE() << "no error";
  } catch (const glmtune::Error& e) {
    EXPECT_EQ(e.problem(), "cannot open data file");
    EXPECT_EQ(e.where(), cfg.files[0]);
  }
  cfg.files = {write("ok.jsonl", kText1 + "\n")};
  cfg.max_length = 1;
  EXPECT_THROW(JsonlSampleReader(cfg, tiny_tokenizer()), glmtune::Error);
}

TEST(BundledTinyData, LoadsCleanlyAndPacksEveryConversationOnce) {
  const std::string dir = std::string(GLMTUNE_SOURCE_DIR) + "/examples/tiny/data/";
  DatasetConfig cfg;
  cfg.files = {dir + "chat.jsonl", dir + "text.jsonl"};
  cfg.max_length = 512;
  JsonlDataset ds = JsonlDataset::scan(cfg, tiny_tokenizer());
  const DatasetStats& st = ds.stats();
  EXPECT_EQ(st.lines, 300);
  EXPECT_EQ(st.samples, 300);
  EXPECT_EQ(st.skipped_total(), 0) << (st.first_errors.empty() ? "" : st.first_errors[0]);
  EXPECT_EQ(st.truncated, 0);
  EXPECT_EQ(st.dropped_untrained, 0);
  EXPECT_GT(st.trained_tokens, 0);
  EXPECT_LT(st.trained_tokens, st.tokens);

  glmtune::data::PackingConfig pc;
  pc.pack_max_length = 1024;
  pc.seed = 17;
  pc.pad_id = tiny_tokenizer().require_id("<|endoftext|>");
  glmtune::data::PackSampler sampler(ds, pc);
  std::vector<int> seen(300, 0);
  const int64_t n = sampler.packs_in_epoch();
  int64_t targets = 0;
  for (int64_t k = 0; k < n; ++k) {
    auto p = sampler.next();
    ASSERT_EQ(p.input_ids.size(), 1024u);
    ASSERT_EQ(p.cu_seqlens.back(), 1024);
    for (int64_t s : p.sample_indices) ++seen[static_cast<size_t>(s)];
    targets += p.num_targets;
  }
  for (int c : seen) EXPECT_EQ(c, 1);
  // Per-document alignment keeps every loss target the dataset counted, and adds none.
  EXPECT_EQ(targets, st.trained_tokens);
  EXPECT_EQ(sampler.epoch(), 1);
}

TEST(DatasetNames, ParseAndReject) {
  using namespace glmtune::data;
  EXPECT_EQ(sample_format_from_name("chat"), SampleFormat::kChat);
  EXPECT_EQ(sample_format_from_name("auto"), SampleFormat::kAuto);
  EXPECT_EQ(bad_line_policy_from_name("skip"), BadLinePolicy::kSkip);
  EXPECT_EQ(overlong_policy_from_name("drop"), OverlongPolicy::kDrop);
  try {
    bad_line_policy_from_name("ignore", "data.on_bad_line");
    ADD_FAILURE() << "no error";
  } catch (const glmtune::Error& e) {
    EXPECT_EQ(e.problem(), "unknown value \"ignore\"");
    EXPECT_EQ(e.where(), "data.on_bad_line");
    EXPECT_EQ(e.fix(), "use one of fail, skip");
  }
  EXPECT_EQ(bad_line_reason_name(BadLineReason::kMedia), "media");
}

TEST(DatasetStatsTest, MergeAddsCounts) {
  DatasetStats a, b;
  a.lines = 3;
  a.skipped[1] = 2;
  a.first_errors = {"x"};
  b.lines = 4;
  b.skipped[1] = 1;
  b.tokens = 9;
  b.first_errors = {"y"};
  a.merge(b);
  EXPECT_EQ(a.lines, 7);
  EXPECT_EQ(a.skipped[1], 3);
  EXPECT_EQ(a.tokens, 9);
  EXPECT_EQ(a.first_errors, (std::vector<std::string>{"x", "y"}));
}

}  // namespace
