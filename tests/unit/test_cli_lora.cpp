// LoRA end to end through the CLI: `glmtune train` with [lora] writes an adapter with every
// checkpoint and names it; `glmtune eval --adapter` applies it; `glmtune merge` folds it into a
// model that evaluates alike; bad inputs are errors that name what to fix and write nothing.

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/cli.h"
#include "support/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using Result = glmtune::test::CliResult;
const fs::path kSource = GLMTUNE_SOURCE_DIR;

class CliLora : public ::testing::Test {
 protected:
  glmtune::test::TempDir dir_{"cli-lora"};

  fs::path path(const std::string& name) const { return dir_.path() / name; }

  Result run(const std::string& args) const {
    return glmtune::test::run_glmtune(args, path("stderr.txt"));
  }

  // The fixture's recipe with its target_modules line replaced by `targets`, written as `name`.
  fs::path recipe_with(const std::string& targets, const std::string& name) const {
    const std::string line = "target_modules = [\"q_proj\", \"o_proj\", \"down_proj\"]";
    std::string text = glmtune::test::read_text(path("recipe.toml"));
    text.replace(text.find(line), line.size(), targets);
    std::ofstream(path(name)) << text;
    return path(name);
  }

  // glmtune merge folds `adapter` into the model, whose loss is then the adapted one up to bf16
  // rounding: closer to it than the adapter moved the base's.
  void expect_merged_like_adapted(const fs::path& adapter, double base, double adapted) const {
    const Result m = run("merge --model " + path("model").string() + " --adapter " +
                         adapter.string() + " --out " + path("merged").string());
    ASSERT_EQ(m.code, 0) << m.err;
    const Result e =
        run("eval --model " + path("merged").string() + " --data " +
            (kSource / "examples/tiny/data/chat.jsonl").string() + " --max-packs 2 --json");
    ASSERT_EQ(e.code, 0) << e.err;
    const double merged = nlohmann::json::parse(e.out)["loss"].get<double>();
    EXPECT_NEAR(merged, adapted, 1e-3 * adapted);
    EXPECT_LT(std::abs(merged - adapted), std::abs(base - adapted));
  }

  double eval_loss(const std::string& extra) const {
    const Result r =
        run("eval --model " + path("model").string() + " --tokenizer " + path("model").string() +
            " --data " + (kSource / "examples/tiny/data/chat.jsonl").string() +
            " --max-packs 2 --json " + extra);
    EXPECT_EQ(r.code, 0) << r.err;
    return r.code == 0 ? nlohmann::json::parse(r.out)["loss"].get<double>() : 0.0;
  }

  void SetUp() override {
    ASSERT_EQ(run("init --preset tiny --seed 4 --out " + path("model").string() + " --tokenizer " +
                  (kSource / "examples/tiny/tokenizer").string())
                  .code,
              0);
    std::ofstream(path("recipe.toml"))
        << "[model]\npath = \"" << path("model").string() << "\"\n"
        << "[data]\nfiles = [\"" << (kSource / "examples/tiny/data/chat.jsonl").string()
        << "\"]\nformat = \"chat\"\nmax_length = 256\npack_max_length = 256\n"
        << "[train]\ntotal_steps = 4\nseed = 1\nrecompute = \"none\"\n"
        << "[optimizer]\nlr = 1e-2\nwarmup_steps = 0\n"
        << "[output]\ndir = \"" << path("run").string() << "\"\nsave_every = 2\n"
        << "[lora]\nrank = 4\nalpha = 8\ntarget_modules = [\"q_proj\", \"o_proj\", "
           "\"down_proj\"]\n";
  }
};

