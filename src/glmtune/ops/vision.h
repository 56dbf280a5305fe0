#pragma once
// Leaf ops of the vision tower (model/vision/tower.cpp): the 2-D axial rotary embedding, exact
// GELU, and bidirectional softmax attention within the segments (images, video frames) of a pack.
// CPU bodies in f32 (the reference path) or f64 (finite-difference tests); CUDA bodies
// (ops/cuda/vision.h) for tensors on a GPU, where x, q, k, v are bf16 and the rotary tables f32.

#include <cstdint>
#include <vector>

#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

// ---- 2-D rotary embedding ----
// cos / sin tables [N, hd] (dtype `dtype`) for patch positions [N, 2] (int64 row, column). With
// q = hd/4: inv_freq[k] = 1 / θ^(2k / (hd/2)) for k < q; the angles [row·inv_freq, col·inv_freq]
// (hd/2 values) repeated twice to cover the head dim (rotate-half pairs m with m + hd/2). In f32
// every step rounds as the reference's float32 tensors do.
struct RopeTables {
  Tensor cos, sin;
};
RopeTables rope_2d_tables(const Tensor& positions, int64_t head_dim, double theta, DType dtype);

// x [N·H, hd] (contiguous, rows grouped by position) rotated in place (tables in x's dtype on the
// CPU; f32 tables on x's device for a GPU tensor):
// x'[m] = x[m]·cos − x[m+hd/2]·sin, x'[m+hd/2] = x[m+hd/2]·cos + x[m]·sin.
void rope_2d_(Tensor& x, const RopeTables& tables);
// The transpose, in place on the gradient of the rotated x (the rotation is orthogonal).
void rope_2d_backward_(Tensor& dx, const RopeTables& tables);

// ---- Exact GELU ----
// x·Φ(x) = x/2 · (1 + erf(x/√2)), in place; its backward overwrites dy with dy · (Φ(x) + x·φ(x)).
void gelu_erf_(Tensor& x);
void gelu_erf_backward_(const Tensor& x, Tensor& dy);

// ---- Attention within segments ----
// Full (bidirectional) softmax attention of every segment [cu[s], cu[s+1]) of a pack with itself,
// per head. q [Nq, H·hd] holds pack rows [q_begin, q_begin + Nq) (all of them unsharded); k and v
// [N, H·hd] the whole pack (any row stride: v may be a view into a fused qkv). Returns
// [Nq, H·hd]. Scores are formed one block of query rows at a time, never as an [N, N] matrix; the
// softmax normaliser is summed in double on the CPU, in fp32 on the GPU. With `lse`, also the
// natural-log log-sum-exp of every row's scaled scores, f32 [Nq, H] (the GPU backward reads it).
Tensor varlen_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<int64_t>& cu_seqlens, int64_t heads, double scale,
                        int64_t q_begin = 0, Tensor* lse = nullptr);

struct VarlenAttentionGrads {
  Tensor dq;  // [Nq, H·hd]
  Tensor dk;  // [N, H·hd], zero outside the segments that hold a query row
  Tensor dv;  // [N, H·hd], likewise
};
// Backward for `out` (the forward's result) and its gradient `dout`; the probabilities are
// recomputed from q and k with the forward's arithmetic. `lse` is the forward's (optional: the
// CPU recomputes the normalisers, the GPU reruns the forward when it is missing).
VarlenAttentionGrads varlen_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                               const Tensor& out, const Tensor& dout,
                                               const std::vector<int64_t>& cu_seqlens,
                                               int64_t heads, double scale, int64_t q_begin = 0,
                                               const Tensor& lse = Tensor());

}  // namespace glmtune::ops
