// `glmtune eval --dump-grads`: the gradient of the reported mean LM loss for every trainable
// parameter, under the released names and shapes, against transformers 5.17.0 (the whole-model
// golden of tools/golden/model_backward.py, whose objective is exactly that loss: no MTP, no
// balancing loss).

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "glmtune/io/checkpoint.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/model/config.h"
#include "glmtune/model/init.h"
#include "glmtune/model/layout.h"
#include "support/temp_dir.h"

using namespace glmtune;
namespace fs = std::filesystem;
using glmtune::test::TempDir;

namespace {

const fs::path kGolden =
    fs::path(GLMTUNE_SOURCE_DIR) / "tests" / "golden" / "model" / "tiny_backward.safetensors";

// max |a − ref| / max |ref|, the relative error of docs/testing.md, "Parity measures".
double rel_err(const Tensor& a, const Tensor& ref) {
  const std::vector<double> x = a.to_doubles(), y = ref.to_doubles();
  EXPECT_EQ(x.size(), y.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

// The golden gradients (internal names, fused layouts as the reference modules hold them) split
// into the released tensors, written out here independently of glmtune's own splitting.
std::map<std::string, Tensor> golden_released_grads(const io::SafetensorsFile& golden) {
  const std::regex gate_up(R"(^(.*\.mlp\.experts\.)gate_up_proj$)");
  const std::regex down(R"(^(.*\.mlp\.experts\.)down_proj$)");
  const std::regex conv(R"(^(.*\.self_attn\.)conv1d\.weight$)");
  std::map<std::string, Tensor> out;
  std::smatch m;
  for (const std::string& key : golden.names()) {
    if (!key.starts_with("grad.")) continue;
    const std::string name = key.substr(5);
    const Tensor g = golden.tensor(key);
    if (std::regex_match(name, m, gate_up)) {
      const int64_t I = g.size(1) / 2;
      for (int64_t e = 0; e < g.size(0); ++e) {
        out[m[1].str() + std::to_string(e) + ".gate_proj.weight"] = g.select(0, e).slice(0, 0, I);
        out[m[1].str() + std::to_string(e) + ".up_proj.weight"] = g.select(0, e).slice(0, I, 2 * I);
      }
    } else if (std::regex_match(name, m, down)) {
      for (int64_t e = 0; e < g.size(0); ++e)
        out[m[1].str() + std::to_string(e) + ".down_proj.weight"] = g.select(0, e);
    } else if (std::regex_match(name, m, conv)) {
      const int64_t rows = g.size(0) / 3;
      const char* which[] = {"q", "k", "v"};
      for (int64_t i = 0; i < 3; ++i)
        out[m[1].str() + which[i] + "_conv1d.weight"] = g.slice(0, i * rows, (i + 1) * rows);
    } else {
      out[name] = g;
    }
  }
  return out;
}

}  // namespace

TEST(EvalDumpGrads, MatchesReferenceUnderReleasedNames) {
  const io::SafetensorsFile golden = io::SafetensorsFile::open(kGolden);
  const auto meta = nlohmann::json::parse(golden.metadata().at("fixture"));
  model::ModelConfig config = model::ModelConfig::preset("tiny");
  for (const auto& s : meta.at("init_sets")) {
    const std::string kv = s.get<std::string>();
    config.set(kv.substr(0, kv.find('=')), kv.substr(kv.find('=') + 1));
  }
  TempDir dir("dumpgrads");
  model::InitOptions init;
  init.seed = meta.at("init_seed").get<uint64_t>();
  model::write_random_checkpoint(config, dir / "init", init);

  // The golden's model: the init with its redrawn parameters, every tensor stored in float32 so
  // that the evaluated weights are exactly the reference's.
  {
    const io::CheckpointReader reader = io::CheckpointReader::open(dir / "init");
    io::CheckpointWriter writer(dir / "model");
    for (const std::string& name : reader.names()) {
      const std::string key = "param." + name;
      const Tensor t = golden.contains(key) ? golden.tensor(key) : reader.tensor(name);
      writer.add(name, t.to(DType::f32).contiguous());
    }
    writer.add_file("config.json", config.document().dump(2));
    writer.finish();
  }

  // The documents as pre-tokenised lines: labels unshifted (the golden's are aligned to the next
  // token), so label j of a document is the golden's label j − 1.
  const std::vector<double> ids = golden.tensor("input_ids").to_doubles();
  const std::vector<double> aligned = golden.tensor("labels").to_doubles();
  const std::vector<double> cu = golden.tensor("cu_seqlens").to_doubles();
  {
    std::ofstream out(dir / "docs.jsonl");
    for (size_t d = 0; d + 1 < cu.size(); ++d) {
      nlohmann::json line = {{"input_ids", nlohmann::json::array()},
                             {"labels", nlohmann::json::array({-100})}};
      for (auto i = size_t(cu[d]); i < size_t(cu[d + 1]); ++i) {
        line["input_ids"].push_back(int64_t(ids[i]));
        if (i + 1 < size_t(cu[d + 1])) line["labels"].push_back(int64_t(aligned[i]));
      }
      out << line.dump() << "\n";
    }
  }

  const fs::path dump = dir / "grads.safetensors";
  const std::string cmd = std::string(GLMTUNE_BINARY) + " eval --model " +
                          (dir / "model").string() + " --data " + (dir / "docs.jsonl").string() +
                          " --dump-grads " + dump.string() + " --json > " +
                          (dir / "out.json").string() + " 2> " + (dir / "err.txt").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << test::read_text(dir / "err.txt");
  const auto result = nlohmann::json::parse(test::read_text(dir / "out.json"));
  EXPECT_NEAR(result.at("loss").get<double>(), golden.tensor("loss").item({0}), 1e-5);
  EXPECT_EQ(result.at("tokens").get<int64_t>(), int64_t(golden.tensor("lm_tokens").item({0})));
  for (const auto& entry : fs::directory_iterator(dir.path()))
    EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos)
        << "left behind: " << entry.path();

  const io::SafetensorsFile grads = io::SafetensorsFile::open(dump);
  const std::map<std::string, Tensor> reference = golden_released_grads(golden);
  const std::string mtp_prefix =
      "model.language_model.layers." + std::to_string(config.text().num_hidden_layers) + ".";
  std::set<std::string> expected;
  for (const model::ParamSpec& spec : model::released_layout(config)) {
    const bool text =
        spec.name.starts_with("model.language_model.") || spec.name == "lm_head.weight";
    const bool frozen = spec.name.find(".indexer.") != std::string::npos ||
                        spec.name.ends_with("e_score_correction_bias");
    if (!text || frozen) {
      EXPECT_FALSE(grads.contains(spec.name)) << spec.name << " has no gradient to dump";
      continue;
    }
    expected.insert(spec.name);
    ASSERT_TRUE(grads.contains(spec.name)) << spec.name;
    const Tensor g = grads.tensor(spec.name);
    EXPECT_EQ(g.dtype(), DType::f32) << spec.name;
    EXPECT_EQ(g.shape(), spec.shape) << spec.name;
  }
  EXPECT_EQ(grads.names().size(), expected.size());

  int compared = 0;
  double worst = 0;
  std::string worst_name;
  for (const std::string& name : expected) {
    const Tensor g = grads.tensor(name);
    if (name.starts_with(mtp_prefix)) {
      // The LM loss does not reach the MTP layer.
      for (double v : g.to_doubles()) ASSERT_EQ(v, 0.0) << name;
      continue;
    }
    auto it = reference.find(name);
    ASSERT_NE(it, reference.end()) << "no reference gradient for " << name;
    const double err = rel_err(g, it->second);
    EXPECT_LE(err, 1e-4) << name;
    if (err > worst) worst = err, worst_name = name;
    ++compared;
  }
  EXPECT_EQ(size_t(compared), reference.size());
  EXPECT_GT(compared, 100);
  std::printf("%d released gradients compared, worst rel err %.3g (%s)\n", compared, worst,
              worst_name.c_str());
}
