#pragma once
// Fused LM head + cross-entropy on the GPU: the CUDA side of ops::lm_head_cross_entropy
// (ops/cross_entropy.h), same semantics (ignore index −100, external denominator, grad_scale),
// without ever holding all [T, V] logits.
//
// Rows whose label is −100 are dropped up front (on the host, from the labels), so they cost no
// GEMM work; the remaining rows are processed in chunks of opts.chunk_rows:
//   1. z = h_c · Wᵀ                        cuBLASLt, bf16 operands, fp32 logits [m, V]
//   2. one block per row: online log-sum-exp over the row in fp32 (a running max and a rescaled
//      sum, merged across threads in a fixed tree), loss_r = lse − z[label], then in place
//      dz = coef·(softmax(z) − onehot(label)) as bf16 over the first half of the row's fp32 bytes
//   3. dh_c = dz · W                        into dhidden's rows (bf16 or f32)
//   4. dW  += dzᵀ · h_c                     fp32 accumulation inside the GEMM, one rounding into dW
// with coef = grad_scale / denominator. The per-row losses are summed on the host in row order
// (double), so the reported loss is deterministic; every kernel and GEMM has a fixed order, so
// whole reruns are bit-identical.
//
// Memory: the fp32 chunk takes chunk_rows·V·4 bytes (4096 rows of a 154880 vocabulary: 2.5 GB).
// Each chunk reads and writes all of dW once, so chunks of a few thousand rows keep that traffic
// small next to the chunk's GEMMs; the CPU default of 256 rows is too small for the GPU.

#include <cuda_runtime.h>

#include "glmtune/ops/cross_entropy.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

// hidden bf16 [T, D] (contiguous or rows with unit inner stride), weight bf16 [V, D] contiguous
// (rows 16-byte aligned for the fast GEMM path), labels int32/int64 [T] on the CPU or the device
// (copied to the host, which is where they come from in training). Forward only when both
// gradient pointers are null. `dhidden` (optional): bf16 or f32 [T, D] contiguous, overwritten
// (ignored rows get 0; allocated as bf16 when undefined). `dweight` (optional): f32 or bf16
// [V, D − opts.weight_grad_col0] contiguous (the weight's columns from that one on), accumulated
// (created as f32 zeros when undefined). Synchronises `stream`
// once at the end, to read the loss.
ops::CrossEntropyResult lm_head_cross_entropy(const Tensor& hidden, const Tensor& weight,
                                              const Tensor& labels,
                                              const ops::CrossEntropyOptions& opts,
                                              Tensor* dhidden = nullptr, Tensor* dweight = nullptr,
                                              cudaStream_t stream = nullptr);

}  // namespace glmtune::cuda
