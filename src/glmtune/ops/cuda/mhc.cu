// mHC forward and backward kernels (ops/cuda/mhc.h).

#include <type_traits>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/mhc.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

constexpr int kH = 4;              // streams
constexpr int kM = (2 + kH) * kH;  // logits per token: pre, post, comb
constexpr int kThreads = 256;
constexpr int kMixTokens = 64;         // tokens per block of the mixing product
constexpr int kMixK = 64;              // columns of X per shared-memory stage
constexpr int kMixLd = kMixK + 4;      // padded row, keeps float4 rows 16-byte aligned
constexpr int kFnTokenBlocks = 32;     // fixed token blocks of the d fn sums
constexpr int kDxTokens = 64;          // tokens per block of the dX kernel
constexpr int kSumChunks = 64;         // fixed row chunks of the small column sums
constexpr int kSinkhornMaxIters = 64;  // replay scratch of the Sinkhorn backward

using detail::from_f;
using detail::to_f;

// Eight consecutive elements (16-byte aligned for bf16, 32-byte aligned runs for f32).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&out)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
    detail::load_bf16x8(p, out);
  }
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&in)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(in[4], in[5], in[6], in[7]);
  } else {
    detail::store_bf16x8(p, in);
  }
}

__device__ __forceinline__ float sigmoid_f(float v) { return 1.0f / (1.0f + expf(-v)); }

// One token's Sinkhorn projection in place (c holds the logits on entry), the CPU op's order:
// row softmax + eps, one column step, then (iters − 1) × (row step, column step).
__device__ void sinkhorn_token(float* c, int iters, float eps, float* init) {
  for (int i = 0; i < kH; ++i) {
    float mx = c[i * kH];
    for (int j = 1; j < kH; ++j) mx = fmaxf(mx, c[i * kH + j]);
    float sum = 0.0f;
    for (int j = 0; j < kH; ++j) {
      c[i * kH + j] = expf(c[i * kH + j] - mx);
      sum += c[i * kH + j];
    }
    for (int j = 0; j < kH; ++j) c[i * kH + j] = c[i * kH + j] / sum + eps;
  }
  for (int k = 0; k < kH * kH; ++k) init[k] = c[k];
  for (int it = 0; it < 2 * iters - 1; ++it) {
    const bool column = it % 2 == 0;
    for (int a = 0; a < kH; ++a) {
      float s = 0.0f;
      for (int b = 0; b < kH; ++b) s += column ? c[b * kH + a] : c[a * kH + b];
      const float d = s + eps;
      for (int b = 0; b < kH; ++b) {
        const int idx = column ? b * kH + a : a * kH + b;
        c[idx] /= d;
      }
    }
  }
}

// Backward of one token's projection: `start` = softmax + eps, `logits` the softmax input, `g`
// the upstream gradient (overwritten), `dl` the result; `states` holds (2·iters − 1)·H² floats.
__device__ void sinkhorn_backward_token(const float* start, const float* logits, int iters,
                                        float eps, float* g, float* dl, float* states) {
  constexpr int hh = kH * kH;
  const int steps = 2 * iters - 1;
  for (int k = 0; k < hh; ++k) states[k] = start[k];
  for (int s = 0; s + 1 < steps; ++s) {
    const bool column = s % 2 == 0;
    const float* in = states + s * hh;
    float* out = states + (s + 1) * hh;
    for (int a = 0; a < kH; ++a) {
      float sum = 0.0f;
      for (int b = 0; b < kH; ++b) sum += column ? in[b * kH + a] : in[a * kH + b];
      const float d = sum + eps;
      for (int b = 0; b < kH; ++b) {
        const int idx = column ? b * kH + a : a * kH + b;
        out[idx] = in[idx] / d;
      }
    }
  }
  for (int s = steps - 1; s >= 0; --s) {
    const float* in = states + s * hh;
    const bool column = s % 2 == 0;
    for (int a = 0; a < kH; ++a) {
      float sum = 0.0f;
      for (int b = 0; b < kH; ++b) sum += column ? in[b * kH + a] : in[a * kH + b];
      const float d = sum + eps;
      float dot = 0.0f;
      for (int b = 0; b < kH; ++b) {
        const int idx = column ? b * kH + a : a * kH + b;
        dot += g[idx] * (in[idx] / d);
      }
      for (int b = 0; b < kH; ++b) {
        const int idx = column ? b * kH + a : a * kH + b;
        g[idx] = (g[idx] - dot) / d;
      }
    }
  }
  for (int i = 0; i < kH; ++i) {
    const float* l = logits + i * kH;
    float mx = l[0];
    for (int j = 1; j < kH; ++j) mx = fmaxf(mx, l[j]);
    float sum = 0.0f;
    for (int j = 0; j < kH; ++j) sum += expf(l[j] - mx);
    float dot = 0.0f;
    for (int j = 0; j < kH; ++j) dot += g[i * kH + j] * (expf(l[j] - mx) / sum);
    for (int j = 0; j < kH; ++j) dl[i * kH + j] = (expf(l[j] - mx) / sum) * (g[i * kH + j] - dot);
  }
}

