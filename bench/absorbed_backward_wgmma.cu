// The wgmma sparse absorbed-latent backward's main kernel (ops/cuda/mla_absorbed_sm90.cuh) on its
// own: d q_abs and every (query, key) pair's share of d latent checked against plain fp32 kernels
// from the same bf16 inputs, then the kernel timed over the queries in workspace-sized chunks, as
// the library launches it (the key-major reduction of the shares is not part of it). Needs only
// the CUDA toolkit:
//
//   (built as bench/absorbed_backward_wgmma by the CUDA build, or alone:)
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc \
//        -o absorbed_backward_wgmma bench/absorbed_backward_wgmma.cu
//   ./absorbed_backward_wgmma [T=4096] [heads=64] [top=512] [check=1]
//
// One document of T tokens, q_abs, d o_lat and latent uniform random (filled on the device); query
// i selects min(i + 1, top) distinct random keys <= i (every 97th query none). lse2 and delta =
// rowsum(d o_lat · o_lat) come from an fp32 forward (zeros when not checking). The check
// covers every 61st query: the largest |difference| of d q_abs and of the shares, relative to the
// largest magnitude of each, and the count off by more than 2% of it. The timing is the mean of 5
// passes over all queries after 2 warm-ups, as ms and TFLOP/s (5 products of heads × 512 a pair).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "glmtune/ops/cuda/mla_absorbed_sm90.cuh"
#include "standalone_cuda.h"
using namespace glmtune::cuda::sm90;
#define CK(x) STANDALONE_CUDA_CHECK(x)

namespace {

constexpr int kR = 512;

float bf(__nv_bfloat16 x) { return __bfloat162float(x); }

// p[k] uniform in [-scale, scale) from a hash of (seed, k): filled on the device, where drawing a
// billion normals on the host took longer than the whole timing.
__global__ void fill_uniform(__nv_bfloat16* p, size_t n, uint32_t seed, float scale) {
  for (size_t k = blockIdx.x * size_t(blockDim.x) + threadIdx.x; k < n;
       k += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(k) * 0x9E3779B1u ^ uint32_t(k >> 32) * 0x85EBCA77u ^ seed;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    h ^= h >> 16;
    p[k] = __float2bfloat16(scale * (float(h >> 8) * (2.0f / 16777216.0f) - 1.0f));
  }
}

// fp32 forward of query i, head h: lse2 (base 2) and delta = Σ_c d o_lat[c] · out[c].
__global__ void forward_fp32(const __nv_bfloat16* q, const __nv_bfloat16* lat,
                             const __nv_bfloat16* dout, const int* keys, const int* counts,
                             int width, int heads, float scale_log2, float* lse2, float* delta) {
  const int i = blockIdx.x, h = blockIdx.y, n = counts[i];
  extern __shared__ float sc[];  // width scores
  __shared__ float red[2], part[128];
  const __nv_bfloat16* qi = q + (size_t(i) * heads + h) * kR;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const __nv_bfloat16* k = lat + size_t(keys[size_t(i) * width + j]) * kR;
    float s = 0;
    for (int c = 0; c < kR; ++c) s += __bfloat162float(qi[c]) * __bfloat162float(k[c]);
    sc[j] = s * scale_log2;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = -INFINITY, l = 0;
    for (int j = 0; j < n; ++j) m = fmaxf(m, sc[j]);
    for (int j = 0; j < n; ++j) l += exp2f(sc[j] - m);
    red[0] = m;
    red[1] = l;
  }
  __syncthreads();
  float d = 0;
  for (int c = threadIdx.x; c < kR; c += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < n; ++j)
      acc += exp2f(sc[j] - red[0]) *
             __bfloat162float(lat[size_t(keys[size_t(i) * width + j]) * kR + c]);
    d += __bfloat162float(dout[(size_t(i) * heads + h) * kR + c]) * (n ? acc / red[1] : 0.0f);
  }
  part[threadIdx.x] = d;
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0;
    for (int t = 0; t < int(blockDim.x); ++t) sum += part[t];
    lse2[size_t(i) * heads + h] = n ? red[0] + log2f(red[1]) : INFINITY;
    delta[size_t(i) * heads + h] = sum;
  }
}

