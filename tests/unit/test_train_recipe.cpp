// The training recipe: defaults, every key, --set overrides, and one error per kind of mistake,
// each naming the file, line and key and saying how to fix it.

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>

#include "glmtune/base/error.h"
#include "glmtune/train/recipe.h"

using namespace glmtune;
using namespace glmtune::train;

namespace {

uint64_t fresh_seed() { return std::random_device{}(); }

const std::string kMinimal = R"([model]
path = "m"
[data]
files = ["a.jsonl"]
[train]
total_steps = 100
[output]
dir = "out"
)";

// kMinimal with extra lines in some sections (sections in this order: model, data, train,
// optimizer, loss, output). An extra line in data is line 5, in train line 7, and in an
// otherwise absent optimizer or loss section line 8 (after its header on line 7).
std::string with(const std::map<std::string, std::string>& extra) {
  const std::vector<std::pair<std::string, std::string>> base = {
      {"model", "path = \"m\"\n"},
      {"data", "files = [\"a.jsonl\"]\n"},
      {"train", "total_steps = 100\n"},
      {"optimizer", ""},
      {"loss", ""},
      {"output", "dir = \"out\"\n"}};
  std::string text;
  for (const auto& [section, keys] : base) {
    auto it = extra.find(section);
    if (keys.empty() && it == extra.end()) continue;
    text += "[" + section + "]\n" + keys;
    if (it != extra.end()) text += it->second + "\n";
  }
  return text;
}

