#pragma once
// Manifold-constrained hyper-connections (mHC; docs/model/kda_mhc.md, "mHC"). The residual stream
// is H parallel copies ("streams") of the hidden state, X [..., H, D]. Around every sub-layer:
//
//   (post, comb, c) = mhc_pre(X)          mixing weights from the RMS-normalised flattened streams,
//                                         c = Σ_i pre_i X_i is the sub-layer input
//   y = sublayer(norm(c))
//   X' = mhc_post(X, y, post, comb)       X'_i = post_i · y + Σ_j comb[j][i] · X_j
//
// The model starts from mhc_expand(embeddings) (H identical copies) and ends with mhc_head (the
// plain mean over streams). Every op is per token, so packed documents need no special care.
//
// CPU tensors in f32 (the reference path) or f64 (finite-difference tests); parameters share the
// input dtype. The reference promotes the stream and parameters to fp32 for all of mhc_pre and
// rounds only `c` back to the activation dtype; with f32 activations there is no rounding at all.

#include <cstdint>

#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

struct MhcOptions {
  int64_t hc_mult = 4;          // H, number of streams
  int64_t sinkhorn_iters = 20;  // column steps of the Sinkhorn projection (rows get one fewer)
  double hc_eps = 1e-6;         // floor on pre, on each softmax entry and in every Sinkhorn divisor
  double rms_eps = 1e-5;        // eps of the un-weighted RMSNorm of the flattened streams
};

struct MhcPreResult {
  Tensor post;       // [..., H]     2·σ(·), the weight of the sub-layer output in each stream
  Tensor comb;       // [..., H, H]  comb[j][i]: weight of source stream j in destination stream i
  Tensor collapsed;  // [..., D]     Σ_i pre_i X_i, the sub-layer input
};

// What a backward pass of mhc_pre needs besides its inputs. The Sinkhorn iterations are cheap
// (H×H per token), so only their input is kept and a backward replays them.
struct MhcPreSaved {
  Tensor rstd;       // [...]            1/sqrt(mean over H·D of X² + rms_eps)
  Tensor mix;        // [..., (2+H)·H]   (X·rstd) · fn^T, before scale and base
  Tensor pre;        // [..., H]         σ(scale[0]·mix_pre + base_pre) + hc_eps
  Tensor comb_init;  // [..., H, H]      softmax over each row + hc_eps (the Sinkhorn start)
};

// streams [..., H, D]; fn [(2+H)·H, H·D]; base [(2+H)·H]; scale [3].
MhcPreResult mhc_pre(const Tensor& streams, const Tensor& fn, const Tensor& base,
                     const Tensor& scale, const MhcOptions& options, MhcPreSaved* saved = nullptr);

// The Sinkhorn projection alone: logits [..., H, H] (already scaled and biased) →
// softmax(row) + eps, a column step, then (iters − 1) × (row step, column step).
Tensor mhc_sinkhorn(const Tensor& logits, int64_t iters, double eps);

// c = Σ_i pre_i · X_i: streams [..., H, D], pre [..., H] → [..., D].
Tensor mhc_collapse(const Tensor& streams, const Tensor& pre);

// X'_i = post_i · y + Σ_j comb[j][i] · X_j: streams [..., H, D], y [..., D], post [..., H],
// comb [..., H, H] → [..., H, D].
Tensor mhc_post(const Tensor& streams, const Tensor& y, const Tensor& post, const Tensor& comb);

// [..., D] → [..., H, D], H identical copies (layer-0 input).
Tensor mhc_expand(const Tensor& x, int64_t hc_mult);

// [..., H, D] → [..., D], the plain unweighted mean over streams (before the final norm).
Tensor mhc_head(const Tensor& streams);

// ---- Backward passes --------------------------------------------------------------------------
// Upstream gradients share the dtype of the streams. Parameter gradients accumulate into the
// caller's buffers (an undefined buffer is first allocated as zeros shaped like the parameter);
// sums over tokens run in token order, so results do not depend on the thread count.

// Gradients of one mHC site's parameters.
struct MhcGrads {
  Tensor fn;     // [(2+H)·H, H·D]
  Tensor base;   // [(2+H)·H]
  Tensor scale;  // [3]
};

// Backward of mhc_pre: the upstream gradients of post [..., H], comb [..., H, H] and collapsed
// [..., D] (any may be undefined, meaning zero) → d streams [..., H, D]; fn, base and scale
// gradients accumulate into `grads`. The path runs through the collapse (pre_i·X_i), the
// sigmoids, the softmax and every Sinkhorn step (replayed per token from saved->comb_init), the
// mixing GEMM and the RMSNorm of the flattened streams. `saved` must come from mhc_pre on the same
// inputs; null recomputes it. `residual` (optional, [..., H, D] in the streams' dtype) is a
// gradient of the streams from another path, mhc_post's residual one in the model: it is added to
// the result before the result is rounded to the streams' dtype (one rounding, no second pass).
Tensor mhc_pre_backward(const Tensor& streams, const Tensor& fn, const Tensor& base,
                        const Tensor& scale, const MhcOptions& options, const MhcPreSaved* saved,
                        const Tensor& d_post, const Tensor& d_comb, const Tensor& d_collapsed,
                        MhcGrads& grads, const Tensor& residual = Tensor());

// Backward of mhc_sinkhorn: d logits [..., H, H] from d out [..., H, H].
Tensor mhc_sinkhorn_backward(const Tensor& logits, int64_t iters, double eps, const Tensor& d_out);

struct MhcCollapseGrads {
  Tensor d_streams;  // [..., H, D]  pre_i · dc
  Tensor d_pre;      // [..., H]     ⟨dc, X_i⟩
};
MhcCollapseGrads mhc_collapse_backward(const Tensor& streams, const Tensor& pre,
                                       const Tensor& d_out);

struct MhcPostGrads {
  Tensor d_streams;  // [..., H, D]  Σ_i comb[j][i] · dX'_i (the residual path)
  Tensor d_y;        // [..., D]     Σ_i post_i · dX'_i
  Tensor d_post;     // [..., H]     ⟨dX'_i, y⟩
  Tensor d_comb;     // [..., H, H]  d comb[j][i] = ⟨dX'_i, X_j⟩
};
// Backward of mhc_post for d out = dX' [..., H, D].
MhcPostGrads mhc_post_backward(const Tensor& streams, const Tensor& y, const Tensor& post,
                               const Tensor& comb, const Tensor& d_out);

// Backward of mhc_expand: the sum over streams, [..., H, D] → [..., D].
Tensor mhc_expand_backward(const Tensor& d_streams);

// Backward of mhc_head: every stream receives d out / H, [..., D] → [..., H, D].
Tensor mhc_head_backward(const Tensor& d_out, int64_t hc_mult);

}  // namespace glmtune::ops
