#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/model/config.h"
#include "glmtune/model/layout.h"

using namespace glmtune;
using namespace glmtune::model;

namespace {

const std::string kReleased =
    std::string(GLMTUNE_SOURCE_DIR) + "/tests/golden/config/released_config.json";

Json released() { return Json::parse(read_text_file(kReleased, "config")); }

// Parses `doc` and returns the error message, failing the test when parsing succeeds.
std::string error_of(const Json& doc) {
  try {
    ModelConfig::from_json(doc, "cfg.json");
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an error for " << doc.dump().substr(0, 200);
  return "";
}

#define EXPECT_ERROR(doc, ...)                                                                  \
  do {                                                                                          \
    std::string msg = error_of(doc);                                                            \
    for (const char* part : {__VA_ARGS__}) EXPECT_NE(msg.find(part), std::string::npos) << msg; \
  } while (0)

}  // namespace

TEST(Config, ParsesTheReleasedConfig) {
  ModelConfig c = ModelConfig::from_file(kReleased);
  const TextConfig& t = c.text();
  EXPECT_FALSE(c.is_flat());
  EXPECT_EQ(t.num_hidden_layers, 45);
  EXPECT_EQ(t.index_kpool, 4);
  EXPECT_EQ(t.count(AttnKind::dsa), 11);
  EXPECT_EQ(t.count(AttnKind::kda), 34);
  EXPECT_EQ(t.count(MlpKind::dense), 3);
  EXPECT_EQ(t.layer_types[3], AttnKind::dsa);
  EXPECT_EQ(t.layer_types[43], AttnKind::dsa);
  EXPECT_EQ(t.linear_head_dim, 128);
  EXPECT_EQ(t.linear_lower_bound, -5.0);
  EXPECT_EQ(t.num_nextn_predict_layers, 1);
  EXPECT_EQ(t.qk_head_dim(), 256);
  ASSERT_TRUE(c.vision().has_value());
  EXPECT_EQ(c.vision()->out_hidden_size, 4096);
  EXPECT_EQ(c.vision()->rope_theta, 10000.0);
  EXPECT_EQ(c.media().image_token_id, 154854);
}

TEST(Config, DerivesSchedulesLikeTheReference) {
  Json doc = released();
  Json& t = doc["text_config"];
  t.erase("layer_types");
  t.erase("mlp_layer_types");
  t.erase("indexer_types");
  t["num_hidden_layers"] = 9;
  t["first_k_dense_replace"] = 7;               // not read, as in the reference
  t["linear_attn_config"]["kda_layers"] = {0};  // not read either
  ModelConfig c = ModelConfig::from_json(doc, "cfg.json");
  EXPECT_EQ(c.text().count(MlpKind::dense), 3);
  EXPECT_EQ(c.text().layer_types[7], AttnKind::dsa);
  EXPECT_EQ(c.text().count(AttnKind::dsa), 2);
  for (auto k : c.text().indexer_types) EXPECT_EQ(k, IndexerKind::full);

  // A shared DSA layer needs a full DSA layer right before it: layers 0 and 1 are DSA.
  t["layer_types"] = {"full_attention",   "deepseek_sparse_attention", "linear_attention",
                      "linear_attention", "linear_attention",          "linear_attention",
                      "linear_attention", "linear_attention",          "linear_attention"};
  t["index_topk_freq"] = 2;
  t["index_skip_topk_offset"] = 1;
  c = ModelConfig::from_json(doc, "cfg.json");
  EXPECT_EQ(c.text().layer_types[0], AttnKind::dsa);  // the full_attention alias
  // freq 2, offset 1: layer i is full iff max(i, 0) % 2 == 0.
  EXPECT_EQ(c.text().indexer_types[0], IndexerKind::full);
  EXPECT_EQ(c.text().indexer_types[2], IndexerKind::full);
  EXPECT_EQ(c.text().indexer_types[1], IndexerKind::shared);
  EXPECT_EQ(c.text().indexer_types[3], IndexerKind::shared);

  t["index_topk_pattern"] = "FFSFFFFFF";
  t["layer_types"][2] = "deepseek_sparse_attention";
  c = ModelConfig::from_json(doc, "cfg.json");
  EXPECT_EQ(c.text().indexer_types[2], IndexerKind::shared);
  EXPECT_EQ(c.text().indexer_types[1], IndexerKind::full);
}

TEST(Config, LinearAttnConfigAndHeadDimOverride) {
  Json doc = released();
  Json& t = doc["text_config"];
  t["linear_attn_config"] = {{"num_heads", 8}, {"head_dim", 32}, {"short_conv_kernel_size", 3}};
  t["linear_lower_bound"] = nullptr;
  t["head_dim"] = 999;  // always replaced by qk_rope_head_dim
  ModelConfig c = ModelConfig::from_json(doc, "cfg.json");
  EXPECT_EQ(c.text().linear_num_heads, 8);
  EXPECT_EQ(c.text().linear_head_dim, 32);
  EXPECT_EQ(c.text().linear_conv_kernel_dim, 3);
  EXPECT_EQ(c.text().linear_lower_bound, -5.0);  // safe_gate defaults on
  t["linear_attn_config"]["safe_gate"] = false;
  c = ModelConfig::from_json(doc, "cfg.json");
  EXPECT_FALSE(c.text().linear_lower_bound.has_value());  // softplus gate
}

TEST(Config, FlatTextOnlyForm) {
  Json flat = released()["text_config"];
  ModelConfig c = ModelConfig::from_json(flat, "flat.json");
  EXPECT_TRUE(c.is_flat());
  EXPECT_FALSE(c.vision().has_value());
  EXPECT_EQ(c.text().hidden_size, 4096);
  c.set("text_config.n_routed_experts", "16");  // the nested spelling works on flat configs
  EXPECT_EQ(c.text().n_routed_experts, 16);
}

TEST(Config, ValidationNamesFieldAndRule) {
  Json doc = released();
  doc["text_config"]["index_topk"] = 2046;
  EXPECT_ERROR(doc, "cfg.json: text_config.index_topk", "not divisible by index_kpool");
  doc = released();
  doc["text_config"]["index_kpool"] = 0;
  EXPECT_ERROR(doc, "text_config.index_kpool", "at least 1");
  doc = released();
  doc["text_config"]["num_key_value_heads"] = 8;
  EXPECT_ERROR(doc, "text_config.num_key_value_heads", "must equal num_attention_heads");
  doc = released();
  doc["text_config"]["q_lora_rank"] = nullptr;
  EXPECT_ERROR(doc, "text_config.q_lora_rank", "must not be null");
  doc = released();
  doc["text_config"]["qk_rope_head_dim"] = 64;
  EXPECT_ERROR(doc, "text_config.qk_rope_head_dim", "must be 0");
  doc = released();
  doc["text_config"]["indexer_types"][3] = "shared";  // layer 2 is KDA: nothing to share from
  EXPECT_ERROR(doc, "text_config.indexer_types", "layer 3 is a \"shared\" DSA layer");
  doc = released();
  doc["text_config"]["layer_types"][0] = "sliding_attention";
  EXPECT_ERROR(doc, "text_config.layer_types", "unknown entry 'sliding_attention'");
  doc = released();
  doc["text_config"]["mlp_layer_types"].erase(0);
  EXPECT_ERROR(doc, "text_config.mlp_layer_types", "has 44 entries but num_hidden_layers is 45");
  doc = released();
  doc["text_config"]["hidden_size"] = "4096";
  EXPECT_ERROR(doc, "text_config.hidden_size", "expected an integer");
  doc = released();
  doc["text_config"]["hidden_act"] = "gelu";
  EXPECT_ERROR(doc, "text_config.hidden_act", "unsupported activation");
  doc = released();
  doc["vision_config"]["out_hidden_size"] = 1536;
  EXPECT_ERROR(doc, "vision_config.out_hidden_size", "must equal text_config.hidden_size");
  doc = released();
  doc["vision_config"]["rope_parameters"] = {{"rope_type", "default"}};
  EXPECT_ERROR(doc, "vision_config.rope_parameters.rope_type", "unsupported rope type");
  doc = released();
  doc["text_config"]["num_experts_per_tok"] = 400;
  EXPECT_ERROR(doc, "text_config.num_experts_per_tok", "cannot be chosen");
  doc = released();
  doc["text_config"]["n_group"] = 7;
  EXPECT_ERROR(doc, "text_config.n_group", "not divisible");
  doc = released();
  doc["text_config"]["num_nextn_predict_layers"] = 2;
  EXPECT_ERROR(doc, "text_config.num_nextn_predict_layers", "one MTP layer");
  doc = released();
  doc["model_type"] = "llama";
  EXPECT_ERROR(doc, "not a GLM-5.3-Flash model");
  EXPECT_ERROR(Json::array(), "must be a JSON object");
}

TEST(Config, ReleasedMediaIdsInASmallVocabularyLoad) {
  // What transformers writes for a small vocabulary: its defaults keep the released media ids.
  Json doc = ModelConfig::preset("tiny").document();
  const std::vector<std::pair<std::string, int64_t>> released_ids = {
      {"image_token_id", 154854},       {"video_token_id", 154855},
      {"image_start_token_id", 154830}, {"image_end_token_id", 154831},
      {"video_start_token_id", 154832}, {"video_end_token_id", 154833}};
  for (const auto& [key, id] : released_ids) doc[key] = id;
  const ModelConfig config = ModelConfig::from_json(doc, "cfg.json");
  EXPECT_EQ(config.text().vocab_size, 2048);
  EXPECT_EQ(config.media().image_token_id, 154854);
  // Only placing an image or a video needs them: then the error names the key, the value, the
  // vocabulary and the file.
  try {
    config.require_media_tokens("the pack has images");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const char* part : {"cfg.json: image_token_id", "154854", "2048", "the pack has images"})
      EXPECT_NE(what.find(part), std::string::npos) << what;
    EXPECT_NE(e.fix().find("image_token_id"), std::string::npos) << e.fix();
  }
  // The ids that text uses are still checked when the config is read.
  doc["text_config"]["pad_token_id"] = 5000;
  EXPECT_ERROR(doc, "pad_token_id");
  // The tiny preset's own ids lie inside its vocabulary.
  EXPECT_NO_THROW(ModelConfig::preset("tiny").require_media_tokens("images"));
}

