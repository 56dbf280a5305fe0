// The vision-language composition against transformers 5.17.0 `Glm5NextForConditionalGeneration`
// (fixture from tools/golden/vision_compose.py): a pack of a text-only, a two-image and a video
// document, its per-document losses, the gradient of the spliced embeddings and every vision
// parameter's gradient. Also the per-document placeholder check, the frozen parts and the
// embedding gradient of the overwritten media rows.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/model/compose.h"
#include "glmtune/model/init.h"
#include "glmtune/model/param_store.h"
#include "support/temp_dir.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::model;
namespace fs = std::filesystem;

namespace {

const fs::path kGolden = fs::path(GLMTUNE_SOURCE_DIR) / "tests" / "golden";
constexpr test::RelErr rel_err{.zero_reference_fails = true};

// The fixture's model: the text model of the text backward fixture (its `glmtune init` settings
// and redrawn parameters) with the tiny tower of the vision forward fixture.
struct FixtureModel {
  test::TempDir dir{"compose"};
  std::unique_ptr<ParamStore> store;
  std::unique_ptr<VisionLanguageModel> model;

  FixtureModel() {
    const auto text = io::SafetensorsFile::open(kGolden / "model" / "tiny_backward.safetensors");
    const auto tower = io::SafetensorsFile::open(kGolden / "vision" / "tower.safetensors");
    const auto meta = nlohmann::json::parse(text.metadata().at("fixture"));
    ModelConfig config = ModelConfig::preset("tiny");
    for (const auto& s : meta.at("init_sets")) {
      const std::string item = s.get<std::string>();
      const size_t eq = item.find('=');
      config.set(item.substr(0, eq), item.substr(eq + 1));
    }
    InitOptions options;
    options.seed = meta.at("init_seed").get<uint64_t>();
    write_random_checkpoint(config, dir.path() / "ck", options);
    store = std::make_unique<ParamStore>(
        ParamStore::load(io::CheckpointReader::open(dir.path() / "ck"), config));
    for (const io::SafetensorsFile* f : {&text, &tower})
      for (const std::string& name : f->names()) {
        if (!name.starts_with("param.")) continue;
        const std::string param = name.substr(6);
        EXPECT_TRUE(store->contains(param)) << param;
        store->get(param) = f->tensor(name).clone();
      }
    model = std::make_unique<VisionLanguageModel>(*store);
  }
};

struct Fixture {
  io::SafetensorsFile file = io::SafetensorsFile::open(kGolden / "vision" / "compose.safetensors");
  text::PackInput input;
  PackMedia media;

