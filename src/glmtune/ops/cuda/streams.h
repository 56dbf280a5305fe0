#pragma once
// The residual-stream reshapes of mHC on the GPU (ops/mhc.h mhc_expand / mhc_head and their
// backward passes), a row gather, and the elementwise sum the composed ops use to add partial
// gradients. bf16 or
// f32 tensors, contiguous, on one device; fp32 arithmetic; asynchronous on `stream`.

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

// [..., D] → [..., H, D]: H copies (mhc_expand), or every stream d_out / H (mhc_head_backward,
// with scale 1/H).
Tensor broadcast_streams(const Tensor& x, int64_t hc_mult, float scale,
                         cudaStream_t stream = nullptr);
// [..., H, D] → [..., D]: scale · Σ_i X_i, summed in stream order (mhc_head with scale 1/H,
// mhc_expand_backward with scale 1).
Tensor reduce_streams(const Tensor& streams, float scale, cudaStream_t stream = nullptr);
// out[i, :] = x[rows[i], :] for x [N, D] (bf16 or f32, contiguous); a negative index gives a zero
// row. `rows` holds int64 indices on the host; they are copied to the device.
Tensor gather_rows(const Tensor& x, const std::vector<int64_t>& rows,
                   cudaStream_t stream = nullptr);
// dst[rows[i], :] = src[i, :] for dst [N, D] and src [n, D] (one dtype, bf16 or f32, contiguous;
// distinct rows in [0, N)). `rows` holds int64 indices on the host.
void scatter_rows(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src,
                  cudaStream_t stream = nullptr);
// a += b (same shape; a bf16 or f32, b bf16 or f32), rounding once into a's dtype.
void add_inplace(Tensor& a, const Tensor& b, cudaStream_t stream = nullptr);
// a *= s (a bf16 or f32, contiguous): the product in double, rounded once into a's dtype.
void scale_inplace(Tensor& a, double s, cudaStream_t stream = nullptr);
// ops::dropout_into's body (ops/elementwise.h): the same mask as the CPU's, bit for bit.
void dropout_inplace(Tensor& a, double p, uint64_t key, cudaStream_t stream = nullptr);

}  // namespace glmtune::cuda
