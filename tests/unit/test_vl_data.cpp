// Vision-language data reading (VlDataset::scan): bad lines under both policies with messages that
// name their place once, media tokens written in message text, numbers beyond a double, folders
// listed as files.

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/dataset.h"
#include "glmtune/train/vl_batch.h"
#include "support/log_capture.h"
#include "support/temp_dir.h"

using namespace glmtune;
using glmtune::data::BadLinePolicy;
using glmtune::data::BadLineReason;
using glmtune::test::count_of;
using glmtune::test::LogCapture;
using glmtune::train::VlDataConfig;
using glmtune::train::VlDataset;
namespace fs = std::filesystem;

namespace {

const fs::path kExample = fs::path(GLMTUNE_SOURCE_DIR) / "examples" / "tiny-vl";
const fs::path kProcessor = fs::path(GLMTUNE_SOURCE_DIR) / "examples" / "tiny" / "tokenizer";

const data::media::VlProcessor& processor() {
  static const auto p =
      std::make_unique<data::media::VlProcessor>(data::media::VlProcessor::from_dir(kProcessor));
  return *p;
}

// A conversation about a bundled image.
const std::string kGood =
    R"({"messages": [{"role": "user", "content": [{"type": "image", "image": "media/chelsea.jpg"}, )"
    R"({"type": "text", "text": "What animal is this?"}]}, {"role": "assistant", "content": "A cat."}]})";

struct Bad {
  std::string line;
  BadLineReason reason;
  std::string problem;  // how the message starts after "file:line: "
};

std::vector<Bad> bad_lines() {
  return {
      {"{broken", BadLineReason::kNotJson, "not valid JSON: parse error"},
      {R"({"messages": [{"role": "user", "content": "x", "n": 1e999}]})", BadLineReason::kNotJson,
       "not valid JSON: number overflow parsing '1e999'"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image", "image": "media/none.jpg"}]}, )"
       R"({"role": "assistant", "content": "a"}]})",
       BadLineReason::kMedia, ""},
      {R"({"messages": [{"role": "user", "content": "see <|image|>"}, {"role": "assistant", "content": "a"}]})",
       BadLineReason::kMedia,
       "`<|image|>` in messages[0].content: a media token written in the text"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<|begin_of_image|>"}]})",
       BadLineReason::kMedia,
       "`<|begin_of_image|>` in messages[1].content: a media token written in the text"},
  };
}

}  // namespace

TEST(VlData, SkippedLinesNameTheirPlaceOnce) {
  test::TempDir dir("vl-data");
  std::string content = kGood + "\n";
  for (const Bad& b : bad_lines()) content += b.line + "\n";
  const std::string file = (dir / "bad.jsonl").string();
  std::ofstream(file, std::ios::binary) << content;
  VlDataConfig dc;
  dc.files = {file};
  dc.media_root = kExample;
  dc.on_bad_line = BadLinePolicy::kSkip;
  std::string log;
  std::unique_ptr<VlDataset> ds;
  {
    LogCapture capture;
    ds = std::make_unique<VlDataset>(VlDataset::scan(dc, processor()));
    log = capture.text();
  }
  EXPECT_EQ(ds->size(), 1);
  const auto bad = bad_lines();
  const auto& st = ds->stats();
  EXPECT_EQ(st.skipped_total(), int64_t(bad.size()));
  ASSERT_EQ(st.first_errors.size(), bad.size());
  std::array<int64_t, data::kNumBadLineReasons> by_reason{};
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(bad[i].line);
    ++by_reason[size_t(bad[i].reason)];
    const std::string where = file + ":" + std::to_string(i + 2);
    const std::string& message = st.first_errors[i];
    EXPECT_EQ(message.rfind(where + ": " + bad[i].problem, 0), 0u) << message;
    EXPECT_EQ(count_of(message, where), 1u) << message;
    EXPECT_EQ(message.find("[json.exception"), std::string::npos) << message;
    EXPECT_EQ(count_of(log, "warning skipping " + message + "\n"), 1u) << log;
    EXPECT_EQ(count_of(log, where), 1u) << log;
  }
  EXPECT_EQ(st.skipped, by_reason);
  EXPECT_EQ(st.skipped_report(), "5 bad lines of 6 skipped (not_json 2, media 3): " + file + " 5");
}

TEST(VlData, BadLinesAreErrorsUnderTheFailPolicy) {
  test::TempDir dir("vl-data");
  for (const Bad& b : bad_lines()) {
    SCOPED_TRACE(b.line);
    const std::string file = (dir / "bad.jsonl").string();
    std::ofstream(file, std::ios::binary) << kGood << "\n" << b.line << "\n";
    VlDataConfig dc;
    dc.files = {file};
    dc.media_root = kExample;
    try {
      VlDataset::scan(dc, processor());
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.where(), file + ":2");
      EXPECT_EQ(e.problem().rfind(b.problem, 0), 0u) << e.problem();
      EXPECT_FALSE(e.fix().empty());
    }
  }
}

TEST(VlData, LinesOverTheByteLimitAndFoldersAreRefused) {
  test::TempDir dir("vl-data");
  const std::string file = (dir / "long.jsonl").string();
  std::ofstream(file, std::ios::binary) << kGood << "\n" << std::string(500, ' ') << "\n" << kGood;
  VlDataConfig dc;
  dc.files = {file};
  dc.media_root = kExample;
  dc.max_line_bytes = 400;
  try {
    VlDataset::scan(dc, processor());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.where(), file + ":2");
    EXPECT_EQ(e.problem().rfind("the line has more than 400 bytes", 0), 0u) << e.problem();
  }
  dc.on_bad_line = BadLinePolicy::kSkip;
  const VlDataset skipped = VlDataset::scan(dc, processor());
  EXPECT_EQ(skipped.size(), 2);
  EXPECT_EQ(skipped.where(1), file + ":3");
  EXPECT_EQ(skipped.stats().skipped[size_t(BadLineReason::kTooLong)], 1);

  dc.files = {file, dir.path().string()};
  try {
    VlDataset::scan(dc, processor());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.where(), dir.path().string());
    EXPECT_EQ(e.problem(), "is a directory, not a JSONL file");
  }
}
