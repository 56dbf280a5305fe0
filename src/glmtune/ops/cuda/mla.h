#pragma once
// Sparse NoPE MLA attention on the GPU: the CUDA side of ops::sparse_attention and
// ops::sparse_attention_backward (ops/mla.h), over each query's selected keys only.
//
//   o[i, h] = Σ_{j ∈ J(i)} softmax_j(scale · q[i,h]·k[j,h]) v[j, h],   J(i) = the row's entries
//   as a set (−1 skipped, duplicates once); a row without keys gives 0.
//
// Key sets: one block per query sorts its row in shared memory, drops −1 and repeats, and checks
// that every entry lies in the query's document (a violation is an error, found with one 4-byte
// read back: the op's only synchronisation). For the backward, the (key, query) pairs are also
// sorted key-major with a stable radix sort, so each key sees its queries in ascending order.
//
// Forward: one warp per (query, head) — four heads of one query per block — with an online
// softmax in fp32 over the gathered keys (each lane holds Dqk/32 query and Dv/32 accumulator
// elements), writing bf16 o and the fp32 log-sum-exp. Backward, recomputing the probabilities
// p = exp(scale·q·k − lse): delta_i = dO_i·o_i; a warp per (query, head) sums
// dq_i = scale Σ_j p (dO_i·v_j − delta_i) k_j over its keys; a warp per (key, head) sums
// dk_j = scale Σ_i p (dO_i·v_j − delta_i) q_i and dv_j = Σ_i p dO_i over the queries that
// selected it. Every sum has a fixed order and no atomics: reruns are bit-identical.
//
// q, k bf16 [T, NH, Dqk], v bf16 [T, NH, Dv], contiguous, with (Dqk, Dv) one of (32, 32),
// (64, 64), (128, 128), (256, 256), (512, 512), (128, 64). indices int32 [T, W] on the GPU (global
// token ids, what the indexer returns); cu_seqlens is a CPU int32/int64 tensor. Runs on `stream`.

#include <cuda_runtime.h>

#include "glmtune/ops/mla.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

struct SparseKeySets {
  Tensor keys;    // int32 [T, W]: the row's distinct keys ascending, then −1
  Tensor counts;  // int32 [T]
  // Key-major pairs (backward only; undefined when not asked for).
  Tensor key_offsets;  // int32 [T + 1]: key j's queries are key_queries[off[j] .. off[j+1] − 1]
  Tensor key_queries;  // int32 [T · W]: ascending query ids per key (the tail is unused)
};

SparseKeySets sparse_key_sets(const Tensor& indices, const Tensor& cu_seqlens, bool key_major,
                              cudaStream_t stream = nullptr);

struct SparseAttentionOutput {
  Tensor out;  // bf16 [T, NH, Dv]
  Tensor lse;  // f32 [T, NH]: log Σ_j exp(scale·q·k_j) (unused for rows without keys)
};

SparseAttentionOutput sparse_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                               const SparseKeySets& sets, double scale,
                                               cudaStream_t stream = nullptr);

// `sets` must carry the key-major pairs; `out` and `lse` from the forward.
ops::AttentionGrads sparse_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& out, const Tensor& lse,
                                              const SparseKeySets& sets, double scale,
                                              const Tensor& dout, cudaStream_t stream = nullptr);

}  // namespace glmtune::cuda
