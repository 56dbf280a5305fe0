#pragma once
// Sparse NoPE MLA attention on the GPU: the CUDA side of ops::sparse_attention and
// ops::sparse_attention_backward (ops/mla.h), over each query's selected keys only.
//
//   o[i, h] = Σ_{j ∈ J(i)} softmax_j(scale · q[i,h]·k[j,h]) v[j, h],   J(i) = the row's entries
//   as a set (−1 skipped, duplicates once); a row without keys gives 0.
//
// Key sets: one block per query marks its row's keys in a shared-memory bitmap (32,768 keys at a
// time) and writes the set bits in order, so −1 and repeats drop out and the keys come ascending
// at a cost of the row's width; it checks that every entry lies in the query's document (a
// violation is an error, found with one 4-byte read back; an entry out of place is skipped, never
// read). The read back waits for the key sets' kernel: at once by default, or, deferred, when the
// caller has queued the attention behind it (require_valid_indices), so that the device never
// idles while the host checks. For the backward, the (key, query) pairs are also sorted key-major
// with a stable radix sort, so each key sees its queries in ascending order.
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

#include <memory>

#include "glmtune/ops/mla.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

// The index check of a deferred sparse_key_sets: the error flag on its way to pinned host memory.
struct PendingIndexCheck;

struct SparseKeySets {
  Tensor keys;    // int32 [T, W]: the row's distinct keys ascending, then −1
  Tensor counts;  // int32 [T]
  std::shared_ptr<PendingIndexCheck> pending;  // set while a deferred check is unread
  // Key-major pairs (backward only; undefined when not asked for).
  Tensor key_offsets;  // int32 [T + 1]: key j's queries are key_queries[off[j] .. off[j+1] − 1]
  Tensor key_queries;  // int32 [T · W]: ascending query ids per key (the tail is unused)
  Tensor key_pairs;    // int32 [T · W]: the same pairs as ids i·W + slot, slot = the key's
                       // position in query i's row of `keys` (ascending per key)
};

enum class IndexCheck { now, deferred };
SparseKeySets sparse_key_sets(const Tensor& indices, const Tensor& cu_seqlens, bool key_major,
                              cudaStream_t stream = nullptr, IndexCheck check = IndexCheck::now);
// The deferred check: waits for the key sets' own kernel (not for work queued after it) and
// raises its error, if any. Does nothing for key sets checked at once.
void require_valid_indices(const SparseKeySets& sets);

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

// ---- absorbed-latent form (ops/cuda/mla_absorbed.cu) ----
//
// With k = latent W_kbᵀ and v = latent W_vbᵀ per head, attention runs on the latent itself:
//   q_abs[i,h] = W_kb[h]ᵀ q[i,h]                                  [T, NH, R]
//   o_lat[i,h] = Σ_{j ∈ J(i)} softmax_j(scale · q_abs[i,h]·latent[j]) latent[j]
//   o[i,h]     = W_vb[h] o_lat[i,h]
// equal to the per-head form in real arithmetic. All heads of a query share the latent rows of
// its keys, so a block per query computes scores and outputs for 64 heads at once with tensor-core
// MMAs (bf16 operands, fp32 accumulation, online softmax in fp32), loading each selected row once.
// R must be 512 (kv_lora_rank); NH ≤ 64 for the backward (any NH for the forward).
//
// Backward: p = 2^(s − lse2) recomputed, delta = d o_lat · o_lat, dS = p (dP − delta);
// d q_abs = scale Σ_j dS latent[j] query-major; each (query, key) pair's share of d latent,
// Σ_h p d o_lat + scale dS q_abs (an MMA over the heads), goes to a bf16 workspace of at most
// `workspace_bytes` (queries in chunks) and is summed key-major in ascending query order in fp32,
// one running sum per key across the chunks: no atomics, and results are bit-identical across
// reruns and workspace sizes.

struct AbsorbedAttentionOutput {
  Tensor out;  // bf16 [T, NH, R] o_lat
  Tensor lse2;  // f32 [T, NH] log2 Σ_j 2^(scale·log2(e)·q_abs·latent_j); +∞ for a row without keys
};

// The kernels: mma.sync (any tensor-core GPU) and Hopper's warpgroup MMA (wgmma,
// ops/cuda/mla_absorbed_sm90.cuh), which needs a build for sm_90a and a device of compute
// capability 9.x. The wgmma forward has a producer warpgroup gather the selected latent rows a
// stage ahead while two consumer warpgroups each score and multiply their own 32-key tile (433
// TFLOP/s at T16384, top-2048 on an H100 against the mma.sync kernel's 162 at T4096 on an H200,
// docs/PERF.md); the wgmma backward forms the scores and dP once for both gradients in one kernel,
// where the mma.sync backward's two kernels (d q_abs, then the d latent shares) each form them.
// Both write the same workspace rows and leave the key-major reduction to the same kernel. The
// model runs the wgmma kernels where they can run (GLMTUNE_MLA_KERNEL=mma_sync or wgmma_forward
// keeps one or both directions on mma.sync, for comparisons); the mma.sync ones everywhere else.
enum class AbsorbedKernel { mma_sync, wgmma };

// Whether the wgmma kernels can run on `device` (this build has sm_90a code, the device is 9.x).
bool absorbed_wgmma_available(int device);

// q_abs bf16 [T, NH, 512], latent bf16 [T, 512], contiguous on one GPU.
AbsorbedAttentionOutput absorbed_attention_forward(
    const Tensor& q_abs, const Tensor& latent, const SparseKeySets& sets, double scale,
    cudaStream_t stream = nullptr, AbsorbedKernel kernel = AbsorbedKernel::mma_sync);

struct AbsorbedAttentionGrads {
  Tensor q_abs;   // bf16 [T, NH, R]
  Tensor latent;  // f32 [T, R]
};

// `sets` must carry the key-major pairs; `out` and `lse2` from the forward; dout = d o_lat.
AbsorbedAttentionGrads absorbed_attention_backward(
    const Tensor& q_abs, const Tensor& latent, const Tensor& out, const Tensor& lse2,
    const SparseKeySets& sets, double scale, const Tensor& dout, cudaStream_t stream = nullptr,
    int64_t workspace_bytes = int64_t(1) << 31, AbsorbedKernel kernel = AbsorbedKernel::mma_sync);

}  // namespace glmtune::cuda
