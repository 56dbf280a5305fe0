// Training from a token cache (`glmtune data prepare`, recipe data.cache): the same losses, bit for
// bit, as training from the JSONL files it was prepared from; a cache prepared with another
// tokenizer, format, max_length or overlong policy is refused with a message saying what differs.

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "glmtune/base/error.h"
#include "glmtune/model/config.h"
#include "glmtune/model/init.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/trainer.h"
#include "support/temp_dir.h"

using namespace glmtune;
namespace fs = std::filesystem;
using glmtune::test::TempDir;

namespace {

const fs::path kSource = GLMTUNE_SOURCE_DIR;
const fs::path kTokenizer = kSource / "examples/tiny/tokenizer";
const fs::path kChat = kSource / "examples/tiny/data/chat.jsonl";

struct Fixture {
  TempDir dir{"train-cache"};
  fs::path model = dir / "tiny";
  Fixture() {
    model::InitOptions options;
    options.seed = 9;
    model::write_random_checkpoint(model::ModelConfig::preset("tiny"), model, options);
  }
};
Fixture& fixture() {
  static Fixture f;
  return f;
}

// `data` is the [data] source line: files = [...] or cache = "...".
std::string recipe_text(const std::string& data, const fs::path& tokenizer, const fs::path& out) {
  std::ostringstream s;
  s << "[model]\npath = \"" << fixture().model.string() << "\"\ntokenizer = \""
    << tokenizer.string() << "\"\n"
    << "[data]\n"
    << data << "\nformat = \"chat\"\nmax_length = 160\npack_max_length = 160\n"
    << "[train]\ntotal_steps = 4\nmicro_packs = 2\nseed = 17\nrecompute = \"none\"\n"
    << "[optimizer]\nlr = 3e-3\nlr_min = 3e-4\nwarmup_steps = 1\n"
    << "[output]\ndir = \"" << out.string() << "\"\nsave_every = 0\n";
  return s.str();
}

void prepare(const fs::path& cache, const fs::path& tokenizer, const std::string& extra) {
  const std::string cmd = std::string(GLMTUNE_BINARY) + " data prepare --tokenizer " +
                          tokenizer.string() + " --input " + kChat.string() + " --out " +
                          cache.string() + " " + extra + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

train::TrainSummary run(const std::string& text) {
  train::TrainerOptions options;
  options.print_steps = false;
  return train::run_training(train::Recipe::parse(text, "test recipe"), options);
}

uint64_t bits(double v) {
  uint64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

}  // namespace

TEST(TrainTokenCache, SameLossesAsTheJsonl) {
  Fixture& f = fixture();
  const fs::path cache = f.dir / "chat.cache";
  prepare(cache, kTokenizer, "--format chat --max-length 160");
  const auto from_files =
      run(recipe_text("files = [\"" + kChat.string() + "\"]", kTokenizer, f.dir / "files-run"));
  const auto from_cache =
      run(recipe_text("cache = \"" + cache.string() + "\"", kTokenizer, f.dir / "cache-run"));
  ASSERT_EQ(from_files.steps.size(), 4u);
  ASSERT_EQ(from_cache.steps.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(bits(from_cache.steps[i].loss), bits(from_files.steps[i].loss)) << "step " << i + 1;
    EXPECT_EQ(bits(from_cache.steps[i].grad_norm), bits(from_files.steps[i].grad_norm));
    EXPECT_EQ(from_cache.steps[i].text_tokens, from_files.steps[i].text_tokens);
  }
  EXPECT_LT(from_cache.steps.back().loss, from_cache.steps.front().loss);
  // The effective recipe records the cache as the data source.
  std::ifstream in(f.dir / "cache-run" / "recipe.toml");
  std::stringstream toml;
  toml << in.rdbuf();
  EXPECT_NE(toml.str().find("cache = \"" + cache.string() + "\""), std::string::npos);
}

TEST(TrainTokenCache, RefusesACachePreparedDifferently) {
  Fixture& f = fixture();
  auto expect_refused = [&](const fs::path& cache, const fs::path& tokenizer,
                            const std::string& what_part, const std::string& fix_part) {
    try {
      run(recipe_text("cache = \"" + cache.string() + "\"", tokenizer, f.dir / "refused"));
      ADD_FAILURE() << "trained on " << cache;
    } catch (const Error& e) {
      EXPECT_NE(e.problem().find(what_part), std::string::npos) << e.what();
      EXPECT_NE(e.where().find(cache.filename().string()), std::string::npos) << e.what();
      EXPECT_NE(e.fix().find(fix_part), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(f.dir / "refused" / "checkpoints"));
  };
  const fs::path longer = f.dir / "longer.cache";
  prepare(longer, kTokenizer, "--format chat --max-length 256");
  expect_refused(longer, kTokenizer, "max_length = 256", "data.max_length = 256");
  const fs::path any_format = f.dir / "auto.cache";
  prepare(any_format, kTokenizer, "--format auto --max-length 160");
  expect_refused(any_format, kTokenizer, "format = \"auto\"", "glmtune data prepare");
  const fs::path dropped = f.dir / "drop.cache";
  prepare(dropped, kTokenizer, "--format chat --max-length 160 --on-overlong drop");
  expect_refused(dropped, kTokenizer, "on_overlong = \"drop\"", "--on-overlong truncate");

  // Another tokenizer: the same files with one byte of tokenizer.json changed.
  const fs::path other = f.dir / "other-tokenizer";
  fs::create_directories(other);
  for (const auto& e : fs::directory_iterator(kTokenizer))
    fs::copy_file(e.path(), other / e.path().filename());
  std::ofstream(other / "tokenizer.json", std::ios::app) << "\n";
  const fs::path matching = f.dir / "matching.cache";
  prepare(matching, kTokenizer, "--format chat --max-length 160");
  try {
    run(recipe_text("cache = \"" + matching.string() + "\"", other, f.dir / "refused"));
    ADD_FAILURE() << "trained with another tokenizer";
  } catch (const Error& e) {
    EXPECT_NE(e.problem().find("different tokenizer"), std::string::npos) << e.what();
    EXPECT_NE(e.where().find("matching.cache"), std::string::npos) << e.what();
  }
}

TEST(TrainTokenCache, RecipeTakesFilesOrCache) {
  const fs::path out = fixture().dir / "x";
  const train::Recipe r =
      train::Recipe::parse(recipe_text("cache = \"a.cache\"", kTokenizer, out), "r.toml");
  EXPECT_EQ(r.data_cache, "a.cache");
  EXPECT_TRUE(r.data_files.empty());
  try {
    train::Recipe::parse(recipe_text("files = [\"a.jsonl\"]\ncache = \"a.cache\"", kTokenizer, out),
                         "r.toml");
    ADD_FAILURE() << "accepted files and cache together";
  } catch (const Error& e) {
    EXPECT_NE(e.where().find("r.toml:6: data.cache"), std::string::npos) << e.what();
  }
  try {
    train::Recipe::parse(recipe_text("", kTokenizer, out), "r.toml");
    ADD_FAILURE() << "accepted a recipe without data";
  } catch (const Error& e) {
    EXPECT_NE(e.problem().find("data.files"), std::string::npos) << e.what();
    EXPECT_NE(e.fix().find("cache"), std::string::npos) << e.what();
  }
}
