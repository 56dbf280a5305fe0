#pragma once
// Private helpers shared by the sparse MLA / DSA forward (mla.cpp) and the forward with context
// and backward (mla_backward.cpp): the parameter and operand checks, the attention + output
// projection and the choice of a DSA layer's selection. Both files must compute the forward the
// same way, bit for bit, so that the backward differentiates exactly the function the forward
// ran.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/indexer.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mla.h"

namespace glmtune::ops::cpu_detail {

inline void check_mla_param(const Tensor& t, const Shape& shape, DType dtype, const char* name) {
  GLMTUNE_ASSERT(t.defined() && t.shape() == shape && t.dtype() == dtype && t.device().is_cpu(),
                 "MLA parameter {} must be a CPU {} tensor of shape {}, got {}", name,
                 dtype_name(dtype), shape_str(shape), describe(t));
}

// A bias: checked when present.
inline void check_optional_mla_param(const Tensor& t, const Shape& shape, DType dtype,
                                     const char* name) {
  if (t.defined()) check_mla_param(t, shape, dtype, name);
}

// The configuration's dimensions and every parameter's shape, for an input of width `dim` in
// dtype `dt`.
inline void check_mla_params(const MlaConfig& cfg, const MlaParams& params, int64_t dim, DType dt) {
  GLMTUNE_ASSERT(cfg.n_heads > 0 && cfg.q_lora_rank > 0 && cfg.kv_lora_rank > 0 &&
                     cfg.qk_nope_head_dim > 0 && cfg.v_head_dim > 0,
                 "MLA config dimensions must be positive");
  const int64_t nh = cfg.n_heads, rq = cfg.q_lora_rank, rkv = cfg.kv_lora_rank;
  const int64_t dn = cfg.qk_nope_head_dim, dv = cfg.v_head_dim;
  check_mla_param(params.q_a_proj, {rq, dim}, dt, "q_a_proj.weight");
  check_optional_mla_param(params.q_a_proj_bias, {rq}, dt, "q_a_proj.bias");
  check_mla_param(params.q_a_layernorm, {rq}, dt, "q_a_layernorm.weight");
  check_mla_param(params.q_b_proj, {nh * dn, rq}, dt, "q_b_proj.weight");
  check_mla_param(params.kv_a_proj_with_mqa, {rkv, dim}, dt, "kv_a_proj_with_mqa.weight");
  check_optional_mla_param(params.kv_a_proj_with_mqa_bias, {rkv}, dt, "kv_a_proj_with_mqa.bias");
  check_mla_param(params.kv_a_layernorm, {rkv}, dt, "kv_a_layernorm.weight");
  check_mla_param(params.kv_b_proj, {nh * (dn + dv), rkv}, dt, "kv_b_proj.weight");
  check_mla_param(params.o_proj, {dim, nh * dv}, dt, "o_proj.weight");
  check_optional_mla_param(params.o_proj_bias, {dim}, dt, "o_proj.bias");
}

// The attention operands: q, k [T, NH, Dqk] and v [T, NH, Dv], CPU tensors of one compute dtype.
inline void check_attention_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  GLMTUNE_ASSERT(q.defined() && q.dim() == 3 && q.device().is_cpu() && is_compute_dtype(q.dtype()),
                 "attention q must be a CPU [T, NH, Dqk] tensor in f32 or f64, got {}",
                 describe(q));
  GLMTUNE_ASSERT(k.defined() && k.shape() == q.shape() && k.dtype() == q.dtype(),
                 "attention k {} must match q {}", describe(k), q.str());
  GLMTUNE_ASSERT(v.defined() && v.dim() == 3 && v.size(0) == q.size(0) && v.size(1) == q.size(1) &&
                     v.dtype() == q.dtype(),
                 "attention v {} must be [T, NH, Dv] like q {}", describe(v), q.str());
}

// The softmax numerators exp(scale·q·k_j − max) of one query row `qh` and head h over its n
// visible keys (token ids `keys`, q and k [T, heads, dqk] contiguous) into prob[0, n); returns
// their sum. The backward replays exactly this arithmetic to recover the forward's probabilities.
template <typename T>
T softmax_numerators(const T* qh, const T* k, const int64_t* keys, size_t n, int64_t heads,
                     int64_t h, int64_t dqk, T scale, T* prob) {
  T mx = -std::numeric_limits<T>::infinity();
  for (size_t j = 0; j < n; ++j) {
    const T* kj = k + (keys[j] * heads + h) * dqk;
    T dot = T(0);
    for (int64_t c = 0; c < dqk; ++c) dot += qh[c] * kj[c];
    prob[j] = dot * scale;
    mx = std::max(mx, prob[j]);
  }
  T sum = T(0);
  for (size_t j = 0; j < n; ++j) {
    prob[j] = std::exp(prob[j] - mx);
    sum += prob[j];
  }
  return sum;
}

// Attention and output projection over precomputed projections.
inline MlaOutput attend(const MlaConfig& cfg, const MlaParams& params, MlaProjections proj,
                        const Tensor& indices, const Tensor& cu_seqlens) {
  MlaOutput out;
  const int64_t tokens = proj.q.size(0);
  out.attn = sparse_attention(proj.q, proj.k, proj.v, indices, cu_seqlens, cfg.softmax_scale())
                 .view({tokens, cfg.n_heads * cfg.v_head_dim});
  out.y = linear(out.attn, params.o_proj, params.o_proj_bias);
  out.proj = std::move(proj);
  return out;
}

// The keys a DSA layer attends to: its own indexer's selection, or, for a layer without an
// indexer, the selection of the layer before it.
inline Tensor dsa_indices(const IndexerConfig& indexer_cfg, const IndexerParams& indexer,
                          const Tensor& x, const Tensor& q_resid, const Tensor& cu_seqlens,
                          const Tensor& prev_indices) {
  if (indexer.defined()) return indexer_forward(indexer_cfg, indexer, x, q_resid, cu_seqlens);
  if (!prev_indices.defined())
    throw Error("a DSA layer without its own indexer got no indices from the layer before it",
                "indexer_types",
                "mark the layer \"full\", or place it right after a \"full\" DSA layer");
  return prev_indices;
}

}  // namespace glmtune::ops::cpu_detail
