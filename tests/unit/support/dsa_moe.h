#pragma once
// Inputs for the DSA (KPool indexer + sparse MLA), MLP and MoE tests: seeded parameters and key
// selections, and the parameters stored in the fixtures of tools/golden/{ops,grads}_dsa_moe.py.

#include <cmath>
#include <initializer_list>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "glmtune/io/safetensors.h"
#include "glmtune/ops/indexer.h"
#include "glmtune/ops/mla.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/ops/moe.h"
#include "test_support.h"

namespace glmtune::test {

// The configurations written by tools/golden/ops_dsa_moe.py.
struct GoldenDsaMoeConfig {
  std::string name;
  ops::MlaConfig mla;
  ops::IndexerConfig indexer;
  ops::MoeConfig moe;
};

inline const std::vector<GoldenDsaMoeConfig> kGoldenDsaMoeConfigs = {
    {"a", {2, 32, 16, 16, 16, 1e-5}, {4, 16, 4, 8, true}, {8, 2, 1, 1, true, 2.5, 1.0}},
    {"b", {3, 24, 12, 8, 12, 1e-5}, {3, 8, 2, 6, true}, {8, 3, 2, 1, false, 1.7, 1.5}},
};

// The entries ≥ 0 of row r of an index tensor [T, W] as a set (−1 marks an empty slot): a
// selection compared regardless of its order and padding.
inline std::set<int64_t> row_set(const Tensor& idx, int64_t r) {
  std::set<int64_t> s;
  for (int64_t k = 0; k < idx.size(1); ++k)
    if (idx.item({r, k}) >= 0) s.insert(int64_t(idx.item({r, k})));
  return s;
}

// Arbitrary key selections [T·width] inside each document of a pack: not causal, with
// duplicates and −1 holes (about one slot in four).
inline std::vector<int32_t> random_selections(const std::vector<int32_t>& lens, int64_t width) {
  std::mt19937_64 gen(test_seed());
  const int64_t total = total_tokens(lens);
  std::vector<int32_t> idx(size_t(total * width), -1);
  int64_t start = 0;
  for (int32_t len : lens) {
    for (int64_t s = 0; s < len; ++s)
      for (int64_t w = 0; w < width; ++w)
        if (gen() % 4 != 0) idx[size_t((start + s) * width + w)] = int32_t(start + gen() % len);
    start += len;
  }
  return idx;
}

// Seeded float64 DSA parameters: fan-in scaled weights, and norm weights near 1 but not 1, so
// that a missing weight factor shows.
inline ops::DsaParams random_dsa_params(const ops::MlaConfig& m, const ops::IndexerConfig& ic,
                                        int64_t dim, bool bias, uint64_t offset) {
  const int64_t nh = m.n_heads, rq = m.q_lora_rank, rkv = m.kv_lora_rank;
  const int64_t dn = m.qk_nope_head_dim, dv = m.v_head_dim;
  auto w = [&](const Shape& s, uint64_t o) {
    return random_normal(s, offset + o, 1 / std::sqrt(double(s.back())));
  };
  auto norm = [&](int64_t n, uint64_t o) {
    Tensor t = random_normal({n}, offset + o, 0.2);
    for (int64_t i = 0; i < n; ++i) t.set_item({i}, 1 + t.item({i}));
    return t;
  };
  ops::DsaParams d;
  d.mla.q_a_proj = w({rq, dim}, 0);
  d.mla.q_a_layernorm = norm(rq, 1000);
  d.mla.q_b_proj = w({nh * dn, rq}, 2000);
  d.mla.kv_a_proj_with_mqa = w({rkv, dim}, 3000);
  d.mla.kv_a_layernorm = norm(rkv, 4000);
  d.mla.kv_b_proj = w({nh * (dn + dv), rkv}, 5000);
  d.mla.o_proj = w({dim, nh * dv}, 6000);
  if (bias) {
    d.mla.q_a_proj_bias = random_normal({rq}, offset + 7000, 0.2);
    d.mla.kv_a_proj_with_mqa_bias = random_normal({rkv}, offset + 8000, 0.2);
    d.mla.o_proj_bias = random_normal({dim}, offset + 9000, 0.2);
  }
  const int64_t id = ic.head_dim, ih = ic.n_heads;
  d.indexer.wq_b = w({ih * id, rq}, 10000);
  d.indexer.wk = w({id, dim}, 11000);
  d.indexer.k_norm_weight = norm(id, 12000);
  d.indexer.k_norm_bias = random_normal({id}, offset + 13000, 0.2);
  d.indexer.weights_proj = w({ih, dim}, 14000);
  d.indexer.kpool_ape = random_normal({ic.kpool, id}, offset + 15000, 0.5);
  d.indexer.kpool_gate = w({id, dim}, 16000);
  return d;
}

// The indexer parameters of configuration `cfg` (under `<cfg>.attn.indexer.`).
inline ops::IndexerParams golden_indexer_params(const io::SafetensorsFile& f,
                                                const std::string& cfg) {
  const std::string p = cfg + ".attn.indexer.";
  return {f.tensor(p + "wq_b.weight"),
          f.tensor(p + "wk.weight"),
          f.tensor(p + "k_norm.weight"),
          f.tensor(p + "k_norm.bias"),
          f.tensor(p + "weights_proj.weight"),
          f.tensor(p + "index_kpool_compress_ape"),
          f.tensor(p + "index_kpool_compress_gate")};
}

// The DSA parameters of configuration `cfg` (under `<cfg>.attn.`); the biases exist only where
// the configuration has attention_bias.
inline ops::DsaParams golden_dsa_params(const io::SafetensorsFile& f, const std::string& cfg) {
  const std::string p = cfg + ".attn.";
  auto maybe = [&](const std::string& name) {
    return f.contains(name) ? f.tensor(name) : Tensor();
  };
  ops::DsaParams d;
  d.mla.q_a_proj = f.tensor(p + "q_a_proj.weight");
  d.mla.q_a_proj_bias = maybe(p + "q_a_proj.bias");
  d.mla.q_a_layernorm = f.tensor(p + "q_a_layernorm.weight");
  d.mla.q_b_proj = f.tensor(p + "q_b_proj.weight");
  d.mla.kv_a_proj_with_mqa = f.tensor(p + "kv_a_proj_with_mqa.weight");
  d.mla.kv_a_proj_with_mqa_bias = maybe(p + "kv_a_proj_with_mqa.bias");
  d.mla.kv_a_layernorm = f.tensor(p + "kv_a_layernorm.weight");
  d.mla.kv_b_proj = f.tensor(p + "kv_b_proj.weight");
  d.mla.o_proj = f.tensor(p + "o_proj.weight");
  d.mla.o_proj_bias = maybe(p + "o_proj.bias");
  d.indexer = golden_indexer_params(f, cfg);
  return d;
}

// The MLP parameters of configuration `cfg` (under `<cfg>.mlp.`).
inline ops::MlpParams golden_mlp_params(const io::SafetensorsFile& f, const std::string& cfg) {
  const std::string p = cfg + ".mlp.";
  return {f.tensor(p + "gate_proj.weight"), f.tensor(p + "up_proj.weight"),
          f.tensor(p + "down_proj.weight")};
}

// The MoE parameters of configuration `cfg` (under `<cfg>.moe.`).
inline ops::MoeParams golden_moe_params(const io::SafetensorsFile& f, const std::string& cfg) {
  const std::string p = cfg + ".moe.";
  ops::MoeParams params;
  params.router_weight = f.tensor(p + "gate.weight");
  params.e_score_correction_bias = f.tensor(p + "gate.e_score_correction_bias");
  params.gate_up_proj = f.tensor(p + "experts.gate_up_proj");
  params.down_proj = f.tensor(p + "experts.down_proj");
  params.shared = {f.tensor(p + "shared_experts.gate_proj.weight"),
                   f.tensor(p + "shared_experts.up_proj.weight"),
                   f.tensor(p + "shared_experts.down_proj.weight")};
  return params;
}

// The float64 instantiations of the fixtures' float32 parameters (the finite-difference checks
// run in float64, so the tests show it computes the same function). Undefined tensors stay so.
inline void to_f64_in_place(std::initializer_list<Tensor*> tensors) {
  for (Tensor* t : tensors)
    if (t->defined()) *t = t->to(DType::f64);
}

inline ops::IndexerParams to_f64(ops::IndexerParams p) {
  to_f64_in_place({&p.wq_b, &p.wk, &p.k_norm_weight, &p.k_norm_bias, &p.weights_proj, &p.kpool_ape,
                   &p.kpool_gate});
  return p;
}

inline ops::DsaParams to_f64(ops::DsaParams d) {
  to_f64_in_place({&d.mla.q_a_proj, &d.mla.q_a_proj_bias, &d.mla.q_a_layernorm, &d.mla.q_b_proj,
                   &d.mla.kv_a_proj_with_mqa, &d.mla.kv_a_proj_with_mqa_bias, &d.mla.kv_a_layernorm,
                   &d.mla.kv_b_proj, &d.mla.o_proj, &d.mla.o_proj_bias});
  d.indexer = to_f64(d.indexer);
  return d;
}

inline ops::MlpParams to_f64(ops::MlpParams p) {
  to_f64_in_place({&p.gate_proj, &p.up_proj, &p.down_proj});
  return p;
}

inline ops::MoeParams to_f64(ops::MoeParams p) {
  to_f64_in_place({&p.router_weight, &p.e_score_correction_bias, &p.gate_up_proj, &p.down_proj});
  p.shared = to_f64(p.shared);
  return p;
}

}  // namespace glmtune::test
