// The glmtune binary's data tools end to end: `tokenize` and `chat-template` against the library
// and the released template's golden renders, `data prepare` / `data inspect` against the cache
// and the dataset counts, and their errors.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "glmtune/base/fs.h"
#include "glmtune/data/chat_template.h"
#include "glmtune/data/dataset.h"
#include "glmtune/data/token_cache.h"
#include "glmtune/data/tokenizer.h"
#include "support/cli.h"

namespace fs = std::filesystem;
using namespace glmtune::data;

namespace {

const std::string kSource = GLMTUNE_SOURCE_DIR;
const std::string kTokenizerDir = kSource + "/examples/tiny/tokenizer";

const Tokenizer& tiny_tokenizer() {
  static const Tokenizer tok = Tokenizer::from_file(kTokenizerDir + "/tokenizer.json");
  return tok;
}

using Result = glmtune::test::CliResult;

class CliDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("glmtune_cli_data_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::string write(const std::string& name, const std::string& content) const {
    std::ofstream(path(name), std::ios::binary) << content;
    return path(name);
  }
  static std::string slurp(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  // Runs glmtune with `args` (shell syntax, so `< file` works), stdout and stderr kept apart.
  Result run(const std::string& args) const {
    return glmtune::test::run_glmtune(args, path("stderr.txt"));
  }

  fs::path dir_;
};

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

#define EXPECT_CONTAINS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

}  // namespace

TEST_F(CliDataTest, TokenizePrintsTheLibrarysIds) {
  const std::vector<std::string> texts = {
      "Hello, world!",
      "",
      "[gMASK]<sop><|user|>¿Cuánto es 6 - 34?<|assistant|><think></think>-28<|endoftext|>",
      "line one\r\nline two\n\n  indented\ttab 12345 把单词 😀",
  };
  std::string input;
  for (const auto& t : texts) input += nlohmann::json(t).dump() + "\n";
  write("in.jsonl", input);
  const Result r = run("tokenize --tokenizer " + kTokenizerDir + " < " + path("in.jsonl"));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto lines = lines_of(r.out);
  ASSERT_EQ(lines.size(), texts.size()) << r.out;
  for (size_t i = 0; i < texts.size(); ++i)
    EXPECT_EQ(nlohmann::json::parse(lines[i]).get<std::vector<int32_t>>(),
              tiny_tokenizer().encode(texts[i]))
        << texts[i];
}

TEST_F(CliDataTest, TokenizeStopsAtABadLineNamingIt) {
  write("in.jsonl", "\"ok\"\n\"fine\"\n{\"text\": \"not a string\"}\n\"never reached\"\n");
  const Result r = run("tokenize --tokenizer " + kTokenizerDir + " < " + path("in.jsonl"));
  EXPECT_NE(r.code, 0);
  EXPECT_CONTAINS(r.err, "stdin line 3");
  EXPECT_EQ(lines_of(r.out).size(), 2u) << r.out;
  const Result missing = run("tokenize --tokenizer " + path("nowhere") + " < " + path("in.jsonl"));
  EXPECT_NE(missing.code, 0);
  EXPECT_CONTAINS(missing.err, "no tokenizer.json found");
}

TEST_F(CliDataTest, ChatTemplateMatchesTheGoldenRendersAndTheLibrary) {
  const auto golden =
      OrderedJson::parse(slurp(kSource + "/tests/golden/chat_template/renders.json"));
  const int32_t eot = tiny_tokenizer().require_id("<|endoftext|>");
  int checked = 0;
  for (const auto& c : golden["cases"]) {
    OrderedJson in = {{"messages", c["messages"]}};
    if (c.contains("tools")) in["tools"] = c["tools"];
    for (const auto& [k, v] : c["options"].items()) in[k] = v;
    const std::string file = write(c["name"].get<std::string>() + ".json", in.dump());
    const Result r = run("chat-template --tokenizer " + kTokenizerDir + " --messages " + file);
    ASSERT_EQ(r.code, 0) << c["name"] << ": " << r.err;
    const auto out = OrderedJson::parse(r.out);
    EXPECT_EQ(out["text"].get<std::string>(), c["expected"].get<std::string>()) << c["name"];

    // ids and mask are the training sequence the library builds (final stop included).
    ChatTemplateOptions options;
    if (in.contains("reasoning_effort")) options.reasoning_effort = in["reasoning_effort"];
    options.clear_thinking = in.value("clear_thinking", false);
    options.add_generation_prompt = in.value("add_generation_prompt", false);
    const auto chat = render_chat(ChatTemplateKind::kGlm53, in["messages"],
                                  in.contains("tools") ? in["tools"] : OrderedJson(), options);
    const auto expected = tokenize_segments(chat.segments, tiny_tokenizer());
    const auto ids = out["input_ids"].get<std::vector<int32_t>>();
    const auto mask = out["loss_mask"].get<std::vector<int>>();
    EXPECT_EQ(ids, expected.input_ids) << c["name"];
    ASSERT_EQ(mask.size(), ids.size()) << c["name"];
    for (size_t i = 0; i < ids.size(); ++i)
      EXPECT_EQ(mask[i], expected.labels[i] != kIgnoreIndex ? 1 : 0) << c["name"] << " " << i;
    // The ids decode to the text, plus `<|endoftext|>` exactly when training ends on it.
    const bool final_stop = !ids.empty() && ids.back() == eot && mask.back() == 1;
    EXPECT_EQ(tiny_tokenizer().decode(ids),
              c["expected"].get<std::string>() + (final_stop ? "<|endoftext|>" : ""))
        << c["name"];
    ++checked;
  }
  EXPECT_GT(checked, 30);
}

