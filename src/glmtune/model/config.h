#pragma once
// The model configuration: the released `config.json` of Glm5NextForConditionalGeneration (nested
// text_config / vision_config) or its flat text-only form, with the derivations and validation of
// transformers 5.17.0 (`Glm5NextTextConfig.__post_init__`, `validate_architecture`). The original
// JSON document is kept so that writing the config back preserves every field, known or not.

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace glmtune::model {

using Json = nlohmann::ordered_json;

enum class AttnKind { kda, dsa };
enum class MlpKind { dense, sparse };
enum class IndexerKind { full, shared };

struct TextConfig {
  int64_t vocab_size = 154880;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 12288;
  int64_t moe_intermediate_size = 2048;
  int64_t num_hidden_layers = 45;
  int64_t num_attention_heads = 64;
  int64_t num_key_value_heads = 64;
  int64_t n_shared_experts = 1;
  int64_t n_routed_experts = 288;
  double routed_scaling_factor = 2.5;
  int64_t kv_lora_rank = 512;
  int64_t q_lora_rank = 1536;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 256;
  int64_t qk_nope_head_dim = 256;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  int64_t num_experts_per_tok = 8;
  bool norm_topk_prob = true;
  std::string hidden_act = "silu";
  double initializer_range = 0.02;
  double rms_norm_eps = 1e-5;
  int64_t pad_token_id = 154820;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  double attention_dropout = 0.0;
  int64_t index_topk = 2048;
  int64_t index_head_dim = 128;
  int64_t index_n_heads = 32;
  int64_t index_kpool = 16;  // class default; the release sets 4
  bool index_kpool_always_select_tail = true;
  double swiglu_limit = 10.0;
  int64_t linear_head_dim = 128;
  int64_t linear_num_heads = 64;
  int64_t linear_conv_kernel_dim = 4;
  std::optional<double> linear_lower_bound = -5.0;  // nullopt: softplus forget gate
  int64_t hc_mult = 4;
  double hc_eps = 1e-6;
  int64_t hc_sinkhorn_iters = 20;
  bool output_router_logits = false;
  double router_aux_loss_coef = 0.001;
  int64_t num_nextn_predict_layers = 0;  // MTP layers stored at layers.<num_hidden_layers + i>

  // Per-layer schedules, always of length num_hidden_layers after parsing.
  std::vector<AttnKind> layer_types;
  std::vector<MlpKind> mlp_layer_types;
  std::vector<IndexerKind> indexer_types;

  int64_t qk_head_dim() const { return qk_rope_head_dim + qk_nope_head_dim; }
  int64_t linear_width() const { return linear_num_heads * linear_head_dim; }  // QL
  bool has_mtp() const { return num_nextn_predict_layers > 0; }
  int64_t count(AttnKind kind) const;
  int64_t count(MlpKind kind) const;
};

struct VisionConfig {
  int64_t depth = 24;
  int64_t hidden_size = 1024;
  int64_t num_heads = 16;
  int64_t intermediate_size = 4096;
  std::string hidden_act = "silu";
  bool attention_bias = true;
  double attention_dropout = 0.0;
  int64_t in_channels = 3;
  int64_t patch_size = 14;
  int64_t temporal_patch_size = 2;
  int64_t spatial_merge_size = 2;
  int64_t out_hidden_size = 1536;
  int64_t projection_intermediate_size = 10240;
  double rms_norm_eps = 1e-5;
  double swiglu_limit = 10.0;
  double rope_theta = 10000.0;
  int64_t image_size = 336;
  double initializer_range = 0.02;

  int64_t head_dim() const { return hidden_size / num_heads; }
};

struct MediaTokens {
  int64_t image_token_id = 154854, video_token_id = 154855;
  int64_t image_start_token_id = 154830, image_end_token_id = 154831;
  int64_t video_start_token_id = 154832, video_end_token_id = 154833;
};

class ModelConfig {
 public:
  // Throws glmtune::Error naming the file, the field and the rule for anything invalid.
  static ModelConfig from_file(const std::string& path);
  static ModelConfig from_json(const Json& document, const std::string& source);
  // A built-in preset: "tiny", "crop25b" or "full".
  static ModelConfig preset(const std::string& name);
  static const std::vector<std::string>& preset_names();

  const TextConfig& text() const { return text_; }
  const std::optional<VisionConfig>& vision() const { return vision_; }
  const MediaTokens& media() const { return media_; }
  // Throws an Error naming the key, its value and the vocabulary size when a media token id lies
  // outside the vocabulary. Configs are accepted with such ids (text runs without them); this is
  // called where an image or a video is about to be spliced in. `where` names that work.
  void require_media_tokens(const std::string& where) const;
  bool is_flat() const { return flat_; }
  const std::string& source() const { return source_; }

  // The document as read (or as modified by set()), unknown fields included.
  const Json& document() const { return document_; }
  // The document with the derived schedules written out explicitly, as glmtune writes checkpoints.
  Json to_json_with_schedules() const;
  // Overrides one field by dotted path (e.g. "text_config.n_routed_experts"), then re-derives and
  // re-validates. `value` is parsed as JSON when it is valid JSON, else taken as a string.
  // When a per-layer length changes, derived schedules are re-derived.
  void set(const std::string& dotted_key, const std::string& value);
  // Applies several overrides, then re-derives and validates once; on error nothing changes.
  void set_all(const std::vector<std::pair<std::string, std::string>>& overrides);
  // Writes the document (indent 2, trailing newline) atomically.
  void save(const std::string& path, bool with_schedules) const;

 private:
  void parse();
  // Writes one override into the document without validating; true when it changes the layer
  // count.
  bool edit(const std::string& dotted_key, const std::string& value);
  void sync_schedule_copies();
  Json document_;
  std::string source_;
  bool flat_ = false;
  TextConfig text_;
  std::optional<VisionConfig> vision_;
  MediaTokens media_;
};

std::string_view to_string(AttnKind kind);
std::string_view to_string(MlpKind kind);
std::string_view to_string(IndexerKind kind);

}  // namespace glmtune::model
