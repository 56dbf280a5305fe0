#pragma once
// The vision tower's leaf ops on the GPU: the CUDA side of ops/vision.h.
//
//   - rope_2d / rope_2d_backward: x [N·H, hd] (bf16 or f32, contiguous) rotated in place by f32
//     tables [N, hd]; every element computed in fp32 and rounded once.
//   - gelu_erf / gelu_erf_backward: exact GELU in place, fp32 arithmetic on bf16 or f32 storage.
//   - varlen_attention: bidirectional softmax attention within the segments of a pack, a
//     flash-attention kernel on tensor cores (mma.sync m16n8k16 fed by ldmatrix, bf16 operands,
//     fp32 accumulation): 128 query rows per block of eight warps, keys and values streamed
//     through double-buffered shared memory 64 at a time, online softmax in fp32, never an
//     [N, N] matrix. It also writes the natural-log log-sum-exp of every row's scaled scores (f32
//     [Nq, H]), which the backward reads.
//   - varlen_attention_backward: two kernels without atomics (so reruns are bit-identical): one
//     block of four warps per 64 keys accumulates dK and dV over the segment's query rows, one per
//     64 query rows accumulates dQ over the segment's keys; both recompute the probabilities from
//     the saved log-sum-exp. P and dS enter the products rounded to bf16, as in flash attention.
//
// q, k, v, dout: bf16 [rows, H·hd] with unit inner stride and any row stride that keeps 16-byte
// alignment (v may be the third of a fused qkv); hd one of 16, 32, 64, 128.

#include <cstdint>
#include <vector>

#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

void rope_2d(Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose);

void gelu_erf(Tensor& x);
void gelu_erf_backward(const Tensor& x, Tensor& dy);

// out [Nq, H·hd] bf16 (contiguous), lse f32 [Nq, H]: both defined by the caller.
void varlen_attention(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                      const std::vector<int64_t>& cu_seqlens, int64_t heads, double scale,
                      int64_t q_begin);

// dq [Nq, H·hd], dk and dv [N, H·hd] (bf16, contiguous, defined by the caller): overwritten;
// rows of dk / dv outside the segments that hold a query row are zero.
void varlen_attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& out, const Tensor& dout,
                               const Tensor& lse, const std::vector<int64_t>& cu_seqlens,
                               int64_t heads, double scale, int64_t q_begin);

}  // namespace glmtune::cuda
