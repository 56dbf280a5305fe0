// mHC forward and backward kernels (ops/cuda/mhc.h).

#include <type_traits>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/mhc.h"
#include "glmtune/ops/cuda/tensor_core.cuh"

namespace glmtune::cuda {
namespace {

using detail::bf16;
using detail::mptr;
using detail::sum_blocks_kernel;

constexpr int kH = 4;              // streams
constexpr int kM = (2 + kH) * kH;  // logits per token: pre, post, comb
constexpr int kThreads = 256;
constexpr int kMixTokens = 64;         // tokens per block of the mixing product
constexpr int kMixK = 64;              // columns of X per shared-memory stage
constexpr int kFnTokenBlocks = 32;     // fixed token blocks of the d fn sums
constexpr int kFnCols = 64;            // columns of X per block of the d fn sums (HD % 64 == 0)
constexpr int kFnThreads = 128;        // four warps of 16 columns
constexpr int kFnStageTokens = 32;     // tokens per shared-memory stage of the d fn sums
constexpr int kFnStages = 3;           // stages of the d fn sums in flight
constexpr int kDxTokens = 64;          // tokens per block of the dX kernel
constexpr int kDxCols = 64;            // columns of X per tile of the dX kernel
constexpr int kDxTileRun = 4;          // column tiles a block of the dX kernel walks (at most)
constexpr int kMPad = 32;              // the 24 logits padded to two 16-wide MMA tiles
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

// ---- pre: mixing product, statistics and Sinkhorn ----------------------------------------------

// The mixing product's B operand: fn as bf16 hi and lo parts [M][HD] (hi + lo keeps about 16 bits
// of each weight; the activations are bf16 already, or split the same way in the f32 mode).
__global__ void split_fn_kernel(const float* __restrict__ fn, int64_t n, bf16* __restrict__ hi,
                                bf16* __restrict__ lo) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const bf16 h = __float2bfloat16_rn(fn[i]);
    hi[i] = h;
    lo[i] = __float2bfloat16_rn(fn[i] - __bfloat162float(h));
  }
}

// The mixing product's staged operands (dynamic shared memory), three stages in flight: X tiles
// of kMixTokens rows by kMixK columns and the same columns of fn's hi and lo parts, every row
// padded by 16 bytes (16-byte aligned, and the fragment loads of eight rows fall in distinct
// banks). fn goes through shared memory too, so no stage waits on L2 for its B operands.
template <typename T>
struct MixTiles {
  static constexpr int kLd = kMixK + 16 / int(sizeof(T));
  static constexpr int kFLd = kMixK + 8;
  static constexpr int kStages = 3;
  T x[kStages][kMixTokens * kLd];
  bf16 fh[kStages][kM * kFLd], fl[kStages][kM * kFLd];
};