TEST_F(CliDataTest, ChatTemplateReadsStdinAndTrainsTheFinalStop) {
  write(
      "in.json",
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})");
  const Result r =
      run("chat-template --tokenizer " + kTokenizerDir + " --messages - < " + path("in.json"));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto out = nlohmann::json::parse(r.out);
  EXPECT_EQ(out["text"],
            "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>Hi<|assistant|>"
            "<think></think>Yo");
  EXPECT_EQ(out["input_ids"].back(), tiny_tokenizer().require_id("<|endoftext|>"));
  EXPECT_EQ(out["loss_mask"].back(), 1);
  EXPECT_EQ(out["loss_mask"].front(), 0);

  write("bad.json", R"({"messages": [{"role": "wizard", "content": "x"}]})");
  const Result bad =
      run("chat-template --tokenizer " + kTokenizerDir + " --messages " + path("bad.json"));
  EXPECT_NE(bad.code, 0);
  EXPECT_CONTAINS(bad.err, "error:");
  write("notjson.json", "{messages");
  const Result nj =
      run("chat-template --tokenizer " + kTokenizerDir + " --messages " + path("notjson.json"));
  EXPECT_NE(nj.code, 0);
  EXPECT_CONTAINS(nj.err, path("notjson.json"));
}

TEST_F(CliDataTest, PrepareThenInspectShowsTheDatasetCounts) {
  const std::string chat = kSource + "/examples/tiny/data/chat.jsonl";
  const std::string text = kSource + "/examples/tiny/data/text.jsonl";
  const Result prep = run("data prepare --tokenizer " + kTokenizerDir + " --input " + chat + " " +
                          text + " --out " + path("c.cache") + " --max-length 64 --threads 1");
  ASSERT_EQ(prep.code, 0) << prep.err;

  // The same pass through the library.
  DatasetConfig cfg;
  cfg.files = {chat, text};
  cfg.max_length = 64;
  JsonlSampleReader reader(cfg, tiny_tokenizer());
  std::vector<Sample> samples;
  while (auto s = reader.next()) samples.push_back(std::move(*s));
  const auto& stats = reader.stats();
  int64_t masked = 0;
  for (const auto& s : samples)
    for (int32_t l : s.tokens.labels) masked += l != kIgnoreIndex;

  const auto cache =
      TokenCache::open(path("c.cache"), tokenizer_file_hash(kTokenizerDir + "/tokenizer.json"));
  ASSERT_EQ(cache.size(), static_cast<int64_t>(samples.size()));
  for (size_t i = 0; i < samples.size(); ++i)
    ASSERT_EQ(cache.sample(static_cast<int64_t>(i)).tokens.labels, samples[i].tokens.labels);
  EXPECT_CONTAINS(prep.out, std::to_string(samples.size()) + " samples");
  EXPECT_CONTAINS(prep.out, std::to_string(stats.truncated) + " truncated");

  const Result r = run("data inspect " + path("c.cache") + " --sample 0");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "samples: " + std::to_string(stats.samples) + "\n");
  EXPECT_CONTAINS(r.out, "tokens: " + std::to_string(stats.tokens) + "\n");
  EXPECT_CONTAINS(r.out, "trained tokens: " + std::to_string(masked) + "\n");
  char fraction[64];
  std::snprintf(fraction, sizeof fraction, "loss-token fraction: %.4f\n",
                static_cast<double>(masked) / stats.tokens);
  EXPECT_CONTAINS(r.out, fraction);
  EXPECT_CONTAINS(r.out, "length histogram");
  // Sample 0 is {"user": "¿Cuánto es 6 - 34?", "assistant": "-28"}: the prompt is context, the
  // answer and its final stop are trained (not a TTY, so brackets mark them).
  EXPECT_CONTAINS(r.out, "<|user|>¿Cuánto es 6 - 34?<|assistant|>");
  EXPECT_CONTAINS(r.out, "-28<|endoftext|>]]");
  EXPECT_EQ(r.out.find("[[[gMASK]"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("\x1b["), std::string::npos);
  const Result colored = run("data inspect " + path("c.cache") + " --color always");
  EXPECT_CONTAINS(colored.out, "-28<|endoftext|>\x1b[0m");

  // The histogram counts every sample once.
  int64_t histogram_total = 0;
  bool in_histogram = false;
  for (const auto& line : lines_of(r.out)) {
    if (line.rfind("length histogram", 0) == 0) {
      in_histogram = true;
      continue;
    }
    if (in_histogram && line.rfind("  [", 0) == 0) {
      histogram_total += std::stoll(line.substr(line.find(')') + 1));
    } else if (in_histogram) {
      break;
    }
  }
  EXPECT_EQ(histogram_total, stats.samples);

  const Result out_of_range = run("data inspect " + path("c.cache") + " --sample 100000");
  EXPECT_NE(out_of_range.code, 0);
  EXPECT_CONTAINS(out_of_range.err, "--sample");
}

