// The device-offset grouped GEMMs (ops/cuda/grouped_gemm_sm90.cuh) on their own: each mode checked
// against cuBLAS GEMMs per group with fp32 results (the same bf16 operands), then timed against
// one cuBLAS bf16 GEMM per group (what the host-offset path runs). Needs only the CUDA toolkit:
//
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc \
//        -o grouped_gemm_wgmma bench/grouped_gemm_wgmma.cu -lcublas
//   ./grouped_gemm_wgmma [groups=36] [mean_rows=3641] [n=4096] [k=4096] [check=1] [band_rows]
//
// band_rows: row tiles per band of the kernel's tile order (default: the library's; a number at
// least the row tiles of every group gives the plain row-first order).
// Group row counts are drawn around mean_rows (every 7th group empty, one group with 1 row). The
// three modes: forward y = x · w[g]^T, input gradient dx = dy · w[g], weight gradient
// dw[g] += dy^T · x (f32 dw). Prints for each the largest |difference| against the fp32
// reference relative to the reference's largest |value|, and ms and TFLOP/s of both.

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "glmtune/ops/cuda/grouped_gemm_sm90.cuh"
#include "standalone_cuda.h"

#define CHECK(x) STANDALONE_CUDA_CHECK(x)
#define CHECK_BLAS(x)                                       \
  do {                                                      \
    cublasStatus_t s = (x);                                 \
    if (s != CUBLAS_STATUS_SUCCESS) {                       \
      printf("cuBLAS status %d at %d\n", int(s), __LINE__); \
      exit(1);                                              \
    }                                                       \
  } while (0)

using glmtune::cuda::sm90::GroupedMode;
using bf16 = __nv_bfloat16;

namespace {

// Uniform values of standard deviation `scale` (a hash of the index: fast for a billion values).
void fill(std::vector<bf16>& v, uint32_t seed, float scale) {
  const float half_width = scale * 1.7320508f;
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 16, h *= 0x7feb352du, h ^= h >> 15, h *= 0x846ca68bu, h ^= h >> 16;
    v[i] = __float2bfloat16((float(h) * 2.3283064e-10f * 2.0f - 1.0f) * half_width);
  }
}

