#pragma once
// Kimi Delta Attention (KDA), the linear-attention mixer of GLM-5.3-Flash (docs/model/kda_mhc.md,
// "KDA mixer"). Inputs are packed: x [T, D] holds several documents back to back and `cu_seqlens`
// (int32 or int64, [ndoc + 1], cu[0] = 0, cu[ndoc] = T) marks their boundaries. The short conv
// and the recurrent state restart at every document, so each document is computed exactly as
// the reference computes it alone (batch of one, no padding).
//
// Per head h with key channels a and value channels e, the state S ∈ R^{K×V} evolves as
//   S ← diag(exp(g_t)) S;  S ← S + k_t (β_t (v_t − S^T k_t))^T;  o_t = S^T q_t
// with q, k L2-normalised and q scaled by K^-1/2. `kda_recurrent` runs this token by token;
// `kda_chunked` is the reference's chunked form (chunk 64, the path it runs for prefill and
// training); both compute the same function up to rounding.
//
// CPU tensors in f32 (the reference path) or f64 (finite-difference tests); all floating
// operands share one dtype. On a GPU (ops/dispatch.h) activations are bf16 and g, β, the q/k norms
// and the core's inputs f32, as the CUDA kernels take them; the chunked core runs chunks of 64 and
// the token-by-token recurrence is CPU-only.

#include <cstdint>
#include <optional>

#include "glmtune/ops/linear.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

// Depthwise causal conv over time, per document: x [T, C], weight [C, Kc] or [C, 1, Kc];
// y[t, c] = Σ_τ weight[c, τ] · x[t − (Kc−1) + τ, c], where positions before the document's first
// token count as 0 (so weight[c, Kc−1] multiplies the current token). No bias. With `silu` the
// result goes through x·σ(x); `pre_activation` (optional) receives the value before it.
Tensor causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens, bool silu,
                     Tensor* pre_activation = nullptr);

// q or k of the mixer from its projection x [T, C]: the conv with SiLU, then each head's row of
// `head_dim` channels L2-normalised, y = c / ν with ν = sqrt(Σ c² + eps), where c is the conv
// output as the activation dtype holds it (the reference normalises inside its kernel, in fp32,
// after that rounding). Returns y [T, C / head_dim, head_dim]; `norm` (optional) receives ν
// [T, C / head_dim] (f32 on a GPU). One pass over x on a GPU.
Tensor kda_qk_conv(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                   int64_t head_dim, double eps, Tensor* norm = nullptr);

// Forget gate (log-decay per key channel) from the gate projection graw = f_b(f_a(x)) [T, NL·HL]:
// z = graw + dt_bias, a_h = exp(A_log[h]);
//   lower_bound LB set:  g = LB · σ(a_h · z)            ∈ (LB, 0)
//   lower_bound unset:   g = −a_h · softplus(z)         (softplus(z) = z for z > 20)
// Returns g [T, NL, HL].
Tensor kda_gate(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                std::optional<double> lower_bound);

// Write strength β = σ(logits) [T, NL] from the b projection. On a GPU β is f32 (it feeds the f32
// delta-rule core), whatever the logits' dtype.
Tensor kda_beta(const Tensor& logits);

// Delta-rule core. q, k [T, NL, K] (already L2-normalised), v [T, NL, V], g [T, NL, K] (log
// decay), beta [T, NL]; q is multiplied by `scale` inside. Returns o [T, NL, V]. `final_state`
// (optional) receives each document's last state, [ndoc, NL, K, V] (rows = key channel).
Tensor kda_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                   const Tensor& beta, const Tensor& cu_seqlens, double scale,
                   int64_t chunk_size = 64, Tensor* final_state = nullptr);
Tensor kda_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                     const Tensor& beta, const Tensor& cu_seqlens, double scale,
                     Tensor* final_state = nullptr);

// The released parameters of one KDA layer (names as under `layers.{l}.self_attn.`; the q/k/v
// conv weights already concatenated in the order q, k, v as the module holds them).
struct KdaParams {
  Linear q_proj, k_proj, v_proj;  // [QL, D]
  Tensor conv1d;                  // [3·QL, 1, Kc] (or [3·QL, Kc])
  Linear f_a_proj;                // [HL, D]   forget_gate.f_a_proj
  Linear f_b_proj;                // [QL, HL]  forget_gate.f_b_proj
  Tensor dt_bias;                 // [QL]      forget_gate.dt_bias
  Tensor A_log;                   // [NL]      forget_gate.A_log
  Linear b_proj;                  // [NL, D]
  Linear g_a_proj;                // [HL, D]
  Linear g_b_proj;                // [QL, HL]
  Tensor o_norm;                  // [HL]      gated RMSNorm weight, shared by heads
  Linear o_proj;                  // [D, QL]
};

enum class KdaCore { chunked, recurrent };

struct KdaOptions {
  int64_t num_heads = 64;                    // NL (linear_num_heads)
  int64_t head_dim = 128;                    // HL (linear_head_dim), key = value head dim
  std::optional<double> lower_bound = -5.0;  // linear_lower_bound; unset: softplus gate
  double rms_eps = 1e-5;                     // o_norm eps (rms_norm_eps)
  double l2_eps = 1e-6;                      // q/k L2 norm eps (inside the sqrt)
  int64_t chunk_size = 64;
  KdaCore core = KdaCore::chunked;
};

