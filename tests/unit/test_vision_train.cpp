// Vision-language training on the bundled examples/tiny-vl conversations (real images and a real
// video) with the tiny model: the data is scanned without decoding, packs carry their pixels,
// a few optimizer steps update the tower and the projector (or leave frozen parts alone), and
// repeating one pack lowers its loss.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/param_store.h"
#include "glmtune/train/optimizer.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/trainer.h"
#include "glmtune/train/vl_batch.h"
#include "support/temp_dir.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::train;
namespace fs = std::filesystem;

namespace {

const fs::path kExample = fs::path(GLMTUNE_SOURCE_DIR) / "examples" / "tiny-vl";
const fs::path kProcessor = fs::path(GLMTUNE_SOURCE_DIR) / "examples" / "tiny" / "tokenizer";

struct VlSetup {
  test::TempDir dir{"vl-train"};
  data::media::VlProcessor processor = data::media::VlProcessor::from_dir(kProcessor);
  std::unique_ptr<VlDataset> dataset;
  std::unique_ptr<model::ParamStore> store;

  VlSetup() {
    VlDataConfig dc;
    dc.files = {(kExample / "chat.jsonl").string()};
    dc.media_root = kExample;
    dc.max_length = 1024;
    dataset = std::make_unique<VlDataset>(VlDataset::scan(dc, processor));
    const model::ModelConfig config = model::ModelConfig::preset("tiny");
    model::InitOptions init;
    init.seed = 7;
    model::write_random_checkpoint(config, dir.path() / "ck", init);
    store = std::make_unique<model::ParamStore>(
        model::ParamStore::load(io::CheckpointReader::open(dir.path() / "ck"), config));
    make_params_writable(*store);
  }
};

// Trains `steps` optimizer steps of one pack each; returns each step's LM loss.
struct TrainRun {
  std::vector<double> losses;
  int64_t media_packs = 0;
};

TrainRun train(VlSetup& s, const model::ComposeOptions& options, int64_t steps, bool same_pack) {
  model::VisionLanguageModel model(*s.store);
  VlTrainStep step(model.vision_config(), model.vision(), options);
  std::vector<NamedParam> params = named_params(*s.store);
  for (NamedParam& p : params) p.trainable = model::text::is_trainable_param(p.name);
  std::vector<Tensor> grad_list = step.attach(params);
  model::text::TextGrads text_grads = model::text::TextGrads::zeros_like(model.text().weights());
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].trainable && !grad_list[i].defined())
      grad_list[i] = *text_grads.find(params[i].name);
  AdamWConfig ac;
  ac.weight_decay = 0;
  AdamW optimizer(params, ac);

  data::PackingConfig pc;
  pc.pack_max_length = 1024;
  pc.seed = 3;
  pc.pad_id = s.processor.tokenizer().require_id("<|endoftext|>");
  data::PackSampler sampler(*s.dataset, pc);
  const data::Pack first = sampler.next();
  model::text::TrainOptions topt;
  topt.mtp = false;
  TrainRun run;
  for (int64_t i = 0; i < steps; ++i) {
    const data::Pack pack = same_pack || i == 0 ? first : sampler.next();
    const model::PackMedia media = pack_media(*s.dataset, pack);
    run.media_packs += media.empty() ? 0 : 1;
    model::text::PackInput in;
    in.input_ids = Tensor::from_vector(pack.input_ids, {int64_t(pack.input_ids.size())});
    in.cu_seqlens = Tensor::from_vector(pack.cu_seqlens, {int64_t(pack.cu_seqlens.size())});
    in.labels = Tensor::from_vector(pack.labels, {int64_t(pack.labels.size())});
    in.padding_tokens = pack.num_padding;
    text_grads.zero();
    step.zero();
    const auto r = step.run(model, in, media, topt, text_grads);
    step.export_grads();
    run.losses.push_back(r.backward.lm_loss);
    EXPECT_TRUE(std::isfinite(r.backward.lm_loss));
    EXPECT_FALSE(optimizer.step(grad_list, 2e-3).skipped);
    model.refresh(*s.store);
  }
  return run;
}

VlSetup& shared() {
  static VlSetup s;
  return s;
}

TEST(VisionTrain, ScanSeesEveryConversationAndItsMedia) {
  const VlSetup& s = shared();
  EXPECT_EQ(s.dataset->size(), 6);
  EXPECT_TRUE(s.dataset->has_media());
  bool video = false;
  for (int64_t i = 0; i < s.dataset->size(); ++i) {
    const auto sample = s.dataset->with_pixels(i);
    EXPECT_EQ(int64_t(sample.input_ids.size()), s.dataset->length(i)) << s.dataset->where(i);
    video |= !sample.video_grid_thw.empty();
  }
  EXPECT_TRUE(video) << "the example should hold a video conversation";
}