// Row-major C[m, n] (ldc) = A · B with cuBLAS's column-major swap; `ta`/`tb` say A is stored
// [k, m] / B is stored [n, k] (row-major).
void gemm_rm(cublasHandle_t h, int m, int n, int k, const bf16* a, int lda, bool ta, const bf16* b,
             int ldb, bool tb, void* c, int ldc, cudaDataType ctype, float beta) {
  const float alpha = 1.0f;
  // Row-major C = A B  <=>  column-major C^T = B^T A^T.
  CHECK_BLAS(cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m,
                          k, &alpha, b, CUDA_R_16BF, ldb, a, CUDA_R_16BF, lda, &beta, c, ctype, ldc,
                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The per-group products with cuBLAS into `out` (f32 or bf16).
void reference(cublasHandle_t h, GroupedMode mode, const std::vector<int>& off, int64_t n,
               int64_t k, const bf16* x, const bf16* w, const bf16* dy, void* out,
               cudaDataType ctype) {
  const int groups = int(off.size()) - 1;
  const size_t esz = ctype == CUDA_R_32F ? 4 : 2;
  for (int g = 0; g < groups; ++g) {
    const int r0 = off[g], rows = off[g + 1] - off[g];
    if (rows == 0) continue;
    const bf16* wg = w + int64_t(g) * n * k;
    if (mode == GroupedMode::kForward)  // y [rows, n] = x [rows, k] · w_g^T; w_g stored [n, k]
      gemm_rm(h, rows, int(n), int(k), x + int64_t(r0) * k, int(k), false, wg, int(k), true,
              static_cast<char*>(out) + int64_t(r0) * n * esz, int(n), ctype, 0.0f);
    else if (mode == GroupedMode::kBackwardInput)  // dx [rows, k] = dy [rows, n] · w_g [n, k]
      gemm_rm(h, rows, int(k), int(n), dy + int64_t(r0) * n, int(n), false, wg, int(k), false,
              static_cast<char*>(out) + int64_t(r0) * k * esz, int(k), ctype, 0.0f);
    else  // dw_g [n, k] += dy^T [n, rows] · x [rows, k]; dy stored [rows, n]
      gemm_rm(h, int(n), int(k), rows, dy + int64_t(r0) * n, int(n), true, x + int64_t(r0) * k,
              int(k), false, static_cast<char*>(out) + int64_t(g) * n * k * esz, int(k), ctype,
              1.0f);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int groups = argc > 1 ? atoi(argv[1]) : 36;
  const int mean_rows = argc > 2 ? atoi(argv[2]) : 3641;
  const int64_t n = argc > 3 ? atoll(argv[3]) : 4096, k = argc > 4 ? atoll(argv[4]) : 4096;
  const int check = argc > 5 ? atoi(argv[5]) : 1;
  const int band_rows = argc > 6 ? atoi(argv[6]) : 0;  // 0: the library's default
  std::mt19937 rng(1234);
  std::vector<int> off(groups + 1, 0);
  std::uniform_int_distribution<int> jitter(-mean_rows / 3, mean_rows / 3);
  for (int g = 0; g < groups; ++g) {
    int rows = g % 7 == 3 ? 0 : std::max(1, mean_rows + jitter(rng));
    if (g == 1) rows = 1;
    off[g + 1] = off[g] + rows;
  }
  const int64_t rows = off[groups];
  std::vector<bf16> hx(size_t(rows * k)), hw(size_t(groups * n * k)), hdy(size_t(rows * n));
  fill(hx, 1u, 1.0f);
  fill(hw, 2u, 0.02f);
  fill(hdy, 3u, 1.0f);
  bf16 *x, *w, *dy, *y, *dx;
  float *dw, *ref;
  int32_t* doff;
  CHECK(cudaMalloc(&x, hx.size() * 2));
  CHECK(cudaMalloc(&w, hw.size() * 2));
  CHECK(cudaMalloc(&dy, hdy.size() * 2));
  CHECK(cudaMalloc(&y, size_t(rows * n) * 2));
  CHECK(cudaMalloc(&dx, size_t(rows * k) * 2));
  CHECK(cudaMalloc(&dw, size_t(groups * n * k) * 4));
  const size_t ref_elems = std::max<size_t>(size_t(groups * n * k), size_t(rows * std::max(n, k)));
  CHECK(cudaMalloc(&ref, ref_elems * 4));
  CHECK(cudaMalloc(&doff, size_t(groups + 1) * 4));
  CHECK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(w, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dy, hdy.data(), hdy.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(doff, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cublasHandle_t h;
  CHECK_BLAS(cublasCreate(&h));

  const GroupedMode modes[3] = {GroupedMode::kForward, GroupedMode::kBackwardInput,
                                GroupedMode::kBackwardWeight};
  const char* names[3] = {"forward", "input grad", "weight grad"};
  printf("groups %d, rows %lld (mean %d), n %lld, k %lld, %d SMs\n", groups, (long long)rows,
         mean_rows, (long long)n, (long long)k, sms);
  for (int mi = 0; mi < 3; ++mi) {
    const GroupedMode mode = modes[mi];
    glmtune::cuda::sm90::grouped::Args a{};
    a.offsets = doff;
    a.groups = groups;
    a.rows = rows;
    a.n = n;
    a.k = k;
    const void* first = mode == GroupedMode::kForward ? x : dy;
    const void* second = mode == GroupedMode::kBackwardWeight ? x : w;
    void* out = mode == GroupedMode::kForward         ? (void*)y
                : mode == GroupedMode::kBackwardInput ? (void*)dx
                                                      : (void*)dw;
    const size_t out_elems = mode == GroupedMode::kForward         ? size_t(rows * n)
                             : mode == GroupedMode::kBackwardInput ? size_t(rows * k)
                                                                   : size_t(groups * n * k);
    a.out = out;
    a.out_f32 = mode == GroupedMode::kBackwardWeight;
    a.accumulate = mode == GroupedMode::kBackwardWeight;
    a.band_rows = band_rows;
    auto ours = [&] {
      bool ok = mode == GroupedMode::kForward
                    ? glmtune::cuda::sm90::launch_grouped_gemm<GroupedMode::kForward>(
                          first, second, a, sms, nullptr)
                : mode == GroupedMode::kBackwardInput
                    ? glmtune::cuda::sm90::launch_grouped_gemm<GroupedMode::kBackwardInput>(
                          first, second, a, sms, nullptr)
                    : glmtune::cuda::sm90::launch_grouped_gemm<GroupedMode::kBackwardWeight>(
                          first, second, a, sms, nullptr);
      if (!ok) {
        printf("no tensor map\n");
        exit(1);
      }
      CHECK(cudaGetLastError());
    };
    if (check) {
      CHECK(cudaMemset(out, 0, out_elems * (a.out_f32 ? 4 : 2)));
      CHECK(cudaMemset(ref, 0, ref_elems * 4));
      if (a.accumulate) {  // the weight gradient adds to what is there: start both from a pattern
        std::vector<float> start(out_elems);
        for (size_t i = 0; i < out_elems; ++i) start[i] = 0.125f * float(i % 7) - 0.25f;
        CHECK(cudaMemcpy(out, start.data(), out_elems * 4, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(ref, start.data(), out_elems * 4, cudaMemcpyHostToDevice));
      }
      ours();
      reference(h, mode, off, n, k, x, w, dy, ref, CUDA_R_32F);
      CHECK(cudaDeviceSynchronize());
      std::vector<float> hr(out_elems), ho(out_elems);
      CHECK(cudaMemcpy(hr.data(), ref, out_elems * 4, cudaMemcpyDeviceToHost));
      if (a.out_f32) {
        CHECK(cudaMemcpy(ho.data(), out, out_elems * 4, cudaMemcpyDeviceToHost));
      } else {
        std::vector<bf16> hb(out_elems);
        CHECK(cudaMemcpy(hb.data(), out, out_elems * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < out_elems; ++i) ho[i] = __bfloat162float(hb[i]);
      }
      double max_ref = 0, max_diff = 0;
      size_t at = 0;
      for (size_t i = 0; i < out_elems; ++i) {
        max_ref = std::max(max_ref, double(std::fabs(hr[i])));
        const double d = std::fabs(double(hr[i]) - double(ho[i]));
        if (!(d <= max_diff)) max_diff = d, at = i;
      }
      // Both start from the same values, so the comparison also covers what an empty group must
      // not touch.
      printf("check %-11s: max |diff| %.3e of max |ref| %.3e (%.2e relative) at %zu\n", names[mi],
             max_diff, max_ref, max_diff / max_ref, at);
    }
    int64_t work_rows = 0;
    for (int g = 0; g < groups; ++g) work_rows += off[g + 1] - off[g];
    const double flops = 2.0 * double(work_rows) * double(n) * double(k);
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    auto time = [&](auto fn) {
      for (int i = 0; i < 3; ++i) fn();
      CHECK(cudaEventRecord(e0));
      const int reps = 10;
      for (int i = 0; i < reps; ++i) fn();
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      return ms / reps;
    };
    const float ms_ours = time(ours);
    void* bf_out = mode == GroupedMode::kBackwardWeight ? (void*)dw : out;
    const float ms_blas = time([&] {
      reference(h, mode, off, n, k, x, w, dy, bf_out,
                mode == GroupedMode::kBackwardWeight ? CUDA_R_32F : CUDA_R_16BF);
    });
    printf("time  %-11s: ours %.3f ms %.1f TFLOP/s | cuBLAS per group %.3f ms %.1f TFLOP/s\n",
           names[mi], ms_ours, flops / ms_ours * 1e-9, ms_blas, flops / ms_blas * 1e-9);
  }
  return 0;
}
