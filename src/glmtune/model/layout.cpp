#include "glmtune/model/layout.h"

#include <fmt/format.h>

#include <memory>
#include <string_view>

#include "glmtune/model/text/weights.h"
#include "glmtune/model/vision/tower.h"

namespace glmtune::model {
namespace {

// The text layers' fields in their released shapes (the fused tensors, split when listed, in
// their fused shapes).
ops::Linear projection(int64_t out, int64_t in, bool bias = false) {
  return ops::Linear(shape_only({out, in}), bias ? shape_only({out}) : Tensor());
}

ops::MlpParams mlp_shapes(int64_t width, int64_t hidden) {
  ops::MlpParams m;
  m.gate_proj = projection(width, hidden);
  m.up_proj = projection(width, hidden);
  m.down_proj = projection(hidden, width);
  return m;
}

ops::KdaParams kda_shapes(const TextConfig& c) {
  const int64_t D = c.hidden_size, QL = c.linear_width(), HL = c.linear_head_dim,
                NL = c.linear_num_heads;
  ops::KdaParams k;
  k.q_proj = projection(QL, D);
  k.k_proj = projection(QL, D);
  k.v_proj = projection(QL, D);
  k.conv1d = shape_only({3 * QL, 1, c.linear_conv_kernel_dim});  // q | k | v, split when released
  k.f_a_proj = projection(HL, D);
  k.f_b_proj = projection(QL, HL);
  k.dt_bias = shape_only({QL});
  k.A_log = shape_only({NL});
  k.b_proj = projection(NL, D);
  k.g_a_proj = projection(HL, D);
  k.g_b_proj = projection(QL, HL);
  k.o_norm = shape_only({HL});
  k.o_proj = projection(D, QL);
  return k;
}

ops::DsaParams dsa_shapes(const TextConfig& c, bool own_indexer) {
  const int64_t D = c.hidden_size, NH = c.num_attention_heads, Rq = c.q_lora_rank,
                Rkv = c.kv_lora_rank, Dr = c.qk_rope_head_dim;
  const bool bias = c.attention_bias;
  ops::DsaParams d;
  d.mla.q_a_proj = projection(Rq, D, bias);
  d.mla.q_a_layernorm = shape_only({Rq});
  d.mla.q_b_proj = projection(NH * c.qk_head_dim(), Rq);
  d.mla.kv_a_proj_with_mqa = projection(Rkv + Dr, D, bias);
  d.mla.kv_a_layernorm = shape_only({Rkv});
  d.mla.kv_b_proj = projection(NH * (c.qk_nope_head_dim + c.v_head_dim), Rkv);
  d.mla.o_proj = projection(D, NH * c.v_head_dim, bias);
  if (!own_indexer) return d;
  const int64_t IH = c.index_n_heads, ID = c.index_head_dim;
  d.indexer.wq_b = projection(IH * ID, Rq);
  d.indexer.wk = projection(ID, D);
  d.indexer.k_norm_weight = shape_only({ID});
  d.indexer.k_norm_bias = shape_only({ID});
  d.indexer.weights_proj = projection(IH, D);
  d.indexer.kpool_ape = shape_only({c.index_kpool, ID});
  d.indexer.kpool_gate = shape_only({ID, D});
  return d;
}

ops::MoeParams moe_shapes(const TextConfig& c) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, Im = c.moe_intermediate_size;
  ops::MoeParams m;
  m.router_weight = shape_only({E, D});
  m.e_score_correction_bias = shape_only({E});
  m.gate_up_proj = ops::Linear(shape_only({E, 2 * Im, D}));  // per expert when released
  m.down_proj = ops::Linear(shape_only({E, D, Im}));
  if (c.n_shared_experts > 0) m.shared = mlp_shapes(Im * c.n_shared_experts, D);
  return m;
}

text::HcParams hc_shapes(const TextConfig& c) {
  const int64_t H = c.hc_mult;
  return {shape_only({(2 + H) * H, H * c.hidden_size}), shape_only({(2 + H) * H}), shape_only({3})};
}

text::LayerWeights layer_shapes(const TextConfig& c, int64_t l) {
  text::LayerWeights w;
  w.input_layernorm = shape_only({c.hidden_size});
  w.post_attention_layernorm = shape_only({c.hidden_size});
  w.attn_hc = hc_shapes(c);
  w.ffn_hc = hc_shapes(c);
  if (c.layer_types[l] == AttnKind::kda)
    w.kda = kda_shapes(c);
  else
    w.dsa = dsa_shapes(c, c.indexer_types[l] == IndexerKind::full);
  if (c.mlp_layer_types[l] == MlpKind::dense)
    w.dense = mlp_shapes(c.intermediate_size, c.hidden_size);
  else
    w.moe = moe_shapes(c);
  return w;
}

// One pre-norm DSA + MoE layer without hyper-connections, sharing embedding and head.
text::MtpWeights mtp_shapes(const TextConfig& c) {
  const int64_t D = c.hidden_size;
  text::MtpWeights m;
  m.eh_proj = projection(D, 2 * D);
  for (Tensor* norm :
       {&m.enorm, &m.hnorm, &m.input_layernorm, &m.post_attention_layernorm, &m.shared_head_norm})
    *norm = shape_only({D});
  m.dsa = dsa_shapes(c, /*own_indexer=*/true);
  m.moe = moe_shapes(c);
  return m;
}

// The reference's initialisation (its _init_weights), by the kind of module a released name is
// of: norms ones, biases zeros, the rest normal; and the few parameters with rules of their own.
InitRule init_rule(std::string_view name) {
  const auto ends = [&](std::string_view s) { return name.ends_with(s); };
  if (ends("embed_tokens.weight")) return InitRule::embedding;
  if (ends("dt_bias")) return InitRule::dt_bias;
  if (ends("A_log")) return InitRule::a_log;
  if (ends(".bias") || ends("e_score_correction_bias") || ends("_base") ||
      ends("index_kpool_compress_ape"))
    return InitRule::zeros;
  if (ends("_scale") || ends("index_kpool_compress_gate")) return InitRule::ones;
  // RMSNorm / LayerNorm weights: the module's own name says norm (o_norm, q_a_layernorm, norm1,
  // shared_head.norm, post_projection_norm, ...).
  const std::string_view module = name.substr(0, name.rfind('.'));
  if (ends(".weight") && module.substr(module.rfind('.') + 1).find("norm") != std::string::npos)
    return InitRule::ones;
  return InitRule::normal;
}

class LayoutBuilder {
 public:
  explicit LayoutBuilder(const TextConfig& text) : std_(text.initializer_range) {}