// The error of parsing `text` as "r.toml"; fails the test when parsing succeeds.
Error error_of(const std::string& text) {
  try {
    Recipe::parse(text, "r.toml");
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected an error for:\n" << text;
  return Error("");
}

Error set_error(Recipe r, const std::string& key, const std::string& value) {
  try {
    r.set(key, value);
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected an error for --set " << key << "=" << value;
  return Error("");
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Checks that the error's problem, location and advice each mention what they should.
#define EXPECT_RECIPE_ERROR(err, problem_part, where_part, fix_part)             \
  do {                                                                           \
    const Error e_ = (err);                                                      \
    EXPECT_TRUE(has(e_.problem(), problem_part)) << "problem: " << e_.problem(); \
    EXPECT_TRUE(has(e_.where(), where_part)) << "where: " << e_.where();         \
    EXPECT_TRUE(has(e_.fix(), fix_part)) << "fix: " << e_.fix();                 \
  } while (0)

}  // namespace

TEST(Recipe, DefaultsFollowTheSpec) {
  const Recipe r = Recipe::parse(kMinimal, "r.toml");
  EXPECT_EQ(r.model_path, "m");
  EXPECT_EQ(r.tokenizer_path, "m");
  EXPECT_EQ(r.data_files, std::vector<std::string>{"a.jsonl"});
  EXPECT_EQ(r.data_format, data::SampleFormat::kAuto);
  EXPECT_EQ(r.on_bad_line, data::BadLinePolicy::kFail);
  EXPECT_EQ(r.on_overlong, data::OverlongPolicy::kTruncate);
  EXPECT_EQ(r.max_length, 4096);
  EXPECT_EQ(r.pack_max_length, 16384);
  EXPECT_EQ(r.pack_lookahead, 100);
  EXPECT_TRUE(r.shuffle);
  EXPECT_EQ(r.total_steps, 100);
  EXPECT_FALSE(r.epochs.has_value());
  EXPECT_EQ(r.micro_packs, 1);
  EXPECT_EQ(r.seed, 0u);
  EXPECT_TRUE(r.device.is_cpu());
  EXPECT_EQ(r.recompute, 1.0);
  EXPECT_FALSE(r.recompute_vision);
  // The reference trainer's defaults (docs/training.md, "Reference").
  EXPECT_EQ(r.lr, 1e-6);
  EXPECT_EQ(r.lr_min, 1e-6);
  EXPECT_FALSE(r.warmup_steps.has_value());
  EXPECT_EQ(r.warmup_ratio, 0.0);
  EXPECT_EQ(r.beta1, 0.9);
  EXPECT_EQ(r.beta2, 0.95);
  EXPECT_EQ(r.eps, 1e-8);
  EXPECT_EQ(r.weight_decay, 0.01);
  EXPECT_EQ(r.clip_grad_norm, 1.0);
  EXPECT_EQ(r.mtp_scale, 0.1);
  EXPECT_EQ(r.balancing_alpha, 0.001);
  EXPECT_EQ(r.router_bias_update_rate, 0.001);
  EXPECT_EQ(r.output_dir, "out");
  EXPECT_EQ(r.save_every, 200);
  EXPECT_EQ(r.keep_last, 3);
  EXPECT_EQ(r.log_every, 1);
  // A pack shorter than 4096 caps the default sample length; a small lr caps lr_min.
  Recipe small = Recipe::parse(kMinimal, "r.toml");
  small.set("data.pack_max_length", "512");
  EXPECT_EQ(small.max_length, 512);
  small.set("optimizer.lr", "1e-7");
  EXPECT_EQ(small.lr_min, 1e-7);
}

TEST(Recipe, ReadsEveryKey) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 gen(seed);
  const double lr = std::uniform_real_distribution<double>(1e-6, 1e-2)(gen);
  const double lr_min = lr * std::uniform_real_distribution<double>(0.0, 1.0)(gen);
  const int64_t steps = std::uniform_int_distribution<int64_t>(10, 100000)(gen);
  const std::string text = fmt::format(R"(# every key
[model]
path = "ckpt"
tokenizer = "tok"
[data]
files = ["a.jsonl", "b.jsonl"]
format = "text"
on_bad_line = "skip"
on_overlong = "drop"
max_length = 1000
pack_max_length = 2048
pack_lookahead = 7
shuffle = false
[train]
total_steps = {}
micro_packs = 4
seed = 77
device = "cuda:1"
recompute = 0.5
recompute_vision = true
fp8 = "tilewise"
frozen_weights = "fp8"
[optimizer]
lr = {:.17g}
lr_min = {:.17g}
warmup_steps = 3
betas = [0.8, 0.99]
eps = 1e-6
weight_decay = 0
clip_grad_norm = 0.5
[loss]
mtp_scale = 0.3
balancing_alpha = 0
router_bias_update_rate = 0.01
[output]
dir = "runs/x"
save_every = 0
keep_last = 0
log_every = 10
)",
                                       steps, lr, lr_min);
  const Recipe r = Recipe::parse(text, "r.toml");
  EXPECT_EQ(r.tokenizer_path, "tok");
  EXPECT_EQ(r.data_files, (std::vector<std::string>{"a.jsonl", "b.jsonl"}));
  EXPECT_EQ(r.data_format, data::SampleFormat::kText);
  EXPECT_EQ(r.on_bad_line, data::BadLinePolicy::kSkip);
  EXPECT_EQ(r.on_overlong, data::OverlongPolicy::kDrop);
  EXPECT_EQ(r.max_length, 1000);
  EXPECT_EQ(r.pack_max_length, 2048);
  EXPECT_EQ(r.pack_lookahead, 7);
  EXPECT_FALSE(r.shuffle);
  EXPECT_EQ(r.total_steps, steps);
  EXPECT_EQ(r.micro_packs, 4);
  EXPECT_EQ(r.seed, 77u);
  EXPECT_EQ(r.device, Device::cuda(1));
  EXPECT_EQ(r.recompute, 0.5);
  EXPECT_TRUE(r.recompute_vision);
  EXPECT_TRUE(r.fp8_tilewise);
  EXPECT_TRUE(r.frozen_fp8);
  EXPECT_EQ(r.lr, lr);
  EXPECT_EQ(r.lr_min, lr_min);
  EXPECT_EQ(r.warmup_steps, 3);
  EXPECT_EQ(r.beta1, 0.8);
  EXPECT_EQ(r.beta2, 0.99);
  EXPECT_EQ(r.eps, 1e-6);
  EXPECT_EQ(r.weight_decay, 0.0);
  EXPECT_EQ(r.clip_grad_norm, 0.5);
  EXPECT_EQ(r.mtp_scale, 0.3);
  EXPECT_EQ(r.balancing_alpha, 0.0);
  EXPECT_EQ(r.router_bias_update_rate, 0.01);
  EXPECT_EQ(r.output_dir, "runs/x");
  EXPECT_EQ(r.save_every, 0);
  EXPECT_EQ(r.keep_last, 0);
  EXPECT_EQ(r.log_every, 10);

  // The derived configs carry the values on.
  const AdamWConfig a = r.adamw_config();
  EXPECT_EQ(a.beta1, 0.8);
  EXPECT_EQ(a.beta2, 0.99);
  EXPECT_EQ(a.eps, 1e-6);
  EXPECT_EQ(a.weight_decay, 0.0);
  EXPECT_EQ(a.max_grad_norm, 0.5);
  const data::DatasetConfig d = r.dataset_config();
  EXPECT_EQ(d.files.size(), 2u);
  EXPECT_EQ(d.max_length, 1000);
  EXPECT_EQ(d.on_overlong, data::OverlongPolicy::kDrop);
  const data::PackingConfig p = r.packing_config(5);
  EXPECT_EQ(p.pack_max_length, 2048);
  EXPECT_EQ(p.lookahead, 7);
  EXPECT_FALSE(p.shuffle);
  EXPECT_EQ(p.seed, 77u);
  EXPECT_EQ(p.pad_id, 5);
  const Schedule s = r.schedule(steps);
  EXPECT_EQ(s.warmup_steps(), 3);
  EXPECT_EQ(s.lr(3), lr);

  // The effective recipe written back parses to the same values.
  const Recipe back = Recipe::parse(r.to_toml(), "effective.toml");
  EXPECT_EQ(back.fingerprint(), r.fingerprint());
  EXPECT_EQ(back.lr, r.lr);
  EXPECT_EQ(back.device, r.device);
  EXPECT_EQ(back.data_files, r.data_files);
  EXPECT_EQ(back.recompute, 0.5);
  EXPECT_TRUE(back.recompute_vision);
  EXPECT_TRUE(back.fp8_tilewise);
  EXPECT_TRUE(back.frozen_fp8);
  // The GEMMs' precision is part of what a resume must match.
  Recipe bf16 = r;
  bf16.set("train.fp8", "none");
  EXPECT_FALSE(bf16.fp8_tilewise);
  EXPECT_NE(bf16.fingerprint(), r.fingerprint());
}