TEST_F(CliDataTest, PrepareAndInspectErrors) {
  const std::string bad =
      write("bad.jsonl", "{\"text\": \"fine\"}\nnot json\n{\"text\": \"also fine\"}\n");
  const Result fail = run("data prepare --tokenizer " + kTokenizerDir + " --input " + bad +
                          " --out " + path("b.cache"));
  EXPECT_NE(fail.code, 0);
  EXPECT_CONTAINS(fail.err, bad + ":2");
  EXPECT_FALSE(fs::exists(path("b.cache")));

  const Result skip = run("data prepare --tokenizer " + kTokenizerDir + " --input " + bad +
                          " --out " + path("b.cache") + " --on-bad-line skip --format text");
  ASSERT_EQ(skip.code, 0) << skip.err;
  EXPECT_CONTAINS(skip.out, "2 samples");
  EXPECT_CONTAINS(skip.out, "1 bad lines skipped");

  // A different tokenizer file than the cache was built with.
  std::string json = slurp(kTokenizerDir + "/tokenizer.json");
  fs::create_directories(path("other"));
  write("other/tokenizer.json", json + " ");
  const Result mismatch = run("data inspect " + path("b.cache") + " --tokenizer " + path("other"));
  EXPECT_NE(mismatch.code, 0);
  EXPECT_CONTAINS(mismatch.err, "different tokenizer");
  EXPECT_CONTAINS(mismatch.err, path("b.cache"));

  const std::string cache = slurp(path("b.cache"));
  write("cut.cache", cache.substr(0, cache.size() / 2));
  const Result cut = run("data inspect " + path("cut.cache"));
  EXPECT_NE(cut.code, 0);
  EXPECT_CONTAINS(cut.err, path("cut.cache"));
  EXPECT_CONTAINS(cut.err, "truncated");
}

TEST_F(CliDataTest, PrepareRemovesTheTemporaryFilesOfAKilledPrepare) {
  const std::string data = write("d.jsonl", "{\"text\": \"hello there\"}\n");
  // What a `data prepare` killed mid-way left: its pid is no longer running.
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string host = glmtune::temporary_host_tag();
  const std::string stale = "old.cache.tmp." + host + "." + std::to_string(dead);
  const std::string stale_mask = "old.cache.mask.tmp." + std::to_string(dead);  // older naming
  const std::string live = "busy.cache.tmp." + host + "." + std::to_string(::getpid());
  const std::string remote = "far.cache.tmp.otherhost." + std::to_string(dead);
  for (const auto& n : {stale, stale_mask, live, remote}) write(n, std::string(4096, 'x'));

  const Result r = run("data prepare --tokenizer " + kTokenizerDir + " --input " + data +
                       " --out " + path("new.cache") + " --format text");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(fs::exists(path(stale)));
  EXPECT_FALSE(fs::exists(path(stale_mask)));
  EXPECT_TRUE(fs::exists(path(live)));    // a running process's
  EXPECT_TRUE(fs::exists(path(remote)));  // another machine's: its pid means nothing here
  // The log says what went and why.
  EXPECT_CONTAINS(r.out + r.err, "removed " + path(stale) + " (4096 bytes)");
  EXPECT_CONTAINS(r.out + r.err, "no longer running");

  // A prepare that fails leaves no temporary file of its own.
  const std::string bad = write("bad.jsonl", "{\"text\": \"fine\"}\nnot json\n");
  const Result fail = run("data prepare --tokenizer " + kTokenizerDir + " --input " + bad +
                          " --out " + path("b.cache"));
  EXPECT_NE(fail.code, 0);
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_FALSE(e.path().filename().string().starts_with("b.cache")) << e.path();
}

TEST_F(CliDataTest, PrepareIntoADirectoryThatCannotBeMadeNamesTheFlag) {
  const std::string data = write("d.jsonl", "{\"text\": \"hello there\"}\n");
  write("file", "x");
  const Result r = run("data prepare --tokenizer " + kTokenizerDir + " --input " + data +
                       " --out " + path("file") + "/caches/new.cache --format text");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_CONTAINS(r.err, "--out: cannot create the directory " + path("file") + "/caches");
  EXPECT_CONTAINS(r.err, "is a file, not a directory");
  EXPECT_CONTAINS(r.err, "fix:");
}
