#include "glmtune/model/layout.h"

#include <fmt/format.h>

namespace glmtune::model {
namespace {

class LayoutBuilder {
 public:
  explicit LayoutBuilder(const ModelConfig& config)
      : c_(config.text()), std_(c_.initializer_range) {}

  void add(std::string name, Shape shape, InitRule init, Component component, int64_t layer,
           bool trainable = true, double std = -1) {
    DType dtype = is_fp32_kept(name) ? DType::f32 : DType::bf16;
    out.push_back({std::move(name), std::move(shape), dtype, init, std < 0 ? std_ : std, component,
                   layer, trainable});
  }

  void hyper_connections(const std::string& p, int64_t l) {
    const int64_t H = c_.hc_mult, D = c_.hidden_size;
    for (const char* site : {"attn", "ffn"}) {
      // The fn init std is fixed at 0.02 in the reference, whatever initializer_range says.
      add(fmt::format("{}hc_{}_fn", p, site), {(2 + H) * H, H * D}, InitRule::normal,
          Component::layer, l, true, 0.02);
      add(fmt::format("{}hc_{}_base", p, site), {(2 + H) * H}, InitRule::zeros, Component::layer,
          l);
      add(fmt::format("{}hc_{}_scale", p, site), {3}, InitRule::ones, Component::layer, l);
    }
  }

  void kda(const std::string& p, int64_t l) {
    const int64_t D = c_.hidden_size, QL = c_.linear_width(), HL = c_.linear_head_dim,
                  NL = c_.linear_num_heads, K = c_.linear_conv_kernel_dim;
    const std::string a = p + "self_attn.";
    for (const char* proj : {"q_proj", "k_proj", "v_proj"})
      add(a + proj + ".weight", {QL, D}, InitRule::normal, Component::layer, l);
    for (const char* conv : {"q_conv1d", "k_conv1d", "v_conv1d"})
      add(a + conv + ".weight", {QL, 1, K}, InitRule::normal, Component::layer, l);
    add(a + "f_a_proj.weight", {HL, D}, InitRule::normal, Component::layer, l);
    add(a + "f_b_proj.weight", {QL, HL}, InitRule::normal, Component::layer, l);
    add(a + "dt_bias", {QL}, InitRule::dt_bias, Component::layer, l);
    add(a + "A_log", {NL}, InitRule::a_log, Component::layer, l);
    add(a + "b_proj.weight", {NL, D}, InitRule::normal, Component::layer, l);
    add(a + "g_a_proj.weight", {HL, D}, InitRule::normal, Component::layer, l);
    add(a + "g_b_proj.weight", {QL, HL}, InitRule::normal, Component::layer, l);
    add(a + "o_norm.weight", {HL}, InitRule::ones, Component::layer, l);
    add(a + "o_proj.weight", {D, QL}, InitRule::normal, Component::layer, l);
  }

  void dsa(const std::string& p, int64_t l, Component comp, bool own_indexer) {
    const int64_t D = c_.hidden_size, NH = c_.num_attention_heads, Rq = c_.q_lora_rank,
                  Rkv = c_.kv_lora_rank, Dqk = c_.qk_head_dim(), Dn = c_.qk_nope_head_dim,
                  Dv = c_.v_head_dim, Dr = c_.qk_rope_head_dim;
    const std::string a = p + "self_attn.";
    add(a + "q_a_proj.weight", {Rq, D}, InitRule::normal, comp, l);
    if (c_.attention_bias) add(a + "q_a_proj.bias", {Rq}, InitRule::zeros, comp, l);
    add(a + "q_a_layernorm.weight", {Rq}, InitRule::ones, comp, l);
    add(a + "q_b_proj.weight", {NH * Dqk, Rq}, InitRule::normal, comp, l);
    add(a + "kv_a_proj_with_mqa.weight", {Rkv + Dr, D}, InitRule::normal, comp, l);
    if (c_.attention_bias) add(a + "kv_a_proj_with_mqa.bias", {Rkv + Dr}, InitRule::zeros, comp, l);
    add(a + "kv_a_layernorm.weight", {Rkv}, InitRule::ones, comp, l);
    add(a + "kv_b_proj.weight", {NH * (Dn + Dv), Rkv}, InitRule::normal, comp, l);
    add(a + "o_proj.weight", {D, NH * Dv}, InitRule::normal, comp, l);
    if (c_.attention_bias) add(a + "o_proj.bias", {D}, InitRule::zeros, comp, l);
    if (!own_indexer) return;
    const int64_t IH = c_.index_n_heads, ID = c_.index_head_dim, P = c_.index_kpool;
    const std::string x = a + "indexer.";
    add(x + "wq_b.weight", {IH * ID, Rq}, InitRule::normal, comp, l, false);
    add(x + "wk.weight", {ID, D}, InitRule::normal, comp, l, false);
    add(x + "k_norm.weight", {ID}, InitRule::ones, comp, l, false);
    add(x + "k_norm.bias", {ID}, InitRule::zeros, comp, l, false);
    add(x + "weights_proj.weight", {IH, D}, InitRule::normal, comp, l, false);
    add(x + "index_kpool_compress_ape", {P, ID}, InitRule::zeros, comp, l, false);
    add(x + "index_kpool_compress_gate", {ID, D}, InitRule::ones, comp, l, false);
  }