// Intermediates of kda_forward, for tests and a later backward. Shapes with T tokens.
struct KdaSaved {
  Tensor q_conv_in, k_conv_in, v_conv_in;  // [T, QL] projections entering the conv
  Tensor q, k, v;                          // [T, NL, HL] after conv + SiLU; q, k L2-normalised
  Tensor q_norm, k_norm;                   // [T, NL] ν = sqrt(Σ c² + l2_eps), c: conv output
  Tensor g;                                // [T, NL, HL] log decay
  Tensor beta;                             // [T, NL]
  Tensor core;                             // [T, NL, HL] delta-rule output
  Tensor gate;                             // [T, NL, HL] output gate g_b(g_a(x))
  Tensor normed;                           // [T, NL, HL] o_norm(core, gate)
  Tensor o_rstd;                           // [T, NL] o_norm's 1/sqrt(mean + eps); GPU: undefined
};

// The whole KDA mixer: x [T, D] (the layer's input_layernorm output) → y [T, D].
Tensor kda_forward(const KdaParams& params, const Tensor& x, const Tensor& cu_seqlens,
                   const KdaOptions& options, KdaSaved* saved = nullptr);

// ---- Backward passes --------------------------------------------------------------------------
// Upstream gradients share the dtype of the forward's operands. Parameter gradients accumulate
// into the caller's buffers (null pointer: skipped; undefined tensor: allocated as zeros shaped
// like the parameter); every sum over tokens runs in a fixed order, so gradients do not depend on
// the thread count. The maths is written out in docs/model/backward_kda_mhc.md.

// Backward of causal_conv1d for d y [T, C] → d x [T, C]; the weight gradient (shaped like
// `weight`) accumulates into *grad_weight. With `silu`, `pre_activation` is the forward's value
// before the SiLU; undefined: recomputed from x.
Tensor causal_conv1d_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                              bool silu, const Tensor& dy, Tensor* grad_weight,
                              const Tensor& pre_activation = Tensor());

// Backward of kda_qk_conv for d y [T, C / head_dim, head_dim] → d x [T, C]: the L2 norm's
// backward on the conv output (recomputed from x) with the forward's `norm`, then the conv's; the
// weight gradient accumulates into *grad_weight as causal_conv1d_backward's does.
Tensor kda_qk_conv_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                            int64_t head_dim, double eps, const Tensor& norm, const Tensor& dy,
                            Tensor* grad_weight);

// Backward of kda_gate for d g [T, NL, HL] (or [T, NL·HL]) → d graw [T, NL·HL]; accumulates
// d dt_bias [NL·HL] and d A_log [NL].
Tensor kda_gate_backward(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                         std::optional<double> lower_bound, const Tensor& dg, Tensor* grad_dt_bias,
                         Tensor* grad_A_log);

// Backward of kda_beta: d logits = d β · β (1 − β), in β's dtype.
Tensor kda_beta_backward(const Tensor& beta, const Tensor& d_beta);

struct KdaCoreGrads {
  Tensor dq, dk;  // [T, NL, K] (dq with respect to the unscaled q)
  Tensor dv;      // [T, NL, V]
  Tensor dg;      // [T, NL, K]
  Tensor dbeta;   // [T, NL]
};

// Backward of the delta-rule core for d o [T, NL, V], in the chunked form (per document and head:
// the chunk-entry states are replayed forward, then the chunks are differentiated in reverse,
// carrying d S backwards across chunk boundaries; d S is 0 after each document's last token).
// kda_chunked and kda_recurrent compute the same function, so this is the gradient of both.
KdaCoreGrads kda_chunked_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                  double scale, const Tensor& d_out, int64_t chunk_size = 64);

// Gradients of one KDA layer's parameters: the same fields as KdaParams, each the gradient of the
// parameter of the same name and shape.
using KdaGrads = KdaParams;

// The list of KdaParams' fields (ops/linear.h), named as under a layer's `self_attn.` (the q/k/v
// convs as the fused conv1d).
template <typename A, typename B, typename F>
void zip_kda_params(A& a, B& b, F&& f) {
  zip_linear("q_proj", a.q_proj, b.q_proj, f);
  zip_linear("k_proj", a.k_proj, b.k_proj, f);
  zip_linear("v_proj", a.v_proj, b.v_proj, f);
  f("conv1d.weight", a.conv1d, b.conv1d);
  zip_linear("f_a_proj", a.f_a_proj, b.f_a_proj, f);
  zip_linear("f_b_proj", a.f_b_proj, b.f_b_proj, f);
  f("dt_bias", a.dt_bias, b.dt_bias);
  f("A_log", a.A_log, b.A_log);
  zip_linear("b_proj", a.b_proj, b.b_proj, f);
  zip_linear("g_a_proj", a.g_a_proj, b.g_a_proj, f);
  zip_linear("g_b_proj", a.g_b_proj, b.g_b_proj, f);
  f("o_norm.weight", a.o_norm, b.o_norm);
  zip_linear("o_proj", a.o_proj, b.o_proj, f);
}

// Backward of kda_forward: d y [T, D] → d x [T, D], accumulating every parameter's gradient into
// `grads`. `saved` holds the forward's intermediates for these (params, x, cu_seqlens, options);
// null recomputes them by rerunning the forward, which gives bit-identical gradients. Values the
// forward does not keep (f_a(x), g_a(x), the gate projection, the conv pre-activations) are
// recomputed either way; they are narrow (HL wide) or cheap.
Tensor kda_backward(const KdaParams& params, const Tensor& x, const Tensor& cu_seqlens,
                    const KdaOptions& options, const KdaSaved* saved, const Tensor& dy,
                    KdaGrads& grads);

}  // namespace glmtune::ops