TEST(Recipe, RunLengthFromEpochsAndWarmupFromRatio) {
  Recipe r = Recipe::parse(R"([model]
path = "m"
[data]
files = "one.jsonl"
[train]
epochs = 2
micro_packs = 3
[optimizer]
warmup_ratio = 0.1
[output]
dir = "o"
)",
                           "r.toml");
  EXPECT_EQ(r.data_files, std::vector<std::string>{"one.jsonl"});
  EXPECT_EQ(r.resolve_total_steps(10), 7);     // ceil(2 · 10 / 3)
  EXPECT_EQ(r.resolve_total_steps(10, 2), 4);  // two data-parallel ranks: ceil(20 / 6)
  EXPECT_EQ(r.resolve_total_steps(3), 2);      // exactly 6 packs: 2 steps, not 3
  EXPECT_EQ(r.resolve_warmup_steps(25), 2);    // floor(0.1 · 25)
  EXPECT_EQ(r.schedule(25).warmup_steps(), 2);
  r.set("train.epochs", "0.5");
  EXPECT_EQ(r.resolve_total_steps(1), 1);  // at least one step
}

// A run length that int64 cannot hold (found by fuzz_recipe) is an error naming train.epochs,
// not undefined behaviour (in practice a run of one step).
TEST(Recipe, RunLengthBeyondInt64IsRefused) {
  const auto with_epochs = [](const std::string& epochs) {
    return Recipe::parse("[model]\npath = \"m\"\n[data]\nfiles = \"a.jsonl\"\n[train]\nepochs = " +
                             epochs + "\n[output]\ndir = \"o\"\n",
                         "r.toml");
  };
  const Recipe r = with_epochs("1e300");
  try {
    r.resolve_total_steps(53);
    ADD_FAILURE() << "expected an error for epochs = 1e300";
  } catch (const Error& e) {
    EXPECT_RECIPE_ERROR(e, "optimizer steps", "r.toml: train.epochs", "lower train.epochs");
  }
  // Just below the limit the run length is still computed: 4e18 epochs of 2 packs.
  EXPECT_EQ(with_epochs("4e18").resolve_total_steps(2), int64_t{8'000'000'000'000'000'000});
}