  void dense_mlp(const std::string& p, int64_t l) {
    const int64_t D = c_.hidden_size, I = c_.intermediate_size;
    add(p + "mlp.gate_proj.weight", {I, D}, InitRule::normal, Component::layer, l);
    add(p + "mlp.up_proj.weight", {I, D}, InitRule::normal, Component::layer, l);
    add(p + "mlp.down_proj.weight", {D, I}, InitRule::normal, Component::layer, l);
  }

  void moe(const std::string& p, int64_t l, Component comp) {
    const int64_t D = c_.hidden_size, E = c_.n_routed_experts, Im = c_.moe_intermediate_size,
                  Is = c_.moe_intermediate_size * c_.n_shared_experts;
    add(p + "mlp.gate.weight", {E, D}, InitRule::normal, comp, l);
    add(p + "mlp.gate.e_score_correction_bias", {E}, InitRule::zeros, comp, l, false);
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = fmt::format("{}mlp.experts.{}.", p, e);
      add(x + "gate_proj.weight", {Im, D}, InitRule::normal, comp, l);
      add(x + "up_proj.weight", {Im, D}, InitRule::normal, comp, l);
      add(x + "down_proj.weight", {D, Im}, InitRule::normal, comp, l);
    }
    if (c_.n_shared_experts > 0) {
      add(p + "mlp.shared_experts.gate_proj.weight", {Is, D}, InitRule::normal, comp, l);
      add(p + "mlp.shared_experts.up_proj.weight", {Is, D}, InitRule::normal, comp, l);
      add(p + "mlp.shared_experts.down_proj.weight", {D, Is}, InitRule::normal, comp, l);
    }
  }

  void norms(const std::string& p, int64_t l, Component comp) {
    add(p + "input_layernorm.weight", {c_.hidden_size}, InitRule::ones, comp, l);
    add(p + "post_attention_layernorm.weight", {c_.hidden_size}, InitRule::ones, comp, l);
  }

  std::vector<ParamSpec> out;

 private:
  const TextConfig& c_;
  double std_;
};

void add_vision(std::vector<ParamSpec>& out, const VisionConfig& v) {
  const double s = v.initializer_range;
  auto add = [&](std::string name, Shape shape, InitRule init) {
    out.push_back({"model.visual." + std::move(name), std::move(shape), DType::bf16, init, s,
                   Component::vision, -1, true});
  };
  const int64_t W = v.hidden_size, I = v.intermediate_size, O = v.out_hidden_size,
                P = v.projection_intermediate_size, hd = v.head_dim(), m = v.spatial_merge_size;
  add("patch_embed.proj.weight",
      {W, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size}, InitRule::normal);
  add("patch_embed.proj.bias", {W}, InitRule::zeros);
  for (int64_t b = 0; b < v.depth; ++b) {
    const std::string x = fmt::format("blocks.{}.", b);
    add(x + "norm1.weight", {W}, InitRule::ones);
    add(x + "norm2.weight", {W}, InitRule::ones);
    add(x + "attn.qkv.weight", {3 * W, W}, InitRule::normal);
    if (v.attention_bias) add(x + "attn.qkv.bias", {3 * W}, InitRule::zeros);
    add(x + "attn.q_norm.weight", {hd}, InitRule::ones);
    add(x + "attn.k_norm.weight", {hd}, InitRule::ones);
    add(x + "attn.proj.weight", {W, W}, InitRule::normal);
    if (v.attention_bias) add(x + "attn.proj.bias", {W}, InitRule::zeros);
    for (const char* proj : {"gate_proj", "up_proj"}) {
      add(x + "mlp." + proj + ".weight", {I, W}, InitRule::normal);
      if (v.attention_bias) add(x + "mlp." + proj + ".bias", {I}, InitRule::zeros);
    }
    add(x + "mlp.down_proj.weight", {W, I}, InitRule::normal);
    if (v.attention_bias) add(x + "mlp.down_proj.bias", {W}, InitRule::zeros);
  }
  add("post_layernorm.weight", {W}, InitRule::ones);
  add("downsample.weight", {O, W, m, m}, InitRule::normal);
  add("downsample.bias", {O}, InitRule::zeros);
  add("merger.proj.weight", {O, O}, InitRule::normal);
  add("merger.post_projection_norm.weight", {O}, InitRule::ones);
  add("merger.post_projection_norm.bias", {O}, InitRule::zeros);
  add("merger.gate_proj.weight", {P, O}, InitRule::normal);
  add("merger.up_proj.weight", {P, O}, InitRule::normal);
  add("merger.down_proj.weight", {O, P}, InitRule::normal);
}

}  // namespace