// fp32 backward of the checked query qi[b], head h: P and dS per key into pds, d q_abs into dq.
__global__ void backward_fp32_dq(const __nv_bfloat16* q, const __nv_bfloat16* lat,
                                 const __nv_bfloat16* dout, const int* keys, const int* counts,
                                 const float* lse2, const float* delta, const int* qi, int width,
                                 int heads, float scale_log2, float scale, float* pds, float* dq) {
  const int i = qi[blockIdx.x], h = blockIdx.y, n = counts[i];
  float* p = pds + (size_t(blockIdx.x) * heads + h) * 2 * width;  // P then dS
  const __nv_bfloat16* qh = q + (size_t(i) * heads + h) * kR;
  const __nv_bfloat16* dh = dout + (size_t(i) * heads + h) * kR;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const __nv_bfloat16* k = lat + size_t(keys[size_t(i) * width + j]) * kR;
    float s = 0, dp = 0;
    for (int c = 0; c < kR; ++c) {
      s += __bfloat162float(qh[c]) * __bfloat162float(k[c]);
      dp += __bfloat162float(dh[c]) * __bfloat162float(k[c]);
    }
    const float pj = exp2f(s * scale_log2 - lse2[size_t(i) * heads + h]);
    p[j] = pj;
    p[width + j] = scale * pj * (dp - delta[size_t(i) * heads + h]);
  }
  __syncthreads();
  for (int c = threadIdx.x; c < kR; c += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < n; ++j)
      acc += p[width + j] * __bfloat162float(lat[size_t(keys[size_t(i) * width + j]) * kR + c]);
    dq[(size_t(blockIdx.x) * heads + h) * kR + c] = acc;
  }
}

// The checked query's share of d latent for each of its keys: Σ_h P d o_lat + dS q_abs.
__global__ void backward_fp32_shares(const __nv_bfloat16* q, const __nv_bfloat16* dout,
                                     const int* counts, const int* qi, const float* pds, int width,
                                     int heads, float* shares) {
  const int i = qi[blockIdx.x], j = blockIdx.y;
  if (j >= counts[i]) return;
  for (int c = threadIdx.x; c < kR; c += blockDim.x) {
    float acc = 0;
    for (int h = 0; h < heads; ++h) {
      const float* p = pds + (size_t(blockIdx.x) * heads + h) * 2 * width;
      acc += p[j] * __bfloat162float(dout[(size_t(i) * heads + h) * kR + c]) +
             p[width + j] * __bfloat162float(q[(size_t(i) * heads + h) * kR + c]);
    }
    shares[(size_t(blockIdx.x) * width + j) * kR + c] = acc;
  }
}

