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
  d.mla.q_a_proj.weight = w({rq, dim}, 0);
  d.mla.q_a_layernorm = norm(rq, 1000);
  d.mla.q_b_proj.weight = w({nh * dn, rq}, 2000);
  d.mla.kv_a_proj_with_mqa.weight = w({rkv, dim}, 3000);
  d.mla.kv_a_layernorm = norm(rkv, 4000);
  d.mla.kv_b_proj.weight = w({nh * (dn + dv), rkv}, 5000);
  d.mla.o_proj.weight = w({dim, nh * dv}, 6000);
  if (bias) {
    d.mla.q_a_proj.bias = random_normal({rq}, offset + 7000, 0.2);
    d.mla.kv_a_proj_with_mqa.bias = random_normal({rkv}, offset + 8000, 0.2);
    d.mla.o_proj.bias = random_normal({dim}, offset + 9000, 0.2);
  }
  const int64_t id = ic.head_dim, ih = ic.n_heads;
  d.indexer.wq_b.weight = w({ih * id, rq}, 10000);
  d.indexer.wk.weight = w({id, dim}, 11000);
  d.indexer.k_norm_weight = norm(id, 12000);
  d.indexer.k_norm_bias = random_normal({id}, offset + 13000, 0.2);
  d.indexer.weights_proj.weight = w({ih, dim}, 14000);
  d.indexer.kpool_ape = random_normal({ic.kpool, id}, offset + 15000, 0.5);
  d.indexer.kpool_gate = w({id, dim}, 16000);
  return d;
}

// A parameter struct read through its list (ops/linear.h): every field from `f` under `prefix`,
// undefined where the file lacks it (biases exist only where the configuration has
// attention_bias; an MLP without a shared expert).
template <typename Params, typename Zip>
Params golden_params(const io::SafetensorsFile& f, const std::string& prefix, Zip zip) {
  Params p;
  zip(p, p, [&](const std::string& name, Tensor& t, Tensor&) {
    if (f.contains(prefix + name)) t = f.tensor(prefix + name);
  });
  return p;
}

const auto zip_indexer = [](auto& a, auto& b, auto&& f) { ops::zip_indexer_params(a, b, f); };
const auto zip_mla = [](auto& a, auto& b, auto&& f) { ops::zip_mla_params(a, b, f); };
const auto zip_mlp = [](auto& a, auto& b, auto&& f) { ops::zip_mlp_params(a, b, f); };
const auto zip_moe = [](auto& a, auto& b, auto&& f) { ops::zip_moe_params(a, b, f); };

// The indexer parameters of configuration `cfg` (under `<cfg>.attn.indexer.`).
inline ops::IndexerParams golden_indexer_params(const io::SafetensorsFile& f,
                                                const std::string& cfg) {
  return golden_params<ops::IndexerParams>(f, cfg + ".attn.indexer.", zip_indexer);
}

// The DSA parameters of configuration `cfg` (under `<cfg>.attn.`).
inline ops::DsaParams golden_dsa_params(const io::SafetensorsFile& f, const std::string& cfg) {
  return {golden_params<ops::MlaParams>(f, cfg + ".attn.", zip_mla), golden_indexer_params(f, cfg)};
}

// The MLP parameters of configuration `cfg` (under `<cfg>.mlp.`).
inline ops::MlpParams golden_mlp_params(const io::SafetensorsFile& f, const std::string& cfg) {
  return golden_params<ops::MlpParams>(f, cfg + ".mlp.", zip_mlp);
}

// The MoE parameters of configuration `cfg` (under `<cfg>.moe.`).
inline ops::MoeParams golden_moe_params(const io::SafetensorsFile& f, const std::string& cfg) {
  return golden_params<ops::MoeParams>(f, cfg + ".moe.", zip_moe);
}

// The float64 instantiations of the fixtures' float32 parameters (the finite-difference checks
// run in float64, so the tests show it computes the same function). Undefined tensors stay so.
template <typename Params, typename Zip>
Params to_f64(Params p, Zip zip) {
  zip(p, p, [](const std::string&, Tensor& t, Tensor&) {
    if (t.defined()) t = t.to(DType::f64);
  });
  return p;
}

inline ops::IndexerParams to_f64(ops::IndexerParams p) { return to_f64(std::move(p), zip_indexer); }
inline ops::DsaParams to_f64(ops::DsaParams d) {
  return {to_f64(std::move(d.mla), zip_mla), to_f64(std::move(d.indexer), zip_indexer)};
}
inline ops::MlpParams to_f64(ops::MlpParams p) { return to_f64(std::move(p), zip_mlp); }
inline ops::MoeParams to_f64(ops::MoeParams p) { return to_f64(std::move(p), zip_moe); }

}  // namespace glmtune::test
