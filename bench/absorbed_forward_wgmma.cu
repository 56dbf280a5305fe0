// The wgmma sparse absorbed-latent forward (ops/cuda/mla_absorbed_sm90.cuh) on its own: checked
// against a plain fp32 kernel (one block per query and head, scores, softmax and output in fp32
// from the same bf16 inputs), then timed. Needs only the CUDA toolkit, so a kernel change is
// checked and timed in seconds, without building or linking glmtune:
//
//   (built as bench/absorbed_forward_wgmma by the CUDA build, or alone:)
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc \
//        -o absorbed_forward_wgmma bench/absorbed_forward_wgmma.cu
//   ./absorbed_forward_wgmma [T=4096] [heads=64] [top=2048] [check=1] [blocks=0]
//
// `blocks` sets the persistent grid (0: one block per multiprocessor, as the library launches it;
// a small number makes every block take many items, each with its own count of keys).
// One document of T tokens; query i selects min(i + 1, top) distinct random keys <= i (every 97th
// query none, the empty-row case). Prints the largest |difference| of the outputs and of lse2
// against the fp32 kernel, the number of outputs off by more than 2e-2, and the mean of
// 10 timed launches after 3 warm-ups as ms and TFLOP/s (2 products of heads x 512 per pair).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "glmtune/ops/cuda/mla_absorbed_sm90.cuh"
#include "standalone_cuda.h"
using namespace glmtune::cuda::sm90;
#define CK(x) STANDALONE_CUDA_CHECK(x)

__global__ void naive(const __nv_bfloat16* q, const __nv_bfloat16* lat, const int* keys,
                      const int* counts, int width, int heads, float scale_log2, float* out,
                      float* lse2) {
  int i = blockIdx.x, h = blockIdx.y;
  extern __shared__ float sc[];  // width scores
  __shared__ float qs[512];
  __shared__ float red[2];
  for (int c = threadIdx.x; c < 512; c += blockDim.x)
    qs[c] = __bfloat162float(q[((size_t)i * heads + h) * 512 + c]);
  __syncthreads();
  int n = counts[i];
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const __nv_bfloat16* k = lat + (size_t)keys[(size_t)i * width + j] * 512;
    float s = 0;
    for (int c = 0; c < 512; ++c) s += qs[c] * __bfloat162float(k[c]);
    sc[j] = s * scale_log2;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int j = 0; j < n; ++j) m = fmaxf(m, sc[j]);
    float l = 0;
    for (int j = 0; j < n; ++j) l += exp2f(sc[j] - m);
    red[0] = m;
    red[1] = l;
  }
  __syncthreads();
  float m = red[0], l = red[1];
  for (int c = threadIdx.x; c < 512; c += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < n; ++j)
      acc +=
          exp2f(sc[j] - m) * __bfloat162float(lat[(size_t)keys[(size_t)i * width + j] * 512 + c]);
    out[((size_t)i * heads + h) * 512 + c] = n ? acc / l : 0.f;
  }
  if (threadIdx.x == 0) lse2[(size_t)i * heads + h] = n ? m + log2f(l) : INFINITY;
}