// -0.0 passes a ">= 0" check; it must be the same setting as 0, or the effective recipe (which
// prints it as -0, read back as the integer 0) and the fingerprint would change between runs.
// Found by fuzz_recipe.
TEST(Recipe, NegativeZeroIsZero) {
  const Recipe neg = Recipe::parse(
      with({{"optimizer", "betas = [-0.0, 0.95]"}, {"loss", "balancing_alpha = -0.0"}}), "r.toml");
  const Recipe zero = Recipe::parse(
      with({{"optimizer", "betas = [0, 0.95]"}, {"loss", "balancing_alpha = 0"}}), "r.toml");
  EXPECT_EQ(neg.to_toml(), zero.to_toml());
  EXPECT_EQ(neg.fingerprint(), zero.fingerprint());
  EXPECT_EQ(Recipe::parse(neg.to_toml(), "effective.toml").to_toml(), neg.to_toml());
}

TEST(Recipe, SetOverridesAndRevalidates) {
  Recipe r = Recipe::parse(kMinimal, "r.toml");
  const std::string before = r.fingerprint();
  r.apply_sets({"optimizer.lr=1e-5", "data.files=[\"x.jsonl\", \"y.jsonl\"]",
                "model.path=runs/other", "train.device=cuda:0", "train.recompute=none",
                "optimizer.betas=[0.9, 0.999]"});
  EXPECT_EQ(r.lr, 1e-5);
  EXPECT_EQ(r.data_files, (std::vector<std::string>{"x.jsonl", "y.jsonl"}));
  EXPECT_EQ(r.model_path, "runs/other");
  EXPECT_EQ(r.tokenizer_path, "runs/other");
  EXPECT_EQ(r.device, Device::cuda(0));
  EXPECT_EQ(r.recompute, 0.0);
  EXPECT_EQ(r.beta2, 0.999);
  EXPECT_NE(r.fingerprint(), before);
  // Output and logging settings do not change the fingerprint.
  const std::string fp = r.fingerprint();
  r.set("output.log_every", "5");
  r.set("output.dir", "elsewhere");
  EXPECT_EQ(r.fingerprint(), fp);
  // A new section may be created by --set.
  r.set("loss.mtp_scale", "0.2");
  EXPECT_EQ(r.mtp_scale, 0.2);

  // Errors name the flag; a failed --set leaves the recipe as it was.
  EXPECT_RECIPE_ERROR(set_error(r, "optimizer.lr", "-1"), "must be a finite number > 0",
                      "--set optimizer.lr", "lr = 1e-5");
  EXPECT_EQ(r.lr, 1e-5);
  EXPECT_RECIPE_ERROR(set_error(r, "optimizer.learning_rate", "1e-5"), "unknown key",
                      "--set optimizer.learning_rate", "did you mean 'lr'");
  EXPECT_RECIPE_ERROR(set_error(r, "optimiser.lr", "1e-5"), "unknown section [optimiser]",
                      "--set optimiser.lr", "did you mean [optimizer]?");
  EXPECT_RECIPE_ERROR(set_error(r, "lr", "1e-5"), "not a section.key", "--set lr",
                      "--set optimizer.lr=1e-5");
  EXPECT_RECIPE_ERROR(set_error(r, "train.total_steps", "ten"), "expected an integer",
                      "--set train.total_steps", "total_steps = 1000");
  try {
    r.apply_sets({"optimizer.lr"});
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.problem(), "expected section.key=value")) << e.what();
    EXPECT_EQ(e.where(), "--set");
  }
}

// Keys checked against each other may come in any order on the command line: the recipe is
// validated once, after every --set; a refused combination leaves it as it was.
TEST(Recipe, SetsAreValidatedTogether) {
  const Recipe base = Recipe::parse(with({{"optimizer", "warmup_steps = 5"}}), "r.toml");
  Recipe r = base;
  // Alone, each of these is refused: a 32768-token sample in the default pack of 16384, or a
  // run shorter than the warmup.
  EXPECT_RECIPE_ERROR(set_error(r, "data.max_length", "32768"), "cannot fit a pack",
                      "--set data.max_length", "");
  EXPECT_RECIPE_ERROR(set_error(r, "train.total_steps", "3"), "does not fit a run of 3 steps",
                      "optimizer.warmup_steps", "");
  r.apply_sets({"data.max_length=32768", "data.pack_max_length=32768", "train.total_steps=3",
                "optimizer.warmup_steps=1"});
  EXPECT_EQ(r.max_length, 32768);
  EXPECT_EQ(r.pack_max_length, 32768);
  EXPECT_EQ(r.total_steps, std::optional<int64_t>(3));
  EXPECT_EQ(r.warmup_steps, std::optional<int64_t>(1));
  // The last of a key given twice wins.
  r.apply_sets({"optimizer.lr=1e-4", "optimizer.lr=2e-4"});
  EXPECT_EQ(r.lr, 2e-4);
  // A set of overrides that does not fit together changes nothing.
  Recipe unchanged = base;
  try {
    unchanged.apply_sets({"data.pack_max_length=4096", "data.max_length=8192"});
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.problem(), "cannot fit a pack")) << e.what();
  }
  EXPECT_EQ(unchanged.fingerprint(), base.fingerprint());
  EXPECT_EQ(unchanged.pack_max_length, base.pack_max_length);
}