  Fixture() {
    input.input_ids = file.tensor("input_ids");
    input.cu_seqlens = file.tensor("cu_seqlens");
    input.labels = file.tensor("labels");
    media.mm_token_type_ids = file.tensor("mm_token_type_ids");
    media.image_pixels = file.tensor("pixel_values");
    media.image_grid = vision::grid_from_tensor(file.tensor("image_grid_thw"));
    media.image_documents = {1, 1};
    media.video_pixels = file.tensor("pixel_values_videos");
    media.video_grid = vision::grid_from_tensor(file.tensor("video_grid_thw"));
    media.video_documents = {2};
    media.document_names = {"text.jsonl:1", "images.jsonl:4", "video.jsonl:2"};
  }
};

FixtureModel& shared_model() {
  static FixtureModel m;
  return m;
}

text::TrainOptions golden_train_options(const Fixture& f) {
  text::TrainOptions opt;
  opt.mtp = false;  // the reference has no MTP forward
  double labels = 0;
  for (double n : f.file.tensor("doc_tokens").to_doubles()) labels += n;
  opt.lm_denominator = labels;
  return opt;
}

TEST(Compose, PerDocumentLossMatchesReference) {
  const VisionLanguageModel& model = *shared_model().model;
  const Fixture f;
  text::ForwardOptions fo;
  fo.mtp = false;
  const text::ForwardOutput out = compose_forward(model, f.input, f.media, fo);
  ASSERT_TRUE(out.logits.defined());
  const std::vector<double> logits = out.logits.to_doubles();
  const int64_t vocab = out.logits.size(1);
  const std::vector<double> labels = f.input.labels.to_doubles();
  const std::vector<double> cu = f.input.cu_seqlens.to_doubles();
  for (int64_t d = 0; d < 3; ++d) {
    double sum = 0;
    int64_t count = 0;
    for (int64_t r = int64_t(cu[size_t(d)]); r < int64_t(cu[size_t(d) + 1]); ++r) {
      if (labels[size_t(r)] < 0) continue;
      const double* row = &logits[size_t(r * vocab)];
      double mx = row[0];
      for (int64_t v = 1; v < vocab; ++v) mx = std::max(mx, row[v]);
      double z = 0;
      for (int64_t v = 0; v < vocab; ++v) z += std::exp(row[v] - mx);
      sum += mx + std::log(z) - row[int64_t(labels[size_t(r)])];
      ++count;
    }
    EXPECT_EQ(count, int64_t(f.file.tensor("doc_tokens").item({d})));
    const double want = f.file.tensor("doc_loss_sum").item({d});
    EXPECT_NEAR(sum / double(count), want / double(count), 1e-5) << "document " << d;
  }
}

TEST(Compose, GradientsMatchReference) {
  const VisionLanguageModel& model = *shared_model().model;
  const Fixture f;
  text::TextGrads tg = text::TextGrads::zeros_like(model.text().weights());
  vision::VisionGrads vg = vision::VisionGrads::zeros_like(model.vision());
  const text::StepPackResult r =
      compose_forward_backward(model, f.input, f.media, golden_train_options(f), {}, tg, vg);
  EXPECT_NEAR(r.backward.lm_loss, f.file.tensor("loss").item({0}), 1e-5);
  EXPECT_LE(rel_err(r.backward.d_embeddings, f.file.tensor("d_embeddings")), 1e-4);
  int compared = 0;
  for (const auto& [name, g] : vg.released(model.vision_config())) {
    ASSERT_TRUE(f.file.contains("grad." + name)) << name;
    EXPECT_LE(rel_err(g, f.file.tensor("grad." + name)), 1e-4) << name;
    ++compared;
  }
  EXPECT_EQ(compared, 2 + 14 * model.vision_config().depth + 1 + 8);

  // The <|image|> row of the embedding table gets no gradient: every one of its lookups was
  // overwritten by a feature. A text token of the pack does get one.
  const int64_t image_token = model.text().config().media().image_token_id;
  EXPECT_EQ(test::max_abs(tg.embed_tokens.select(0, image_token)), 0.0);
  const int64_t first_text = int64_t(f.input.input_ids.item({0}));
  EXPECT_GT(test::max_abs(tg.embed_tokens.select(0, first_text)), 0.0);
}

TEST(Compose, OneTowerCallForThePack) {
  const VisionLanguageModel& model = *shared_model().model;
  const Fixture f;
  SpliceContext ctx;
  const Tensor e = compose_embeddings(model, f.input.input_ids, f.input.cu_seqlens, f.media, &ctx);
  EXPECT_TRUE(ctx.ran_tower);
  ASSERT_EQ(ctx.tower.grid.size(), 3u);  // both images and the video, in one forward
  EXPECT_EQ(ctx.image_positions.size(), 3u);
  EXPECT_EQ(ctx.video_positions.size(), 2u);
  // Text rows keep their token embedding.
  const Tensor plain = model.text().embed(f.input.input_ids);
  EXPECT_EQ(rel_err(e.select(0, 0), plain.select(0, 0)), 0.0);
  EXPECT_GT(test::max_abs(e.select(0, ctx.image_positions[0])), 0.0);
}

TEST(Compose, PlaceholderMismatchNamesTheDocument) {
  const VisionLanguageModel& model = *shared_model().model;
  Fixture f;
  // Drop one image slot of document 1 (turn it into a plain text token).
  std::vector<double> types = f.media.mm_token_type_ids.to_doubles();
  const auto it = std::find(types.begin(), types.end(), 1.0);
  ASSERT_NE(it, types.end());
  *it = 0;
  f.media.mm_token_type_ids = Tensor::from_doubles(types, {int64_t(types.size())}, DType::i32);
  try {
    compose_embeddings(model, f.input.input_ids, f.input.cu_seqlens, f.media);
    FAIL() << "expected a glmtune::Error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("images.jsonl:4"), std::string::npos) << what;
    EXPECT_NE(what.find("2 image placeholder tokens"), std::string::npos) << what;
    EXPECT_NE(what.find("3"), std::string::npos) << what;
  }
  // A video's frames counted as image slots: both documents' counts are off.
  Fixture g;
  std::vector<double> vt = g.media.mm_token_type_ids.to_doubles();
  for (double& t : vt)
    if (t == 2) t = 1;
  g.media.mm_token_type_ids = Tensor::from_doubles(vt, {int64_t(vt.size())}, DType::i32);
  EXPECT_THROW(compose_embeddings(model, g.input.input_ids, g.input.cu_seqlens, g.media), Error);
}

TEST(Compose, MediaIdsOutsideTheVocabularyAreNamedWhenMediaArrive) {
  // transformers keeps the released media ids in a config of any vocabulary size: such a model
  // runs text, and a pack with media says which key to fix.
  FixtureModel& fixture = shared_model();
  Json doc = fixture.store->config().document();
  doc["image_token_id"] = 154854;
  doc["video_token_id"] = 154855;
  const ModelConfig config = ModelConfig::from_json(doc, "released-ids/config.json");
  const ParamStore store =
      ParamStore::load(io::CheckpointReader::open(fixture.dir.path() / "ck"), config);
  const VisionLanguageModel model(store);
  const Fixture f;
  try {
    compose_embeddings(model, f.input.input_ids, f.input.cu_seqlens, f.media);
    FAIL() << "expected a glmtune::Error";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const std::string& part :
         {std::string("released-ids/config.json: image_token_id"), std::string("154854"),
          std::to_string(config.text().vocab_size)})
      EXPECT_NE(what.find(part), std::string::npos) << what;
  }
  const Tensor text = compose_embeddings(model, f.input.input_ids, f.input.cu_seqlens, PackMedia{});
  EXPECT_EQ(text.size(0), f.input.input_ids.numel());
}