// ---- pre: mixing product, statistics and Sinkhorn ----------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads)
    mhc_mix_kernel(const T* __restrict__ x, const float* __restrict__ fn,
                   const float* __restrict__ base, const float* __restrict__ scale, int64_t tokens,
                   int hd, float rms_eps, float hc_eps, int iters, float* __restrict__ mix_out,
                   float* __restrict__ rstd_out, float* __restrict__ pre_out,
                   float* __restrict__ post_out, float* __restrict__ comb_out,
                   float* __restrict__ init_out) {
  __shared__ __align__(16) float xs[kMixTokens * kMixLd];
  __shared__ __align__(16) float fs[kM * kMixLd];
  __shared__ float raw[kMixTokens * kM];
  __shared__ float ss_tok[kMixTokens];
  const int tid = threadIdx.x;
  const int64_t t0 = int64_t(blockIdx.x) * kMixTokens;
  // Loader role: token tid/4, 16 consecutive columns of the stage.
  const int load_tok = tid >> 2, load_col = (tid & 3) * 16;
  const bool load_ok = t0 + load_tok < tokens;
  const T* xrow = x + (t0 + load_tok) * int64_t(hd);
  // Compute role: tokens 2·(tid/8) + {0, 1}, logits tid%8 + {0, 8, 16}.
  const int ct = (tid >> 3) * 2, cm = tid & 7;
  float acc[2][3] = {};
  float ss = 0.0f;
  for (int k0 = 0; k0 < hd; k0 += kMixK) {
    float va[8] = {}, vb[8] = {};
    if (load_ok) {
      load8(xrow + k0 + load_col, va);
      load8(xrow + k0 + load_col + 8, vb);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      ss += va[i] * va[i];
      ss += vb[i] * vb[i];
      xs[load_tok * kMixLd + load_col + i] = va[i];
      xs[load_tok * kMixLd + load_col + 8 + i] = vb[i];
    }
    for (int i = tid; i < kM * kMixK; i += kThreads) {
      const int m = i / kMixK, k = i % kMixK;
      fs[m * kMixLd + k] = fn[int64_t(m) * hd + k0 + k];
    }
    __syncthreads();
#pragma unroll 4
    for (int k = 0; k < kMixK; k += 4) {
      const float4 xa = *reinterpret_cast<const float4*>(&xs[ct * kMixLd + k]);
      const float4 xb = *reinterpret_cast<const float4*>(&xs[(ct + 1) * kMixLd + k]);
#pragma unroll
      for (int r = 0; r < 3; ++r) {
        const float4 f = *reinterpret_cast<const float4*>(&fs[(cm + 8 * r) * kMixLd + k]);
        acc[0][r] += xa.x * f.x + xa.y * f.y + xa.z * f.z + xa.w * f.w;
        acc[1][r] += xb.x * f.x + xb.y * f.y + xb.z * f.z + xb.w * f.w;
      }
    }
    __syncthreads();
  }
  ss += __shfl_xor_sync(0xffffffffu, ss, 1);
  ss += __shfl_xor_sync(0xffffffffu, ss, 2);
  if ((tid & 3) == 0) ss_tok[load_tok] = ss;
#pragma unroll
  for (int r = 0; r < 3; ++r) {
    raw[ct * kM + cm + 8 * r] = acc[0][r];
    raw[(ct + 1) * kM + cm + 8 * r] = acc[1][r];
  }
  __syncthreads();
  if (tid >= kMixTokens || t0 + tid >= tokens) return;
  const int64_t t = t0 + tid;
  const float rstd = 1.0f / sqrtf(ss_tok[tid] / float(hd) + rms_eps);
  rstd_out[t] = rstd;
  float mix[kM];
  for (int m = 0; m < kM; ++m) {
    mix[m] = raw[tid * kM + m] * rstd;
    mix_out[t * kM + m] = mix[m];
  }
  for (int i = 0; i < kH; ++i) {
    pre_out[t * kH + i] = sigmoid_f(mix[i] * scale[0] + base[i]) + hc_eps;
    post_out[t * kH + i] = 2.0f * sigmoid_f(mix[kH + i] * scale[1] + base[kH + i]);
  }
  float c[kH * kH], init[kH * kH];
  for (int k = 0; k < kH * kH; ++k) c[k] = mix[2 * kH + k] * scale[2] + base[2 * kH + k];
  sinkhorn_token(c, iters, hc_eps, init);
  for (int k = 0; k < kH * kH; ++k) {
    comb_out[t * kH * kH + k] = c[k];
    init_out[t * kH * kH + k] = init[k];
  }
}

