// Datasets: chat and plain-text JSONL lines to samples, bad lines with file and line numbers under
// both policies, truncation and drop counts, streaming across batch and file boundaries, and the
// indexed dataset's random access; the line reader's limits and read errors.

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/dataset.h"
#include "glmtune/data/packing.h"
#include "glmtune/data/tokenizer.h"
#include "support/log_capture.h"

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
using glmtune::data::LineReader;
using glmtune::data::OrderedJson;
using glmtune::data::OverlongPolicy;
using glmtune::data::Sample;
using glmtune::data::SampleFormat;
using glmtune::data::TokenizedSample;
using glmtune::data::Tokenizer;
using glmtune::test::count_of;
using glmtune::test::LogCapture;

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

TEST_F(DatasetTest, NumberBeyondADoubleIsABadLineNamingItsPlace) {
  // nlohmann reports it as out_of_range.406, not as a parse error.
  const std::string overflow = R"({"messages": [{"role":"user","content":"x","n": 1e999}]})";
  const std::string path = write("num.jsonl", kChat1 + "\n" + overflow + "\n" + kText1 + "\n");
  DatasetConfig cfg;
  cfg.files = {path};
  try {
    read_all(cfg);
    ADD_FAILURE() << "no error";
  } catch (const glmtune::Error& e) {
    EXPECT_EQ(e.where(), path + ":2");
    EXPECT_EQ(e.problem().rfind("not valid JSON: number overflow parsing '1e999'", 0), 0u)
        << e.problem();
    EXPECT_NE(e.fix().find("within a double's range"), std::string::npos) << e.fix();
    EXPECT_NE(e.fix().find("on_bad_line"), std::string::npos) << e.fix();
  }
  cfg.on_bad_line = BadLinePolicy::kSkip;
  DatasetStats st;
  auto samples = read_all(cfg, &st);
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(samples[1].line, 3);
  EXPECT_EQ(st.skipped[static_cast<size_t>(BadLineReason::kNotJson)], 1);
  ASSERT_EQ(st.first_errors.size(), 1u);
  EXPECT_EQ(st.first_errors[0].rfind(path + ":2: not valid JSON: number overflow", 0), 0u)
      << st.first_errors[0];
}

TEST_F(DatasetTest, MediaTokensWrittenInTheTextAreBadLines) {
  struct Case {
    std::string line;
    std::string found;  // where the message says the token is
  };
  const std::vector<Case> cases = {
      {R"({"messages":[{"role":"user","content":"look <|image|> here"},{"role":"assistant","content":"ok"}]})",
       "`<|image|>` in messages[0].content"},
      {R"({"messages":[{"role":"user","content":[{"type":"text","text":"a"}]},{"role":"assistant","content":"<|video|>"}]})",
       "`<|video|>` in messages[1].content"},
      {R"({"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"}],"tools":[{"name":"f","description":"<|begin_of_image|>"}]})",
       "`<|begin_of_image|>` in tools[0].description"},
      {R"({"text":"caption <|end_of_video|>"})", "`<|end_of_video|>` in text"},
      // Escaped in a JSON-string argument, the token only appears once the template renders it.
      {R"({"messages":[{"role":"user","content":"q"},{"role":"assistant","tool_calls":[{"name":"f","arguments":"{\"x\": \"\\u003c|image|>\"}"}]}]})",
       "`<|image|>` in the rendered text"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.line);
    const std::string path = write("media.jsonl", kChat1 + "\n" + c.line + "\n" + kText1 + "\n");
    DatasetConfig cfg;
    cfg.files = {path};
    try {
      read_all(cfg);
      ADD_FAILURE() << "no error";
    } catch (const glmtune::Error& e) {
      EXPECT_EQ(e.where(), path + ":2");
      EXPECT_EQ(e.problem().rfind(c.found + ": a media token written in the text", 0), 0u)
          << e.problem();
      EXPECT_NE(e.fix().find("content items"), std::string::npos) << e.fix();
    }
    cfg.on_bad_line = BadLinePolicy::kSkip;
    DatasetStats st;
    auto samples = read_all(cfg, &st);
    ASSERT_EQ(samples.size(), 2u);
    EXPECT_EQ(st.skipped[static_cast<size_t>(BadLineReason::kMedia)], 1);
    const int32_t image = tiny_tokenizer().require_id("<|image|>");
    for (const auto& s : samples)
      EXPECT_EQ(std::count(s.tokens.input_ids.begin(), s.tokens.input_ids.end(), image), 0);
  }
  // Other special tokens written in the text stay their ids, as Hugging Face encodes them.
  const std::string box =
      R"({"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"<|begin_of_box|>1<|end_of_box|>"}]})";
  DatasetConfig cfg;
  cfg.files = {write("box.jsonl", box + "\n")};
  auto samples = read_all(cfg);
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(samples[0].tokens.input_ids, expected_chat(box).input_ids);
}

