#pragma once
// NoPE multi-head latent attention with DSA sparse selection (docs/model/dsa_moe.md, "NoPE
// MLA").
//
//   q_resid = RMSNorm_q(x Wqa^T (+bqa))                 [T, Rq]   (also the indexer's input)
//   q       = q_resid Wqb^T                             [T, NH, Dqk]
//   c       = RMSNorm_kv(x Wkva^T (+bkva))              [T, Rkv]
//   [k_h | v_h] = (c Wkvb^T)[h·(Dn+Dv) ...]             k [T, NH, Dn], v [T, NH, Dv]
//   o[i, h] = Σ_{j ∈ J(i)} softmax_j(q[i,h]·k[j,h] · Dqk^−1/2) v[j, h]
//   y       = concat_h o[i, h] Wo^T (+bo)
// with Dqk = Dn (qk_rope_head_dim is 0: no positional encoding at all) and J(i) the set of the
// indexer's entries for query i. There is no separate causal mask: causality comes from the
// indexer alone. Duplicates in a row count once and −1 entries are skipped (the reference builds
// a mask by union). A row with no key gives 0 (the eager reference would average every value of
// the sequence there; the indexer never produces such a row when its tail is on).
//
// Packed layout: tokens of all documents back to back, cu_seqlens int32/int64 [ndoc + 1]; indices
// are GLOBAL token ids into the pack (what indexer_forward returns) and each must lie in the
// query's own document, so attention never crosses a boundary. The sparse path gathers the selected
// keys of each query and never builds a [S, S] mask; the dense path exists only so that tests can
// check the sparse one against plain masked attention.

#include "glmtune/ops/indexer.h"
#include "glmtune/ops/linear.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

struct MlaConfig {
  int64_t n_heads = 64;            // num_attention_heads (NH)
  int64_t q_lora_rank = 1536;      // Rq
  int64_t kv_lora_rank = 512;      // Rkv
  int64_t qk_nope_head_dim = 256;  // Dn (= Dqk: qk_rope_head_dim must be 0)
  int64_t v_head_dim = 256;        // Dv
  double rms_norm_eps = 1e-5;      // q_a_layernorm and kv_a_layernorm

  // The reference's softmax scale, qk_head_dim^-1/2.
  double softmax_scale() const;
};

// Released names under `self_attn.`; the biases exist only with attention_bias (leave them
// undefined otherwise).
struct MlaParams {
  Linear q_a_proj;            // q_a_proj [Rq, D], optional bias [Rq]
  Tensor q_a_layernorm;       // q_a_layernorm.weight [Rq]
  Linear q_b_proj;            // q_b_proj [NH·Dqk, Rq]
  Linear kv_a_proj_with_mqa;  // kv_a_proj_with_mqa [Rkv, D], optional bias [Rkv]
  Tensor kv_a_layernorm;      // kv_a_layernorm.weight [Rkv]
  Linear kv_b_proj;           // kv_b_proj [NH·(Dn + Dv), Rkv]
  Linear o_proj;              // o_proj [D, NH·Dv], optional bias [D]
};

// The list of MlaParams' fields (ops/linear.h), named as under `self_attn.`.
template <typename A, typename B, typename F>
void zip_mla_params(A& a, B& b, F&& f) {
  zip_linear("q_a_proj", a.q_a_proj, b.q_a_proj, f, /*with_bias=*/true);
  f("q_a_layernorm.weight", a.q_a_layernorm, b.q_a_layernorm);
  zip_linear("q_b_proj", a.q_b_proj, b.q_b_proj, f);
  zip_linear("kv_a_proj_with_mqa", a.kv_a_proj_with_mqa, b.kv_a_proj_with_mqa, f,
             /*with_bias=*/true);
  f("kv_a_layernorm.weight", a.kv_a_layernorm, b.kv_a_layernorm);
  zip_linear("kv_b_proj", a.kv_b_proj, b.kv_b_proj, f);
  zip_linear("o_proj", a.o_proj, b.o_proj, f, /*with_bias=*/true);
}

struct MlaProjections {
  Tensor q_resid;  // [T, Rq]
  Tensor q;        // [T, NH, Dqk]
  Tensor k;        // [T, NH, Dqk]
  Tensor v;        // [T, NH, Dv]
};

// Everything before the attention itself, per token.
MlaProjections mla_project(const MlaConfig& cfg, const MlaParams& params, const Tensor& x);

// Sparse attention core: q, k [T, NH, Dqk], v [T, NH, Dv], indices int32 [T, W] -> [T, NH, Dv].
Tensor sparse_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& indices,
                        const Tensor& cu_seqlens, double scale);

// The same result through a dense [S, S] mask per document and full score matrices. For tests
// only (cross-check of sparse_attention); its cost is quadratic in the document length.
Tensor dense_masked_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& indices, const Tensor& cu_seqlens, double scale);

struct MlaOutput {
  Tensor y;             // [T, D]
  MlaProjections proj;  // the projections (q_resid feeds the indexer); k and v stay undefined
                        // where the GPU path attends on the latent (MlaContext::attn_latent)
  Tensor attn;          // [T, NH·Dv] attention output before o_proj
};

// MLA with given sparse indices (a "shared" layer reuses the previous layer's).
MlaOutput mla_forward(const MlaConfig& cfg, const MlaParams& params, const Tensor& x,
                      const Tensor& indices, const Tensor& cu_seqlens);

// The DSA mixer: a layer with its own indexer selects keys from (x, q_resid); a layer without one
// (indexer parameters undefined) reuses `prev_indices`, which must then be given.
struct DsaParams {
  MlaParams mla;
  IndexerParams indexer;  // undefined for a layer whose indexer_types entry is "shared"
};

