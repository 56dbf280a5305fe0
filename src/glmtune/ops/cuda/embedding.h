#pragma once
// Token embedding on the GPU: the CUDA side of ops::embedding_forward / embedding_backward
// (ops/embedding.h), bf16 table and activations (f32 both in the fp32 mode).
//
// The forward is a gather with 16-byte copies. Every id is checked on the device against the
// vocabulary; a bad id leaves its output row zero and makes the call throw glmtune::Error naming
// the first bad position (the check costs one stream synchronisation per call).
//
// The backward is deterministic without atomics or a device sort. The token list is bucketed by
// id on the host (EmbeddingGradPlan: touched rows, and for each the positions that hold it, in
// increasing order); one thread block then owns each touched row. Its 8 warps take the row's
// tokens round-robin in a fixed assignment (warp w: tokens w, w+8, ...), each summing in fp32 in
// order, and the 8 partial sums are added in warp order before the single update of the row. The
// result depends only on the ids and values, never on timing. The padding row is left out of the
// plan, so it never receives a gradient, as in the CPU op.

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

// out[..., D] = table[ids[...], :]. table bf16 or f32 [V, D] contiguous on a CUDA device; ids int32
// or int64 on that device or on the CPU (copied over); out of the table's dtype, contiguous, shaped
// ids.shape + [D].
void embedding_forward_out(Tensor& out, const Tensor& table, const Tensor& ids,
                           cudaStream_t stream = nullptr);
Tensor embedding_forward(const Tensor& table, const Tensor& ids, cudaStream_t stream = nullptr);

// Rows of the table touched by a token list, with their tokens, on `device`.
struct EmbeddingGradPlan {
  Tensor rows;     // i32 [U]: the distinct ids (padding excluded), increasing
  Tensor offsets;  // i32 [U + 1]: tokens of rows[u] are tokens[offsets[u] .. offsets[u + 1])
  Tensor tokens;   // i32 [n]: flat token positions, increasing within each row
  int64_t vocab = 0;
  int64_t num_positions = 0;  // ids.numel() the plan was built for
};

// Built on the host from `ids` (int32/int64, CPU or CUDA: a CUDA tensor is copied to the host).
// An id outside [0, vocab) is a glmtune::Error naming it and its position. The training loop can
// build the plan while the GPU still runs the previous step: it only needs the token ids.
EmbeddingGradPlan make_embedding_grad_plan(const Tensor& ids, int64_t vocab,
                                           std::optional<int64_t> padding_idx, Device device);

// dtable[v, :] += Σ_{t : ids[t] = v} dout[t, :] for every row in the plan. dout bf16 [..., D]
// (contiguous, plan.num_positions rows); dtable f32 or bf16 [V, D] contiguous; rows not in the
// plan are not touched. dout may also be f32.
void embedding_backward(const EmbeddingGradPlan& plan, const Tensor& dout, Tensor& dtable,
                        cudaStream_t stream = nullptr);

}  // namespace glmtune::cuda