// c[t] = Σ_i pre_i X_i, eight columns per thread.
template <typename T>
__global__ void mhc_collapse_kernel(const T* __restrict__ x, const float* __restrict__ pre,
                                    int64_t tokens, int d, T* __restrict__ out) {
  const int64_t groups = int64_t(d / 8), n = tokens * groups;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < n;
       g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = g / groups;
    const int k = int(g % groups) * 8;
    float o[8] = {};
    for (int i = 0; i < kH; ++i) {
      float v[8];
      load8(x + (t * kH + i) * d + k, v);
      const float p = pre[t * kH + i];
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] += p * v[e];
    }
    store8(out + t * d + k, o);
  }
}

// X'_i = post_i·y + Σ_j comb[j][i]·X_j.
template <typename T>
__global__ void mhc_post_kernel(const T* __restrict__ x, const T* __restrict__ y,
                                const float* __restrict__ post, const float* __restrict__ comb,
                                int64_t tokens, int d, T* __restrict__ out) {
  const int64_t groups = int64_t(d / 8), n = tokens * groups;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < n;
       g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = g / groups;
    const int k = int(g % groups) * 8;
    float xv[kH][8], yv[8];
    for (int j = 0; j < kH; ++j) load8(x + (t * kH + j) * d + k, xv[j]);
    load8(y + t * d + k, yv);
    const float* ct = comb + t * kH * kH;
#pragma unroll
    for (int i = 0; i < kH; ++i) {
      const float p = post[t * kH + i];
      float o[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < kH; ++j) acc += ct[j * kH + i] * xv[j][e];
        o[e] = p * yv[e] + acc;
      }
      store8(out + (t * kH + i) * d + k, o);
    }
  }
}

// Sums `count` per-thread values over the block in a fixed order: warps by butterfly, then warp
// results in warp order. Results land in out[0..count) (shared), visible after the call.
template <int N>
__device__ void block_sums(float (&v)[N], float* scratch /* [32 * N] */, float* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float s = detail::warp_sum(v[i]);
    if (lane == 0) scratch[warp * N + i] = s;
  }
  __syncthreads();
  if (threadIdx.x < N) {
    float s = 0.0f;
    for (int w = 0; w < warps; ++w) s += scratch[w * N + threadIdx.x];
    out[threadIdx.x] = s;
  }
  __syncthreads();
}

// One block per token: d y, d streams elementwise; d post, d comb as block sums.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    mhc_post_bwd_kernel(const T* __restrict__ x, const T* __restrict__ y,
                        const float* __restrict__ post, const float* __restrict__ comb,
                        const T* __restrict__ g, int d, T* __restrict__ dx, T* __restrict__ dy,
                        float* __restrict__ dpost, float* __restrict__ dcomb) {
  constexpr int kDots = kH + kH * kH;
  __shared__ float scratch[32 * kDots];
  __shared__ float sums[kDots];
  const int64_t t = blockIdx.x;
  const float* ct = comb + t * kH * kH;
  float p[kH], cm[kH * kH];
  for (int i = 0; i < kH; ++i) p[i] = post[t * kH + i];
  for (int k = 0; k < kH * kH; ++k) cm[k] = ct[k];
  float dots[kDots] = {};
  for (int k = threadIdx.x * 8; k < d; k += blockDim.x * 8) {
    float xv[kH][8], gv[kH][8], yv[8];
    for (int j = 0; j < kH; ++j) {
      load8(x + (t * kH + j) * d + k, xv[j]);
      load8(g + (t * kH + j) * d + k, gv[j]);
    }
    load8(y + t * d + k, yv);
    float o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < kH; ++i) acc += p[i] * gv[i][e];
      o[e] = acc;
    }
    store8(dy + t * d + k, o);
#pragma unroll
    for (int i = 0; i < kH; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) dots[i] += gv[i][e] * yv[e];
#pragma unroll
    for (int j = 0; j < kH; ++j) {
#pragma unroll
      for (int i = 0; i < kH; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) dots[kH + j * kH + i] += gv[i][e] * xv[j][e];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < kH; ++i) acc += cm[j * kH + i] * gv[i][e];
        o[e] = acc;
      }
      store8(dx + (t * kH + j) * d + k, o);
    }
  }
  block_sums(dots, scratch, sums);
  if (threadIdx.x < kH) dpost[t * kH + threadIdx.x] = sums[threadIdx.x];
  if (threadIdx.x < kH * kH) dcomb[t * kH * kH + threadIdx.x] = sums[kH + threadIdx.x];
}