struct DsaOutput {
  Tensor y;        // [T, D]
  Tensor indices;  // int32 [T, W] the selection used (own or reused)
};

DsaOutput dsa_forward(const MlaConfig& mla_cfg, const IndexerConfig& indexer_cfg,
                      const DsaParams& params, const Tensor& x, const Tensor& cu_seqlens,
                      const Tensor& prev_indices = Tensor());

// ---- Backward ----
//
// The selection is an input: no gradient flows through the indexer (the reference runs it under
// no_grad), so its parameters get none and it adds nothing to the gradient of x or of q_resid,
// although it reads both. Attention is differentiated over each query's selected keys only (the
// same de-duplicated set as the forward); probabilities are recomputed from q and k rather than
// kept. Everything else (o_proj, kv_b_proj, both RMSNorms, q_b/q_a/kv_a projections and the
// biases) is differentiated as written.

// What mla_backward needs from the forward.
struct MlaContext {
  Tensor x;           // [T, D] input
  Tensor indices;     // int32 [T, W] the selection used
  Tensor cu_seqlens;  // document offsets of the pack
  Tensor q_a;         // [T, Rq] x Wqa^T (+ bqa), the q_a_layernorm input
  Tensor q_rstd;      // [T] its 1/sqrt(mean(q_a²) + eps)
  Tensor kv_a;        // [T, Rkv] x Wkva^T (+ bkva), the kv_a_layernorm input
  Tensor kv_rstd;     // [T] its 1/sqrt(mean(kv_a²) + eps)
  Tensor latent;      // [T, Rkv] kv_a_layernorm output (kv_b_proj's input)
  MlaProjections proj;
  Tensor attn;  // [T, NH·Dv] attention output (o_proj's input)
  // mla_attention's absorbed-latent form (a GPU's; never set on the CPU): the latent-space output
  // o_lat [T, NH, Rkv] and its base-2 log-sum-exp [T, NH]. When set, proj.k and proj.v are
  // undefined: the per-head keys and values are never formed.
  Tensor attn_latent;
  Tensor attn_lse2;
};

// mla_forward and dsa_forward that also fill `ctx` (same results as without it).
MlaOutput mla_forward(const MlaConfig& cfg, const MlaParams& params, const Tensor& x,
                      const Tensor& indices, const Tensor& cu_seqlens, MlaContext& ctx);
DsaOutput dsa_forward(const MlaConfig& mla_cfg, const IndexerConfig& indexer_cfg,
                      const DsaParams& params, const Tensor& x, const Tensor& cu_seqlens,
                      const Tensor& prev_indices, MlaContext& ctx);

// The attention of the MLA block, from ctx.proj.q [T, NH, Dn] and ctx.latent [T, Rkv] over
// `indices` → [T, NH·Dv] (o_proj's input). Per head it forms k | v = latent kv_b_projᵀ
// (ctx.proj.k, ctx.proj.v) and runs sparse_attention. On a GPU in bf16 with the released geometry
// (Rkv = 512, at most 64 heads) it attends on the latent instead: q_abs = W_kbᵀ q per head, the
// attention over the shared latent keys, o = W_vb o_lat (ctx.attn_latent, ctx.attn_lse2) — the
// same function in real arithmetic, without ever forming per-head keys and values.
// An adapter on kv_b_proj enters the absorbed form merged into the weight (W + scale · B A, rebuilt
// by the backward, whose weight gradient then flows to W, A and B); the per-head form applies it
// as its own term.
Tensor mla_attention(const MlaConfig& cfg, const Linear& kv_b_proj, const Tensor& indices,
                     const Tensor& cu_seqlens, MlaContext& ctx);

struct MlaAttentionGrads {
  Tensor q;       // [T, NH·Dn]
  Tensor latent;  // [T, Rkv]
};

// Backward of mla_attention for d attn [T, NH·Dv], in the form its forward ran (read from ctx);
// kv_b_proj's gradients accumulate into *grad_kv_b_proj (null: none; a frozen weight: none for
// it).
MlaAttentionGrads mla_attention_backward(const MlaConfig& cfg, const Linear& kv_b_proj,
                                         const MlaContext& ctx, const Tensor& d_attn,
                                         Linear* grad_kv_b_proj);

struct AttentionGrads {
  Tensor q;  // [T, NH, Dqk]
  Tensor k;  // [T, NH, Dqk]
  Tensor v;  // [T, NH, Dv]
};

// Backward of sparse_attention: dout [T, NH, Dv] -> gradients of q, k and v. A key's gradient is
// the sum over the queries that selected it (scatter-add); a query row without keys gives 0.
AttentionGrads sparse_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& indices, const Tensor& cu_seqlens,
                                         double scale, const Tensor& dout);

// dy [T, D] -> dx [T, D]. Adds the gradients of every MLA parameter into `grads` (mirrors
// MlaParams; an undefined entry is created as zeros first; the bias entries only when the
// parameters have biases).
Tensor mla_backward(const MlaConfig& cfg, const MlaParams& params, const MlaContext& ctx,
                    const Tensor& dy, MlaParams& grads);

// The DSA mixer's backward: mla_backward into grads.mla. grads.indexer is left exactly as given
// (normally undefined): the indexer's parameters are frozen and never receive a gradient.
Tensor dsa_backward(const MlaConfig& mla_cfg, const DsaParams& params, const MlaContext& ctx,
                    const Tensor& dy, DsaParams& grads);

}  // namespace glmtune::ops
