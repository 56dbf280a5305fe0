#include "glmtune/model/text/weights.h"

#include <fmt/format.h>

#include "glmtune/model/layout.h"
#include "glmtune/tensor/convert.h"

namespace glmtune::model::text {
namespace {

// A copy of `src` in memory of its own, converted to `dtype`. Stored values (bf16, f32, or bf16
// dequantised from FP8) are exact in f32 and f64, so this never rounds.
Tensor to_compute(const Tensor& src, DType dtype) {
  const Tensor in = src.contiguous();
  Tensor out = Tensor::empty(in.shape(), dtype);
  const int64_t n = in.numel();
  const auto* s = static_cast<const uint8_t*>(in.data_ptr());
  const size_t es = in.element_size();
  const DType st = in.dtype();
  if (dtype == DType::f32) {
    float* d = out.data<float>();
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i) d[i] = float(convert::load(s + size_t(i) * es, st));
  } else {
    double* d = out.data<double>();
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i) d[i] = convert::load(s + size_t(i) * es, st);
  }
  return out;
}

// The GPU storage of one parameter: `dtype` (bf16, or f32 in the fp32 mode), f32 anyway where the
// parameter is kept in f32 or a kernel reads it in f32 (the mHC mixing matrix hc_*_fn).
Tensor to_device(const Tensor& src, const std::string& name, Device device, DType dtype) {
  const bool keep_f32 = dtype == DType::f32 || is_fp32_kept(name) ||
                        (name.find(".hc_") != std::string::npos && name.size() > 3 &&
                         name.compare(name.size() - 3, 3, "_fn") == 0);
  return src.contiguous().to(keep_f32 ? DType::f32 : DType::bf16).to(device);
}

class Loader {
 public:
  Loader(const ParamStore& store, TextWeights& w) : store_(store), w_(w) {}

  Tensor get(const std::string& name) {
    Tensor t = w_.device.is_cuda() ? to_device(store_.get(name), name, w_.device, w_.dtype)
                                   : to_compute(store_.get(name), w_.dtype);
    // A tensor the store does not train (the indexer, the router bias, `train.freeze`) is frozen:
    // the backward passes give it no gradient.
    t.set_frozen(!store_.param(name).trainable);
    w_.named.emplace_back(name, t);
    return t;
  }
  Tensor optional(const std::string& name) { return store_.contains(name) ? get(name) : Tensor(); }

  ops::MlaParams mla(const std::string& p) {
    const std::string a = p + "self_attn.";
    ops::MlaParams m;
    m.q_a_proj = get(a + "q_a_proj.weight");
    m.q_a_proj_bias = optional(a + "q_a_proj.bias");
    m.q_a_layernorm = get(a + "q_a_layernorm.weight");
    m.q_b_proj = get(a + "q_b_proj.weight");
    m.kv_a_proj_with_mqa = get(a + "kv_a_proj_with_mqa.weight");
    m.kv_a_proj_with_mqa_bias = optional(a + "kv_a_proj_with_mqa.bias");
    m.kv_a_layernorm = get(a + "kv_a_layernorm.weight");
    m.kv_b_proj = get(a + "kv_b_proj.weight");
    m.o_proj = get(a + "o_proj.weight");
    m.o_proj_bias = optional(a + "o_proj.bias");
    return m;
  }

  ops::IndexerParams indexer(const std::string& p) {
    const std::string x = p + "self_attn.indexer.";
    ops::IndexerParams ix;
    ix.wq_b = get(x + "wq_b.weight");
    ix.wk = get(x + "wk.weight");
    ix.k_norm_weight = get(x + "k_norm.weight");
    ix.k_norm_bias = get(x + "k_norm.bias");
    ix.weights_proj = get(x + "weights_proj.weight");
    ix.kpool_ape = get(x + "index_kpool_compress_ape");
    ix.kpool_gate = get(x + "index_kpool_compress_gate");
    return ix;
  }

  ops::KdaParams kda(const std::string& p) {
    const std::string a = p + "self_attn.";
    ops::KdaParams k;
    k.q_proj = get(a + "q_proj.weight");
    k.k_proj = get(a + "k_proj.weight");
    k.v_proj = get(a + "v_proj.weight");
    k.conv1d = get(a + "conv1d.weight");
    k.f_a_proj = get(a + "f_a_proj.weight");
    k.f_b_proj = get(a + "f_b_proj.weight");
    k.dt_bias = get(a + "dt_bias");
    k.A_log = get(a + "A_log");
    k.b_proj = get(a + "b_proj.weight");
    k.g_a_proj = get(a + "g_a_proj.weight");
    k.g_b_proj = get(a + "g_b_proj.weight");
    k.o_norm = get(a + "o_norm.weight");
    k.o_proj = get(a + "o_proj.weight");
    return k;
  }

  ops::MlpParams mlp(const std::string& p) {
    return {get(p + "gate_proj.weight"), get(p + "up_proj.weight"), get(p + "down_proj.weight")};
  }