TEST_F(DatasetTest, ALineOverTheByteLimitIsABadLine) {
  const std::string long_line = R"({"text":")" + std::string(300, 'a') + R"("})";
  const std::string path =
      write("long.jsonl", kChat1 + "\n" + long_line + "\n" + kText1 + "\n" + kChat2);
  DatasetConfig cfg;
  cfg.files = {path};
  cfg.max_line_bytes = 200;
  try {
    read_all(cfg);
    ADD_FAILURE() << "no error";
  } catch (const glmtune::Error& e) {
    EXPECT_EQ(e.where(), path + ":2");
    EXPECT_EQ(e.problem().rfind("the line has more than 200 bytes", 0), 0u) << e.problem();
    EXPECT_NE(e.fix().find("one JSON object per line"), std::string::npos) << e.fix();
  }
  cfg.on_bad_line = BadLinePolicy::kSkip;
  DatasetStats st;
  auto samples = read_all(cfg, &st);
  ASSERT_EQ(samples.size(), 3u);
  EXPECT_EQ(st.lines, 4);
  EXPECT_EQ(st.skipped[static_cast<size_t>(BadLineReason::kTooLong)], 1);
  EXPECT_EQ(st.to_json()["skipped_by_reason"]["too_long"], 1);
  EXPECT_EQ(samples[1].line, 3);
  EXPECT_EQ(samples[1].offset, kChat1.size() + 1 + long_line.size() + 1);
  // The index keeps working past the line read over.
  JsonlDataset ds = JsonlDataset::scan(cfg, tiny_tokenizer());
  auto loaded = ds.load({2, 1});
  EXPECT_EQ(loaded[0].input_ids, samples[2].tokens.input_ids);
  EXPECT_EQ(loaded[1].input_ids, samples[1].tokens.input_ids);
}

TEST_F(DatasetTest, ADirectoryInTheFilesIsRefused) {
  const std::string sub = (dir_ / "folder.jsonl").string();
  fs::create_directories(sub);
  DatasetConfig cfg;
  cfg.files = {write("ok.jsonl", kChat1 + "\n"), sub};
  for (bool indexed : {false, true}) {
    try {
      if (indexed)
        JsonlDataset::scan(cfg, tiny_tokenizer());
      else
        read_all(cfg);
      ADD_FAILURE() << "no error";
    } catch (const glmtune::Error& e) {
      EXPECT_EQ(e.where(), sub);
      EXPECT_EQ(e.problem(), "is a directory, not a JSONL file");
      EXPECT_NE(e.fix().find("JSONL files inside it"), std::string::npos) << e.fix();
    }
  }
}

// Serves `data`, then fails the way a file system does: the read raises an error.
class FailingBuf : public std::streambuf {
 public:
  explicit FailingBuf(std::string data) : data_(std::move(data)) {
    setg(data_.data(), data_.data(), data_.data() + data_.size());
  }

 protected:
  int_type underflow() override { throw std::runtime_error("EIO"); }

 private:
  std::string data_;
};

class FailingStream : public std::istream {
 public:
  explicit FailingStream(std::string data) : std::istream(nullptr), buf_(std::move(data)) {
    rdbuf(&buf_);
  }

 private:
  FailingBuf buf_;
};

TEST(LineReaderTest, AReadErrorIsNotTheEndOfTheFile) {
  for (const std::string& data : {std::string("one\ntwo\n"), std::string("one\ntwo\nthr")}) {
    LineReader in(std::make_unique<FailingStream>(data), "broken.jsonl");
    std::string line;
    ASSERT_EQ(in.next(line), LineReader::Status::kLine);
    EXPECT_EQ(line, "one");
    ASSERT_EQ(in.next(line), LineReader::Status::kLine);
    EXPECT_EQ(line, "two");
    try {
      in.next(line);
      ADD_FAILURE() << "a failed read ended the file";
    } catch (const glmtune::Error& e) {
      EXPECT_EQ(e.where(), "broken.jsonl:3");
      EXPECT_NE(e.problem().find("reading the file failed in line 3"), std::string::npos)
          << e.problem();
      EXPECT_NE(e.fix().find("readable"), std::string::npos) << e.fix();
    }
  }
}