TEST_F(CliLora, TrainEvalAndMerge) {
  const Result train = run("train --config " + path("recipe.toml").string());
  ASSERT_EQ(train.code, 0) << train.err;
  const fs::path adapter = path("run") / "checkpoints/step-4/adapter";
  EXPECT_NE(train.out.find("adapter      " + adapter.string()), std::string::npos) << train.out;
  EXPECT_TRUE(fs::exists(path("run") / "checkpoints/step-2/adapter/adapter_config.json"));
  EXPECT_TRUE(fs::exists(adapter / "adapter_model.safetensors"));
  // The base is not copied into a LoRA checkpoint (it stays as loaded); the adapter is checksummed
  // with the rest, so a changed byte is found.
  EXPECT_FALSE(fs::exists(path("run") / "checkpoints/step-4/model"));
  EXPECT_EQ(run("inspect --verify " + path("run").string()).code, 0);
  {
    const fs::path file = path("run") / "checkpoints/step-2/adapter/adapter_model.safetensors";
    std::string bytes = glmtune::test::read_text(file);
    bytes[bytes.size() - 3] ^= 1;
    std::ofstream(file, std::ios::binary) << bytes;
    const Result v = run("inspect --verify " + path("run").string());
    EXPECT_NE(v.code, 0);
    EXPECT_NE((v.out + v.err).find("adapter/adapter_model.safetensors"), std::string::npos)
        << v.out << v.err;
  }

  // Resuming a LoRA run without its [lora] section would silently train the base instead.
  {
    std::string text = glmtune::test::read_text(path("recipe.toml"));
    text.erase(text.find("[lora]"));
    std::ofstream(path("full.toml")) << text;
    const Result r =
        run("train --config " + path("full.toml").string() + " --set train.total_steps=6 --resume");
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.err.find("holds a LoRA adapter, and the recipe has no [lora]"), std::string::npos)
        << r.err;
  }

  const double base = eval_loss(""), adapted = eval_loss("--adapter " + adapter.string());
  EXPECT_NE(base, adapted);

  const std::string merge = "merge --model " + path("model").string() + " --adapter " +
                            adapter.string() + " --out " + path("merged").string();
  const Result m = run(merge);
  ASSERT_EQ(m.code, 0) << m.err;
  EXPECT_NE(m.out.find("merged"), std::string::npos) << m.out;
  EXPECT_TRUE(fs::exists(path("merged") / "tokenizer.json"));
  const Result e =
      run("eval --model " + path("merged").string() + " --data " +
          (kSource / "examples/tiny/data/chat.jsonl").string() + " --max-packs 2 --json");
  ASSERT_EQ(e.code, 0) << e.err;
  // The merged weights are the adapted ones rounded to bf16.
  EXPECT_NEAR(nlohmann::json::parse(e.out)["loss"].get<double>(), adapted, 1e-3 * adapted);

  // A non-empty --out needs --overwrite; nothing is written without it.
  const Result again = run(merge);
  EXPECT_NE(again.code, 0);
  EXPECT_NE(again.err.find("--overwrite"), std::string::npos) << again.err;
  EXPECT_EQ(run(merge + " --overwrite").code, 0);
}

TEST_F(CliLora, BadAdaptersAreErrorsNamingTheDirectory) {
  fs::create_directories(path("empty"));
  const Result e = run("eval --model " + path("model").string() + " --data " +
                       (kSource / "examples/tiny/data/chat.jsonl").string() + " --adapter " +
                       path("empty").string());
  EXPECT_NE(e.code, 0);
  EXPECT_NE(e.err.find("no adapter_config.json"), std::string::npos) << e.err;
  EXPECT_NE(e.err.find(path("empty").string()), std::string::npos) << e.err;
  const Result m = run("merge --model " + path("model").string() + " --adapter " +
                       path("empty").string() + " --out " + path("merged").string());
  EXPECT_NE(m.code, 0);
  EXPECT_NE(m.err.find("no adapter_config.json"), std::string::npos) << m.err;
  EXPECT_FALSE(fs::exists(path("merged")));
  // A target the model cannot adapt stops the run before any step, naming the recipe key.
  const Result t =
      run("train --config " + recipe_with("target_modules = [\"wk\"]", "bad.toml").string());
  EXPECT_NE(t.code, 0);
  EXPECT_NE(t.err.find("lora.target_modules"), std::string::npos) << t.err;
  EXPECT_NE(t.err.find("never train"), std::string::npos) << t.err;
  EXPECT_FALSE(fs::exists(path("run") / "checkpoints"));
}