  void add(std::string name, Shape shape, Component component, int64_t layer) {
    const InitRule init = init_rule(name);
    // The mHC mixing matrix's init std is fixed at 0.02 in the reference, whatever
    // initializer_range says.
    const bool hc_fn = name.find(".hc_") != std::string::npos && name.ends_with("_fn");
    // The indexer runs without gradient and the router correction bias is a buffer moved by the
    // load-balancing rule.
    const bool trainable =
        name.find(".indexer.") == std::string::npos && !name.ends_with("e_score_correction_bias");
    DType dtype = is_fp32_kept(name) ? DType::f32 : DType::bf16;
    out.push_back({std::move(name), std::move(shape), dtype, init, hc_fn ? 0.02 : std_, component,
                   layer, trainable});
  }

  // Every defined field of a decoder (or the MTP) layer, the fused tensors split back into the
  // released ones: the KDA's q | k | v convolution, and each routed expert's three projections
  // (listed together, expert by expert).
  template <typename Weights, typename Zip>
  void layer(const std::string& prefix, Weights& w, int64_t l, Component component, Zip zip) {
    zip(w, w, [&](const std::string& name, text::ParamGroup, const Tensor& field, const Tensor&) {
      if (!field.defined()) return;
      const Shape& s = field.shape();
      if (name == "self_attn.conv1d.weight") {
        for (const char* conv : {"q_conv1d", "k_conv1d", "v_conv1d"})
          add(fmt::format("{}self_attn.{}.weight", prefix, conv), {s[0] / 3, s[1], s[2]}, component,
              l);
      } else if (name == "mlp.experts.gate_up_proj") {
        const Shape& down = w.moe.down_proj.weight.shape();
        for (int64_t e = 0; e < s[0]; ++e) {
          const std::string x = fmt::format("{}mlp.experts.{}.", prefix, e);
          add(x + "gate_proj.weight", {s[1] / 2, s[2]}, component, l);
          add(x + "up_proj.weight", {s[1] / 2, s[2]}, component, l);
          add(x + "down_proj.weight", {down[1], down[2]}, component, l);
        }
      } else if (name != "mlp.experts.down_proj") {
        add(prefix + name, s, component, l);
      }
    });
  }

  std::vector<ParamSpec> out;

 private:
  double std_;
};

void add_vision(std::vector<ParamSpec>& out, const VisionConfig& v) {
  vision::VisionParams shapes = vision::VisionParams::shapes(v);
  vision::zip_vision_params(
      shapes, shapes, [&](const std::string& name, const Tensor& field, const Tensor&) {
        if (field.defined())
          out.push_back({"model.visual." + name, field.shape(), DType::bf16, init_rule(name),
                         v.initializer_range, Component::vision, -1, true});
      });
}

}  // namespace

Tensor shape_only(const Shape& shape) {
  static const auto no_memory = std::make_shared<int>(0);
  return Tensor::from_external(nullptr, shape, DType::bf16, Device::cpu(), no_memory);
}

bool is_fp32_kept(const std::string& name) {
  auto ends_with = [&](std::string_view suffix) { return name.ends_with(suffix); };
  const bool hyper_connection = name.find(".hc_") != std::string::npos;
  return ends_with("A_log") || ends_with("dt_bias") || ends_with("e_score_correction_bias") ||
         ends_with("conv1d.weight") ||
         (hyper_connection && (ends_with("_base") || ends_with("_scale")));
}

std::vector<ParamSpec> released_layout(const ModelConfig& config) {
  const TextConfig& c = config.text();
  LayoutBuilder b(c);
  const std::string root = "model.language_model.";
  const auto zip_layer = [](auto& a, auto& w, auto&& f) { text::zip_layer_params(a, w, f); };
  b.add(root + "embed_tokens.weight", {c.vocab_size, c.hidden_size}, Component::embeddings_and_head,
        -1);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    text::LayerWeights w = layer_shapes(c, l);
    b.layer(text::layer_prefix(l), w, l, Component::layer, zip_layer);
  }
  b.add(root + "norm.weight", {c.hidden_size}, Component::final_norm, -1);
  if (c.has_mtp()) {
    text::MtpWeights m = mtp_shapes(c);
    b.layer(text::layer_prefix(c.num_hidden_layers), m, c.num_hidden_layers, Component::mtp,
            [](auto& a, auto& w, auto&& f) { text::zip_mtp_params(a, w, f); });
  }
  if (!c.tie_word_embeddings)
    b.add("lm_head.weight", {c.vocab_size, c.hidden_size}, Component::embeddings_and_head, -1);
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