// One block per 64 tokens: raw logits X·fnᵀ on the tensor cores (warp w: tokens 16·(w mod 4) ..,
// the stage's columns 32·(w / 4) .., all 24 logits; the two column halves added at the end), the
// sum of squares for the RMS statistic, then per token the gates and the Sinkhorn projection.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    mhc_mix_kernel(const T* __restrict__ x, const bf16* __restrict__ fn_hi,
                   const bf16* __restrict__ fn_lo, const float* __restrict__ base,
                   const float* __restrict__ scale, int64_t tokens, int hd, float rms_eps,
                   float hc_eps, int iters, float* __restrict__ mix_out,
                   float* __restrict__ rstd_out, float* __restrict__ pre_out,
                   float* __restrict__ post_out, float* __restrict__ comb_out,
                   float* __restrict__ init_out) {
  using Tiles = MixTiles<T>;
  constexpr int kLd = Tiles::kLd, kFLd = Tiles::kFLd, kStages = Tiles::kStages;
  constexpr int kPieces = 16 / int(sizeof(T));  // elements per 16-byte piece
  constexpr int kRowPieces = kMixK / kPieces;   // pieces per staged row
  extern __shared__ __align__(16) unsigned char mix_smem[];
  Tiles& tiles = *reinterpret_cast<Tiles*>(mix_smem);
  __shared__ float raw[kMixTokens * kM];
  __shared__ float ss_tok[kMixTokens];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t t0 = int64_t(blockIdx.x) * kMixTokens;
  const int rows = int(tokens - t0 < kMixTokens ? tokens - t0 : kMixTokens);
  // Rows past the last token stay zero in every stage (nothing loads them).
  for (int i = tid; i < kStages * kMixTokens * kLd; i += kThreads) {
    const int row = (i % (kMixTokens * kLd)) / kLd;
    if (row >= rows) (&tiles.x[0][0])[i] = from_f<T>(0.0f);
  }
  auto load_stage = [&](int stage, int k0) {
    for (int piece = tid; piece < kMixTokens * kRowPieces; piece += kThreads) {
      const int row = piece / kRowPieces, col = (piece % kRowPieces) * kPieces;
      if (row < rows)
        tc::cp_async16(&tiles.x[stage][row * kLd + col], x + (t0 + row) * int64_t(hd) + k0 + col);
    }
    for (int piece = tid; piece < 2 * kM * (kMixK / 8); piece += kThreads) {
      const int part = piece / (kM * (kMixK / 8)), rest = piece % (kM * (kMixK / 8));
      const int m = rest / (kMixK / 8), col = (rest % (kMixK / 8)) * 8;
      bf16* dst = part == 0 ? tiles.fh[stage] : tiles.fl[stage];
      tc::cp_async16(dst + m * kFLd + col,
                     (part == 0 ? fn_hi : fn_lo) + int64_t(m) * hd + k0 + col);
    }
  };
  const int stages = hd / kMixK;
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < stages) load_stage(s, s * kMixK);
    tc::cp_async_commit();
  }
  const int m0 = 16 * (warp & 3), half = warp >> 2;
  float acc[3][4] = {};
  // Sum of squares: thread tid takes token tid / 4, columns 16·(tid mod 4) .. + 15 of each stage.
  const int sq_row = tid >> 2, sq_col = (tid & 3) * 16;
  float ss = 0.0f;
  for (int c = 0; c < stages; ++c) {
    tc::cp_async_wait<kStages - 2>();
    __syncthreads();
    // The buffer refilled here was read in the previous iteration, before the barrier above.
    if (c + kStages - 1 < stages)
      load_stage((c + kStages - 1) % kStages, (c + kStages - 1) * kMixK);
    tc::cp_async_commit();
    const T* tile = tiles.x[c % kStages];
#pragma unroll
    for (int half8 = 0; half8 < 2; ++half8) {
      float v[8];
      load8(tile + sq_row * kLd + sq_col + 8 * half8, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += v[e] * v[e];
    }
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
      const int kl = 32 * half + 16 * kt;  // column in the stage
      tc::FragA a;
      if constexpr (std::is_same_v<T, bf16>)
        tc::lds_a_mk(tile, kLd, m0, kl, a.hi);
      else
        a = tc::load_a_f32(tile + m0 * kLd + kl, kLd, 1);
#pragma unroll
      for (int nt = 0; nt < 3; ++nt) {
        tc::FragB b;
        tc::lds_b_nk(tiles.fh[c % kStages], kFLd, 8 * nt, kl, b.hi);
        tc::lds_b_nk(tiles.fl[c % kStages], kFLd, 8 * nt, kl, b.lo);
        if constexpr (std::is_same_v<T, bf16>) {  // bf16 activations are exact: no lo part
          tc::mma(acc[nt], a.hi, b.lo);
          tc::mma(acc[nt], a.hi, b.hi);
        } else {
          tc::mma3(acc[nt], a, b);
        }
      }
    }
  }
  // The second column half's partial sums, then the first half adds its own.
  if (half == 1)
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        raw[(m0 + g + (r >> 1) * 8) * kM + 8 * nt + 2 * t4 + (r & 1)] = acc[nt][r];
  __syncthreads();
  if (half == 0)
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        float& slot = raw[(m0 + g + (r >> 1) * 8) * kM + 8 * nt + 2 * t4 + (r & 1)];
        slot = acc[nt][r] + slot;
      }
  ss += __shfl_xor_sync(0xffffffffu, ss, 1);
  ss += __shfl_xor_sync(0xffffffffu, ss, 2);
  if ((tid & 3) == 0) ss_tok[sq_row] = ss;
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

// Calls f(t, k) for each token t and each group of eight columns [k, k + 8) of d, one (token,
// group) per thread with a grid stride: the split that the launches size as n · d / 8 threads.
template <typename F>
__device__ __forceinline__ void for_each_column_group(int64_t tokens, int d, F&& f) {
  const int64_t groups = int64_t(d / 8), n = tokens * groups;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < n;
       g += int64_t(gridDim.x) * blockDim.x)
    f(g / groups, int(g % groups) * 8);
}