TEST(VisionTrain, StepsUpdateTowerAndProjector) {
  VlSetup& s = shared();
  const Tensor tower_before = s.store->get("model.visual.blocks.0.attn.qkv.weight").clone();
  const Tensor merger_before = s.store->get("model.visual.merger.proj.weight").clone();
  const TrainRun run = train(s, {}, 2, /*same_pack=*/false);
  EXPECT_GT(run.media_packs, 0);
  EXPECT_GT(test::max_abs_diff(s.store->get("model.visual.blocks.0.attn.qkv.weight").to_doubles(),
                               tower_before.to_doubles())
                .diff,
            0.0);
  EXPECT_GT(test::max_abs_diff(s.store->get("model.visual.merger.proj.weight").to_doubles(),
                               merger_before.to_doubles())
                .diff,
            0.0);
}

TEST(VisionTrain, FrozenTowerStaysPut) {
  VlSetup& s = shared();
  const Tensor tower_before = s.store->get("model.visual.patch_embed.proj.weight").clone();
  const Tensor down_before = s.store->get("model.visual.downsample.weight").clone();
  model::ComposeOptions options;
  options.freeze_vision = true;
  train(s, options, 1, /*same_pack=*/true);
  EXPECT_EQ(test::max_abs_diff(s.store->get("model.visual.patch_embed.proj.weight").to_doubles(),
                               tower_before.to_doubles())
                .diff,
            0.0);
  EXPECT_GT(test::max_abs_diff(s.store->get("model.visual.downsample.weight").to_doubles(),
                               down_before.to_doubles())
                .diff,
            0.0);
}

TEST(VisionTrain, RepeatingAPackLowersItsLoss) {
  VlSetup& s = shared();
  const TrainRun run = train(s, {}, 4, /*same_pack=*/true);
  ASSERT_EQ(run.losses.size(), 4u);
  EXPECT_EQ(run.media_packs, 4);
  EXPECT_LT(run.losses.back(), run.losses.front());
}

TEST(VisionTrain, OverlongSampleIsAnErrorNamingTheLine) {
  const VlSetup& s = shared();
  VlDataConfig dc;
  dc.files = {(kExample / "chat.jsonl").string()};
  dc.media_root = kExample;
  dc.max_length = 8;
  dc.on_overlong = data::OverlongPolicy::kTruncate;
  try {
    VlDataset::scan(dc, s.processor);
    FAIL() << "expected a glmtune::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("chat.jsonl:1"), std::string::npos) << e.what();
  }
  dc.on_overlong = data::OverlongPolicy::kDrop;
  const VlDataset dropped = VlDataset::scan(dc, s.processor);
  EXPECT_EQ(dropped.size(), 0);
  EXPECT_EQ(dropped.stats().dropped_overlong, 6);
}

TEST(VisionTrain, AnImagePathThatIsAFolderIsABadLine) {
  // A folder named like an image is a bad line like any unreadable image: fatal with its file,
  // line and path, or skipped and counted under on_bad_line = "skip".
  const VlSetup& s = shared();
  test::TempDir dir("vl-folder-image");
  fs::create_directories(dir / "media" / "folder.jpg");
  fs::copy_file(kExample / "media" / "chelsea.jpg", dir / "media" / "chelsea.jpg");
  auto line = [](const std::string& image) {
    return R"({"messages": [{"role": "user", "content": [{"type": "image", "image": ")" + image +
           R"("}, {"type": "text", "text": "What is it?"}]}, {"role": "assistant", "content": )"
           R"("A cat."}]})"
           "\n";
  };
  test::write_text(dir / "data.jsonl", line("media/chelsea.jpg") + line("media/folder.jpg"));
  VlDataConfig dc;
  dc.files = {(dir / "data.jsonl").string()};
  dc.media_root = dir.path();
  dc.max_length = 1024;
  try {
    VlDataset::scan(dc, s.processor);
    FAIL() << "expected a glmtune::Error";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const std::string& part :
         {(dir / "data.jsonl").string() + ":2", (dir / "media" / "folder.jpg").string(),
          std::string("is a directory")})
      EXPECT_NE(what.find(part), std::string::npos) << what;
  }
  dc.on_bad_line = data::BadLinePolicy::kSkip;
  const VlDataset skipped = VlDataset::scan(dc, s.processor);
  EXPECT_EQ(skipped.size(), 1);
  EXPECT_EQ(skipped.stats().skipped[size_t(data::BadLineReason::kMedia)], 1);
}