TEST(Compose, FrozenPartsKeepZeroGradients) {
  const VisionLanguageModel& model = *shared_model().model;
  const Fixture f;
  const text::TrainOptions opt = golden_train_options(f);
  text::TextGrads tg_all = text::TextGrads::zeros_like(model.text().weights());
  vision::VisionGrads vg_all = vision::VisionGrads::zeros_like(model.vision());
  compose_forward_backward(model, f.input, f.media, opt, {}, tg_all, vg_all);
  const auto want = vg_all.released(model.vision_config());

  for (const auto& [freeze_vision, freeze_projector] :
       std::vector<std::pair<bool, bool>>{{true, false}, {false, true}, {true, true}}) {
    SCOPED_TRACE(testing::Message()
                 << "freeze_vision " << freeze_vision << ", freeze_projector " << freeze_projector);
    ComposeOptions co;
    co.freeze_vision = freeze_vision;
    co.freeze_projector = freeze_projector;
    text::TextGrads tg = text::TextGrads::zeros_like(model.text().weights());
    vision::VisionGrads vg = vision::VisionGrads::zeros_like(model.vision());
    compose_forward_backward(model, f.input, f.media, opt, co, tg, vg);
    const auto got = vg.released(model.vision_config());
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const bool frozen =
          vision::is_projector_param(got[i].first) ? freeze_projector : freeze_vision;
      if (frozen)
        EXPECT_EQ(test::max_abs(got[i].second), 0.0) << got[i].first;
      else
        EXPECT_EQ(rel_err(got[i].second, want[i].second), 0.0) << got[i].first;
    }
    // The text model's gradients do not depend on what the vision side trains (some, e.g. of
    // experts no token reached, are legitimately zero).
    for (size_t i = 0; i < tg.named.size(); ++i)
      EXPECT_EQ(test::RelErr{}(tg.named[i].second, tg_all.named[i].second), 0.0)
          << tg.named[i].first;
  }
}

}  // namespace
