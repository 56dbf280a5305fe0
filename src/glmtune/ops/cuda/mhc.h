#pragma once
// Manifold-constrained hyper-connections on the GPU: the CUDA side of ops::mhc_pre, ops::mhc_post
// and their backward passes (ops/mhc.h), same results and the same result structs.
//
// Storage: the streams X [T, H, D], the sub-layer output y [T, D], the collapsed input c [T, D]
// and their gradients are bf16 (or all f32, the tight-tolerance mode). The mixing parameters fn
// [(2+H)·H, H·D], base [(2+H)·H] and scale [3], the per-token weights post [T, H] and comb
// [T, H, H], the saved tensors and every parameter gradient are f32. Arithmetic is fp32, except
// the three products with fn (X·fnᵀ, dmix·fn, dmixᵀ·X), which run on the tensor cores with every
// f32 operand split into a bf16 hi and lo part (tensor_core.cuh: about 16 bits each, fp32
// accumulation); H must be 4 and D a multiple of 16.
//
// Kernels (no [T, H, H, D] product is ever formed: every stream mix runs per token in registers):
//   pre     1. mix = rstd · (X · fnᵀ) for 64 tokens per block, X and fn's hi/lo parts staged in
//              shared memory three column blocks ahead (cp.async), rstd from the same tiles; then,
//              one thread per token, the sigmoids, the row softmax and the 20 Sinkhorn iterations
//              exactly as the CPU op orders them
//           2. c = Σ_i pre_i X_i
//   post       X'_i = post_i · y + Σ_j comb[j][i] · X_j
//   pre bwd 1. one block per token: dpre_i = ⟨dc, X_i⟩
//           2. the logit gradients, one token on 16 lanes (a lane per comb element): the
//              Sinkhorn replay and its backward with the row and column sums by shuffles, the
//              row softmax, the gate sigmoids
//           3. d fn partial sums over fixed token blocks (tensor cores), then summed over blocks
//              in order
//           4. dX = pre_i·dc + rstd·(dmix · fn) − X·rstd³/(HD)·⟨dmix · fn, X⟩ (the product on the
//              tensor cores, the rest in a coalesced pass), where the inner product reuses
//              ⟨fn_m, X⟩ = mix_m / rstd (no second pass over X)
//   post bwd   one block per token; the 20 inner products are block sums in a fixed order.
// Every sum over tokens (d fn, d base, d scale) runs over fixed token blocks and then over blocks
// in order: no atomics, bit-identical reruns.

#include <cuda_runtime.h>

#include "glmtune/ops/mhc.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

// `saved` (optional) receives rstd [T], mix [T, (2+H)·H], pre [T, H] and comb_init [T, H, H], f32.
ops::MhcPreResult mhc_pre(const Tensor& streams, const Tensor& fn, const Tensor& base,
                          const Tensor& scale, const ops::MhcOptions& options,
                          ops::MhcPreSaved* saved = nullptr, cudaStream_t stream = nullptr);

// `saved` must come from cuda::mhc_pre on the same inputs (null: recomputed). Upstream gradients
// may be undefined (zero): d_post f32 [T, H], d_comb f32 [T, H, H], d_collapsed [T, D] in the
// streams' dtype. Returns d streams (plus `residual` [T, H, D] in the streams' dtype where defined,
// added in f32 before the one rounding); fn, base and scale gradients (f32) accumulate into `grads`
// (undefined: created as f32 zeros).
Tensor mhc_pre_backward(const Tensor& streams, const Tensor& fn, const Tensor& base,
                        const Tensor& scale, const ops::MhcOptions& options,
                        const ops::MhcPreSaved* saved, const Tensor& d_post, const Tensor& d_comb,
                        const Tensor& d_collapsed, ops::MhcGrads& grads,
                        const Tensor& residual = Tensor(), cudaStream_t stream = nullptr);

Tensor mhc_post(const Tensor& streams, const Tensor& y, const Tensor& post, const Tensor& comb,
                cudaStream_t stream = nullptr);

// d_streams and d_y in the streams' dtype; d_post and d_comb f32.
ops::MhcPostGrads mhc_post_backward(const Tensor& streams, const Tensor& y, const Tensor& post,
                                    const Tensor& comb, const Tensor& d_out,
                                    cudaStream_t stream = nullptr);

}  // namespace glmtune::cuda
