#pragma once
// RMSNorm (and, at the end, LayerNorm) on the GPU: the CUDA side of ops::rms_norm /
// ops::rms_norm_backward and ops::layer_norm / ops::layer_norm_backward (ops/norm.h), with bf16
// storage and fp32 statistics.
//
//   rstd = 1 / sqrt(mean(x²) + eps)                 fp32, per row
//   y    = bf16( w ⊙ bf16(x · rstd) )               the reference's bf16 casts: the normalised
//                                                   value is rounded before the weight multiply
//   dx   = r·u − (r³/n)·x·Σ_j u_j x_j,  u = w ⊙ dy   (u = dy without a weight)
//   dw  += Σ_rows dy ⊙ x·r
//
// One thread block per row for the statistics and dx. The weight gradient is summed per block
// over a fixed range of rows (set by the row count only), then over blocks in order: no atomics,
// bit-identical reruns. Rows may be any length; a length that is a multiple of 8 with 16-byte
// aligned rows uses 16-byte accesses.
//
// Tensors: x, dy, y, dx are bf16 [..., n], contiguous or 2-D views with unit inner stride; the
// weight is bf16 [n] (undefined: the un-weighted norm); rstd is f32 with x's leading shape. In
// the fp32 mode x, dy, y, dx and the weight are all f32 and x · r is not rounded.
// Everything runs asynchronously on `stream`.

#include <cuda_runtime.h>

#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

// Writes y (bf16, shaped like x) and, when `rstd` is non-null, the per-row statistic into *rstd
// (f32, x's leading shape, defined by the caller).
void rms_norm_out(Tensor& y, Tensor* rstd, const Tensor& x, const Tensor& weight, double eps,
                  cudaStream_t stream = nullptr);
// Allocating form; `rstd` (optional) is allocated here.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, Tensor* rstd = nullptr,
                cudaStream_t stream = nullptr);

// Writes dx (bf16, shaped like x). `rstd` from the forward, or undefined to recompute it exactly
// as the forward does. `grad_weight` (optional): f32 or bf16 [n], accumulated; an undefined
// tensor is first created as f32 zeros.
void rms_norm_backward_out(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& weight,
                           double eps, const Tensor& rstd = Tensor(), Tensor* grad_weight = nullptr,
                           cudaStream_t stream = nullptr);
Tensor rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                         const Tensor& rstd = Tensor(), Tensor* grad_weight = nullptr,
                         cudaStream_t stream = nullptr);

// LayerNorm (ops::layer_norm): y = (x − μ)·r ⊙ w + b with μ the row mean and
// r = 1 / sqrt(var + eps) (biased variance, two passes), computed in fp32 on bf16 or f32 storage;
// `mean` / `rstd` (optional) receive the f32 per-row statistics. The backward takes them (both or
// neither: recomputed as the forward does) and accumulates the f32 weight and bias gradients
// through per-block partial sums added in block order: bit-identical reruns. One block per row in
// the forward; weight and bias (either may be undefined) in x's dtype.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                  Tensor* mean = nullptr, Tensor* rstd = nullptr, cudaStream_t stream = nullptr);
Tensor layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                           const Tensor& mean = Tensor(), const Tensor& rstd = Tensor(),
                           Tensor* grad_weight = nullptr, Tensor* grad_bias = nullptr,
                           cudaStream_t stream = nullptr);

}  // namespace glmtune::cuda
