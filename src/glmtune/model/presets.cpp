// Built-in model presets. `full` is the released GLM-5.3-Flash geometry (BF16, no quantization
// block), `crop25b` its 5-layer + MTP crop at full width, and `tiny` a CI-sized model that still
// exercises every code path: KDA and DSA layers, a sparse top-k that drops tokens, dense and MoE
// MLPs (KDA+dense, KDA+MoE, DSA+MoE), group-limited routing, MTP and a small vision tower.

#include "glmtune/base/error.h"
#include "glmtune/model/config.h"

namespace glmtune::model {
namespace {

// The released config.json with `layers` decoder layers (schedules cut to that length), in the
// release's key order.
Json released_document(int64_t layers) {
  Json layer_types = Json::array(), mlp_types = Json::array(), indexer_types = Json::array();
  Json kda = Json::array(), full = Json::array();
  for (int64_t i = 0; i < layers; ++i) {
    const bool dsa = i % 4 == 3;
    layer_types.push_back(dsa ? "deepseek_sparse_attention" : "linear_attention");
    mlp_types.push_back(i < 3 ? "dense" : "sparse");
    indexer_types.push_back("full");
    (dsa ? full : kda).push_back(i);
  }
  Json text = {
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"dtype", "bfloat16"},
      {"eos_token_id", {154820, 154827, 154829}},
      {"first_k_dense_replace", std::min<int64_t>(3, layers)},
      {"hc_eps", 1e-06},
      {"hc_mult", 4},
      {"hc_sinkhorn_iters", 20},
      {"head_dim", 0},
      {"hidden_act", "silu"},
      {"hidden_size", 4096},
      {"index_head_dim", 128},
      {"index_kpool", 4},
      {"index_kpool_always_select_tail", true},
      {"index_kpool_compress", true},
      {"index_n_heads", 32},
      {"index_topk", 2048},
      {"index_share_for_mtp_iteration", true},
      {"indexer_rope_interleave", true},
      {"indexer_types", indexer_types},
      {"initializer_range", 0.02},
      {"intermediate_size", 12288},
      {"kv_lora_rank", 512},
      {"layer_types", layer_types},
      {"linear_attn_config",
       {{"num_heads", 64},
        {"gate_lower_bound", -5.0},
        {"head_dim", 128},
        {"short_conv_kernel_size", 4},
        {"kda_layers", kda},
        {"full_attn_layers", full}}},
      {"max_position_embeddings", 1048576},
      {"mhc", true},
      {"mla_use_nope", true},
      {"mlp_layer_types", mlp_types},
      {"model_type", "glm5_next_text"},
      {"moe_intermediate_size", 2048},
      {"moe_router_dtype", "float32"},
      {"n_group", 1},
      {"n_routed_experts", 288},
      {"n_shared_experts", 1},
      {"norm_topk_prob", true},
      {"num_attention_heads", 64},
      {"num_experts_per_tok", 8},
      {"num_hidden_layers", layers},
      {"num_key_value_heads", 64},
      {"num_nextn_predict_layers", 1},
      {"output_router_logits", false},
      {"pad_token_id", 154820},
      {"q_lora_rank", 1536},
      {"qk_head_dim", 256},
      {"qk_nope_head_dim", 256},
      {"qk_rope_head_dim", 0},
      {"rms_norm_eps", 1e-05},
      {"routed_scaling_factor", 2.5},
      {"router_aux_loss_coef", 0.001},
      {"scoring_func", "sigmoid"},
      {"swiglu_limit", 10.0},
      {"tie_word_embeddings", false},
      {"topk_group", 1},
      {"topk_method", "noaux_tc"},
      {"use_cache", true},
      {"v_head_dim", 256},
      {"vocab_size", 154880},
  };
  Json vision = {
      {"attention_bias", true},
      {"attention_dropout", 0.0},
      {"depth", 24},
      {"hidden_act", "silu"},
      {"hidden_size", 1024},
      {"image_size", 448},
      {"in_channels", 3},
      {"initializer_range", 0.02},
      {"intermediate_size", 4096},
      {"model_type", "glm5_next_vision"},
      {"num_heads", 16},
      {"out_hidden_size", 4096},
      {"patch_size", 14},
      {"projection_intermediate_size", 10240},
      {"rms_norm_eps", 1e-05},
      {"spatial_merge_size", 2},
      {"swiglu_limit", 10.0},
      {"temporal_patch_size", 2},
  };
  return Json{{"architectures", {"Glm5NextForConditionalGeneration"}},
              {"text_config", text},
              {"vision_config", vision},
              {"image_token_id", 154854},
              {"video_token_id", 154855},
              {"image_start_token_id", 154830},
              {"image_end_token_id", 154831},
              {"video_start_token_id", 154832},
              {"video_end_token_id", 154833},
              {"tie_word_embeddings", false},
              {"model_type", "glm5_next"},
              {"transformers_version", "5.17.0"}};
}

// The bundled tiny tokenizer has 2000 byte-level BPE tokens followed by the 36 added tokens of the
// release in the release's order, so every special id is the released id minus 152820.
constexpr int64_t kTinyAddedBase = 2000;
int64_t tiny_id(int64_t released_id) { return released_id - 154820 + kTinyAddedBase; }

Json tiny_document() {
  Json doc = released_document(5);
  Json& t = doc["text_config"];
  t["vocab_size"] = 2048;
  t["pad_token_id"] = tiny_id(154820);
  t["eos_token_id"] = {tiny_id(154820), tiny_id(154827), tiny_id(154829)};
  t["hidden_size"] = 64;
  t["intermediate_size"] = 96;
  t["moe_intermediate_size"] = 32;
  t["num_attention_heads"] = 2;
  t["num_key_value_heads"] = 2;
  t["q_lora_rank"] = 32;
  t["kv_lora_rank"] = 16;
  t["qk_nope_head_dim"] = 16;
  t["qk_head_dim"] = 16;
  t["v_head_dim"] = 16;
  t["index_n_heads"] = 2;
  t["index_head_dim"] = 16;
  t["index_topk"] = 8;  // two pools of 4: longer documents really drop keys
  t["n_routed_experts"] = 8;
  t["num_experts_per_tok"] = 2;
  t["n_group"] = 2;
  t["topk_group"] = 1;
  t["max_position_embeddings"] = 4096;
  // Layer 0 dense, the rest MoE: covers KDA+dense, KDA+MoE and DSA+MoE.
  t["first_k_dense_replace"] = 1;
  t["mlp_layer_types"] = {"dense", "sparse", "sparse", "sparse", "sparse"};
  t["linear_attn_config"]["num_heads"] = 2;
  t["linear_attn_config"]["head_dim"] = 16;
  Json& v = doc["vision_config"];
  v["depth"] = 2;
  v["hidden_size"] = 32;
  v["num_heads"] = 2;
  v["intermediate_size"] = 64;
  v["out_hidden_size"] = 64;
  v["projection_intermediate_size"] = 96;
  v["image_size"] = 112;
  for (const char* key : {"image_token_id", "video_token_id", "image_start_token_id",
                          "image_end_token_id", "video_start_token_id", "video_end_token_id"})
    doc[key] = tiny_id(doc[key].get<int64_t>());
  return doc;
}

}  // namespace

const std::vector<std::string>& ModelConfig::preset_names() {
  static const std::vector<std::string> names = {"tiny", "crop25b", "full"};
  return names;
}

ModelConfig ModelConfig::preset(const std::string& name) {
  if (name == "tiny") return from_json(tiny_document(), "preset tiny");
  if (name == "crop25b") return from_json(released_document(5), "preset crop25b");
  if (name == "full") return from_json(released_document(45), "preset full");
  throw Error("unknown preset '" + name + "'", "--preset", "use one of: tiny, crop25b, full");
}

}  // namespace glmtune::model
