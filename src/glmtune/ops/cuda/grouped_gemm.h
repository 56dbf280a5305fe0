#pragma once
// Grouped GEMMs of the routed experts: one weight matrix per group (expert), applied to that
// group's contiguous segment of rows in a permuted activation buffer. Row segments are given by
// offsets [G + 1] (group g owns rows offsets[g] .. offsets[g + 1] − 1), on the host for the
// cuBLAS backends, on the device for the Hopper kernels at the end of this file; empty groups are
// skipped, so an expert without tokens gets no gradient, as in the CPU op.
//
//   grouped_linear:                 y[rows_g, N]  = x[rows_g, K] · w[g]^T        w [G, N, K]
//   grouped_linear_backward_input:  dx[rows_g, K] = dy[rows_g, N] · w[g]
//   grouped_linear_backward_weight: dw[g] += dy[rows_g, N]^T · x[rows_g, K]       dw [G, N, K]
//
// bf16 operands (f32 in the fp32 mode, always per group), fp32 accumulation inside the GEMMs.
// Three backends, picked per call:
//   kLtPerGroup    — one cuBLASLt GEMM per group through cuda::gemm (bf16 or f32 results): the
//                    default of these functions and the MoE block's for large experts. Measured
//                    on an H200 (2026-11-29) at the expert-parallel shapes (36 groups of 910 /
//                    3641 rows, gate_up N 4096 K 4096, down N 4096 K 2048) it
//                    runs the forward and dX at 605-681 TFLOP/s, level with or above
//                    torch._grouped_mm (544-673), and about twice the grouped cuBLAS call;
//   kCublasGrouped — one cublasGemmGroupedBatchedEx launch for all groups (bf16 results only):
//                    274-304 TFLOP/s for the forward and dX there (462-609 for dW), kept as the
//                    measured alternative;
//   kWgmmaDeviceOffsets — the device-offset kernels at the end of this file, where the caller
//                    holds the offsets on the device (the MoE block runs them for its bf16
//                    expert weights when its experts average fewer than 2,048 rows; FP8 experts
//                    and adapters read the offsets on the host; ops/cuda/dispatch_cuda.cpp): on an
//                    H100 at 36 groups of about 3641 rows, N 4096 K 2048, 717 / 722 / 638 TFLOP/s
//                    forward / dX / dW (f32) against cuBLASLt per group's 732 / 762 / 666; at 8
//                    groups of 16 K rows 736 / 741 / 706 against 790 / 796 / 795; at 144 groups of
//                    about 910 rows 669 / 675 / 347 against 641 / 611 / 312 (docs/PERF.md). Given
//                    to the host-offset functions it means kLtPerGroup.
// All run a fixed algorithm per problem, so reruns are bit-identical. The weight gradient into
// an f32 buffer always takes kLtPerGroup (the grouped cuBLAS call has no bf16 → f32 variant).
// cuBLASLt's algorithm cache is keyed by the exact shape, so each new per-expert row count costs
// one heuristic query the first time it is seen.
// Every call is asynchronous on `stream`; row operands are contiguous [rows, cols] tensors.

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

enum class GroupedGemmBackend { kCublasGrouped, kLtPerGroup, kWgmmaDeviceOffsets };

const char* grouped_gemm_backend_name(GroupedGemmBackend backend);

// With `accumulate`, the products are added into y / dx (rows of empty groups stay as they are).
void grouped_linear(Tensor& y, const Tensor& x, const Tensor& w,
                    const std::vector<int64_t>& offsets,
                    GroupedGemmBackend backend = GroupedGemmBackend::kLtPerGroup,
                    cudaStream_t stream = nullptr, bool accumulate = false);

void grouped_linear_backward_input(Tensor& dx, const Tensor& dy, const Tensor& w,
                                   const std::vector<int64_t>& offsets,
                                   GroupedGemmBackend backend = GroupedGemmBackend::kLtPerGroup,
                                   cudaStream_t stream = nullptr, bool accumulate = false);

// Accumulates into dw (f32 or bf16, contiguous [G, N, K]).
void grouped_linear_backward_weight(Tensor& dw, const Tensor& dy, const Tensor& x,
                                    const std::vector<int64_t>& offsets,
                                    GroupedGemmBackend backend = GroupedGemmBackend::kLtPerGroup,
                                    cudaStream_t stream = nullptr);

// ---- the offsets on the device -----------------------------------------------------------------
//
// The same three products with the offsets held on the device (int32 [G + 1], nondecreasing from
// 0 to the rows), so that the caller never waits for them: Hopper's warpgroup MMA with TMA loads
// in one persistent launch (ops/cuda/grouped_gemm_sm90.cuh). A fixed k order per output tile, so
// reruns are bit-identical. grouped_gemm_device_offsets_fit says whether a call can take them: an
// sm_90a build on a compute capability 9.x device, bf16 operands and results (dw f32 or bf16),
// every row a multiple of 8 elements (TMA addresses 16-byte rows), N and K at least 1, at most
// 1024 groups. Offsets that do not end at the rows leave the rows past their end unwritten: the
// MoE hands in the offsets of its own permutation.

bool grouped_gemm_device_offsets_fit(const Tensor& first, const Tensor& second, const Tensor& out,
                                     int64_t groups);

void grouped_linear(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& offsets,
                    cudaStream_t stream = nullptr, bool accumulate = false);

void grouped_linear_backward_input(Tensor& dx, const Tensor& dy, const Tensor& w,
                                   const Tensor& offsets, cudaStream_t stream = nullptr,
                                   bool accumulate = false);

void grouped_linear_backward_weight(Tensor& dw, const Tensor& dy, const Tensor& x,
                                    const Tensor& offsets, cudaStream_t stream = nullptr);

// Row-major C[m, n] = alpha · A[m, k] · B[n, k]^T with fp32 operands and sums, through the same
// cuBLAS handle: in plain fp32 (CUBLAS_COMPUTE_32F), or with `tf32_operands` on the tensor cores
// with A and B rounded to TF32 (CUBLAS_COMPUTE_32F_FAST_TF32), for a caller whose operands are
// TF32 parts of fp32 values laid side by side along k (the indexer's scores).
void gemm_f32_nt(int device, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                 cudaStream_t stream = nullptr, bool tf32_operands = false);

}  // namespace glmtune::cuda