// ---- pre backward -----------------------------------------------------------------------------

// One block per token: dpre = ⟨dc, X_i⟩, then (thread 0) d logits through the sigmoids and the
// Sinkhorn replay. Writes dmix [T, M] = dlogit·scale of its group, and rows [dlogit, dlogit·mix]
// [T, 2M] for the base and scale sums.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    mhc_pre_bwd_token_kernel(const T* __restrict__ x, const T* __restrict__ dc,
                             const float* __restrict__ dpost, const float* __restrict__ dcomb,
                             const float* __restrict__ mix, const float* __restrict__ comb_init,
                             const float* __restrict__ base, const float* __restrict__ scale, int d,
                             int iters, float hc_eps, float* __restrict__ dmix_out,
                             float* __restrict__ param_rows) {
  __shared__ float scratch[32 * kH];
  __shared__ float dpre[kH];
  __shared__ float states[kSinkhornMaxIters * 2 * kH * kH];
  const int64_t t = blockIdx.x;
  float dots[kH] = {};
  if (dc) {
    for (int k = threadIdx.x * 8; k < d; k += blockDim.x * 8) {
      float gv[8];
      load8(dc + t * d + k, gv);
#pragma unroll
      for (int i = 0; i < kH; ++i) {
        float xv[8];
        load8(x + (t * kH + i) * d + k, xv);
#pragma unroll
        for (int e = 0; e < 8; ++e) dots[i] += gv[e] * xv[e];
      }
    }
  }
  block_sums(dots, scratch, dpre);
  if (threadIdx.x != 0) return;
  const float* mt = mix + t * kM;
  float dl[kM];
  for (int i = 0; i < kH; ++i) {
    const float sp = sigmoid_f(mt[i] * scale[0] + base[i]);
    dl[i] = dc ? dpre[i] * sp * (1.0f - sp) : 0.0f;
    const float so = sigmoid_f(mt[kH + i] * scale[1] + base[kH + i]);
    dl[kH + i] = dpost ? dpost[t * kH + i] * 2.0f * so * (1.0f - so) : 0.0f;
  }
  if (dcomb) {
    float logits[kH * kH], g[kH * kH];
    for (int k = 0; k < kH * kH; ++k) {
      logits[k] = mt[2 * kH + k] * scale[2] + base[2 * kH + k];
      g[k] = dcomb[t * kH * kH + k];
    }
    sinkhorn_backward_token(comb_init + t * kH * kH, logits, iters, hc_eps, g, dl + 2 * kH, states);
  } else {
    for (int k = 0; k < kH * kH; ++k) dl[2 * kH + k] = 0.0f;
  }
  for (int m = 0; m < kM; ++m) {
    const float s = scale[m < kH ? 0 : m < 2 * kH ? 1 : 2];
    dmix_out[t * kM + m] = dl[m] * s;
    param_rows[t * 2 * kM + m] = dl[m];
    param_rows[t * 2 * kM + kM + m] = dl[m] * mt[m];
  }
}

// partial[blockIdx.y][m][k] = Σ_{t in block y} dmix[t][m] · X[t][k] · rstd[t]; one column k per
// thread, the block's tokens staged in shared memory.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    mhc_dfn_partial_kernel(const T* __restrict__ x, const float* __restrict__ dmix,
                           const float* __restrict__ rstd, int64_t tokens, int hd,
                           int64_t tokens_per_block, float* __restrict__ partial) {
  constexpr int kStage = 32;
  __shared__ float dm[kStage * kM];
  const int k = blockIdx.x * kThreads + threadIdx.x;
  const int64_t t0 = int64_t(blockIdx.y) * tokens_per_block;
  const int64_t t1 = t0 + tokens_per_block < tokens ? t0 + tokens_per_block : tokens;
  float acc[kM] = {};
  for (int64_t s = t0; s < t1; s += kStage) {
    const int n = int(t1 - s < kStage ? t1 - s : kStage);
    __syncthreads();
    for (int i = threadIdx.x; i < n * kM; i += kThreads) {
      const int tt = i / kM;
      dm[i] = dmix[(s + tt) * kM + i % kM] * rstd[s + tt];
    }
    __syncthreads();
    if (k < hd) {
      for (int tt = 0; tt < n; ++tt) {
        const float xv = to_f(x[(s + tt) * hd + k]);
#pragma unroll
        for (int m = 0; m < kM; ++m) acc[m] += dm[tt * kM + m] * xv;
      }
    }
  }
  if (k < hd)
    for (int m = 0; m < kM; ++m) partial[(int64_t(blockIdx.y) * kM + m) * hd + k] = acc[m];
}

