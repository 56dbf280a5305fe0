#include "glmtune/model/text/weights.h"

#include <fmt/format.h>

#include <regex>
#include <set>

#include "glmtune/base/overloaded.h"
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

// Whether parameters of `group` belong to a layer of lw's mixer and MLP kinds.
bool of_layer_kind(ParamGroup group, const LayerWeights& lw) {
  switch (group) {
    case ParamGroup::layer:
      return true;
    case ParamGroup::kda:
      return lw.attn == AttnKind::kda;
    case ParamGroup::dsa:
      return lw.attn != AttnKind::kda;
    case ParamGroup::dense_mlp:
      return lw.mlp == MlpKind::dense;
    case ParamGroup::moe:
      return lw.mlp != MlpKind::dense;
  }
  return false;
}

class Loader {
 public:
  Loader(const ParamStore& store, TextWeights& w) : store_(store), w_(w) {}

  Tensor get(const std::string& name) {
    GLMTUNE_ASSERT(loaded_.insert(name).second, "text parameter '{}' loaded twice", name);
    Tensor t = w_.device.is_cuda() ? to_device(store_.get(name), name, w_.device, w_.dtype)
                                   : to_compute(store_.get(name), w_.dtype);
    // A tensor the store does not train (the indexer, the router bias, `train.freeze`) is frozen:
    // the backward passes give it no gradient.
    t.set_frozen(!store_.param(name).trainable);
    w_.named.emplace_back(name, t);
    return t;
  }

  // Every field of the list (weights.h) of the layer's own mixer and MLP kinds that the store
  // holds under `prefix` (the store has exactly the tensors of the layer: own or shared indexer,
  // biases, shared expert; checked against the config when it was loaded).
  void layer(const std::string& prefix, LayerWeights& lw) {
    zip_layer_params(
        lw, lw,
        Overloaded{[&](const std::string& name, ParamGroup group, Tensor& field, Tensor&) {
                     if (of_layer_kind(group, lw) && store_.contains(prefix + name))
                       field = get(prefix + name);
                   },
                   // A projection with an adapter in the store (model/lora.h) takes its scale.
                   [&](const std::string& name, ParamGroup group, ops::Linear& l, ops::Linear&,
                       ops::WholeProjection) {
                     if (of_layer_kind(group, lw) &&
                         store_.contains(prefix + name + ".lora_A.weight"))
                       l.lora.scale = store_.adapter_scale();
                   }});
    // The fused experts' adapters (ops/moe.h) are not whole projections of the list.
    for (ops::Linear* l : {&lw.moe.gate_up_proj, &lw.moe.down_proj})
      if (l->lora.defined()) l->lora.scale = store_.adapter_scale();
  }
  void mtp(const std::string& prefix, MtpWeights& m) {
    for_each_mtp_param(m, [&](const std::string& name, Tensor& field) {
      if (store_.contains(prefix + name)) field = get(prefix + name);
    });
  }