TEST(Config, BadFileErrors) {
  auto dir = std::filesystem::temp_directory_path() / ("glmtune_cfg_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "bad.json") << "{\"text_config\": {,}";
  try {
    ModelConfig::from_file((dir / "bad.json").string());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ModelConfig::from_file((dir / "missing.json").string()), Error);
  EXPECT_THROW(ModelConfig::from_file(dir.string()), Error);
  std::filesystem::remove_all(dir);
}

TEST(Config, RefusesNumbersBeyondTheirRange) {
  // A number no double holds is an error naming the file, not an nlohmann exception.
  auto dir =
      std::filesystem::temp_directory_path() / ("glmtune_cfgn_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "huge.json") << "{\"vocab_size\": 1e999}";
  try {
    ModelConfig::from_file((dir / "huge.json").string());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1e999"), std::string::npos) << e.what();
    EXPECT_NE(e.where().find("huge.json"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);

  // Integer fields: a float beyond int64 (undefined to convert) or an unsigned beyond int64 (it
  // would wrap to a negative number).
  Json doc = released();
  doc["text_config"]["num_hidden_layers"] = 1e300;
  EXPECT_ERROR(doc, "text_config.num_hidden_layers", "beyond the 64-bit integer range");
  doc = released();
  doc["text_config"]["qk_rope_head_dim"] = std::numeric_limits<uint64_t>::max();
  EXPECT_ERROR(doc, "text_config.qk_rope_head_dim", "beyond the 64-bit integer range");
  // Sizes that allocate per item are capped far above the release.
  doc = released();
  doc["text_config"]["num_hidden_layers"] = 2000000000;
  EXPECT_ERROR(doc, "text_config.num_hidden_layers", "must be at most 1024");
  doc = released();
  doc["text_config"]["num_hidden_layers"] = 1024;
  doc["text_config"].erase("layer_types");
  doc["text_config"].erase("mlp_layer_types");
  doc["text_config"].erase("indexer_types");
  EXPECT_EQ(ModelConfig::from_json(doc, "cfg.json").text().layer_types.size(), 1024u);
  doc = released();
  doc["text_config"]["vocab_size"] = int64_t{1} << 40;
  EXPECT_ERROR(doc, "text_config.vocab_size", "must be at most 16777216");
  doc = released();
  doc["text_config"]["n_routed_experts"] = 1 << 20;
  EXPECT_ERROR(doc, "text_config.n_routed_experts", "must be at most 16384");
  doc = released();
  doc["vision_config"]["depth"] = 5000;
  EXPECT_ERROR(doc, "vision_config.depth", "must be at most 1024");
  // `i - offset + 1` of the indexer schedule must not overflow.
  EXPECT_ERROR(Json({{"index_skip_topk_offset", std::numeric_limits<int64_t>::min()}}),
               "index_skip_topk_offset", "must be at least -2147483648");

  // --set: a value nlohmann cannot hold, and a key below a field that is not an object.
  ModelConfig c = ModelConfig::preset("tiny");
  try {
    c.set("text_config.vocab_size", "1e999");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.where(), "--set text_config.vocab_size");
    EXPECT_NE(std::string(e.what()).find("1e999"), std::string::npos) << e.what();
  }
  try {
    c.set("text_config.hidden_size.x", "1");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'hidden_size' is not an object"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(c.set("text_config.num_hidden_layers", "2000000000"), Error);
  EXPECT_EQ(c.text().num_hidden_layers, 5);
}

TEST(Config, WritesBackLosslessly) {
  Json doc = released();
  doc["text_config"]["some_future_field"] = {{"nested", {1, 2, 3}}};
  doc["custom_top_level"] = "kept";
  ModelConfig c = ModelConfig::from_json(doc, "cfg.json");
  auto dir =
      std::filesystem::temp_directory_path() / ("glmtune_cfgw_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "config.json").string();
  c.save(path, false);
  Json back = Json::parse(read_text_file(path, "config"));
  EXPECT_EQ(back, doc);
  // Key order is kept too (the released file is not sorted).
  EXPECT_EQ(back.begin().key(), "architectures");
  ModelConfig again = ModelConfig::from_file(path);
  EXPECT_EQ(again.text().layer_types, c.text().layer_types);
  std::filesystem::remove_all(dir);
}

TEST(Config, SetOverridesFields) {
  ModelConfig c = ModelConfig::preset("crop25b");
  c.set("text_config.n_routed_experts", "36");
  EXPECT_EQ(c.text().n_routed_experts, 36);
  c.set("vision_config.depth", "2");
  EXPECT_EQ(c.vision()->depth, 2);
  // Changing the layer count re-derives schedules that were the default ones.
  c.set("text_config.num_hidden_layers", "8");
  EXPECT_EQ(c.text().layer_types.size(), 8u);
  EXPECT_EQ(c.text().layer_types[7], AttnKind::dsa);
  EXPECT_EQ(c.document()["text_config"]["linear_attn_config"]["full_attn_layers"], Json({3, 7}));
  try {
    c.set("text_config.n_routed_expert", "36");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown field 'n_routed_expert'"), std::string::npos)
        << e.what();
  }
  try {
    c.set("text_config.index_topk", "7");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not divisible"), std::string::npos) << e.what();
  }
  EXPECT_THROW(c.set("text_config..x", "1"), Error);
}

TEST(Config, SetAllValidatesOverridesTogether) {
  ModelConfig c = ModelConfig::preset("tiny");
  // Alone, either change breaks the rule that the vision output width equals the text width.
  EXPECT_THROW(c.set("text_config.hidden_size", "96"), Error);
  EXPECT_EQ(c.text().hidden_size, 64);  // a failed override changes nothing
  c.set_all({{"text_config.hidden_size", "96"}, {"vision_config.out_hidden_size", "96"}});
  EXPECT_EQ(c.text().hidden_size, 96);
  EXPECT_EQ(c.vision()->out_hidden_size, 96);
  EXPECT_THROW(c.set_all({{"text_config.num_attention_heads", "4"}}), Error);
  c.set_all({{"text_config.num_attention_heads", "4"}, {"text_config.num_key_value_heads", "4"}});
  EXPECT_EQ(c.text().num_attention_heads, 4);
}

TEST(Layout, CountsMatchTheRelease) {
  // The published sizes (docs/checkpoints.md, "Presets"): 24.95B for the 5-layer crop in 3100
  // tensors (0.56B vision, 1.27B embeddings + head, 7.43B MTP), 321.02B for the full model
  // (313.03B text + 7.43B MTP + 0.56B vision), each within 0.5%. Counting reads shapes only:
  // nothing is allocated.
  auto within = [](double got, double want) { return std::abs(got / want - 1.0) < 0.005; };
  ModelConfig crop = ModelConfig::preset("crop25b");
  ParamCounts n = count_params(crop, released_layout(crop));
  EXPECT_TRUE(within(n.total, 24.95e9)) << n.total;
  EXPECT_EQ(n.vision, 563'627'008);  // the released vision tower + projector, exact
  EXPECT_TRUE(within(n.embeddings_and_head, 1.27e9)) << n.embeddings_and_head;
  EXPECT_TRUE(within(n.mtp, 7.43e9)) << n.mtp;
  EXPECT_EQ(n.tensors, 3100);
  ModelConfig full = ModelConfig::preset("full");
  ParamCounts f = count_params(full, released_layout(full));
  EXPECT_TRUE(within(f.total, 321.02e9)) << f.total;
  EXPECT_TRUE(within(f.text, 313.03e9)) << f.text;
  EXPECT_TRUE(within(f.mtp, 7.43e9)) << f.mtp;
  EXPECT_EQ(f.tensors, 38770);  // the BF16 release's tensor count
  EXPECT_EQ(f.per_layer_kind["dsa+moe"].layers, 11);
  EXPECT_EQ(f.per_layer_kind["kda+dense"].layers, 3);
  EXPECT_EQ(f.per_layer_kind["kda+moe"].layers, 31);
}

TEST(Layout, TinyExercisesEveryPath) {
  ModelConfig tiny = ModelConfig::preset("tiny");
  const TextConfig& t = tiny.text();
  ParamCounts n = count_params(tiny, released_layout(tiny));
  EXPECT_EQ(n.per_layer_kind.size(), 3u);  // kda+dense, kda+moe, dsa+moe
  EXPECT_GT(n.mtp, 0);
  EXPECT_GT(n.vision, 0);
  EXPECT_LT(t.index_topk, 32);  // a sparse top-k that drops keys on short documents
  EXPECT_GT(t.n_group, 1);
  EXPECT_LT(n.total, 2'000'000);
}

TEST(Layout, DTypePolicy) {
  ModelConfig tiny = ModelConfig::preset("tiny");
  int fp32 = 0;
  for (const auto& p : released_layout(tiny)) {
    const bool kept = p.name.ends_with("A_log") || p.name.ends_with("dt_bias") ||
                      p.name.ends_with("conv1d.weight") ||
                      p.name.ends_with("e_score_correction_bias") || p.name.ends_with("_base") ||
                      p.name.ends_with("_scale");
    EXPECT_EQ(p.dtype, kept ? DType::f32 : DType::bf16) << p.name;
    fp32 += kept;
    if (p.name.find("indexer.") != std::string::npos || p.name.ends_with("e_score_correction_bias"))
      EXPECT_FALSE(p.trainable) << p.name;
  }
  EXPECT_GT(fp32, 0);
}