// The largest |difference| and |reference| over (got, ref) pairs that `each` visits, then the
// count of differences above 2% of that largest reference.
struct Diff {
  double max_diff = 0, max_ref = 0;
  size_t bad = 0, n = 0;
  template <typename Each>
  explicit Diff(Each&& each) {
    each([&](double got, double ref) {
      max_diff = std::max(max_diff, std::fabs(got - ref));
      max_ref = std::max(max_ref, std::fabs(ref));
      ++n;
    });
    each([&](double got, double ref) { bad += !(std::fabs(got - ref) <= 0.02 * max_ref); });
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int T = argc > 1 ? atoi(argv[1]) : 4096, heads = argc > 2 ? atoi(argv[2]) : 64,
            topk = argc > 3 ? atoi(argv[3]) : 512, check = argc > 4 ? atoi(argv[4]) : 1;
  const int width = topk;
  std::mt19937 rng(1);
  const size_t q_elems = size_t(T) * heads * kR, lat_elems = size_t(T) * kR;
  std::vector<int> keys(size_t(T) * width, 0), counts(T);
  long long pairs = 0;
  for (int i = 0; i < T; ++i) {
    const int n = i % 97 == 5 ? 0 : std::min(i + 1, topk);
    int c = 0;
    for (int j = 0; j <= i && c < n; ++j)
      if (int(rng() % (i + 1 - j)) < n - c) keys[size_t(i) * width + c++] = j;
    counts[i] = c;
    pairs += c;
  }
  __nv_bfloat16 *d_q, *d_lat, *d_dout, *d_dq, *d_part;
  int *d_keys, *d_counts;
  float *d_lse2, *d_delta;
  CK(cudaMalloc(&d_q, q_elems * 2));
  CK(cudaMalloc(&d_dout, q_elems * 2));
  CK(cudaMalloc(&d_dq, q_elems * 2));
  CK(cudaMalloc(&d_lat, lat_elems * 2));
  CK(cudaMalloc(&d_keys, keys.size() * 4));
  CK(cudaMalloc(&d_counts, T * 4));
  CK(cudaMalloc(&d_lse2, size_t(T) * heads * 4));
  CK(cudaMalloc(&d_delta, size_t(T) * heads * 4));
  // Uniform with the spread of unit, 0.1 and 0.5 normals.
  fill_uniform<<<1024, 256>>>(d_q, q_elems, 1, 1.732f);
  fill_uniform<<<1024, 256>>>(d_dout, q_elems, 2, 0.1732f);
  fill_uniform<<<1024, 256>>>(d_lat, lat_elems, 3, 0.866f);
  CK(cudaGetLastError());
  CK(cudaMemcpy(d_keys, keys.data(), keys.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_counts, counts.data(), T * 4, cudaMemcpyHostToDevice));
  const float scale = 1.0f / sqrtf(float(kR)), scale_log2 = scale * 1.4426950408889634f;
  if (check) {
    CK(cudaFuncSetAttribute(forward_fp32, cudaFuncAttributeMaxDynamicSharedMemorySize, width * 4));
    forward_fp32<<<dim3(T, heads), 128, width * 4>>>(d_q, d_lat, d_dout, d_keys, d_counts, width,
                                                     heads, scale_log2, d_lse2, d_delta);
    CK(cudaGetLastError());
  } else {  // timing alone: any finite statistics will do (P stays within a few units)
    CK(cudaMemset(d_lse2, 0, size_t(T) * heads * 4));
    CK(cudaMemset(d_delta, 0, size_t(T) * heads * 4));
  }

  // Chunks of queries whose shares fit 2 GiB, as the library's default workspace.
  const int chunk = int(std::max<long long>(
      1, std::min<long long>(T, (2LL << 30) / (static_cast<long long>(width) * kR * 2))));
  CK(cudaMalloc(&d_part, size_t(chunk) * width * kR * 2));
  AbsorbedBackwardArgs args{
      {d_q, d_lat, d_keys, d_counts, width, heads, scale_log2}, d_dout, d_lse2, d_delta, scale, 0};
  CK(cudaFuncSetAttribute(absorbed_backward_wgmma_kernel,
                          cudaFuncAttributeMaxDynamicSharedMemorySize, absorbed_bwd::kSmemBytes));
  const auto pass = [&](auto&& after_chunk) {
    for (int q0 = 0; q0 < T; q0 += chunk) {
      args.q0 = q0;
      const int n = std::min(chunk, T - q0);
      absorbed_backward_wgmma_kernel<<<n, absorbed_bwd::kThreads, absorbed_bwd::kSmemBytes>>>(
          args, d_dq, d_part);
      CK(cudaGetLastError());
      after_chunk(q0, n);
    }
  };

  if (check) {
    std::vector<int> checked;
    for (int i = 0; i < T; i += 61) checked.push_back(i);
    const int nc = int(checked.size());
    int* d_checked;
    float *d_pds, *d_dq_ref, *d_shares_ref;
    CK(cudaMalloc(&d_checked, nc * 4));
    CK(cudaMalloc(&d_pds, size_t(nc) * heads * 2 * width * 4));
    CK(cudaMalloc(&d_dq_ref, size_t(nc) * heads * kR * 4));
    CK(cudaMalloc(&d_shares_ref, size_t(nc) * width * kR * 4));
    CK(cudaMemcpy(d_checked, checked.data(), nc * 4, cudaMemcpyHostToDevice));
    backward_fp32_dq<<<dim3(nc, heads), 128>>>(d_q, d_lat, d_dout, d_keys, d_counts, d_lse2,
                                               d_delta, d_checked, width, heads, scale_log2, scale,
                                               d_pds, d_dq_ref);
    CK(cudaGetLastError());
    backward_fp32_shares<<<dim3(nc, width), 128>>>(d_q, d_dout, d_counts, d_checked, d_pds, width,
                                                   heads, d_shares_ref);
    CK(cudaGetLastError());
    std::vector<float> dq_ref(size_t(nc) * heads * kR), shares_ref(size_t(nc) * width * kR);
    CK(cudaMemcpy(dq_ref.data(), d_dq_ref, dq_ref.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(shares_ref.data(), d_shares_ref, shares_ref.size() * 4, cudaMemcpyDeviceToHost));
    // The wgmma shares of each checked query, read from the workspace after its chunk.
    std::vector<__nv_bfloat16> shares(shares_ref.size());
    pass([&](int q0, int n) {
      CK(cudaDeviceSynchronize());
      for (int c = 0; c < nc; ++c)
        if (checked[c] >= q0 && checked[c] < q0 + n)
          CK(cudaMemcpy(shares.data() + size_t(c) * width * kR,
                        d_part + size_t(checked[c] - q0) * width * kR,
                        size_t(counts[checked[c]]) * kR * 2, cudaMemcpyDeviceToHost));
    });
    std::vector<__nv_bfloat16> dq(q_elems);
    CK(cudaMemcpy(dq.data(), d_dq, dq.size() * 2, cudaMemcpyDeviceToHost));
    const Diff ddq([&](auto&& visit) {
      for (int c = 0; c < nc; ++c)
        for (size_t e = 0; e < size_t(heads) * kR; ++e)
          visit(bf(dq[size_t(checked[c]) * heads * kR + e]), dq_ref[size_t(c) * heads * kR + e]);
    });
    const Diff dsh([&](auto&& visit) {
      for (int c = 0; c < nc; ++c)
        for (size_t e = 0; e < size_t(counts[checked[c]]) * kR; ++e)
          visit(bf(shares[size_t(c) * width * kR + e]), shares_ref[size_t(c) * width * kR + e]);
    });
    printf(
        "check T%d H%d top%d, %d queries: d q_abs max |diff| %.3e of max %.3f (%zu of %zu off "
        "by > 2%%), shares max |diff| %.3e of max %.3f (%zu of %zu off by > 2%%)\n",
        T, heads, topk, nc, ddq.max_diff, ddq.max_ref, ddq.bad, ddq.n, dsh.max_diff, dsh.max_ref,
        dsh.bad, dsh.n);
  }

  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const auto nothing = [](int, int) {};
  for (int w = 0; w < 2; ++w) pass(nothing);
  const int reps = 5;
  CK(cudaEventRecord(e0));
  for (int w = 0; w < reps; ++w) pass(nothing);
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  ms /= reps;
  const double flop = double(pairs) * heads * kR * 2 * 5;
  printf("wgmma bwd T%d H%d top%d (chunks of %d queries): %lld pairs, %.3f ms, %.1f TFLOP/s\n", T,
         heads, topk, chunk, pairs, ms, flop / ms / 1e9);
  return 0;
}