TEST(Recipe, ErrorsNameFileLineKeyAndFix) {
  // Unknown key, with a suggestion; the line is the key's.
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "learning_rate = 1e-5"}})),
                      "unknown key 'learning_rate' in [optimizer]", "r.toml:8: optimizer",
                      "did you mean 'lr'?");
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "lrr = 1e-5"}})), "unknown key 'lrr'",
                      "r.toml:8", "did you mean 'lr'?");
  EXPECT_RECIPE_ERROR(error_of(with({{"train", "output_dir = \"x\""}})),
                      "unknown key 'output_dir' in [train]", "r.toml:7: train.output_dir",
                      "did you mean 'dir' in [output]?");
  // A key in the wrong section.
  EXPECT_RECIPE_ERROR(error_of(with({{"loss", "lr = 1e-5"}})), "unknown key 'lr' in [loss]",
                      "r.toml:8", "'lr' belongs in [optimizer]");
  // Unknown section.
  EXPECT_RECIPE_ERROR(error_of(kMinimal + "[optimiser]\nlr = 1e-5\n"), "unknown section",
                      "r.toml:9", "did you mean [optimizer]?");
  // A key outside any section.
  EXPECT_RECIPE_ERROR(error_of("lr = 1e-5\n" + kMinimal), "must be inside a section", "r.toml:1",
                      "move it under [optimizer]");
  // A section that is a value.
  EXPECT_RECIPE_ERROR(error_of("loss = 1\n" + kMinimal), "must be a section", "r.toml:1", "[loss]");
  // Wrong types.
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "lr = \"1e-5\""}})),
                      "expected a number, got a string", "r.toml:8: optimizer.lr", "lr = 1e-5");
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "warmup_steps = 2.5"}})),
                      "expected an integer, got a float", "optimizer.warmup_steps",
                      "warmup_steps = 100");
  EXPECT_RECIPE_ERROR(error_of(with({{"data", "shuffle = \"yes\""}})), "expected true or false",
                      "r.toml:5: data.shuffle", "shuffle = true");
  EXPECT_RECIPE_ERROR(
      error_of("[model]\npath = 3\n[data]\nfiles = [\"a\"]\n[train]\ntotal_steps = 1\n"
               "[output]\ndir = \"o\"\n"),
      "expected a string, got an integer", "r.toml:2: model.path", "path = ");
  EXPECT_RECIPE_ERROR(error_of("[model]\npath = \"m\"\n[data]\nfiles = [\"a\", 2]\n[train]\n"
                               "total_steps = 1\n[output]\ndir = \"o\"\n"),
                      "every entry must be a non-empty string", "r.toml:4: data.files", "files = ");
  EXPECT_RECIPE_ERROR(error_of("[model]\npath = \"m\"\n[data]\nfiles = []\n[train]\n"
                               "total_steps = 1\n[output]\ndir = \"o\"\n"),
                      "lists no file", "data.files", "files = ");
  EXPECT_RECIPE_ERROR(error_of(with({{"train", "fp8 = \"e4m3\""}})), "\"e4m3\"", "train.fp8",
                      "tilewise");
  EXPECT_RECIPE_ERROR(error_of(with({{"train", "frozen_weights = \"fp8\""}}) +
                               "[lora]\nrank = 4\nalpha = 8\ntarget_modules = [\"q_proj\"]\n"),
                      "with [lora]", "train.frozen_weights", "base = \"fp8\"");
  // Out of range.
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "eps = 0"}})), "> 0, got 0", "optimizer.eps",
                      "eps = 1e-8");
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "betas = [0.9, 1.0]"}})),
                      "beta2 must be a finite number in [0, 1)", "optimizer.betas",
                      "betas = [0.9, 0.95]");
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "betas = [0.9]"}})),
                      "expected an array of two numbers", "optimizer.betas", "betas = ");
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "warmup_ratio = 1.0"}})), "in [0, 1)",
                      "optimizer.warmup_ratio", "warmup_ratio = 0.03");
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "weight_decay = -0.1"}})), ">= 0",
                      "optimizer.weight_decay", "weight_decay = 0.01");
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "lr = inf"}})), "finite", "optimizer.lr",
                      "lr = 1e-5");
  EXPECT_RECIPE_ERROR(error_of(with({{"loss", "mtp_scale = nan"}})), "finite", "loss.mtp_scale",
                      "mtp_scale = 0.1");
  EXPECT_RECIPE_ERROR(error_of(with({{"train", "micro_packs = 0"}})), "must be in [1,",
                      "train.micro_packs", "micro_packs = 1");
  EXPECT_RECIPE_ERROR(error_of(with({{"train", "seed = -1"}})), ">= 0, got -1", "train.seed",
                      "seed = 0");
  EXPECT_RECIPE_ERROR(error_of(with({{"train", "recompute = 1.5"}})), "in [0, 1]",
                      "train.recompute", "\"all\"");
  EXPECT_RECIPE_ERROR(error_of(with({{"train", "recompute = \"some\""}})),
                      "unknown value \"some\" (accepted: all, none)", "train.recompute",
                      "recompute = ");
  EXPECT_RECIPE_ERROR(error_of(with({{"output", "log_every = 0"}})), ">= 1", "output.log_every",
                      "log_every = 1");
  EXPECT_RECIPE_ERROR(error_of(with({{"data", "pack_max_length = 1"}})), "must be in [2,",
                      "data.pack_max_length", "pack_max_length = 16384");
  // Unknown choices.
  EXPECT_RECIPE_ERROR(error_of(with({{"data", "format = \"json\""}})),
                      "unknown value \"json\" (accepted: auto, chat, text)",
                      "r.toml:5: data.format", "format = ");
  EXPECT_RECIPE_ERROR(error_of(with({{"data", "on_bad_line = \"ignore\""}})),
                      "accepted: fail, skip", "data.on_bad_line", "on_bad_line = ");
  EXPECT_RECIPE_ERROR(error_of(with({{"train", "device = \"tpu\""}})), "tpu", "train.device",
                      "cuda:0");
  // Missing and contradictory keys.
  EXPECT_RECIPE_ERROR(error_of("[data]\nfiles = [\"a\"]\n[train]\ntotal_steps = 1\n[output]\n"
                               "dir = \"o\"\n"),
                      "missing required key model.path", "r.toml", "path = ");
  EXPECT_RECIPE_ERROR(error_of("[model]\npath = \"m\"\n[train]\ntotal_steps = 1\n[output]\n"
                               "dir = \"o\"\n"),
                      "missing required key data.files", "r.toml", "under [data]");
  EXPECT_RECIPE_ERROR(error_of("[model]\npath = \"m\"\n[data]\nfiles = [\"a\"]\n[train]\n"
                               "total_steps = 1\n"),
                      "missing required key output.dir", "r.toml", "under [output]");
  EXPECT_RECIPE_ERROR(error_of("[model]\npath = \"m\"\n[data]\nfiles = [\"a\"]\n[output]\n"
                               "dir = \"o\"\n"),
                      "run length is not set", "r.toml", "total_steps = 1000");
  EXPECT_RECIPE_ERROR(error_of(with({{"train", "epochs = 1"}})),
                      "total_steps and epochs are both set", "train.epochs", "keep one");
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "warmup_steps = 5\nwarmup_ratio = 0.1"}})),
                      "both set", "optimizer.warmup_ratio", "keep one");
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "warmup_steps = 100"}})),
                      "does not fit a run of 100 steps", "optimizer.warmup_steps",
                      "smaller than train.total_steps");
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "lr = 1e-5\nlr_min = 1e-4"}})), "above lr",
                      "r.toml:9: optimizer.lr_min", "at most optimizer.lr");
  EXPECT_RECIPE_ERROR(error_of(with({{"data", "max_length = 9000\npack_max_length = 8192"}})),
                      "cannot fit a pack of 8192", "data.max_length", "data.pack_max_length");
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "lr = 10\nweight_decay = 0.5"}})),
                      "flip the sign", "optimizer.weight_decay", "weight_decay");
  // TOML syntax, with line and column; a section written twice is a TOML error too.
  EXPECT_RECIPE_ERROR(error_of(with({{"optimizer", "lr = 1e-5 oops"}})), "",
                      "r.toml:8:", "TOML syntax");
  EXPECT_RECIPE_ERROR(error_of(kMinimal + "[data]\nshuffle = true\n"), "data",
                      "r.toml:9:", "TOML syntax");
}