TEST(VisionTrain, GlmtuneTrainRunsAVisionLanguageRecipe) {
  // The whole `glmtune train` path: a recipe with data.media_root and a frozen projector, three
  // steps, a checkpoint whose tower moved and whose projector did not.
  test::TempDir dir("vl-recipe");
  const model::ModelConfig config = model::ModelConfig::preset("tiny");
  model::InitOptions init;
  init.seed = 11;
  model::write_random_checkpoint(config, dir.path() / "model", init);
  const std::string recipe_text = fmt::format(R"(
[model]
path = "{model}"
tokenizer = "{tokenizer}"
freeze_projector = true
[data]
files = ["{data}"]
media_root = "{media}"
max_length = 1024
pack_max_length = 1024
[train]
total_steps = 3
seed = 5
recompute = "none"
[optimizer]
lr = 1e-3
lr_min = 1e-3
[output]
dir = "{out}"
save_every = 0
)",
                                              fmt::arg("model", (dir.path() / "model").string()),
                                              fmt::arg("tokenizer", kProcessor.string()),
                                              fmt::arg("data", (kExample / "chat.jsonl").string()),
                                              fmt::arg("media", kExample.string()),
                                              fmt::arg("out", (dir.path() / "out").string()));
  const Recipe recipe = Recipe::parse(recipe_text, "vl recipe");
  EXPECT_EQ(recipe.media_root, kExample.string());
  EXPECT_TRUE(recipe.freeze_projector);
  TrainerOptions options;
  options.print_steps = false;
  const TrainSummary summary = run_training(recipe, options);
  ASSERT_EQ(summary.steps.size(), 3u);
  for (const auto& m : summary.steps) EXPECT_TRUE(std::isfinite(m.loss));
  ASSERT_FALSE(summary.checkpoint.empty());

  const auto before =
      model::ParamStore::load(io::CheckpointReader::open(dir.path() / "model"), config);
  const auto after =
      model::ParamStore::load(io::CheckpointReader::open(summary.checkpoint / "model"), config);
  auto moved = [&](const std::string& name) {
    return test::max_abs_diff(after.get(name).to_doubles(), before.get(name).to_doubles()).diff;
  };
  EXPECT_GT(moved("model.visual.blocks.1.mlp.up_proj.weight"), 0.0);
  EXPECT_GT(moved("model.visual.patch_embed.proj.weight"), 0.0);
  EXPECT_EQ(moved("model.visual.merger.gate_proj.weight"), 0.0);  // frozen projector
  EXPECT_EQ(moved("model.visual.downsample.weight"), 0.0);
}