// out[j] += Σ_b partial[b][j], blocks in order.
__global__ void sum_blocks_kernel(const float* __restrict__ partial, int64_t blocks, int64_t n,
                                  float* __restrict__ out) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= n) return;
  float acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) acc += partial[b * n + j];
  out[j] += acc;
}

// partial[c][j] = Σ over rows of chunk c of in[row][j] (rows in order).
__global__ void column_chunk_sums_kernel(const float* __restrict__ in, int64_t rows, int cols,
                                         int64_t rows_per_chunk, float* __restrict__ partial) {
  const int j = threadIdx.x;
  if (j >= cols) return;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float acc = 0.0f;
  for (int64_t r = r0; r < r1; ++r) acc += in[r * cols + j];
  partial[int64_t(blockIdx.x) * cols + j] = acc;
}

// sums [2M] = (Σ dlogit, Σ dlogit·mix): base += first half, scale[group] += second half.
__global__ void fold_base_scale_kernel(const float* __restrict__ sums, float* __restrict__ gbase,
                                       float* __restrict__ gscale) {
  if (threadIdx.x != 0) return;
  for (int m = 0; m < kM; ++m) gbase[m] += sums[m];
  float s[3] = {0.0f, 0.0f, 0.0f};
  for (int m = 0; m < kM; ++m) s[m < kH ? 0 : m < 2 * kH ? 1 : 2] += sums[kM + m];
  for (int i = 0; i < 3; ++i) gscale[i] += s[i];
}

// dX[t][k] = pre_i·dc[t][k mod D] + rstd·Σ_m dmix[t][m]·fn[m][k] − coef_t·X[t][k], with
// coef_t = rstd²/(HD) · Σ_m dmix[t][m]·mix[t][m]. One column per thread (its fn column in
// registers) over a tile of tokens.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    mhc_pre_dx_kernel(const T* __restrict__ x, const T* __restrict__ dc,
                      const float* __restrict__ fn, const float* __restrict__ dmix,
                      const float* __restrict__ mix, const float* __restrict__ rstd,
                      const float* __restrict__ pre, int64_t tokens, int d, T* __restrict__ dx) {
  __shared__ float dm[kDxTokens * kM];
  __shared__ float coef[kDxTokens], rs[kDxTokens];
  const int hd = kH * d;
  const int k = blockIdx.x * kThreads + threadIdx.x;
  const int64_t t0 = int64_t(blockIdx.y) * kDxTokens;
  const int n = int(tokens - t0 < kDxTokens ? tokens - t0 : kDxTokens);
  for (int i = threadIdx.x; i < n * kM; i += kThreads) dm[i] = dmix[t0 * kM + i];
  if (threadIdx.x < n) {
    const int64_t t = t0 + threadIdx.x;
    float dot = 0.0f;
    for (int m = 0; m < kM; ++m) dot += dmix[t * kM + m] * mix[t * kM + m];
    const float r = rstd[t];
    rs[threadIdx.x] = r;
    coef[threadIdx.x] = dot * r * r / float(hd);
  }
  __syncthreads();
  if (k >= hd) return;
  float f[kM];
#pragma unroll
  for (int m = 0; m < kM; ++m) f[m] = fn[int64_t(m) * hd + k];
  const int stream_i = k / d, col = k % d;
  for (int tt = 0; tt < n; ++tt) {
    const int64_t t = t0 + tt;
    float dn = 0.0f;
#pragma unroll
    for (int m = 0; m < kM; ++m) dn += dm[tt * kM + m] * f[m];
    const float xv = to_f(x[t * hd + k]);
    float v = rs[tt] * dn - coef[tt] * xv;
    if (dc) v += pre[t * kH + stream_i] * to_f(dc[t * d + col]);
    dx[t * hd + k] = from_f<T>(v);
  }
}

// ---- host side --------------------------------------------------------------------------------

int blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return int(b < 65535 * 32 ? (b > 0 ? b : 1) : 65535 * 32);
}

void check_streams(const Tensor& x, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(
      x.defined() && x.device().is_cuda() &&
          (x.dtype() == DType::bf16 || x.dtype() == DType::f32) && x.is_contiguous() &&
          x.dim() >= 2 && x.size(-2) == kH && x.size(-1) % 16 == 0,
      std::string(op) + ": streams " + detail::describe(x) +
          " must be a contiguous bf16/f32 CUDA tensor [..., 4, D], D % 16 == 0");
}

