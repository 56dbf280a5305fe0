#pragma once
// Normalisations over the last dimension, as the reference computes them (docs/model/kda_mhc.md,
// "Norms"):
//   rms_norm        y = w ⊙ (x / sqrt(mean(x²) + eps))            (w undefined: un-weighted, mHC)
//   rms_norm_gated  y = (w ⊙ x / sqrt(mean(x²) + eps)) ⊙ act(z)   (KDA o_norm; act: sigmoid)
//   layer_norm      y = (x − mean) / sqrt(var + eps) ⊙ w + b      (biased variance, as torch)
//   l2_norm         y = x / sqrt(Σ x² + eps)                      (KDA q/k; eps inside the sqrt)
// CPU tensors in f32 (reference path) or f64 (finite-difference tests); all operands share the
// dtype. Reductions accumulate in double. In the bf16 model the reference rounds the weighted
// RMSNorm's normalised value to bf16 before the weight multiply, and the gated norm only once at
// the end; in f32/f64 those casts are the identity, so these kernels have none.
//
// The optional outputs hold per-row statistics for a backward pass: shape x.shape()[:-1].

#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

enum class GateActivation {
  sigmoid,  // the reference Glm5NextTextRMSNormGated (activation = "sigmoid")
  silu,     // FLA's FusedRMSNormGated default ("swish"), for other KDA models
};

// `rstd` (optional): 1 / sqrt(mean(x²) + eps) per row.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, Tensor* rstd = nullptr);

// Gated RMSNorm with weight [n] shared across all leading dims (KDA heads) and gate z shaped as x.
// `rstd` (optional): 1 / sqrt(mean(x²) + eps) per row.
Tensor rms_norm_gated(const Tensor& x, const Tensor& weight, const Tensor& gate, double eps,
                      GateActivation activation = GateActivation::sigmoid, Tensor* rstd = nullptr);

// LayerNorm with optional weight and bias (either may be undefined). `mean` and `rstd` (optional):
// per-row mean and 1 / sqrt(var + eps).
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                  Tensor* mean = nullptr, Tensor* rstd = nullptr);

// `norm` (optional): sqrt(Σ x² + eps) per row (the reference divides by it).
Tensor l2_norm(const Tensor& x, double eps, Tensor* norm = nullptr);

// ---- Backward passes --------------------------------------------------------------------------
// Each takes the upstream gradient dy (shaped and typed like x), the forward's inputs and, where
// the forward can return one, its per-row statistic; an undefined statistic is recomputed from x
// exactly as the forward computes it. Parameter gradients accumulate into the caller's buffers
// (null: skipped; undefined: allocated as zeros shaped like the parameter), summed over all rows.
// Row reductions accumulate in double, parameter sums run over rows in order (deterministic).

// With r = rstd, u = w ⊙ dy (u = dy un-weighted):
//   dx = r·u − (r³/n)·x·Σ_j u_j x_j;   dw += Σ_rows dy ⊙ x·r.
Tensor rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                         const Tensor& rstd = Tensor(), Tensor* grad_weight = nullptr);

struct RmsNormGatedGrads {
  Tensor dx;     // shaped like x
  Tensor dgate;  // shaped like gate
};

// The gated norm is the weighted RMSNorm times act(z): the x path sees dy ⊙ act(z) as its
// upstream gradient; dz = dy ⊙ w ⊙ x·r ⊙ act'(z); dw += Σ_rows dy ⊙ x·r ⊙ act(z).
RmsNormGatedGrads rms_norm_gated_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                          const Tensor& gate, double eps,
                                          GateActivation activation = GateActivation::sigmoid,
                                          const Tensor& rstd = Tensor(),
                                          Tensor* grad_weight = nullptr);

// With x̂ = (x − μ)·r and u = w ⊙ dy: dx = r·(u − mean(u) − x̂·mean(u ⊙ x̂));
// dw += Σ_rows dy ⊙ x̂; db += Σ_rows dy. `grad_bias` has shape [n] (the bias itself is not needed).
Tensor layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                           const Tensor& mean = Tensor(), const Tensor& rstd = Tensor(),
                           Tensor* grad_weight = nullptr, Tensor* grad_bias = nullptr);

// y = x / ν with ν = sqrt(Σ x² + eps): dx = (dy − y·⟨y, dy⟩) / ν.
Tensor l2_norm_backward(const Tensor& dy, const Tensor& x, double eps,
                        const Tensor& norm = Tensor());

}  // namespace glmtune::ops