// Adapters on the routed experts alone (target_parameters): trained on the CPU, written in PEFT's
// fused-parameter keys, applied by eval --adapter and folded in by merge.
TEST_F(CliLora, ExpertAdaptersTrainEvalAndMerge) {
  const fs::path recipe =
      recipe_with("target_parameters = [\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]",
                  "experts.toml");
  const Result train = run("train --config " + recipe.string());
  ASSERT_EQ(train.code, 0) << train.err;
  const fs::path adapter = path("run") / "checkpoints/step-4/adapter";
  const nlohmann::json config =
      nlohmann::json::parse(glmtune::test::read_text(adapter / "adapter_config.json"));
  ASSERT_TRUE(config.contains("target_parameters")) << config.dump();
  EXPECT_FALSE(config["target_parameters"].empty());
  EXPECT_TRUE(config["target_modules"].empty()) << config.dump();
  const std::string weights = glmtune::test::read_text(adapter / "adapter_model.safetensors");
  EXPECT_NE(weights.find(".mlp.experts.base_layer.lora_A.weight"), std::string::npos);
  EXPECT_NE(weights.find(".mlp.experts.lora_B.weight"), std::string::npos);
  EXPECT_EQ(weights.find("self_attn"), std::string::npos);

  const double base = eval_loss(""), adapted = eval_loss("--adapter " + adapter.string());
  EXPECT_NE(base, adapted);
  expect_merged_like_adapted(adapter, base, adapted);
}

// An adapter on the LM head (named: all-linear leaves it out, as in PEFT), with dropout: trained,
// written under PEFT's lm_head keys and named in target_modules, applied by eval (logits dump and
// chunked loss alike), and merged into lm_head.weight.
TEST_F(CliLora, HeadAdapterTrainsEvalsAndMerges) {
  const fs::path recipe =
      recipe_with("target_modules = [\"q_proj\", \"lm_head\"]\ndropout = 0.1", "head.toml");
  const Result train = run("train --config " + recipe.string());
  ASSERT_EQ(train.code, 0) << train.err;
  const fs::path adapter = path("run") / "checkpoints/step-4/adapter";
  const nlohmann::json config =
      nlohmann::json::parse(glmtune::test::read_text(adapter / "adapter_config.json"));
  EXPECT_NE(config["target_modules"].get<std::string>().find("lm_head"), std::string::npos)
      << config.dump();
  const std::string weights = glmtune::test::read_text(adapter / "adapter_model.safetensors");
  EXPECT_NE(weights.find("\"base_model.model.lm_head.lora_A.weight\""), std::string::npos);
  EXPECT_NE(weights.find("\"base_model.model.lm_head.lora_B.weight\""), std::string::npos);

  const double base = eval_loss(""), adapted = eval_loss("--adapter " + adapter.string());
  EXPECT_NE(base, adapted);
  // With a logits dump the head's product is formed apart (in f32, the adapter added into it):
  // the same loss as the chunked one.
  {
    const Result dump = run("eval --model " + path("model").string() + " --data " +
                            (kSource / "examples/tiny/data/chat.jsonl").string() +
                            " --max-packs 2 --json --adapter " + adapter.string() +
                            " --dump-logits " + path("logits.safetensors").string());
    ASSERT_EQ(dump.code, 0) << dump.err;
    EXPECT_NEAR(nlohmann::json::parse(dump.out)["loss"].get<double>(), adapted, 1e-5 * adapted);
  }
  expect_merged_like_adapted(adapter, base, adapted);
}

