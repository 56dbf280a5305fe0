// The glmtune binary's init / inspect commands end to end, including their error messages.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "glmtune/io/checkpoint.h"

namespace fs = std::filesystem;

namespace {

struct Result {
  int code;
  std::string output;  // stdout and stderr
};

Result run(const std::string& args) {
  std::string cmd = std::string(GLMTUNE_BINARY) + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
  int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("glmtune_cli_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

#define EXPECT_CONTAINS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

}  // namespace

TEST_F(CliTest, InspectPresetJsonCountsWithoutWeights) {
  Result r = run("inspect --preset crop25b --json");
  ASSERT_EQ(r.code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  const auto& p = j["params"];
  EXPECT_NEAR(p["total"].get<double>() / 24.95e9, 1.0, 0.005);
  EXPECT_NEAR(p["vision"].get<double>() / 0.5636e9, 1.0, 0.005);
  EXPECT_NEAR(p["embeddings_and_head"].get<double>() / 1.27e9, 1.0, 0.005);
  EXPECT_NEAR(p["mtp"].get<double>() / 7.43e9, 1.0, 0.005);
  EXPECT_TRUE(p["per_layer_kind"].contains("kda+dense"));
  Result full = run("inspect --preset full --json");
  ASSERT_EQ(full.code, 0) << full.output;
  auto f = nlohmann::json::parse(full.output)["params"];
  EXPECT_NEAR(f["total"].get<double>() / 321.02e9, 1.0, 0.005);
  EXPECT_NEAR(f["text"].get<double>() / 313.03e9, 1.0, 0.005);
  Result set = run("inspect --preset crop25b --set text_config.n_routed_experts=36 --json");
  ASSERT_EQ(set.code, 0) << set.output;
  // 252 fewer experts (and router rows / bias entries) in each of the 3 MoE layers (2 + MTP).
  const double removed = 3.0 * 252 * (3.0 * 2048 * 4096 + 4096 + 1);
  EXPECT_EQ(nlohmann::json::parse(set.output)["params"]["total"].get<double>(),
            p["total"].get<double>() - removed);
}

TEST_F(CliTest, InitThenInspectFindsACompleteLayout) {
  Result init = run("init --preset tiny --seed 3 --out " + path("m"));
  ASSERT_EQ(init.code, 0) << init.output;
  EXPECT_TRUE(fs::exists(path("m/model.safetensors.index.json")));
  EXPECT_TRUE(fs::exists(path("m/config.json")));
  Result r = run("inspect " + path("m") + " --json");
  ASSERT_EQ(r.code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_TRUE(j["checkpoint"]["missing"].empty());
  EXPECT_TRUE(j["checkpoint"]["unexpected"].empty());
  EXPECT_EQ(j["checkpoint"]["tensors"], j["params"]["tensors"]);
  EXPECT_GT(j["checkpoint"]["dtype_tensors"]["f32"].get<int>(), 0);
  Result text = run("inspect " + path("m"));
  EXPECT_CONTAINS(text.output, "layout: complete");
  EXPECT_CONTAINS(text.output, "Kd Km Km Dm Km");
  // A directory holding only config.json is counted from the config.
  fs::create_directories(path("cfg"));
  fs::copy_file(path("m/config.json"), path("cfg/config.json"));
  Result cfg = run("inspect " + path("cfg") + " --json");
  ASSERT_EQ(cfg.code, 0) << cfg.output;
  EXPECT_FALSE(nlohmann::json::parse(cfg.output).contains("checkpoint"));
}

TEST_F(CliTest, InspectReportsBrokenCheckpoints) {
  ASSERT_EQ(run("init --preset tiny --out " + path("m")).code, 0);
  // Point the config at more experts than the weights have: every extra expert is missing.
  Result r = run("inspect " + path("m") + " --set text_config.n_routed_experts=10 --json");
  EXPECT_EQ(r.code, 1) << r.output;
  auto j = nlohmann::json::parse(r.output);
  bool found = false;
  for (const auto& name : j["checkpoint"]["missing"])
    found |= name.get<std::string>().find("mlp.experts.9.gate_proj.weight") != std::string::npos;
  EXPECT_TRUE(found) << r.output;
  EXPECT_FALSE(j["checkpoint"]["misshaped"].empty());  // the router's [E, D] no longer fits
}

TEST_F(CliTest, BadInputsGetClearErrors) {
  Result preset = run("init --preset huge --out " + path("x"));
  EXPECT_NE(preset.code, 0);
  EXPECT_CONTAINS(preset.output, "huge");
  Result set = run("init --preset tiny --out " + path("x") + " --set text_config.index_topk=7");
  EXPECT_EQ(set.code, 2);
  EXPECT_CONTAINS(set.output, "text_config.index_topk");
  EXPECT_CONTAINS(set.output, "not divisible by index_kpool");
  EXPECT_FALSE(fs::exists(path("x")));  // nothing written on a bad config
  Result malformed = run("inspect --preset tiny --set n_routed_experts");
  EXPECT_EQ(malformed.code, 2);
  EXPECT_CONTAINS(malformed.output, "expected key=value");
  Result typo = run("inspect --preset tiny --set text_config.hiden_size=3");
  EXPECT_EQ(typo.code, 2);
  EXPECT_CONTAINS(typo.output, "unknown field 'hiden_size'");
  ASSERT_EQ(run("init --preset tiny --out " + path("m")).code, 0);
  Result again = run("init --preset tiny --out " + path("m"));
  EXPECT_EQ(again.code, 2);
  EXPECT_CONTAINS(again.output, "not empty");
  EXPECT_TRUE(fs::exists(path("m/config.json")));  // the existing model is untouched
  EXPECT_EQ(run("init --preset tiny --force --out " + path("m")).code, 0);
  Result missing = run("inspect " + path("nowhere"));
  EXPECT_EQ(missing.code, 2);
  EXPECT_CONTAINS(missing.output, "does not exist");
  std::ofstream(path("m/config.json")) << R"({"model_type": "llama", "hidden_size": 8})";
  Result other = run("inspect " + path("m"));
  EXPECT_EQ(other.code, 2);
  EXPECT_CONTAINS(other.output, "not a GLM-5.3-Flash model");
  Result nothing = run("inspect");
  EXPECT_EQ(nothing.code, 2);
  EXPECT_CONTAINS(nothing.output, "nothing to inspect");
}

TEST_F(CliTest, InspectVerifyNamesTheCorruptTensorAndItsFile) {
  ASSERT_EQ(run("init --preset tiny --seed 5 --out " + path("m")).code, 0);
  Result ok = run("inspect --verify " + path("m"));
  EXPECT_EQ(ok.code, 0) << ok.output;
  EXPECT_CONTAINS(ok.output, "OK");
  EXPECT_CONTAINS(ok.output, "match their checksums");

  // One bit of the embedding table, in the middle of its data: same size, still a finite bf16.
  const std::string name = "model.language_model.embed_tokens.weight";
  std::string shard;
  uint64_t at = 0;
  {
    const auto reader = glmtune::io::CheckpointReader::open(path("m"));
    shard = reader.shard_of(name);
    const auto& sf = reader.shard(shard);
    at = sf.data_offset() + sf.info(name).begin + sf.info(name).nbytes() / 2;
  }
  {
    std::fstream f(path("m/" + shard), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(std::streamoff(at));
    char c = 0;
    f.read(&c, 1);
    c = char(c ^ 0x01);
    f.seekp(std::streamoff(at));
    f.write(&c, 1);
  }
  Result bad = run("inspect --verify " + path("m"));
  EXPECT_EQ(bad.code, 1) << bad.output;
  EXPECT_CONTAINS(bad.output, "CORRUPT");
  EXPECT_CONTAINS(bad.output, shard + ": tensor \"" + name + "\": checksum mismatch");
  Result json = run("inspect --verify --json " + path("m"));
  EXPECT_EQ(json.code, 1);
  const auto j = nlohmann::json::parse(json.output);
  ASSERT_EQ(j["problems"].size(), 1u) << json.output;
  EXPECT_EQ(j["problems"][0]["tensor"], name);
  EXPECT_EQ(j["problems"][0]["file"], shard);

  // Without the checksums file (a released model): structure only, said to be unverified.
  fs::remove(path("m/glmtune-checksums.json"));
  Result unverified = run("inspect --verify " + path("m"));
  EXPECT_EQ(unverified.code, 0) << unverified.output;
  EXPECT_CONTAINS(unverified.output, "UNVERIFIED");
}

TEST_F(CliTest, AnOutputPathThroughAFileNamesTheFlag) {
  std::ofstream(path("file")) << "x";
  Result r = run("init --preset tiny --out " + path("file") + "/sub/m");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.output, "--out: cannot create the directory " + path("file") + "/sub");
  EXPECT_CONTAINS(r.output, path("file") + " is a file, not a directory");
  EXPECT_CONTAINS(r.output, "fix:");
  EXPECT_EQ(r.output.find("filesystem error"), std::string::npos) << r.output;
}

// A checkpoint exported in float32 (every tensor f32): inspect says which tensors the release
// stores in bf16, that glmtune computes with their f32 values, and that its own checkpoints store
// them rounded; a released-dtype checkpoint gets no such line.
TEST_F(CliTest, InspectNamesFloat32TensorsOfBf16Parameters) {
  ASSERT_EQ(run("init --preset tiny --seed 3 --out " + path("m")).code, 0);
  {
    const glmtune::io::CheckpointReader reader = glmtune::io::CheckpointReader::open(path("m"));
    glmtune::io::CheckpointWriter writer(path("f32"));
    for (const auto& name : reader.names())
      writer.add(name, reader.tensor(name).to(glmtune::DType::f32));
    writer.finish();
  }
  fs::copy_file(path("m/config.json"), path("f32/config.json"));
  Result text = run("inspect " + path("f32"));
  ASSERT_EQ(text.code, 0) << text.output;
  EXPECT_CONTAINS(text.output, "tensors stored in f32 that the release stores in bf16");
  Result json = run("inspect " + path("f32") + " --json");
  ASSERT_EQ(json.code, 0) << json.output;
  EXPECT_GT(nlohmann::json::parse(json.output)["checkpoint"]["f32_not_bf16"].size(), 10u);
  Result released = run("inspect " + path("m"));
  EXPECT_EQ(released.output.find("stored in f32 that the release"), std::string::npos);
}

// init --fp8 writes the FP8 release's layout: the release's FP8 tensors as e4m3 with a float32
// block-scale companion each, and a quantization_config. inspect reports the weights' device bytes
// both ways: dequantised, and kept in FP8 (its codes are the checkpoint's FP8 tensors, one byte
// each); the same model without --fp8 gives the same bf16 figure and counts the release's FP8 set.
TEST_F(CliTest, InitFp8WritesTheReleasedFp8LayoutAndInspectCountsItsDeviceBytes) {
  ASSERT_EQ(run("init --preset tiny --seed 3 --fp8 --out " + path("fp8")).code, 0);
  ASSERT_EQ(run("init --preset tiny --seed 3 --out " + path("bf16")).code, 0);
  const auto reader = glmtune::io::CheckpointReader::open(path("fp8"));
  double fp8_values = 0;
  int64_t fp8_tensors = 0;
  for (const std::string& name : reader.names()) {
    if (reader.info(name).dtype != glmtune::DType::fp8e4m3) continue;
    ++fp8_tensors;
    fp8_values += double(glmtune::shape_numel(reader.info(name).shape));
    const std::string scale = name.substr(0, name.size() - 7) + ".weight_scale_inv";
    ASSERT_TRUE(reader.contains(scale)) << name;
    EXPECT_EQ(reader.info(scale).dtype, glmtune::DType::f32) << scale;
    // Which tensors: experts, shared experts, the dense MLP and the MLA projections, never a
    // KDA projection, kv_b_proj or the indexer.
    EXPECT_TRUE(name.find(".mlp.") != std::string::npos ||
                name.find(".self_attn.q_a_proj.") != std::string::npos ||
                name.find(".self_attn.q_b_proj.") != std::string::npos ||
                name.find(".self_attn.kv_a_proj_with_mqa.") != std::string::npos ||
                name.find(".self_attn.o_proj.") != std::string::npos)
        << name;
    EXPECT_EQ(name.find(".indexer."), std::string::npos) << name;
  }
  // tiny: 1 dense MLP (3), 4 MoE layers and the MTP layer with 8 experts (5 x (2 x 8 + 1) fused
  // tensors count per expert: 5 x 8 x 3) and a shared expert (5 x 3), MLA in layer 3 and MTP (2 x
  // 4).
  EXPECT_EQ(fp8_tensors, 3 + 5 * 8 * 3 + 5 * 3 + 2 * 4);
  const auto config = nlohmann::json::parse(std::ifstream(path("fp8/config.json")));
  EXPECT_EQ(config["quantization_config"]["quant_method"], "fp8");
  EXPECT_EQ(config["quantization_config"]["weight_block_size"], nlohmann::json({128, 128}));

  Result fp8 = run("inspect " + path("fp8") + " --json");
  ASSERT_EQ(fp8.code, 0) << fp8.output;
  const auto d = nlohmann::json::parse(fp8.output)["device_weight_bytes"];
  EXPECT_EQ(d["fp8_values"].get<double>(), fp8_values);
  EXPECT_EQ(d["fp8_from"], "checkpoint");
  EXPECT_LT(d["fp8_base"].get<double>(),
            d["bf16"].get<double>() + d["fp8_running_layer"].get<double>());
  Result bf16 = run("inspect " + path("bf16") + " --json");
  ASSERT_EQ(bf16.code, 0) << bf16.output;
  const auto b = nlohmann::json::parse(bf16.output)["device_weight_bytes"];
  EXPECT_EQ(b["bf16"], d["bf16"]);
  EXPECT_EQ(b["fp8_values"], d["fp8_values"]);
  EXPECT_EQ(b["fp8_from"], "release layout");
  EXPECT_CONTAINS(run("inspect " + path("fp8")).output, "FP8 kept (lora.base = \"fp8\")");
  // At the released width the FP8 base is the smaller one, the running layer included.
  Result crop = run("inspect --preset crop25b --json");
  ASSERT_EQ(crop.code, 0) << crop.output;
  const auto c = nlohmann::json::parse(crop.output)["device_weight_bytes"];
  EXPECT_LT(c["fp8_base"].get<double>(), 0.9 * c["bf16"].get<double>());
  // --freeze: only the frozen FP8 tensors (here the routed experts) stay in FP8
  // (train.frozen_weights = "fp8"): fewer bytes than bf16, more than the whole FP8 base.
  Result frozen = run("inspect --preset crop25b --json --freeze 'mlp\\.experts\\.'");
  ASSERT_EQ(frozen.code, 0) << frozen.output;
  const auto f = nlohmann::json::parse(frozen.output)["device_weight_bytes"];
  EXPECT_LT(f["fp8_frozen"].get<double>(), 0.9 * f["bf16"].get<double>());
  EXPECT_GT(f["fp8_frozen"].get<double>(), f["fp8_base"].get<double>());
  EXPECT_FALSE(c.contains("fp8_frozen"));
  EXPECT_CONTAINS(run("inspect --preset crop25b --freeze 'mlp\\.experts\\.'").output,
                  "FP8 kept where --freeze matches");
  const Result none = run("inspect --preset crop25b --freeze 'no_such_tensor'");
  EXPECT_NE(none.code, 0);
  EXPECT_CONTAINS(none.output, "matches no parameter");
  const Result bad = run("inspect --preset crop25b --freeze '(['");
  EXPECT_NE(bad.code, 0);
  EXPECT_CONTAINS(bad.output, "not a regular expression");
}