 private:
  const ParamStore& store_;
  TextWeights& w_;
  std::set<std::string> loaded_;
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

void set_adapter_dropout(TextWeights& w, double p, uint64_t pack_key, int64_t shard_row0) {
  const auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  const auto key_of = [&](const std::string& module) -> uint64_t {
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the name
    for (const char c : module) h = (h ^ uint8_t(c)) * 0x100000001b3ull;
    return pack_key == 0 ? 0 : mix(pack_key ^ h) | 1;
  };
  for (LayerWeights& lw : w.layers) {
    const std::string prefix = layer_prefix(lw.index);
    zip_layer_params(lw, lw,
                     Overloaded{[](const std::string&, ParamGroup, Tensor&, Tensor&) {},
                                [&](const std::string& name, ParamGroup group, ops::Linear& l,
                                    ops::Linear&, ops::WholeProjection) {
                                  if (!l.lora.defined()) return;
                                  l.lora.dropout = p;
                                  l.lora.dropout_key = key_of(prefix + name);
                                  const bool mlp =
                                      group == ParamGroup::dense_mlp || group == ParamGroup::moe;
                                  l.lora.dropout_block = {mlp ? shard_row0 : 0, 0, 0};
                                }});
  }
  // The head reads the final norm's rows (and the MTP depths' shared-head norm's), a shard of
  // them under sequence parallelism.
  if (w.lm_head.lora.defined()) {
    w.lm_head.lora.dropout = p;
    w.lm_head.lora.dropout_key = key_of("lm_head");
    w.lm_head.lora.dropout_block = {shard_row0, 0, 0};
  }
}

namespace {

// The projections of use_fp8_gemms, by their names under a layer.
bool runs_in_fp8(const std::string& name, ParamGroup group) {
  static const std::set<std::string> kda = {
      "self_attn.q_proj",   "self_attn.k_proj",   "self_attn.v_proj",   "self_attn.o_proj",
      "self_attn.f_a_proj", "self_attn.f_b_proj", "self_attn.g_a_proj", "self_attn.g_b_proj"};
  static const std::set<std::string> dsa = {"self_attn.q_a_proj", "self_attn.q_b_proj",
                                            "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj"};
  switch (group) {
    case ParamGroup::kda:
      return kda.contains(name);
    case ParamGroup::dsa:
      return dsa.contains(name);
    case ParamGroup::dense_mlp:
    case ParamGroup::moe:
      return name.starts_with("mlp.");
    case ParamGroup::layer:
      return false;
  }
  return false;
}

}  // namespace

bool released_weight_runs_in_fp8(const std::string& name) {
  static const std::regex layer(R"(^model\.language_model\.layers\.\d+\.(.*)\.weight$)");
  static const std::regex expert(R"(^mlp\.experts\.\d+\.(gate|up|down)_proj$)");
  std::smatch m;
  if (!std::regex_match(name, m, layer)) return false;
  const std::string module = m[1].str();
  if (std::regex_match(module, expert)) return true;
  // A KDA and an MLA layer both name their output projection self_attn.o_proj.
  for (ParamGroup group :
       {ParamGroup::kda, ParamGroup::dsa, ParamGroup::dense_mlp, ParamGroup::moe})
    if (runs_in_fp8(module, group) && module != "mlp.gate") return true;
  return false;
}

int64_t use_fp8_gemms(TextWeights& w, int64_t alignment) {
  int64_t marked = 0;
  const auto mark_one = [&](const std::string& name, ops::Linear& l) {
    // Under fsdp a layer's weights are placeholders between uses; their shapes are checked by the
    // GPU's linear_fp8 when the layer first runs.
    const bool whole = l.weight.dim() >= 2;
    const int64_t n = whole ? l.weight.size(-2) : 0, k = whole ? l.weight.size(-1) : 0;
    if (alignment > 0 && (n % alignment != 0 || k % alignment != 0))
      throw Error(fmt::format("train.fp8 = \"tilewise\": {} is {}, and the GPU's FP8 GEMMs take "
                              "only dimensions that are multiples of {}",
                              name, l.weight.str(), alignment),
                  "train.fp8", "write train.fp8 = \"none\" for this model, or train it on the CPU");
    l.fp8 = true;
    ++marked;
  };
  const auto visit = [&](const std::string& prefix, auto& params, auto zip) {
    zip(params, params,
        Overloaded{[](const std::string&, ParamGroup, Tensor&, Tensor&) {},
                   [&](const std::string& name, ParamGroup group, ops::Linear& l, ops::Linear&,
                       ops::WholeProjection) {
                     if (l.weight.defined() && runs_in_fp8(name, group)) mark_one(prefix + name, l);
                   }});
    for (auto [name, l] : {std::pair{"mlp.experts.gate_up_proj", &params.moe.gate_up_proj},
                           std::pair{"mlp.experts.down_proj", &params.moe.down_proj}})
      if (l->weight.defined()) mark_one(prefix + name, *l);
  };
  for (LayerWeights& lw : w.layers)
    visit(layer_prefix(lw.index), lw,
          [](auto& a, auto& b, auto&& f) { zip_layer_params(a, b, f); });
  if (w.mtp)
    visit(layer_prefix(int64_t(w.layers.size())), *w.mtp,
          [](auto& a, auto& b, auto&& f) { zip_mtp_params(a, b, f); });
  return marked;
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
    load.layer(p, lw);
    w.layers.push_back(std::move(lw));
  }
  w.final_norm = load.get("model.language_model.norm.weight");
  if (c.has_mtp()) {
    const std::string p = layer_prefix(c.num_hidden_layers);
    MtpWeights m;
    load.mtp(p, m);
    w.mtp = std::move(m);
  }
  // A tied head is the embedding matrix itself (same storage, one entry in `named`).
  w.lm_head = ops::Linear(c.tie_word_embeddings ? w.embed_tokens : load.get("lm_head.weight"));
  // An adapter on the head (model/lora.h) belongs to the head alone, tied or not: the embedding
  // lookup reads the table without it, as PEFT's adapted lm_head module leaves the embedding be.
  if (store.contains("lm_head.lora_A.weight")) {
    w.lm_head.lora.A = load.get("lm_head.lora_A.weight");
    w.lm_head.lora.B = load.get("lm_head.lora_B.weight");
    w.lm_head.lora.scale = store.adapter_scale();
  }
  return w;
}

}  // namespace glmtune::model::text