int main(int argc, char** argv) {
  int T = argc > 1 ? atoi(argv[1]) : 4096, heads = argc > 2 ? atoi(argv[2]) : 64,
      topk = argc > 3 ? atoi(argv[3]) : 2048;
  int check = argc > 4 ? atoi(argv[4]) : 1;
  int blocks = argc > 5 ? atoi(argv[5]) : 0;
  int width = topk;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0, 1);
  std::vector<__nv_bfloat16> q((size_t)T * heads * 512), lat((size_t)T * 512);
  for (auto& x : q) x = __float2bfloat16(nd(rng));
  for (auto& x : lat) x = __float2bfloat16(nd(rng) * 0.5f);
  std::vector<int> keys((size_t)T * width, 0), counts(T);
  long long pairs = 0;
  for (int i = 0; i < T; ++i) {
    int n = std::min(i + 1, topk);
    if (i % 97 == 5) n = 0;  // a query without keys
    // Random causal subset of n positions (ascending): skip some positions when i+1 > topk.
    int c = 0;
    for (int j = 0; j <= i && c < n; ++j) {
      int left = i + 1 - j, need = n - c;
      if ((int)(rng() % left) < need) keys[(size_t)i * width + c++] = j;
    }
    counts[i] = c;
    pairs += c;
  }
  __nv_bfloat16 *dq, *dl, *dout;
  int *dk, *dc;
  float *dlse, *rout, *rlse;
  CK(cudaMalloc(&dq, q.size() * 2));
  CK(cudaMalloc(&dl, lat.size() * 2));
  CK(cudaMalloc(&dout, q.size() * 2));
  CK(cudaMalloc(&dk, keys.size() * 4));
  CK(cudaMalloc(&dc, T * 4));
  CK(cudaMalloc(&dlse, (size_t)T * heads * 4));
  CK(cudaMalloc(&rout, q.size() * 4));
  CK(cudaMalloc(&rlse, (size_t)T * heads * 4));
  CK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dl, lat.data(), lat.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk, keys.data(), keys.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dc, counts.data(), T * 4, cudaMemcpyHostToDevice));
  float scale_log2 = 1.0f / sqrtf(512.f) * 1.4426950408889634f * 0.5f;
  AbsorbedForwardArgs a{dq, dl, dk, dc, width, heads, scale_log2};
  CK(cudaFuncSetAttribute(absorbed_forward_wgmma_kernel,
                          cudaFuncAttributeMaxDynamicSharedMemorySize, absorbed_fwd::kSmemBytes));
  const long long items = (long long)T * ((heads + 63) / 64);
  if (blocks <= 0) CK(cudaDeviceGetAttribute(&blocks, cudaDevAttrMultiProcessorCount, 0));
  const dim3 grid((unsigned)std::min<long long>(items, blocks));
  absorbed_forward_wgmma_kernel<<<grid, absorbed_fwd::kThreads, absorbed_fwd::kSmemBytes>>>(
      a, items, dout, dlse);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  if (check) {
    CK(cudaFuncSetAttribute(naive, cudaFuncAttributeMaxDynamicSharedMemorySize, width * 4));
    naive<<<dim3(T, heads), 128, width * 4>>>(dq, dl, dk, dc, width, heads, scale_log2, rout, rlse);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<__nv_bfloat16> o(q.size());
    std::vector<float> ro(q.size()), l1((size_t)T * heads), l2((size_t)T * heads);
    CK(cudaMemcpy(o.data(), dout, o.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ro.data(), rout, ro.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(l1.data(), dlse, l1.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(l2.data(), rlse, l2.size() * 4, cudaMemcpyDeviceToHost));
    double maxd = 0, maxr = 0, maxl = 0;
    size_t bad = 0, worst = 0;
    for (size_t k = 0; k < o.size(); ++k) {
      double d = fabs((double)__bfloat162float(o[k]) - ro[k]);
      if (!(d <= maxd)) {
        maxd = d;
        worst = k;
      }
      maxr = std::max(maxr, (double)fabs(ro[k]));
      if (!(d < 2e-2)) ++bad;
    }
    for (size_t k = 0; k < l1.size(); ++k) {
      if (std::isinf(l2[k])) {
        if (!std::isinf(l1[k])) maxl = 1e9;
        continue;
      }
      maxl = std::max(maxl, (double)fabs(l1[k] - l2[k]));
    }
    printf(
        "check T%d H%d top%d: max |out diff| %.3e (max |out| %.3f) at %zu (q %zu h %zu c %zu), bad "
        "%zu, max |lse2 diff| %.3e\n",
        T, heads, topk, maxd, maxr, worst, worst / (heads * 512), worst / 512 % heads, worst % 512,
        bad, maxl);
  }
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int w = 0; w < 3; ++w)
    absorbed_forward_wgmma_kernel<<<grid, absorbed_fwd::kThreads, absorbed_fwd::kSmemBytes>>>(
        a, items, dout, dlse);
  cudaEventRecord(e0);
  int reps = 10;
  for (int w = 0; w < reps; ++w)
    absorbed_forward_wgmma_kernel<<<grid, absorbed_fwd::kThreads, absorbed_fwd::kSmemBytes>>>(
        a, items, dout, dlse);
  cudaEventRecord(e1);
  CK(cudaEventSynchronize(e1));
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  ms /= reps;
  double flop = (double)pairs * heads * 512 * 2 * 2;
  printf("wgmma fwd T%d H%d top%d (%u blocks): %lld pairs, %.3f ms, %.1f TFLOP/s\n", T, heads, topk,
         grid.x, pairs, ms, flop / ms / 1e9);
  return 0;
}