TEST(LineReaderTest, LinesAroundTheReadChunkSizeComeBackWhole) {
  // The reader assembles lines from 64 KiB reads: lengths around multiples of the chunk, a last
  // line without a newline, CRLF, an empty line and a byte-order mark.
  const std::vector<size_t> lengths = {65534, 65535, 65536, 65537, 0, 131070, 131071, 131072, 5};
  std::string data = "\xEF\xBB\xBF";
  std::vector<std::string> lines;
  for (size_t i = 0; i < lengths.size(); ++i) {
    lines.push_back(std::string(lengths[i], static_cast<char>('a' + i)));
    data += lines.back() + (i == 3 ? "\r\n" : i + 1 < lengths.size() ? "\n" : "");
  }
  lines[3] += "\r";
  LineReader in(std::make_unique<std::istringstream>(data), "chunks.jsonl");
  std::string line;
  uint64_t offset = 3;
  for (size_t i = 0; i < lines.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_EQ(in.next(line), LineReader::Status::kLine);
    EXPECT_EQ(line.size(), lines[i].size());
    EXPECT_TRUE(line == lines[i]);
    EXPECT_EQ(in.line_number(), static_cast<int64_t>(i) + 1);
    EXPECT_EQ(in.line_offset(), offset);
    offset += lines[i].size() + 1;
  }
  EXPECT_EQ(in.next(line), LineReader::Status::kEnd);
  EXPECT_EQ(in.next(line), LineReader::Status::kEnd);

  // With a limit, a longer line is read past and the next one comes back whole. The first line
  // has exactly the limit's bytes with its byte-order mark, the fourth one more with its '\r'.
  LineReader capped(std::make_unique<std::istringstream>(data), "chunks.jsonl", 65537);
  std::vector<LineReader::Status> got;
  while (true) {
    const auto s = capped.next(line);
    if (s == LineReader::Status::kEnd) break;
    got.push_back(s);
    if (s == LineReader::Status::kTooLong) EXPECT_TRUE(line.empty());
  }
  using S = LineReader::Status;
  EXPECT_EQ(got, (std::vector<S>{S::kLine, S::kLine, S::kLine, S::kTooLong, S::kLine, S::kTooLong,
                                 S::kTooLong, S::kTooLong, S::kLine}));
  EXPECT_EQ(capped.line_offset(), offset - lines.back().size() - 1);
}

TEST_F(DatasetTest, SkippedLinesAreCountedPerFileAndLoggedUpToTen) {
  // 7 bad lines in one file and 5 in another: ten messages, then one note, and the totals.
  std::string a = kChat1 + "\n", b = kText1 + "\n";
  for (int i = 0; i < 7; ++i) a += "{broken\n";
  for (int i = 0; i < 5; ++i) b += "[1]\n";
  const std::string pa = write("a.jsonl", a), pb = write("b.jsonl", b);
  DatasetConfig cfg;
  cfg.files = {pa, pb};
  cfg.on_bad_line = BadLinePolicy::kSkip;
  DatasetStats st;
  std::string log;
  {
    LogCapture capture;
    read_all(cfg, &st);
    log = capture.text();
  }
  EXPECT_EQ(st.skipped_total(), 12);
  EXPECT_EQ(st.first_errors.size(), 10u);
  EXPECT_EQ(count_of(log, "warning skipping "), 10u) << log;
  EXPECT_EQ(count_of(log, "further bad lines are skipped without a message"), 1u) << log;
  EXPECT_EQ(count_of(log, pb + ":4:"), 1u) << log;  // the tenth
  EXPECT_EQ(count_of(log, pb + ":5:"), 0u) << log;
  EXPECT_EQ(st.skipped_by_file, (std::vector<std::pair<std::string, int64_t>>{{pa, 7}, {pb, 5}}));
  EXPECT_EQ(st.skipped_report(),
            "12 bad lines of 14 skipped (not_json 7, not_object 5): " + pa + " 7, " + pb + " 5");
  EXPECT_EQ(st.to_json()["skipped_by_file"][pb], 5);
  EXPECT_EQ(DatasetStats{}.skipped_report(), "");
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
  a.skipped_by_file = {{"f", 2}};
  b.lines = 4;
  b.skipped[1] = 1;
  b.tokens = 9;
  b.first_errors = {"y"};
  b.skipped_by_file = {{"g", 1}, {"f", 3}};
  a.merge(b);
  EXPECT_EQ(a.lines, 7);
  EXPECT_EQ(a.skipped[1], 3);
  EXPECT_EQ(a.skipped_by_file, (std::vector<std::pair<std::string, int64_t>>{{"f", 5}, {"g", 1}}));
  EXPECT_EQ(a.tokens, 9);
  EXPECT_EQ(a.first_errors, (std::vector<std::string>{"x", "y"}));
}

}  // namespace
