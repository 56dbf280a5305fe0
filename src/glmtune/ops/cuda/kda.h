#pragma once
// Kimi Delta Attention on the GPU: the CUDA side of the KDA ops in ops/kda.h and of the two norms
// the mixer uses (ops/norm.h: l2_norm of q and k, the sigmoid-gated o_norm), forward and backward.
//
// Packed documents: `cu_seqlens` is an int32 CUDA tensor [ndoc + 1] (cu[0] = 0, cu[ndoc] = T);
// the conv taps and the delta-rule state restart at every document, as on the CPU.
//
// Storage: activations and their gradients (x, q, k, v, o, the norms' inputs and outputs) are bf16,
// or all f32 (the tight-tolerance mode); the log decay g, beta, the per-row statistics and every
// parameter gradient are f32. Arithmetic is fp32. Every sum over tokens (conv weight, dt_bias,
// A_log, o_norm weight gradients) runs over fixed token blocks and then over blocks in order, and
// the delta-rule backward sums its per-value-slice partials in slice order: no float atomics,
// bit-identical reruns.
//
// The delta rule (kda_chunked / kda_chunked_backward) needs key = value head dim 128. It runs in
// chunks of 16 tokens (any chunk size computes the same function; the CPU reference uses 64) on
// the tensor cores: a token-parallel kernel forms each chunk's local quantities, a kernel per
// (head, document) walks the chunks carrying the 128×128 state in MMA accumulators, and the
// backward walks them in reverse carrying d S. In bf16 storage its large products take bf16
// operands with fp32 accumulation (dg and dβ within about 2e-3 rel L2 of the f32 CPU op); the
// f32 mode splits every operand into three bf16 parts (about 1e-6). The kernel overview, the
// notation and the workspace sizes are at the top of kda_core.cu.

#include <cuda_runtime.h>

#include <array>
#include <optional>

#include "glmtune/ops/kda.h"
#include "glmtune/ops/norm.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

// x [T, C]; weight [C, Kc] or [C, 1, Kc] in x's dtype. y[t, c] = Σ_τ w[c, τ] x[t − (Kc−1) + τ, c]
// (taps before the document start read 0), then SiLU when `silu`.
Tensor causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens, bool silu,
                     cudaStream_t stream = nullptr);
// d x [T, C] (x's dtype) from d y; the weight gradient (f32, shaped like weight) accumulates into
// *grad_weight (undefined: created as zeros). The pre-activation is recomputed from x.
Tensor causal_conv1d_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                              bool silu, const Tensor& dy, Tensor* grad_weight,
                              cudaStream_t stream = nullptr);

// q or k of the mixer (ops::kda_qk_conv): the conv with SiLU and each head's row L2-normalised in
// one pass over x; y [T, C / head_dim, head_dim] in x's dtype, `norm` (optional) the f32 ν
// [T, C / head_dim]. The same bits as causal_conv1d followed by l2_norm.
Tensor kda_qk_conv(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                   int64_t head_dim, double eps, Tensor* norm = nullptr,
                   cudaStream_t stream = nullptr);
// d x from d y of the normalised rows (`norm`, the forward's ν, is checked; the kernels recompute
// it): the conv output recomputed from x, then the norm's backward and the conv's.
Tensor kda_qk_conv_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                            int64_t head_dim, double eps, const Tensor& norm, const Tensor& dy,
                            Tensor* grad_weight, cudaStream_t stream = nullptr);

// graw [T, NL·HL] (bf16/f32), dt_bias f32 [NL·HL], A_log f32 [NL] → g f32 [T, NL, HL].
Tensor kda_gate(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                std::optional<double> lower_bound, cudaStream_t stream = nullptr);
// dg f32 [T, NL, HL] → d graw (graw's dtype); d dt_bias and d A_log (f32) accumulate.
Tensor kda_gate_backward(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                         std::optional<double> lower_bound, const Tensor& dg, Tensor* grad_dt_bias,
                         Tensor* grad_A_log, cudaStream_t stream = nullptr);

// beta = σ(logits): logits [T, NL] (bf16/f32) → f32; backward d logits = dβ·β(1 − β), f32.
Tensor kda_beta(const Tensor& logits, cudaStream_t stream = nullptr);
Tensor kda_beta_backward(const Tensor& beta, const Tensor& d_beta, cudaStream_t stream = nullptr);

// y = x / sqrt(Σ x² + eps) per row of the last dim; `norm` (optional) receives the f32 divisor.
Tensor l2_norm(const Tensor& x, double eps, Tensor* norm = nullptr, cudaStream_t stream = nullptr);
Tensor l2_norm_backward(const Tensor& dy, const Tensor& x, double eps,
                        cudaStream_t stream = nullptr);

// o_norm: y = w ⊙ x·rstd ⊙ σ(gate), rows of the last dim; weight f32 [n]; one rounding at the end.
Tensor rms_norm_gated(const Tensor& x, const Tensor& weight, const Tensor& gate, double eps,
                      cudaStream_t stream = nullptr);
// d x and d gate in x's dtype; the weight gradient (f32) accumulates into *grad_weight.
ops::RmsNormGatedGrads rms_norm_gated_backward(const Tensor& dy, const Tensor& x,
                                               const Tensor& weight, const Tensor& gate, double eps,
                                               Tensor* grad_weight, cudaStream_t stream = nullptr);

// The chunk-local quantities kda_chunked forms before its walk (per chunk of 16 tokens and head:
// W, U, qd, kdec, A, e^{Γ_last}, (I + L)^{-1}; 22 KB in bf16, so 1.5 GB at T = 16384 with 64
// heads; 47 KB in the f32 mode).
// kda_chunked fills one when given it; kda_chunked_backward of the same inputs then reads them
// instead of forming them again. Memory for time: the caller decides whether to hold it.
struct KdaChunkCache {
  Tensor chunks, tiles, f32s;           // the chunk table, the bf16 hi/lo tiles, the f32 tiles
  int64_t slots = 0;                    // chunk slots (an upper bound on the chunk count)
  std::array<const void*, 5> inputs{};  // q, k, v, g, beta of the forward that filled it
  float scale = 0.0f;
};

// The delta-rule core: q, k [T, NL, 128] (already L2-normalised) and v [T, NL, 128] in one dtype,
// g f32 [T, NL, 128], beta f32 [T, NL]; q is scaled by `scale` inside. Returns o (q's dtype).
// `value_slices` (1, 2 or 4) splits each (head, document) walk over that many blocks of value
// rows, the state's value columns evolving independently; 0 picks by the walk count and the SM
// count, so few documents with few heads still fill the GPU. The result does not depend on it
// beyond fp32 rounding (the backward's sums over the value rows are grouped per slice).
Tensor kda_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                   const Tensor& beta, const Tensor& cu_seqlens, double scale,
                   cudaStream_t stream = nullptr, int value_slices = 0,
                   KdaChunkCache* keep = nullptr);
// dq, dk, dv in q's dtype (dq with respect to the unscaled q); dg, dbeta f32.
ops::KdaCoreGrads kda_chunked_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& g, const Tensor& beta,
                                       const Tensor& cu_seqlens, double scale, const Tensor& d_out,
                                       cudaStream_t stream = nullptr, int value_slices = 0,
                                       const KdaChunkCache* cached = nullptr);

}  // namespace glmtune::cuda