void check_like(const Tensor& t, const Shape& shape, DType dtype, const Tensor& x, const char* what,
                const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(t.defined() && t.dtype() == dtype && t.shape() == shape &&
                              t.is_contiguous() && t.device() == x.device(),
                          std::string(op) + ": " + what + " " + detail::describe(t) +
                              " must be a contiguous " + std::string(dtype_name(dtype)) + " " +
                              shape_str(shape) + " on " + x.device().str());
}

Shape lead_with(const Tensor& x, std::initializer_list<int64_t> tail) {
  Shape s(x.shape().begin(), x.shape().end() - 2);
  s.insert(s.end(), tail);
  return s;
}

int64_t token_count(const Tensor& x) { return x.numel() / (x.size(-1) * kH); }

Tensor& grad_buffer(Tensor& slot, const Tensor& param, const char* what, const char* op) {
  if (!slot.defined()) slot = Tensor::zeros(param.shape(), DType::f32, param.device());
  check_like(slot, param.shape(), DType::f32, param, what, op);
  return slot;
}

void check_params(const Tensor& x, const Tensor& fn, const Tensor& base, const Tensor& scale,
                  const ops::MhcOptions& o, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(
      o.hc_mult == kH && o.sinkhorn_iters >= 1 && o.sinkhorn_iters <= kSinkhornMaxIters,
      std::string(op) + ": hc_mult must be 4 and sinkhorn_iters in [1, 64]");
  check_like(fn, {kM, kH * x.size(-1)}, DType::f32, x, "fn", op);
  check_like(base, {kM}, DType::f32, x, "base", op);
  check_like(scale, {3}, DType::f32, x, "scale", op);
}