  ops::MoeParams moe(const std::string& p) {
    ops::MoeParams m;
    m.router_weight = get(p + "mlp.gate.weight");
    m.e_score_correction_bias = get(p + "mlp.gate.e_score_correction_bias");
    m.gate_up_proj = get(p + "mlp.experts.gate_up_proj");
    m.down_proj = get(p + "mlp.experts.down_proj");
    if (store_.contains(p + "mlp.shared_experts.gate_proj.weight"))
      m.shared = mlp(p + "mlp.shared_experts.");
    return m;
  }

  HcParams hc(const std::string& p, const char* site) {
    return {get(fmt::format("{}hc_{}_fn", p, site)), get(fmt::format("{}hc_{}_base", p, site)),
            get(fmt::format("{}hc_{}_scale", p, site))};
  }

 private:
  const ParamStore& store_;
  TextWeights& w_;
};

// The GPU kernels are built for the released geometry's head dimensions (the KDA core for 128,
// sparse attention for a fixed set): a model outside it is refused at load, before any work, rather
// than by the first kernel of the step.
void check_gpu_geometry(const TextConfig& c) {
  if (c.linear_head_dim != 128)
    throw Error(fmt::format("the GPU KDA kernels take a head dim of 128; this model's is {}",
                            c.linear_head_dim),
                "config.json: text_config.linear_attn_config.head_dim",
                "train this model on the CPU (device = \"cpu\"), or create it with head dim 128 "
                "(glmtune init --set text_config.linear_attn_config.head_dim=128)");
  const int64_t dqk = c.qk_head_dim(), dv = c.v_head_dim;
  const bool attention_ok =
      (dqk == dv && (dqk == 32 || dqk == 64 || dqk == 128 || dqk == 256 || dqk == 512)) ||
      (dqk == 128 && dv == 64);
  if (!attention_ok)
    throw Error(fmt::format("the GPU sparse-attention kernels take query/key and value head dims "
                            "of 32, 64, 128, 256 or 512 (equal), or 128 and 64; this model has {} "
                            "and {}",
                            dqk, dv),
                "config.json: text_config.qk_head_dim / v_head_dim",
                "train this model on the CPU (device = \"cpu\"), or create it with supported "
                "head dims (e.g. glmtune init --set text_config.qk_nope_head_dim=32 --set "
                "text_config.qk_head_dim=32 --set text_config.v_head_dim=32)");
}

}  // namespace

std::string layer_prefix(int64_t layer) {
  return fmt::format("model.language_model.layers.{}.", layer);
}

TextWeights load_text_weights(const ParamStore& store, DType dtype, Device device) {
  if (device.is_cuda())
    GLMTUNE_ASSERT(dtype == DType::bf16 || dtype == DType::f32,
                   "the GPU text model computes in bf16 (or f32, the fp32 mode), not {}",
                   dtype_name(dtype));
  else
    GLMTUNE_ASSERT(dtype == DType::f32 || dtype == DType::f64,
                   "the CPU text model computes in f32 or f64, not {}", dtype_name(dtype));
  const TextConfig& c = store.config().text();
  if (device.is_cuda()) check_gpu_geometry(c);
  TextWeights w;
  w.dtype = dtype;
  w.device = device;
  Loader load(store, w);
  w.embed_tokens = load.get("model.language_model.embed_tokens.weight");
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = layer_prefix(l);
    LayerWeights lw;
    lw.index = l;
    lw.attn = c.layer_types[l];
    lw.mlp = c.mlp_layer_types[l];
    lw.input_layernorm = load.get(p + "input_layernorm.weight");
    lw.post_attention_layernorm = load.get(p + "post_attention_layernorm.weight");
    lw.attn_hc = load.hc(p, "attn");
    lw.ffn_hc = load.hc(p, "ffn");
    if (lw.attn == AttnKind::kda) {
      lw.kda = load.kda(p);
    } else {
      lw.dsa.mla = load.mla(p);
      if (c.indexer_types[l] == IndexerKind::full) lw.dsa.indexer = load.indexer(p);
    }
    if (lw.mlp == MlpKind::dense)
      lw.dense = load.mlp(p + "mlp.");
    else
      lw.moe = load.moe(p);
    w.layers.push_back(std::move(lw));
  }
  w.final_norm = load.get("model.language_model.norm.weight");
  if (c.has_mtp()) {
    const std::string p = layer_prefix(c.num_hidden_layers);
    MtpWeights m;
    m.eh_proj = load.get(p + "eh_proj.weight");
    m.enorm = load.get(p + "enorm.weight");
    m.hnorm = load.get(p + "hnorm.weight");
    m.input_layernorm = load.get(p + "input_layernorm.weight");
    m.post_attention_layernorm = load.get(p + "post_attention_layernorm.weight");
    m.shared_head_norm = load.get(p + "shared_head.norm.weight");
    m.dsa.mla = load.mla(p);
    m.dsa.indexer = load.indexer(p);
    m.moe = load.moe(p);
    w.mtp = std::move(m);
  }
  // A tied head is the embedding matrix itself (same storage, one entry in `named`).
  w.lm_head = c.tie_word_embeddings ? w.embed_tokens : load.get("lm_head.weight");
  return w;
}

}  // namespace glmtune::model::text