TEST(Recipe, MissingFileIsReported) {
  try {
    Recipe::load("does/not/exist.toml");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "does/not/exist.toml")) << e.what();
  }
}

TEST(Recipe, TheBundledTinyRecipeIsValid) {
  const std::string dir = std::string(GLMTUNE_SOURCE_DIR);
  const Recipe r = Recipe::load(dir + "/examples/tiny/recipe.toml");
  ASSERT_EQ(r.data_files.size(), 1u);
  // Its paths are relative to the repository root, where the demo runs.
  EXPECT_TRUE(std::filesystem::exists(dir + "/" + r.data_files[0])) << r.data_files[0];
  EXPECT_EQ(r.data_format, data::SampleFormat::kChat);
  EXPECT_LE(r.max_length, r.pack_max_length);
  ASSERT_TRUE(r.total_steps.has_value());
  EXPECT_NO_THROW(r.schedule(*r.total_steps));
}

TEST(Recipe, LoraSection) {
  EXPECT_FALSE(Recipe::parse(kMinimal, "r.toml").lora.has_value());
  const Recipe r = Recipe::parse(kMinimal +
                                     "[lora]\nrank = 16\nalpha = 32\nuse_rslora = true\n"
                                     "target_modules = [\"q_proj\", \"o_proj\"]\n",
                                 "r.toml");
  ASSERT_TRUE(r.lora.has_value());
  EXPECT_EQ(r.lora->rank, 16);
  EXPECT_EQ(r.lora->alpha, 32);
  EXPECT_TRUE(r.lora->use_rslora);
  EXPECT_DOUBLE_EQ(r.lora->scale(), 32 / 4.0);
  EXPECT_EQ(r.lora->target_modules, (std::vector<std::string>{"q_proj", "o_proj"}));
  // alpha defaults to the rank (scale 1); a string is one regular expression.
  const Recipe d =
      Recipe::parse(kMinimal + "[lora]\nrank = 4\ntarget_modules = 'layers\\.0\\.'\n", "r.toml");
  EXPECT_DOUBLE_EQ(d.lora->scale(), 1.0);
  EXPECT_EQ(d.lora->target_regex, "layers\\.0\\.");
  // The effective recipe reads back to the same adapter settings, and they shape the fingerprint.
  const Recipe back = Recipe::parse(r.to_toml(), "back.toml");
  ASSERT_TRUE(back.lora.has_value());
  EXPECT_EQ(back.lora->target_modules, r.lora->target_modules);
  EXPECT_EQ(back.lora->use_rslora, true);
  EXPECT_EQ(back.fingerprint(1), r.fingerprint(1));
  EXPECT_NE(Recipe::parse(kMinimal, "r.toml").fingerprint(1), r.fingerprint(1));

  EXPECT_RECIPE_ERROR(error_of(kMinimal + "[lora]\nrank = 8\n"), "missing", "r.toml",
                      "target_modules");
  EXPECT_RECIPE_ERROR(error_of(kMinimal + "[lora]\nrank = 0\ntarget_modules = [\"q_proj\"]\n"),
                      "must be in [1, 65536]", "lora.rank", "rank = 16");
  EXPECT_RECIPE_ERROR(error_of(kMinimal + "[lora]\ntarget_modules = []\n"), "non-empty array",
                      "lora.target_modules", "target_modules");
  EXPECT_RECIPE_ERROR(error_of(kMinimal + "[lora]\ntarget_modules = [1]\n"), "non-empty string",
                      "lora.target_modules", "target_modules");
  EXPECT_RECIPE_ERROR(error_of(kMinimal + "[lora]\ntarget_modules = '(q'\n"),
                      "not a regular expression", "lora.target_modules", "regular expression");
  EXPECT_RECIPE_ERROR(error_of(kMinimal + "[lora]\ndropout = 1.0\ntarget_modules = [\"q_proj\"]\n"),
                      "", "lora.dropout", "");
  EXPECT_RECIPE_ERROR(
      error_of(kMinimal +
               "[lora]\ndropout = 0.1\ntarget_parameters = [\"mlp.experts.down_proj\"]\n"),
      "take no dropout", "lora.dropout", "dropout = 0");
  // Dropout parses, round-trips and changes the fingerprint.
  const Recipe dropped =
      Recipe::parse(kMinimal + "[lora]\ndropout = 0.05\ntarget_modules = [\"q_proj\"]\n", "r.toml");
  EXPECT_EQ(dropped.lora->dropout, 0.05);
  EXPECT_EQ(Recipe::parse(dropped.to_toml(), "again.toml").lora->dropout, 0.05);
  EXPECT_NE(
      dropped.fingerprint(1),
      Recipe::parse(kMinimal + "[lora]\ntarget_modules = [\"q_proj\"]\n", "r.toml").fingerprint(1));
  EXPECT_RECIPE_ERROR(
      error_of(kMinimal + "[lora]\nbase = \"fp16\"\ntarget_modules = [\"q_proj\"]\n"), "fp16",
      "lora.base", "fp8");
  // An FP8 base: parsed, and written back by to_toml.
  const Recipe fp8 =
      Recipe::parse(kMinimal + "[lora]\nbase = \"fp8\"\ntarget_modules = [\"q_proj\"]\n", "r.toml");
  ASSERT_TRUE(fp8.lora.has_value());
  EXPECT_TRUE(fp8.lora->fp8_base);
  EXPECT_TRUE(Recipe::parse(fp8.to_toml(), "again.toml").lora->fp8_base);
  EXPECT_FALSE(
      Recipe::parse(kMinimal + "[lora]\ntarget_modules = [\"q_proj\"]\n", "r.toml").lora->fp8_base);
  EXPECT_RECIPE_ERROR(error_of(kMinimal + "[lora]\nr = 8\ntarget_modules = [\"q_proj\"]\n"),
                      "unknown key", "lora.r", "rank");

  // The routed experts' fused parameters, as PEFT's target_parameters: alone (target_modules
  // absent or empty) or beside target_modules; they round-trip and change the fingerprint.
  const Recipe p = Recipe::parse(kMinimal +
                                     "[lora]\ntarget_parameters = [\"mlp.experts.gate_up_proj\", "
                                     "\"mlp.experts.down_proj\"]\n",
                                 "r.toml");
  ASSERT_TRUE(p.lora.has_value());
  EXPECT_TRUE(p.lora->target_modules.empty());
  EXPECT_EQ(p.lora->target_parameters,
            (std::vector<std::string>{"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}));
  const Recipe pb = Recipe::parse(p.to_toml(), "back.toml");
  EXPECT_EQ(pb.lora->target_parameters, p.lora->target_parameters);
  EXPECT_EQ(pb.fingerprint(1), p.fingerprint(1));
  const Recipe both = Recipe::parse(kMinimal +
                                        "[lora]\ntarget_modules = [\"q_proj\", \"o_proj\"]\n"
                                        "target_parameters = [\"mlp.experts.down_proj\"]\n",
                                    "r.toml");
  EXPECT_EQ(both.lora->target_modules, r.lora->target_modules);
  EXPECT_NE(both.fingerprint(1), Recipe::parse(kMinimal + "[lora]\ntarget_modules = [\"q_proj\", "
                                                          "\"o_proj\"]\n",
                                               "r.toml")
                                     .fingerprint(1));
  EXPECT_RECIPE_ERROR(error_of(kMinimal + "[lora]\ntarget_parameters = \"mlp.experts\"\n"),
                      "expected an array", "lora.target_parameters", "mlp.experts.gate_up_proj");
  EXPECT_RECIPE_ERROR(error_of(kMinimal + "[lora]\ntarget_parameters = [\"\"]\n"),
                      "non-empty string", "lora.target_parameters", "mlp.experts.down_proj");
  EXPECT_RECIPE_ERROR(error_of(kMinimal + "[lora]\ntarget_parameters = []\n"), "missing",
                      "lora.target_modules", "target_modules");
}