template <typename T>
const T* cptr(const Tensor& t) {
  return t.defined() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr;
}
template <typename T>
T* mptr(const Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename T>
void launch_pre(const Tensor& x, const Tensor& fn, const Tensor& base, const Tensor& scale,
                const ops::MhcOptions& o, ops::MhcPreResult& res, ops::MhcPreSaved& sv,
                cudaStream_t stream) {
  const int64_t n = token_count(x);
  const int d = int(x.size(-1)), hd = kH * d;
  if (n == 0) return;
  mhc_mix_kernel<T><<<unsigned((n + kMixTokens - 1) / kMixTokens), kThreads, 0, stream>>>(
      cptr<T>(x), fn.data<float>(), base.data<float>(), scale.data<float>(), n, hd,
      float(o.rms_eps), float(o.hc_eps), int(o.sinkhorn_iters), sv.mix.data<float>(),
      sv.rstd.data<float>(), sv.pre.data<float>(), res.post.data<float>(), res.comb.data<float>(),
      sv.comb_init.data<float>());
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  mhc_collapse_kernel<T><<<blocks_for(n * (d / 8), kThreads), kThreads, 0, stream>>>(
      cptr<T>(x), sv.pre.data<float>(), n, d, mptr<T>(res.collapsed));
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
}

// Σ over rows of a [rows, cols] f32 matrix, accumulated into out[cols]: fixed row chunks, then
// the chunks in order.
void column_sums_into(const float* in, int64_t rows, int cols, float* out, Device dev,
                      cudaStream_t stream) {
  const int64_t per = (rows + kSumChunks - 1) / kSumChunks;
  const int64_t chunks = per > 0 ? (rows + per - 1) / per : 0;
  if (chunks == 0) return;
  Tensor partial = Tensor::empty({chunks, cols}, DType::f32, dev);
  column_chunk_sums_kernel<<<unsigned(chunks), 64, 0, stream>>>(in, rows, cols, per,
                                                                partial.data<float>());
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  sum_blocks_kernel<<<1, 64, 0, stream>>>(partial.data<float>(), chunks, cols, out);
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

ops::MhcPreResult mhc_pre(const Tensor& streams, const Tensor& fn, const Tensor& base,
                          const Tensor& scale, const ops::MhcOptions& options,
                          ops::MhcPreSaved* saved, cudaStream_t stream) {
  const char* op = "cuda::mhc_pre";
  check_streams(streams, op);
  check_params(streams, fn, base, scale, options, op);
  detail::DeviceGuard guard(streams.device().index);
  const Device dev = streams.device();
  ops::MhcPreResult res;
  res.post = Tensor::empty(lead_with(streams, {kH}), DType::f32, dev);
  res.comb = Tensor::empty(lead_with(streams, {kH, kH}), DType::f32, dev);
  res.collapsed = Tensor::empty(lead_with(streams, {streams.size(-1)}), streams.dtype(), dev);
  ops::MhcPreSaved sv;
  sv.rstd = Tensor::empty(lead_with(streams, {}), DType::f32, dev);
  sv.mix = Tensor::empty(lead_with(streams, {kM}), DType::f32, dev);
  sv.pre = Tensor::empty(lead_with(streams, {kH}), DType::f32, dev);
  sv.comb_init = Tensor::empty(lead_with(streams, {kH, kH}), DType::f32, dev);
  if (streams.dtype() == DType::bf16)
    launch_pre<bf16>(streams, fn, base, scale, options, res, sv, stream);
  else
    launch_pre<float>(streams, fn, base, scale, options, res, sv, stream);
  if (saved) *saved = sv;
  return res;
}

Tensor mhc_post(const Tensor& streams, const Tensor& y, const Tensor& post, const Tensor& comb,
                cudaStream_t stream) {
  const char* op = "cuda::mhc_post";
  check_streams(streams, op);
  const int64_t n = token_count(streams);
  const int d = int(streams.size(-1));
  check_like(y, lead_with(streams, {d}), streams.dtype(), streams, "y", op);
  check_like(post, lead_with(streams, {kH}), DType::f32, streams, "post", op);
  check_like(comb, lead_with(streams, {kH, kH}), DType::f32, streams, "comb", op);
  detail::DeviceGuard guard(streams.device().index);
  Tensor out = Tensor::empty(streams.shape(), streams.dtype(), streams.device());
  if (n == 0) return out;
  const int blocks = blocks_for(n * (d / 8), kThreads);
  if (streams.dtype() == DType::bf16)
    mhc_post_kernel<bf16><<<blocks, kThreads, 0, stream>>>(cptr<bf16>(streams), cptr<bf16>(y),
                                                           post.data<float>(), comb.data<float>(),
                                                           n, d, mptr<bf16>(out));
  else
    mhc_post_kernel<float><<<blocks, kThreads, 0, stream>>>(cptr<float>(streams), cptr<float>(y),
                                                            post.data<float>(), comb.data<float>(),
                                                            n, d, mptr<float>(out));
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  return out;
}

ops::MhcPostGrads mhc_post_backward(const Tensor& streams, const Tensor& y, const Tensor& post,
                                    const Tensor& comb, const Tensor& d_out, cudaStream_t stream) {
  const char* op = "cuda::mhc_post_backward";
  check_streams(streams, op);
  const int64_t n = token_count(streams);
  const int d = int(streams.size(-1));
  check_like(y, lead_with(streams, {d}), streams.dtype(), streams, "y", op);
  check_like(post, lead_with(streams, {kH}), DType::f32, streams, "post", op);
  check_like(comb, lead_with(streams, {kH, kH}), DType::f32, streams, "comb", op);
  check_like(d_out, streams.shape(), streams.dtype(), streams, "d_out", op);
  detail::DeviceGuard guard(streams.device().index);
  const Device dev = streams.device();
  ops::MhcPostGrads r{Tensor::empty(streams.shape(), streams.dtype(), dev),
                      Tensor::empty(y.shape(), streams.dtype(), dev),
                      Tensor::empty(post.shape(), DType::f32, dev),
                      Tensor::empty(comb.shape(), DType::f32, dev)};
  if (n == 0) return r;
  if (streams.dtype() == DType::bf16)
    mhc_post_bwd_kernel<bf16><<<unsigned(n), kThreads, 0, stream>>>(
        cptr<bf16>(streams), cptr<bf16>(y), post.data<float>(), comb.data<float>(),
        cptr<bf16>(d_out), d, mptr<bf16>(r.d_streams), mptr<bf16>(r.d_y), r.d_post.data<float>(),
        r.d_comb.data<float>());
  else
    mhc_post_bwd_kernel<float><<<unsigned(n), kThreads, 0, stream>>>(
        cptr<float>(streams), cptr<float>(y), post.data<float>(), comb.data<float>(),
        cptr<float>(d_out), d, mptr<float>(r.d_streams), mptr<float>(r.d_y), r.d_post.data<float>(),
        r.d_comb.data<float>());
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  return r;
}

namespace {

template <typename T>
void launch_pre_backward(const Tensor& x, const Tensor& fn, const ops::MhcOptions& o,
                         const ops::MhcPreSaved& sv, const Tensor& base, const Tensor& scale,
                         const Tensor& d_post, const Tensor& d_comb, const Tensor& d_coll,
                         Tensor& gfn, Tensor& gbase, Tensor& gscale, Tensor& dx,
                         cudaStream_t stream) {
  const int64_t n = token_count(x);
  const int d = int(x.size(-1)), hd = kH * d;
  const Device dev = x.device();
  Tensor dmix = Tensor::empty({n, kM}, DType::f32, dev);
  Tensor rows = Tensor::empty({n, 2 * kM}, DType::f32, dev);
  mhc_pre_bwd_token_kernel<T><<<unsigned(n), kThreads, 0, stream>>>(
      cptr<T>(x), cptr<T>(d_coll), cptr<float>(d_post), cptr<float>(d_comb), sv.mix.data<float>(),
      sv.comb_init.data<float>(), base.data<float>(), scale.data<float>(), d, int(o.sinkhorn_iters),
      float(o.hc_eps), dmix.data<float>(), rows.data<float>());
  GLMTUNE_CUDA_CHECK(cudaGetLastError());

  Tensor sums = Tensor::zeros({2 * kM}, DType::f32, dev);
  column_sums_into(rows.data<float>(), n, 2 * kM, sums.data<float>(), dev, stream);
  fold_base_scale_kernel<<<1, 32, 0, stream>>>(sums.data<float>(), gbase.data<float>(),
                                               gscale.data<float>());
  GLMTUNE_CUDA_CHECK(cudaGetLastError());

  const int64_t per = (n + kFnTokenBlocks - 1) / kFnTokenBlocks;
  const int64_t nblk = (n + per - 1) / per;
  Tensor partial = Tensor::empty({nblk, kM, hd}, DType::f32, dev);
  mhc_dfn_partial_kernel<T>
      <<<dim3(unsigned((hd + kThreads - 1) / kThreads), unsigned(nblk)), kThreads, 0, stream>>>(
          cptr<T>(x), dmix.data<float>(), sv.rstd.data<float>(), n, hd, per, partial.data<float>());
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  sum_blocks_kernel<<<blocks_for(int64_t(kM) * hd, kThreads), kThreads, 0, stream>>>(
      partial.data<float>(), nblk, int64_t(kM) * hd, gfn.data<float>());
  GLMTUNE_CUDA_CHECK(cudaGetLastError());

  mhc_pre_dx_kernel<T>
      <<<dim3(unsigned((hd + kThreads - 1) / kThreads), unsigned((n + kDxTokens - 1) / kDxTokens)),
         kThreads, 0, stream>>>(cptr<T>(x), cptr<T>(d_coll), fn.data<float>(), dmix.data<float>(),
                                sv.mix.data<float>(), sv.rstd.data<float>(), sv.pre.data<float>(),
                                n, d, mptr<T>(dx));
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

Tensor mhc_pre_backward(const Tensor& streams, const Tensor& fn, const Tensor& base,
                        const Tensor& scale, const ops::MhcOptions& options,
                        const ops::MhcPreSaved* saved, const Tensor& d_post, const Tensor& d_comb,
                        const Tensor& d_collapsed, ops::MhcGrads& grads, cudaStream_t stream) {
  const char* op = "cuda::mhc_pre_backward";
  check_streams(streams, op);
  check_params(streams, fn, base, scale, options, op);
  const int d = int(streams.size(-1));
  if (d_post.defined())
    check_like(d_post, lead_with(streams, {kH}), DType::f32, streams, "d_post", op);
  if (d_comb.defined())
    check_like(d_comb, lead_with(streams, {kH, kH}), DType::f32, streams, "d_comb", op);
  if (d_collapsed.defined())
    check_like(d_collapsed, lead_with(streams, {d}), streams.dtype(), streams, "d_collapsed", op);
  ops::MhcPreSaved fresh;
  if (!saved) {
    mhc_pre(streams, fn, base, scale, options, &fresh, stream);
    saved = &fresh;
  }
  check_like(saved->rstd, lead_with(streams, {}), DType::f32, streams, "saved rstd", op);
  check_like(saved->mix, lead_with(streams, {kM}), DType::f32, streams, "saved mix", op);
  check_like(saved->pre, lead_with(streams, {kH}), DType::f32, streams, "saved pre", op);
  check_like(saved->comb_init, lead_with(streams, {kH, kH}), DType::f32, streams, "saved comb_init",
             op);
  detail::DeviceGuard guard(streams.device().index);
  Tensor& gfn = grad_buffer(grads.fn, fn, "fn gradient", op);
  Tensor& gbase = grad_buffer(grads.base, base, "base gradient", op);
  Tensor& gscale = grad_buffer(grads.scale, scale, "scale gradient", op);
  Tensor dx = Tensor::empty(streams.shape(), streams.dtype(), streams.device());
  if (token_count(streams) == 0) return dx;
  if (streams.dtype() == DType::bf16)
    launch_pre_backward<bf16>(streams, fn, options, *saved, base, scale, d_post, d_comb,
                              d_collapsed, gfn, gbase, gscale, dx, stream);
  else
    launch_pre_backward<float>(streams, fn, options, *saved, base, scale, d_post, d_comb,
                               d_collapsed, gfn, gbase, gscale, dx, stream);
  return dx;
}

}  // namespace glmtune::cuda