// c[t] = Σ_i pre_i X_i, eight columns per thread.
template <typename T>
__global__ void mhc_collapse_kernel(const T* __restrict__ x, const float* __restrict__ pre,
                                    int64_t tokens, int d, T* __restrict__ out) {
  for_each_column_group(tokens, d, [&](int64_t t, int k) {
    float o[8] = {};
    for (int i = 0; i < kH; ++i) {
      float v[8];
      load8(x + (t * kH + i) * d + k, v);
      const float p = pre[t * kH + i];
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] += p * v[e];
    }
    store8(out + t * d + k, o);
  });
}

// X'_i = post_i·y + Σ_j comb[j][i]·X_j.
template <typename T>
__global__ void mhc_post_kernel(const T* __restrict__ x, const T* __restrict__ y,
                                const float* __restrict__ post, const float* __restrict__ comb,
                                int64_t tokens, int d, T* __restrict__ out) {
  for_each_column_group(tokens, d, [&](int64_t t, int k) {
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
  });
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

// The sum of v over the four lanes of this lane's row (kRow) or column of a token's 4×4 matrix,
// the matrix held by 16 consecutive lanes, lane j on element (j / 4, j mod 4); the same bits in
// all four lanes.
template <bool kRow>
__device__ __forceinline__ float group4_sum(float v) {
  constexpr int a = kRow ? 1 : 4, b = kRow ? 2 : 8;
  v += __shfl_xor_sync(0xffffffffu, v, a);
  return v + __shfl_xor_sync(0xffffffffu, v, b);
}
__device__ __forceinline__ float group4_sum(float v, bool row) {
  return row ? group4_sum<true>(v) : group4_sum<false>(v);
}

// The sum of v over the 16 lanes of this lane's token group (the same bits in all of them).
__device__ __forceinline__ float group16_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  return v + __shfl_xor_sync(0xffffffffu, v, 8);
}

