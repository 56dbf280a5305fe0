#pragma once
// The KPool DSA indexer on the GPU: the CUDA side of ops::indexer_forward (ops/indexer.h), with the
// same packed layout, the same output rows (global token ids, best pool first, the causal tail,
// −1 padding) and the same selection rule, ties towards the lower pool index and NaN first.
//
// The inputs and parameters are bf16 (f32 in the fp32 mode), but everything after them is fp32, as
// in the CPU op:
// projections with fp32 outputs (exact products of bf16 values, fp32 sums), the key LayerNorm,
// the channel-wise pool softmax, the scoring GEMM with fp32 accuracy (on the tensor cores: each
// fp32 operand as two TF32 parts, hi·hi + hi·lo + lo·hi, within about 2^-20 of each product) and
// the head-weighted ReLU sum over heads in head order. So the selection matches the CPU op's
// except where two candidate scores agree to within fp32 rounding of differently ordered sums.
//
// Per document: one scoring GEMM per block of queries gives every (query, head, candidate pool)
// product; a kernel sums the heads; a block per query sorts (score, pool) keys in shared memory
// and writes its row. At most 16384 pools per document (65536 tokens at P = 4).
//
// cu_seqlens is a CPU int32/int64 tensor (read_cu_seqlens). Runs on `stream`; no gradient.

#include <cuda_runtime.h>

#include "glmtune/ops/indexer.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

// x [T, D], q_resid [T, Rq] bf16 or f32 on the GPU; parameters of their dtype on the same device
// -> int32 [T, W].
Tensor indexer_forward(const ops::IndexerConfig& cfg, const ops::IndexerParams& params,
                       const Tensor& x, const Tensor& q_resid, const Tensor& cu_seqlens,
                       cudaStream_t stream = nullptr);

}  // namespace glmtune::cuda