// The next step's media decode on a host thread while a step computes: the run is bit for bit the
// one that decodes each pack when it trains it, and an image whose body does not decode (its
// header does: the scan passes) stops the run at that step with its file and line either way.
TEST(VisionTrain, PrefetchedMediaTrainAsDecodedInPlace) {
  test::TempDir dir("vl-prefetch");
  const model::ModelConfig config = model::ModelConfig::preset("tiny");
  model::InitOptions init;
  init.seed = 13;
  model::write_random_checkpoint(config, dir.path() / "model", init);
  fs::copy(kExample / "media", dir.path() / "media");
  fs::copy_file(kExample / "chat.jsonl", dir.path() / "chat.jsonl");
  const auto recipe = [&](const fs::path& out, int steps) {
    return Recipe::parse(fmt::format(R"(
[model]
path = "{model}"
tokenizer = "{tokenizer}"
[data]
files = ["{data}"]
media_root = "{media}"
max_length = 200
pack_max_length = 200
[train]
total_steps = {steps}
seed = 5
[optimizer]
lr = 1e-3
[output]
dir = "{out}"
save_every = 0
)",
                                     fmt::arg("model", (dir.path() / "model").string()),
                                     fmt::arg("tokenizer", kProcessor.string()),
                                     fmt::arg("data", (dir.path() / "chat.jsonl").string()),
                                     fmt::arg("media", dir.path().string()),
                                     fmt::arg("out", out.string()), fmt::arg("steps", steps)),
                         "prefetch recipe");
  };
  TrainerOptions with, without;
  with.print_steps = without.print_steps = false;
  without.prefetch_media = false;
  const TrainSummary a = run_training(recipe(dir.path() / "with", 4), with);
  const TrainSummary b = run_training(recipe(dir.path() / "without", 4), without);
  ASSERT_EQ(a.steps.size(), 4u);
  ASSERT_EQ(b.steps.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(a.steps[i].grad_norm, b.steps[i].grad_norm) << "step " << i + 1;
  }

  // Line LINE's image replaced by a copy truncated after its first 2000 bytes: the header probe of
  // the scan still reads it, the decoding of its pixels fails when a pack needs them. Both runs
  // stop at the same step with the same message; with this seed that conversation is in the
  // third pack, so the prefetch (started during step 2) meets the failure and step 3 reports it.
  constexpr int kLine = 4;
  {
    std::ifstream in(dir.path() / "chat.jsonl");
    std::vector<std::string> lines;
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    std::string& line = lines.at(kLine - 1);
    for (const char* image :
         {"media/chelsea.jpg", "media/astronaut.jpg", "media/newtonscradle.png"})
      for (size_t at; (at = line.find(image)) != std::string::npos;)
        line.replace(at, std::string(image).size(), "media/broken.jpg");
    std::ofstream out(dir.path() / "chat.jsonl");
    for (const std::string& l : lines) out << l << "\n";
  }
  fs::copy_file(kExample / "media" / "astronaut.jpg", dir.path() / "media" / "broken.jpg");
  fs::resize_file(dir.path() / "media" / "broken.jpg", 2000);
  std::vector<std::string> messages;
  std::vector<int64_t> done;
  for (TrainerOptions* options : {&with, &without}) {
    const fs::path out = dir.path() / (options->prefetch_media ? "broken-with" : "broken-without");
    int64_t last = 0;
    options->on_step = [&](const StepMetrics& m) { last = m.step; };
    try {
      run_training(recipe(out, 4), *options);
      ADD_FAILURE() << "a run over an undecodable image finished";
    } catch (const Error& e) {
      messages.push_back(e.what());
    }
    done.push_back(last);
  }
  ASSERT_EQ(messages.size(), 2u);
  EXPECT_EQ(messages[0], messages[1]);
  EXPECT_NE(messages[0].find("broken.jpg"), std::string::npos) << messages[0];
  EXPECT_NE(messages[0].find("chat.jsonl:" + std::to_string(kLine)), std::string::npos)
      << messages[0];
  EXPECT_EQ(done[0], done[1]);
  EXPECT_EQ(done[0], 2) << "the broken conversation is no longer in the third pack: "
                        << messages[0];
}

TEST(VisionTrain, ReleasedMediaIdsTrainTextAndStopMediaBeforeTheFirstStep) {
  // A config as transformers writes it for a small vocabulary: the released media ids stay.
  test::TempDir dir("vl-released-ids");
  model::Json doc = model::ModelConfig::preset("tiny").document();
  for (const auto& [key, id] : {std::pair{"image_token_id", 154854},
                                {"video_token_id", 154855},
                                {"image_start_token_id", 154830},
                                {"image_end_token_id", 154831},
                                {"video_start_token_id", 154832},
                                {"video_end_token_id", 154833}})
    doc[key] = id;
  const model::ModelConfig config = model::ModelConfig::from_json(doc, "released ids");
  model::InitOptions init;
  init.seed = 11;
  model::write_random_checkpoint(config, dir.path() / "model", init);
  auto recipe = [&](const fs::path& data, const std::string& media_root, const std::string& out) {
    return Recipe::parse(
        fmt::format(
            R"(
[model]
path = "{model}"
tokenizer = "{tokenizer}"
[data]
files = ["{data}"]
{media}
max_length = 512
pack_max_length = 512
[train]
total_steps = 2
seed = 5
recompute = "none"
[output]
dir = "{out}"
save_every = 0
)",
            fmt::arg("model", (dir.path() / "model").string()),
            fmt::arg("tokenizer", kProcessor.string()), fmt::arg("data", data.string()),
            fmt::arg("media", media_root.empty() ? "" : "media_root = \"" + media_root + "\""),
            fmt::arg("out", (dir.path() / out).string())),
        "recipe");
  };
  TrainerOptions options;
  options.print_steps = false;
  const fs::path text_data =
      fs::path(GLMTUNE_SOURCE_DIR) / "examples" / "tiny" / "data" / "chat.jsonl";
  const TrainSummary text = run_training(recipe(text_data, "", "text"), options);
  ASSERT_EQ(text.steps.size(), 2u);
  for (const auto& m : text.steps) EXPECT_TRUE(std::isfinite(m.loss));

  try {
    run_training(recipe(kExample / "chat.jsonl", kExample.string(), "vl"), options);
    FAIL() << "expected a glmtune::Error";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const char* part : {"image_token_id", "154854", "2048", "images or videos"})
      EXPECT_NE(what.find(part), std::string::npos) << what;
  }
  EXPECT_FALSE(fs::exists(dir.path() / "vl" / "metrics.jsonl"));
}

}  // namespace