// An FP8 checkpoint (init --fp8: the release's FP8 weights in e4m3 with 128 × 128 block scales)
// trained with lora.base = "fp8" keeps those weights in FP8 and dequantises them per layer around
// each use: every step's loss and the adapters it writes equal, bit for bit, the run with the
// base dequantised at load (lora.base = "bf16"), since both compute with the same bf16 values.
// Layouts that hold layers in slices refuse it, naming the key.
TEST_F(CliLora, Fp8BaseTrainsExactlyAsTheDequantisedBase) {
  ASSERT_EQ(run("init --preset tiny --seed 4 --fp8 --out " + path("fp8").string() +
                " --tokenizer " + (kSource / "examples/tiny/tokenizer").string())
                .code,
            0);
  std::string text = glmtune::test::read_text(path("recipe.toml"));
  const auto replace = [&](const std::string& from, const std::string& to) {
    ASSERT_NE(text.find(from), std::string::npos) << from;
    text.replace(text.find(from), from.size(), to);
  };
  replace("path = \"" + path("model").string() + "\"", "path = \"" + path("fp8").string() + "\"");
  replace("target_modules = [\"q_proj\", \"o_proj\", \"down_proj\"]",
          "target_modules = [\"all-linear\"]\ntarget_parameters = [\"mlp.experts.gate_up_proj\", "
          "\"mlp.experts.down_proj\"]");
  std::ofstream(path("bf16.toml")) << text << "base = \"bf16\"\n";
  replace("dir = \"" + path("run").string() + "\"", "dir = \"" + path("run-fp8").string() + "\"");
  std::ofstream(path("fp8.toml")) << text << "base = \"fp8\"\n";

  const Result bf16 = run("train --config " + path("bf16.toml").string());
  ASSERT_EQ(bf16.code, 0) << bf16.err;
  const Result fp8 = run("train --config " + path("fp8.toml").string());
  ASSERT_EQ(fp8.code, 0) << fp8.err;
  // The tiny model's FP8 weights: the dense MLP, every expert and shared expert, and the MLA
  // projections, of the decoder layers and the MTP layer.
  EXPECT_NE(fp8.out.find("36 frozen layer tensors held in FP8"), std::string::npos) << fp8.out;
  const auto losses = [](const std::string& log) {
    std::vector<std::string> out;
    // Each step's line: "step k/n loss … grad_norm … lr …".
    for (size_t at = log.find(" loss "); at != std::string::npos; at = log.find(" loss ", at + 1))
      if (const size_t end = log.find(" lr ", at); end != std::string::npos)
        out.push_back(log.substr(at, end - at));
    return out;
  };
  ASSERT_EQ(losses(bf16.out).size(), 4u) << bf16.out;
  EXPECT_EQ(losses(fp8.out), losses(bf16.out));
  EXPECT_EQ(glmtune::test::read_text(path("run-fp8") / "checkpoints/step-4/adapter/"
                                                       "adapter_model.safetensors"),
            glmtune::test::read_text(path("run") / "checkpoints/step-4/adapter/"
                                                   "adapter_model.safetensors"));

  std::string fsdp = glmtune::test::read_text(path("fp8.toml"));
  fsdp.replace(fsdp.find("[train]\n"), 8, "[train]\nfsdp = true\n");
  fsdp.replace(fsdp.find("run-fp8"), 7, "run-fsdp");
  std::ofstream(path("fsdp.toml")) << fsdp;
  const Result refused = run("train --config " + path("fsdp.toml").string());
  EXPECT_NE(refused.code, 0);
  EXPECT_NE(refused.err.find("lora.base"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("train.fsdp"), std::string::npos) << refused.err;
}

}  // namespace

namespace {

// Vision-language data: the adapters train on the text model with the tower and projector frozen
// (they are part of the base), and eval --adapter applies them to conversations with media.
TEST_F(CliLora, VisionLanguageDataTrainsTheTextAdapters) {
  const std::string vl = (kSource / "examples/tiny-vl").string();
  std::string text = glmtune::test::read_text(path("recipe.toml"));
  text.replace(text.find("[data]\n"), 7, "[data]\nmedia_root = \"" + vl + "\"\n");
  text.replace(text.find((kSource / "examples/tiny/data/chat.jsonl").string()),
               (kSource / "examples/tiny/data/chat.jsonl").string().size(), vl + "/chat.jsonl");
  text.replace(text.find("max_length = 256\npack_max_length = 256"),
               std::string("max_length = 256\npack_max_length = 256").size(),
               "max_length = 4096\npack_max_length = 4096");
  std::ofstream(path("vl.toml")) << text;
  const Result train = run("train --config " + path("vl.toml").string() +
                           " --set train.total_steps=2 --set output.save_every=0");
  ASSERT_EQ(train.code, 0) << train.err;
  const fs::path adapter = path("run") / "checkpoints/step-2/adapter";
  const std::string eval = "eval --model " + path("model").string() + " --data " + vl +
                           "/chat.jsonl --media-root " + vl + " --json";
  const Result base = run(eval), adapted = run(eval + " --adapter " + adapter.string());
  ASSERT_EQ(base.code, 0) << base.err;
  ASSERT_EQ(adapted.code, 0) << adapted.err;
  EXPECT_LT(nlohmann::json::parse(adapted.out)["loss"].get<double>(),
            nlohmann::json::parse(base.out)["loss"].get<double>());
}

}  // namespace
