// The first 20 losses of a training run against transformers 5.17.0 + torch.optim.AdamW
// (tools/golden/train_curve.py): the tiny model, real text, warmup + cosine schedule, gradient
// clipping and weight decay as the recipe sets them, MTP, balancing loss and the router bias
// update off. Every sample fills one pack alone (max_length = pack_max_length, longer texts cut),
// and a step takes two packs; the reference runs each document alone and divides the step's CE
// sum by the step's label count, which is glmtune's reduction (docs/training.md, "The model
// backward").

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "glmtune/data/dataset.h"
#include "glmtune/data/packing.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/io/safetensors.h"
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
const fs::path kGoldenDir = kSource / "tests" / "golden" / "train_curve";

std::string num(double v) { return nlohmann::json(v).dump(); }

}  // namespace

TEST(TrainCurve, LossesMatchReference) {
  const io::SafetensorsFile golden = io::SafetensorsFile::open(kGoldenDir / "curve.safetensors");
  const auto meta = nlohmann::json::parse(golden.metadata().at("fixture"));
  const int64_t doc_len = meta.at("doc_len").get<int64_t>();
  const int64_t steps = meta.at("steps").get<int64_t>();
  const int64_t micro_packs = meta.at("micro_packs").get<int64_t>();

  // The reference's model: the same init, stored in float32 so that every parameter is its own
  // fp32 master (the fused experts stay bf16 with an fp32 master, which the reference mirrors).
  model::ModelConfig config = model::ModelConfig::preset(meta.at("preset").get<std::string>());
  std::vector<std::pair<std::string, std::string>> sets;  // applied together, as glmtune init does
  for (const auto& s : meta.at("init_sets")) {
    const std::string kv = s.get<std::string>();
    sets.emplace_back(kv.substr(0, kv.find('=')), kv.substr(kv.find('=') + 1));
  }
  config.set_all(sets);
  TempDir dir("train-curve");
  model::InitOptions init;
  init.seed = meta.at("init_seed").get<uint64_t>();
  model::write_random_checkpoint(config, dir / "init", init);
  {
    const io::CheckpointReader reader = io::CheckpointReader::open(dir / "init");
    io::CheckpointWriter writer(dir / "model");
    for (const std::string& name : reader.names())
      writer.add(name, reader.tensor(name).to(DType::f32).contiguous());
    writer.add_file("config.json", config.document().dump(2));
    writer.finish();
  }

  std::ostringstream s;
  s << "[model]\npath = \"" << (dir / "model").string() << "\"\ntokenizer = \""
    << (kSource / "examples/tiny/tokenizer").string() << "\"\n"
    << "[data]\nfiles = [\"" << (kGoldenDir / "text.jsonl").string() << "\"]\n"
    << "format = \"text\"\nmax_length = " << doc_len << "\npack_max_length = " << doc_len
    << "\nshuffle = false\n"
    << "[train]\ntotal_steps = " << steps << "\nmicro_packs = " << micro_packs
    << "\nrecompute = \"none\"\n"
    << "[optimizer]\nlr = " << num(meta.at("lr")) << "\nlr_min = " << num(meta.at("lr_min"))
    << "\nwarmup_steps = " << meta.at("warmup_steps") << "\nbetas = " << meta.at("betas").dump()
    << "\neps = " << num(meta.at("eps")) << "\nweight_decay = " << num(meta.at("weight_decay"))
    << "\nclip_grad_norm = " << num(meta.at("clip_grad_norm")) << "\n"
    << "[loss]\nmtp_scale = 0\nbalancing_alpha = 0\nrouter_bias_update_rate = 0\n"
    << "[output]\ndir = \"" << (dir / "out").string() << "\"\nsave_every = 0\n";
  const train::Recipe recipe = train::Recipe::parse(s.str(), "train curve recipe");

  // The packs the trainer will take are the reference's documents, in order.
  const data::Tokenizer tokenizer =
      data::Tokenizer::from_file((kSource / "examples/tiny/tokenizer/tokenizer.json").string());
  const data::JsonlDataset dataset = data::JsonlDataset::scan(recipe.dataset_config(), tokenizer);
  data::PackSampler sampler(dataset, recipe.packing_config(tokenizer.require_id("<|endoftext|>")));
  const Tensor ids = golden.tensor("input_ids");
  ASSERT_EQ(ids.size(0), steps * micro_packs);
  for (int64_t d = 0; d < ids.size(0); ++d) {
    const data::Pack pack = sampler.next();
    ASSERT_EQ(pack.num_padding, 0) << "pack " << d;
    ASSERT_EQ(int64_t(pack.input_ids.size()), doc_len) << "pack " << d;
    const std::vector<double> want = ids.select(0, d).to_doubles();
    for (int64_t i = 0; i < doc_len; ++i)
      ASSERT_EQ(pack.input_ids[size_t(i)], int32_t(want[size_t(i)]))
          << "pack " << d << " token " << i;
  }

  train::TrainerOptions options;
  options.print_steps = false;
  const train::TrainSummary run = train::run_training(recipe, options);
  ASSERT_EQ(int64_t(run.steps.size()), steps);
  const std::vector<double> loss = golden.tensor("loss").to_doubles();
  const std::vector<double> lr = golden.tensor("lr").to_doubles();
  const std::vector<double> norm = golden.tensor("grad_norm").to_doubles();
  double worst = 0;
  for (int64_t i = 0; i < steps; ++i) {
    const train::StepMetrics& m = run.steps[size_t(i)];
    EXPECT_NEAR(m.loss, loss[size_t(i)], 1e-4) << "step " << i + 1;
    EXPECT_NEAR(m.lr, lr[size_t(i)], 1e-12 + 1e-9 * lr[size_t(i)]) << "step " << i + 1;
    EXPECT_NEAR(m.grad_norm, norm[size_t(i)], 1e-3 * norm[size_t(i)]) << "step " << i + 1;
    EXPECT_FALSE(m.skipped);
    worst = std::max(worst, std::abs(m.loss - loss[size_t(i)]));
    std::printf("step %2lld  loss %.6f  reference %.6f\n", (long long)(i + 1), m.loss,
                loss[size_t(i)]);
  }
  // The run learns: a wrong update would not follow the reference for long.
  EXPECT_LT(loss.back(), loss.front() - 0.5);
  std::printf("worst loss difference %.3g\n", worst);
}
