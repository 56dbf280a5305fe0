// Bad data through the glmtune binary: `train`, `eval` and `data prepare` on lines with numbers
// beyond a double, lines over the byte limit, folders listed as data files, and skipped lines
// whose total `train` reports once the data is read.

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "glmtune/data/dataset.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using glmtune::test::TempDir;

namespace {

const fs::path kSource = GLMTUNE_SOURCE_DIR;
const fs::path kTokenizer = kSource / "examples" / "tiny" / "tokenizer";
const fs::path kChat = kSource / "examples" / "tiny" / "data" / "chat.jsonl";

struct Result {
  int code = -1;
  std::string output;  // stdout and stderr
};

Result run(const std::string& args, const TempDir& dir) {
  const fs::path out = dir / "output.txt";
  const std::string cmd = std::string(GLMTUNE_BINARY) + " " + args + " > " + out.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, glmtune::test::read_text(out)};
}

// The first `n` conversations of the bundled data.
std::string chat_lines(int n) {
  std::ifstream in(kChat);
  std::string out, line;
  for (int i = 0; i < n && std::getline(in, line); ++i) out += line + "\n";
  return out;
}

std::string write(const TempDir& dir, const std::string& name, const std::string& content) {
  const fs::path p = dir / name;
  std::ofstream(p, std::ios::binary) << content;
  return p.string();
}

const std::string kOverflow = R"({"messages": [{"role":"user","content":"x","n": 1e999}]})";

// One tiny checkpoint for the binary's tests, with the tiny tokenizer next to it.
struct Checkpoint {
  TempDir dir{"bad-data"};
  fs::path model = dir / "model";
  Checkpoint() {
    const Result r = run("init --preset tiny --seed 3 --out " + model.string() + " --tokenizer " +
                             kTokenizer.string(),
                         dir);
    if (r.code != 0) throw std::runtime_error("glmtune init failed: " + r.output);
  }
};

const Checkpoint& checkpoint() {
  static Checkpoint c;
  return c;
}

std::string recipe(const TempDir& dir, const std::string& files) {
  return write(dir, "recipe.toml",
               "[model]\npath = \"" + checkpoint().model.string() + "\"\ntokenizer = \"" +
                   kTokenizer.string() + "\"\n[data]\nfiles = [" + files +
                   "]\nformat = \"auto\"\non_bad_line = \"skip\"\nmax_length = 192\n"
                   "pack_max_length = 192\n[train]\ntotal_steps = 1\nseed = 1\n"
                   "[output]\ndir = \"" +
                   (dir / "out").string() + "\"\nsave_every = 0\n");
}

size_t count_of(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t p = text.find(part); p != std::string::npos; p = text.find(part, p + 1)) ++n;
  return n;
}

#define EXPECT_CONTAINS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

}  // namespace

TEST(CliBadData, TrainReportsTheSkippedLinesPerFileOnceTheDataIsRead) {
  TempDir dir("bad-train");
  std::string a = chat_lines(20), b = chat_lines(10);
  for (int i = 0; i < 6; ++i) a += "{broken\n";
  a += kOverflow + "\n";
  for (int i = 0; i < 5; ++i) b += "[1]\n";
  const std::string pa = write(dir, "a.jsonl", a), pb = write(dir, "b.jsonl", b);
  const Result r = run("train --config " + recipe(dir, "\"" + pa + "\", \"" + pb + "\""), dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "skipping " + dir.path().string()), 10u) << r.output;
  EXPECT_CONTAINS(r.output, pa + ":27: not valid JSON: number overflow parsing '1e999'");
  EXPECT_CONTAINS(r.output, "12 bad lines of 42 skipped (not_json 7, not_object 5): " + pa +
                                " 7, " + pb + " 5");
}

TEST(CliBadData, TrainRefusesAFolderAmongTheDataFiles) {
  TempDir dir("bad-train-dir");
  const std::string pa = write(dir, "a.jsonl", chat_lines(20));
  const std::string folder = (dir / "more").string();
  fs::create_directories(folder);
  const Result r = run("train --config " + recipe(dir, "\"" + pa + "\", \"" + folder + "\""), dir);
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.output, folder + ": is a directory, not a JSONL file");
  EXPECT_CONTAINS(r.output, "list the JSONL files inside it");
}

TEST(CliBadData, EvalNamesTheLineOfANumberBeyondADoubleAndRefusesFolders) {
  TempDir dir("bad-eval");
  const std::string file = write(dir, "bad.jsonl", chat_lines(2) + kOverflow + "\n");
  const std::string eval = "eval --model " + checkpoint().model.string() + " --pack-length 192 ";
  Result r = run(eval + "--data " + file, dir);
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.output, file + ":3: not valid JSON: number overflow parsing '1e999'");
  EXPECT_EQ(r.output.find("[json.exception"), std::string::npos) << r.output;

  r = run(eval + "--data " + dir.path().string(), dir);
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.output, dir.path().string() + ": is a directory, not a JSONL file");
}

TEST(CliBadData, PrepareSkipsANumberBeyondADoubleAndStopsAtALineOverTheLimit) {
  TempDir dir("bad-prepare");
  const std::string file = write(dir, "num.jsonl", chat_lines(2) + kOverflow + "\n");
  const std::string prepare = "data prepare --tokenizer " + kTokenizer.string() + " --out " +
                              (dir / "cache.bin").string() + " --input ";
  Result r = run(prepare + file, dir);
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.output, file + ":3: not valid JSON: number overflow parsing '1e999'");
  r = run(prepare + file + " --on-bad-line skip", dir);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "3 lines read, 1 bad lines skipped");
  EXPECT_CONTAINS(r.output, "1 bad line of 3 skipped (not_json 1): " + file + " 1");

  // A line one byte over the limit stops the run at that line, the lines after it unread, instead
  // of being read whole (or, memory exhausted, taken for the end of the file).
  const std::string huge = write(
      dir, "huge.jsonl",
      chat_lines(5) + std::string(glmtune::data::kMaxLineBytes + 1, 'x') + "\n" + chat_lines(3));
  r = run(prepare + huge, dir);
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.output, huge + ":6: the line has more than " +
                                std::to_string(glmtune::data::kMaxLineBytes) + " bytes");
}