bool is_fp32_kept(const std::string& name) {
  auto ends_with = [&](std::string_view suffix) { return name.ends_with(suffix); };
  const bool hyper_connection = name.find(".hc_") != std::string::npos;
  return ends_with("A_log") || ends_with("dt_bias") || ends_with("e_score_correction_bias") ||
         ends_with("conv1d.weight") ||
         (hyper_connection && (ends_with("_base") || ends_with("_scale")));
}

std::vector<ParamSpec> released_layout(const ModelConfig& config) {
  const TextConfig& c = config.text();
  LayoutBuilder b(config);
  const std::string root = "model.language_model.";
  b.add(root + "embed_tokens.weight", {c.vocab_size, c.hidden_size}, InitRule::embedding,
        Component::embeddings_and_head, -1);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("{}layers.{}.", root, l);
    b.norms(p, l, Component::layer);
    b.hyper_connections(p, l);
    if (c.layer_types[l] == AttnKind::kda)
      b.kda(p, l);
    else
      b.dsa(p, l, Component::layer, c.indexer_types[l] == IndexerKind::full);
    if (c.mlp_layer_types[l] == MlpKind::dense)
      b.dense_mlp(p, l);
    else
      b.moe(p, l, Component::layer);
  }
  b.add(root + "norm.weight", {c.hidden_size}, InitRule::ones, Component::final_norm, -1);
  if (c.has_mtp()) {
    // One pre-norm DSA + MoE layer without hyper-connections, sharing embedding and head.
    const int64_t l = c.num_hidden_layers;
    const std::string p = fmt::format("{}layers.{}.", root, l);
    b.add(p + "eh_proj.weight", {c.hidden_size, 2 * c.hidden_size}, InitRule::normal,
          Component::mtp, l);
    b.add(p + "enorm.weight", {c.hidden_size}, InitRule::ones, Component::mtp, l);
    b.add(p + "hnorm.weight", {c.hidden_size}, InitRule::ones, Component::mtp, l);
    b.norms(p, l, Component::mtp);
    b.dsa(p, l, Component::mtp, true);
    b.moe(p, l, Component::mtp);
    b.add(p + "shared_head.norm.weight", {c.hidden_size}, InitRule::ones, Component::mtp, l);
  }
  if (!c.tie_word_embeddings)
    b.add("lm_head.weight", {c.vocab_size, c.hidden_size}, InitRule::normal,
          Component::embeddings_and_head, -1);
  if (config.vision()) add_vision(b.out, *config.vision());
  return std::move(b.out);
}

std::string layer_kind_name(const TextConfig& text, int64_t layer) {
  return fmt::format("{}+{}", text.layer_types[layer] == AttnKind::kda ? "kda" : "dsa",
                     text.mlp_layer_types[layer] == MlpKind::dense ? "dense" : "moe");
}

ParamCounts count_params(const ModelConfig& config, const std::vector<ParamSpec>& layout) {
  const TextConfig& c = config.text();
  ParamCounts n;
  std::map<int64_t, int64_t> per_layer;
  auto part_of = [&](const std::string& name) -> std::string {
    if (name.find(".hc_") != std::string::npos) return "hyper_connections";
    if (name.find("self_attn.indexer.") != std::string::npos) return "dsa_indexer";
    if (name.find("mlp.experts.") != std::string::npos) return "moe_experts";
    if (name.find("mlp.gate.") != std::string::npos) return "moe_router";
    if (name.find("mlp.shared_experts.") != std::string::npos) return "moe_shared_expert";
    if (name.find("layernorm.weight") != std::string::npos &&
        name.find("self_attn.") == std::string::npos)
      return "norms";
    if (name.find(".mlp.") != std::string::npos) return "dense_mlp";
    return "";
  };
  for (const auto& p : layout) {
    const int64_t k = p.numel();
    n.total += k;
    n.tensors++;
    n.bytes += k * int64_t(dtype_size(p.dtype));
    if (p.trainable) n.trainable += k;
    switch (p.component) {
      case Component::embeddings_and_head:
        n.embeddings_and_head += k;
        n.text += k;
        break;
      case Component::final_norm:
        n.text += k;
        break;
      case Component::mtp:
        n.mtp += k;
        break;
      case Component::vision:
        n.vision += k;
        break;
      case Component::layer: {
        n.text += k;
        per_layer[p.layer] += k;
        std::string part = part_of(p.name);
        if (part.empty())
          part = c.layer_types[p.layer] == AttnKind::kda ? "kda_attention" : "dsa_attention";
        n.per_part[part] += k;
        break;
      }
    }
  }
  for (auto [layer, k] : per_layer) {
    auto& kind = n.per_layer_kind[layer_kind_name(c, layer)];
    kind.layers++;
    kind.params += k;
  }
  return n;
}

}  // namespace glmtune::model
