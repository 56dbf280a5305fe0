#pragma once
// Clamped SwiGLU on the GPU: the CUDA side of ops::swiglu_clamped and its backward (ops/mlp.h),
// elementwise in fp32 on bf16 storage.
//
//   a = min(gate, lim)             (clamped from above only)
//   b = clamp(up, −lim, lim)
//   out = silu(a) · b
//   dgate = dout · b · σ(a)(1 + a(1 − σ(a)))   where gate < lim, else 0
//   dup   = dout · silu(a)                      where −lim < up < lim, else 0
//
// The clamps pass the gradient only strictly inside their bounds, exactly as the CPU op (and
// torch's clamp with scalar bounds) does; min/clamp propagate NaN the way std::min/std::clamp do.
//
// gate, up, dgate and dup share one shape [..., I] and may be 2-D views with unit inner stride
// and their own row stride (the two halves of a fused [N, 2I] product or gradient); out and dout
// are contiguous or such views too. All bf16 (or all f32 in the fp32 mode), on one device,
// asynchronous on `stream`.

#include <cuda_runtime.h>

#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

void swiglu_clamped_out(Tensor& out, const Tensor& gate, const Tensor& up, double limit,
                        cudaStream_t stream = nullptr);
Tensor swiglu_clamped(const Tensor& gate, const Tensor& up, double limit,
                      cudaStream_t stream = nullptr);

// Overwrites dgate and dup (both defined by the caller).
void swiglu_clamped_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, double limit,
                             Tensor& dgate, Tensor& dup, cudaStream_t stream = nullptr);

}  // namespace glmtune::cuda