// The logit gradients of the pre, post and comb maps, one token on 16 lanes. First d pre_i =
// ⟨dc, X_i⟩ (lane j on the column groups 8j, 8j + 128, ..., the sums over the group's lanes by
// shuffles). Then lane j takes comb element j (the Sinkhorn replay and its reverse walk, each
// normalisation's sums over its row or column by shuffles; the states of its own element in local
// memory), and lanes 0–3 pre_j, lanes 4–7 post_{j−4}. Writes, for the d fn and dX products,
// dmix·rstd (dmix = dlogit·scale of its group) as bf16 hi and lo parts [T][2][32] (zero past
// the 24 logits) and coef [T] = rstd²/(HD) · Σ_m dmix·mix; and rows [dlogit, dlogit·mix] [T, 2M]
// for the base and scale sums. Lanes past the last token repeat the last one (every lane of a
// warp takes part in the shuffles) and store nothing.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    mhc_pre_logit_grads_kernel(const T* __restrict__ x, const T* __restrict__ dc, int d,
                               const float* __restrict__ dpost, const float* __restrict__ dcomb,
                               const float* __restrict__ mix, const float* __restrict__ rstd,
                               const float* __restrict__ comb_init, const float* __restrict__ base,
                               const float* __restrict__ scale, int64_t tokens, int iters,
                               float hc_eps, bf16* __restrict__ dmix_parts,
                               float* __restrict__ coef_out, float* __restrict__ param_rows) {
  constexpr int hh = kH * kH;
  const int64_t gid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, token = gid / hh;
  const int j = int(gid % hh);
  const int64_t t = token < tokens ? token : tokens - 1;
  const float* mt = mix + t * kM;
  float dpre = 0.0f;  // ⟨dc, X_j⟩ in lanes 0–3
  if (dc) {
    float dots[kH] = {};
#pragma unroll 2
    for (int k = 8 * j; k < d; k += 8 * hh) {
      float gv[8], xv[kH][8];
      load8(dc + t * d + k, gv);
#pragma unroll
      for (int i = 0; i < kH; ++i) load8(x + (t * kH + i) * d + k, xv[i]);
#pragma unroll
      for (int i = 0; i < kH; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) dots[i] += gv[e] * xv[i][e];
    }
#pragma unroll
    for (int i = 0; i < kH; ++i) {
      dots[i] = group16_sum(dots[i]);
      if (j == i) dpre = dots[i];
    }
  }
  // pre (lanes 0–3) and post (lanes 4–7).
  float dl_gate = 0.0f;
  if (j < kH) {
    const float sp = sigmoid_f(mt[j] * scale[0] + base[j]);
    dl_gate = dpre * sp * (1.0f - sp);
  } else if (j < 2 * kH) {
    const float so = sigmoid_f(mt[j] * scale[1] + base[j]);
    dl_gate = dpost ? dpost[t * kH + j - kH] * 2.0f * so * (1.0f - so) : 0.0f;
  }
  // comb: replay the 2·iters − 1 normalisations (column first) from softmax + eps, then walk
  // them back, then the row softmax.
  float dl_comb = 0.0f;
  if (dcomb) {
    float state[2 * kSinkhornMaxIters];
    const int steps = 2 * iters - 1;
    state[0] = comb_init[t * hh + j];
    for (int s = 0; s + 1 < steps; ++s)
      state[s + 1] = state[s] / (group4_sum(state[s], s % 2 != 0) + hc_eps);
    float g = dcomb[t * hh + j];
    for (int s = steps - 1; s >= 0; --s) {
      const bool row = s % 2 != 0;
      const float dd = group4_sum(state[s], row) + hc_eps;
      const float dot = group4_sum(g * (state[s] / dd), row);
      g = (g - dot) / dd;
    }
    const float l = mt[2 * kH + j] * scale[2] + base[2 * kH + j];
    float mx = fmaxf(l, __shfl_xor_sync(0xffffffffu, l, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float e = expf(l - mx);
    const float p = e / group4_sum<true>(e);
    dl_comb = p * (g - group4_sum<true>(g * p));
  }
  const bool gate = j < 2 * kH;
  const float dm_gate = gate ? dl_gate * scale[j < kH ? 0 : 1] : 0.0f;
  const float dm_comb = dl_comb * scale[2];
  const float dmix_mix = group16_sum(dm_comb * mt[2 * kH + j] + (gate ? dm_gate * mt[j] : 0.0f));
  if (token >= tokens) return;
  const float r = rstd[t];
  if (j == 0) coef_out[t] = dmix_mix * r * r / float(kH * d);
  bf16* parts = dmix_parts + t * 2 * kMPad;
  auto put = [&](int m, float dl, float dm) {
    const float v = dm * r;
    const bf16 hi = __float2bfloat16_rn(v);
    parts[m] = hi;
    parts[kMPad + m] = __float2bfloat16_rn(v - __bfloat162float(hi));
    param_rows[t * 2 * kM + m] = dl;
    param_rows[t * 2 * kM + kM + m] = dl * mt[m];
  };
  if (gate) {
    put(j, dl_gate, dm_gate);
  } else {  // lanes 8–15 zero the padding logits 24–31
    parts[kM + j - 2 * kH] = bf16(0.0f);
    parts[kMPad + kM + j - 2 * kH] = bf16(0.0f);
  }
  put(2 * kH + j, dl_comb, dm_comb);
}

// partial[blockIdx.y][m][k] = Σ_{t in block y} dmix[t][m]·rstd[t]·X[t][k] on the tensor cores:
// a [32 (24 logits, padded) × tokens] by [tokens × kFnCols] product per block, tokens staged
// kFnStageTokens at a time by cp.async (X, and the hi and lo parts of dmix·rstd), kFnStages stages
// in flight, four warps, warp w on columns 16w .. + 15 for both logit tiles. X is exact in bf16
// (split into hi and lo in the f32 mode).
template <typename T>
__global__ void __launch_bounds__(kFnThreads)
    mhc_dfn_partial_kernel(const T* __restrict__ x, const bf16* __restrict__ dmix_parts,
                           int64_t tokens, int hd, int64_t tokens_per_block,
                           float* __restrict__ partial) {
  constexpr int kXLd = kFnCols + 16 / int(sizeof(T));  // 16-byte padded rows
  constexpr int kALd = 2 * kMPad + 8;                  // [t][hi 32 | lo 32], 16-byte padded
  constexpr int kPieces = 16 / int(sizeof(T)), kRowPieces = kFnCols / kPieces;
  constexpr int kAPieces = 2 * kMPad / 8;  // 16-byte pieces of a token's dmix parts
  __shared__ __align__(16) T xs[kFnStages][kFnStageTokens * kXLd];
  __shared__ __align__(16) bf16 as[kFnStages][kFnStageTokens * kALd];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int col0 = blockIdx.x * kFnCols;
  const int64_t t0 = int64_t(blockIdx.y) * tokens_per_block;
  const int64_t t1 = t0 + tokens_per_block < tokens ? t0 + tokens_per_block : tokens;
  const int stages = int((t1 - t0 + kFnStageTokens - 1) / kFnStageTokens);
  // Rows past t1 are zero-filled (their sources are not read).
  auto load_stage = [&](int buf, int64_t s0) {
    for (int piece = tid; piece < kFnStageTokens * kRowPieces; piece += kFnThreads) {
      const int row = piece / kRowPieces, col = (piece % kRowPieces) * kPieces;
      const bool real = s0 + row < t1;
      tc::cp_async16_zfill(&xs[buf][row * kXLd + col],
                           x + (real ? s0 + row : t0) * int64_t(hd) + col0 + col, real);
    }
    for (int piece = tid; piece < kFnStageTokens * kAPieces; piece += kFnThreads) {
      const int row = piece / kAPieces, col = (piece % kAPieces) * 8;
      const bool real = s0 + row < t1;
      tc::cp_async16_zfill(&as[buf][row * kALd + col],
                           dmix_parts + (real ? s0 + row : t0) * 2 * kMPad + col, real);
    }
  };
  float acc[2][2][4] = {};
  for (int s = 0; s < kFnStages - 1; ++s) {
    if (s < stages) load_stage(s, t0 + int64_t(s) * kFnStageTokens);
    tc::cp_async_commit();
  }
  for (int c = 0; c < stages; ++c) {
    tc::cp_async_wait<kFnStages - 2>();
    __syncthreads();
    // The buffer refilled here was read in the previous iteration, before the barrier above.
    if (c + kFnStages - 1 < stages)
      load_stage((c + kFnStages - 1) % kFnStages, t0 + int64_t(c + kFnStages - 1) * kFnStageTokens);
    tc::cp_async_commit();
    const T* xt = xs[c % kFnStages];
    const bf16* at = as[c % kFnStages];
#pragma unroll
    for (int kt = 0; kt < kFnStageTokens / 16; ++kt) {
      tc::FragB b[2];
      if constexpr (std::is_same_v<T, bf16>) {
        tc::ldsm_b_kn(xt, kXLd, 16 * kt, 16 * warp, b[0].hi, b[1].hi);
      } else {
        b[0] = tc::load_b_f32(xt, kXLd, 16 * kt, 16 * warp);
        b[1] = tc::load_b_f32(xt, kXLd, 16 * kt, 16 * warp + 8);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        tc::FragA a;
        tc::ldsm_a_km(at, kALd, 16 * kt, 16 * mt, a.hi);
        tc::ldsm_a_km(at + kMPad, kALd, 16 * kt, 16 * mt, a.lo);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          if constexpr (std::is_same_v<T, bf16>) {  // X exact in bf16: no lo part
            tc::mma(acc[mt][nt], a.lo, b[nt].hi);
            tc::mma(acc[mt][nt], a.hi, b[nt].hi);
          } else {
            tc::mma3(acc[mt][nt], a, b[nt]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = 16 * mt + g + 8 * half;
        if (m < kM)
          *reinterpret_cast<float2*>(partial + (int64_t(blockIdx.y) * kM + m) * hd + col0 +
                                     16 * warp + 8 * nt + 2 * t4) =
              make_float2(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
      }
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

// The dX kernel's shared memory: the token tile's rstd·dmix parts [t][hi 32 | lo 32], then two
// stages of one column tile each (fn's hi and lo parts [m][col], and X, d c and the residual
// [t][col], every row padded by 16 bytes), the product's tile, and each token's coefficient and
// pre weights.
template <typename T>
struct DxTiles {
  static constexpr int kALd = 2 * kMPad + 8, kBLd = kDxCols + 8, kOLd = kDxCols + 4;
  static constexpr int kXLd = kDxCols + 16 / int(sizeof(T));
  bf16 a[kDxTokens * kALd];
  bf16 b[2][2][kMPad * kBLd];
  T x[2][kDxTokens * kXLd], c[2][kDxTokens * kXLd], r[2][kDxTokens * kXLd];
  float out[kDxTokens * kOLd];
  float coef[kDxTokens], pre[kDxTokens][kH];
};

// dX[t][k] = pre_i·dc[t][k mod D] + rstd·Σ_m dmix[t][m]·fn[m][k] − coef_t·X[t][k] (+ residual),
// coef from the logit kernel. A block takes kDxTokens tokens and walks `tiles` column tiles of
// kDxCols: the next tile's fn parts, X, d c and residual are staged by cp.async while the present
// one's product runs on the tensor cores ([tokens × 32] rstd·dmix from its hi and lo parts, loaded
// once, by [32 × cols] fn; warp w on tokens 16·(w mod 4) .., columns 32·(w / 4) ..) and goes
// through shared memory to a coalesced pass that adds the other terms.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    mhc_pre_dx_kernel(const T* __restrict__ x, const T* __restrict__ dc,
                      const bf16* __restrict__ fn_hi, const bf16* __restrict__ fn_lo,
                      const bf16* __restrict__ dmix_parts, const float* __restrict__ coef,
                      const float* __restrict__ pre, const T* __restrict__ residual, int64_t tokens,
                      int d, int tiles, T* __restrict__ dx) {
  using Tiles = DxTiles<T>;
  constexpr int kALd = Tiles::kALd, kBLd = Tiles::kBLd, kOLd = Tiles::kOLd, kXLd = Tiles::kXLd;
  constexpr int kPieces = 16 / int(sizeof(T)), kRowPieces = kDxCols / kPieces;
  extern __shared__ __align__(16) unsigned char dx_smem[];
  Tiles& sm = *reinterpret_cast<Tiles*>(dx_smem);
  const int hd = kH * d;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t t0 = int64_t(blockIdx.y) * kDxTokens;
  const int n = int(tokens - t0 < kDxTokens ? tokens - t0 : kDxTokens);
  const int tile0 = blockIdx.x * tiles;
  // Rows past the last token are zero-filled from a valid address.
  auto row_of = [&](int tt) { return t0 + (tt < n ? tt : 0); };
  for (int piece = tid; piece < kDxTokens * (2 * kMPad / 8); piece += kThreads) {
    const int tt = piece / (2 * kMPad / 8), col = (piece % (2 * kMPad / 8)) * 8;
    tc::cp_async16_zfill(&sm.a[tt * kALd + col], dmix_parts + row_of(tt) * 2 * kMPad + col, tt < n);
  }
  for (int tt = tid; tt < kDxTokens; tt += kThreads) {
    sm.coef[tt] = coef[row_of(tt)];
    for (int i = 0; i < kH; ++i) sm.pre[tt][i] = pre[row_of(tt) * kH + i];
  }
  auto load_tile = [&](int buf, int tile) {
    const int col0 = tile * kDxCols;
    for (int piece = tid; piece < 2 * kMPad * (kDxCols / 8); piece += kThreads) {
      const int part = piece / (kMPad * (kDxCols / 8)), rest = piece % (kMPad * (kDxCols / 8));
      const int m = rest / (kDxCols / 8), col = (rest % (kDxCols / 8)) * 8;
      tc::cp_async16_zfill(&sm.b[buf][part][m * kBLd + col],
                           (part == 0 ? fn_hi : fn_lo) + int64_t(m < kM ? m : 0) * hd + col0 + col,
                           m < kM);
    }
    for (int piece = tid; piece < kDxTokens * kRowPieces; piece += kThreads) {
      const int tt = piece / kRowPieces, col = (piece % kRowPieces) * kPieces, k = col0 + col;
      const int64_t t = row_of(tt);
      tc::cp_async16_zfill(&sm.x[buf][tt * kXLd + col], x + t * hd + k, tt < n);
      if (dc) tc::cp_async16_zfill(&sm.c[buf][tt * kXLd + col], dc + t * d + k % d, tt < n);
      if (residual)
        tc::cp_async16_zfill(&sm.r[buf][tt * kXLd + col], residual + t * hd + k, tt < n);
    }
  };
  load_tile(0, tile0);
  tc::cp_async_commit();
  const int m0 = 16 * (warp & 3), n0 = 32 * (warp >> 2);
  for (int j = 0; j < tiles; ++j) {
    // The buffer refilled here was read in the previous iteration, before its closing barrier.
    if (j + 1 < tiles) load_tile((j + 1) & 1, tile0 + j + 1);
    tc::cp_async_commit();
    tc::cp_async_wait<1>();
    __syncthreads();
    const int buf = j & 1, col0 = (tile0 + j) * kDxCols;
    float acc[4][4] = {};
#pragma unroll
    for (int kt = 0; kt < kMPad / 16; ++kt) {
      tc::FragA a;
      tc::ldsm_a_mk(sm.a, kALd, m0, 16 * kt, a.hi);
      tc::ldsm_a_mk(sm.a + kMPad, kALd, m0, 16 * kt, a.lo);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        tc::FragB b0, b1;
        tc::ldsm_b_kn(sm.b[buf][0], kBLd, 16 * kt, n0 + 16 * np, b0.hi, b1.hi);
        tc::ldsm_b_kn(sm.b[buf][1], kBLd, 16 * kt, n0 + 16 * np, b0.lo, b1.lo);
        tc::mma3(acc[2 * np], a, b0);
        tc::mma3(acc[2 * np + 1], a, b1);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *reinterpret_cast<float2*>(&sm.out[(m0 + g + 8 * half) * kOLd + n0 + 8 * nt + 2 * t4]) =
            make_float2(acc[nt][2 * half], acc[nt][2 * half + 1]);
    __syncthreads();
    // Eight columns a thread and run: token tt, columns c8 .. c8 + 7 (one stream: D % 8 == 0).
    for (int job = tid; job < kDxTokens * (kDxCols / 8); job += kThreads) {
      const int tt = job / (kDxCols / 8), c8 = (job % (kDxCols / 8)) * 8;
      if (tt >= n) continue;
      const float cf = sm.coef[tt], p = sm.pre[tt][(col0 + c8) / d];
      float xv[8], v[8];
      load8(&sm.x[buf][tt * kXLd + c8], xv);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = sm.out[tt * kOLd + c8 + e] - cf * xv[e];
      if (dc) {
        float cv[8];
        load8(&sm.c[buf][tt * kXLd + c8], cv);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] += p * cv[e];
      }
      if (residual) {
        float rv[8];
        load8(&sm.r[buf][tt * kXLd + c8], rv);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] += rv[e];
      }
      store8(dx + (t0 + tt) * hd + col0 + c8, v);
    }
    __syncthreads();
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

// Unlike detail::cptr, an undefined (optional) operand gives nullptr: the backward's gradient
// inputs may be absent.
template <typename T>
const T* cptr(const Tensor& t) {
  return t.defined() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr;
}

// fn [M, HD] as bf16 hi and lo parts (the tensor-core kernels' operands), on the stream.
struct FnSplit {
  Tensor parts;
  const bf16 *hi = nullptr, *lo = nullptr;
};
FnSplit split_fn(const Tensor& fn, int hd, cudaStream_t stream) {
  FnSplit f;
  const int64_t n = int64_t(kM) * hd;
  f.parts = Tensor::empty({2, n}, DType::bf16, fn.device());
  bf16* hi = mptr<bf16>(f.parts);
  split_fn_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(fn.data<float>(), n, hi,
                                                                    hi + n);
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  f.hi = hi;
  f.lo = hi + n;
  return f;
}

template <typename T>
void launch_pre(const Tensor& x, const Tensor& fn, const Tensor& base, const Tensor& scale,
                const ops::MhcOptions& o, ops::MhcPreResult& res, ops::MhcPreSaved& sv,
                cudaStream_t stream) {
  const int64_t n = token_count(x);
  const int d = int(x.size(-1)), hd = kH * d;
  if (n == 0) return;
  const FnSplit fs = split_fn(fn, hd, stream);
  constexpr int mix_bytes = int(sizeof(MixTiles<T>));
  GLMTUNE_CUDA_CHECK(cudaFuncSetAttribute(mhc_mix_kernel<T>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, mix_bytes));
  mhc_mix_kernel<T><<<unsigned((n + kMixTokens - 1) / kMixTokens), kThreads, mix_bytes, stream>>>(
      cptr<T>(x), fs.hi, fs.lo, base.data<float>(), scale.data<float>(), n, hd, float(o.rms_eps),
      float(o.hc_eps), int(o.sinkhorn_iters), sv.mix.data<float>(), sv.rstd.data<float>(),
      sv.pre.data<float>(), res.post.data<float>(), res.comb.data<float>(),
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

namespace {

// mhc_post's operands, checked alike by the forward and the backward: streams [..., H, D], y
// [..., D] in the streams' dtype, post [..., H] and comb [..., H, H] in f32. Returns D.
int check_post_operands(const Tensor& streams, const Tensor& y, const Tensor& post,
                        const Tensor& comb, const char* op) {
  check_streams(streams, op);
  const int d = int(streams.size(-1));
  check_like(y, lead_with(streams, {d}), streams.dtype(), streams, "y", op);
  check_like(post, lead_with(streams, {kH}), DType::f32, streams, "post", op);
  check_like(comb, lead_with(streams, {kH, kH}), DType::f32, streams, "comb", op);
  return d;
}

}  // namespace

Tensor mhc_post(const Tensor& streams, const Tensor& y, const Tensor& post, const Tensor& comb,
                cudaStream_t stream) {
  const char* op = "cuda::mhc_post";
  const int d = check_post_operands(streams, y, post, comb, op);
  const int64_t n = token_count(streams);
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
  const int d = check_post_operands(streams, y, post, comb, op);
  const int64_t n = token_count(streams);
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
                         const Tensor& residual, Tensor& gfn, Tensor& gbase, Tensor& gscale,
                         Tensor& dx, cudaStream_t stream) {
  const int64_t n = token_count(x);
  const int d = int(x.size(-1)), hd = kH * d;
  const Device dev = x.device();
  Tensor dmix_parts = Tensor::empty({n, 2 * kMPad}, DType::bf16, dev);
  Tensor coef = Tensor::empty({n}, DType::f32, dev);
  Tensor rows = Tensor::empty({n, 2 * kM}, DType::f32, dev);
  // One token on 16 lanes; the grid must cover every token (no grid stride).
  const int64_t lanes = n * kH * kH;
  mhc_pre_logit_grads_kernel<T>
      <<<unsigned((lanes + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
          cptr<T>(x), cptr<T>(d_coll), d, cptr<float>(d_post), cptr<float>(d_comb),
          sv.mix.data<float>(), sv.rstd.data<float>(), sv.comb_init.data<float>(),
          base.data<float>(), scale.data<float>(), n, int(o.sinkhorn_iters), float(o.hc_eps),
          mptr<bf16>(dmix_parts), coef.data<float>(), rows.data<float>());
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
      <<<dim3(unsigned(hd / kFnCols), unsigned(nblk)), kFnThreads, 0, stream>>>(
          cptr<T>(x), cptr<bf16>(dmix_parts), n, hd, per, partial.data<float>());
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  sum_blocks_kernel<<<blocks_for(int64_t(kM) * hd, kThreads), kThreads, 0, stream>>>(
      partial.data<float>(), nblk, int64_t(kM) * hd, gfn.data<float>());
  GLMTUNE_CUDA_CHECK(cudaGetLastError());

  const FnSplit fs = split_fn(fn, hd, stream);
  // Column tiles a block walks: as many of kDxTileRun as divide the row's tiles.
  const int row_tiles = hd / kDxCols;
  int tiles = kDxTileRun;
  while (row_tiles % tiles != 0) tiles /= 2;
  constexpr int dx_bytes = int(sizeof(DxTiles<T>));
  GLMTUNE_CUDA_CHECK(cudaFuncSetAttribute(mhc_pre_dx_kernel<T>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, dx_bytes));
  mhc_pre_dx_kernel<T>
      <<<dim3(unsigned(row_tiles / tiles), unsigned((n + kDxTokens - 1) / kDxTokens)), kThreads,
         dx_bytes, stream>>>(cptr<T>(x), cptr<T>(d_coll), fs.hi, fs.lo, cptr<bf16>(dmix_parts),
                             coef.data<float>(), sv.pre.data<float>(), cptr<T>(residual), n, d,
                             tiles, mptr<T>(dx));
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

Tensor mhc_pre_backward(const Tensor& streams, const Tensor& fn, const Tensor& base,
                        const Tensor& scale, const ops::MhcOptions& options,
                        const ops::MhcPreSaved* saved, const Tensor& d_post, const Tensor& d_comb,
                        const Tensor& d_collapsed, ops::MhcGrads& grads, const Tensor& residual,
                        cudaStream_t stream) {
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
  if (residual.defined())
    check_like(residual, streams.shape(), streams.dtype(), streams, "residual", op);
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
  // One kernel pass yields all three parameter gradients: a frozen parameter's goes to a scratch
  // buffer of this call (the mixing parameters are small) and never reaches the caller's slot.
  Tensor scratch_fn, scratch_base, scratch_scale;
  Tensor& gfn = grad_buffer(fn.frozen() ? scratch_fn : grads.fn, fn, "fn gradient", op);
  Tensor& gbase = grad_buffer(base.frozen() ? scratch_base : grads.base, base, "base gradient", op);
  Tensor& gscale =
      grad_buffer(scale.frozen() ? scratch_scale : grads.scale, scale, "scale gradient", op);
  Tensor dx = Tensor::empty(streams.shape(), streams.dtype(), streams.device());
  if (token_count(streams) == 0) return dx;
  if (streams.dtype() == DType::bf16)
    launch_pre_backward<bf16>(streams, fn, options, *saved, base, scale, d_post, d_comb,
                              d_collapsed, residual, gfn, gbase, gscale, dx, stream);
  else
    launch_pre_backward<float>(streams, fn, options, *saved, base, scale, d_post, d_comb,
                               d_collapsed, residual, gfn, gbase, gscale, dx, stream);
  return dx;
}

}  // namespace glmtune::cuda
