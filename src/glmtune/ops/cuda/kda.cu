// KDA's per-token kernels on the GPU (ops/cuda/kda.h): the short causal conv, the forget gate,
// beta, the q/k L2 norm and the gated output norm, forward and backward.

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/kda.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;
using detail::cptr;
using detail::mptr;
using detail::sum_blocks_kernel;

constexpr int kThreads = 256;
constexpr int kMaxTaps = 8;
constexpr int kTokenBlocks = 128;   // fixed token blocks of the parameter-gradient sums
constexpr int kMaxRow = 256;        // longest row of the per-row norms
constexpr int kGatedBlocks = 1024;  // most blocks (weight-gradient partials) of the gated norm

using detail::from_f;
using detail::to_f;
__device__ __forceinline__ float sigmoid_f(float v) { return 1.0f / (1.0f + expf(-v)); }
// The conv's SiLU, where the exact exponential and division would be most of a token's
// instructions: the hardware exponential and reciprocal (a few ulp, under every bar of the f32
// mode).
__device__ __forceinline__ float silu_sigmoid(float v) {
  return __fdividef(1.0f, 1.0f + __expf(-v));
}

// The document holding token t (cu sorted, cu[0] = 0): its start is cu[doc], its end cu[doc + 1].
__device__ __forceinline__ int doc_of(const int* cu, int ndoc, int64_t t) {
  int lo = 0, hi = ndoc;  // invariant: cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (cu[mid] <= t)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// ---- conv -------------------------------------------------------------------------------------
//
// A thread owns V adjacent channels over a run of kConvRun tokens, adjacent threads taking
// adjacent channels so that a warp reads whole rows. It loads every input of its run (and the
// Kc − 1 tokens before it, and in the backward the Kc − 1 after it) before it uses the first:
// kConvRun + Kc − 1 accesses in flight per thread, where loading each token on reaching it would
// wait a memory latency per token. Taps that would reach before a document's start read zero; the
// backward lets no gradient cross a document's end.

constexpr int kConvRun = 16;  // tokens per thread
// Blocks of 128 threads: two or more fit an SM beside the registers that hold a run's inputs, so
// one block's loads are in flight while another computes.
constexpr int kConvFwdThreads = 128;
constexpr int kConvGroups = 32, kConvRuns = 4;          // backward block: channel groups × runs
constexpr int kConvBlockTokens = kConvRuns * kConvRun;  // tokens per weight-gradient partial

// V channels of T in one register access.
template <typename T, int V>
using ConvRaw = typename detail::RawAccess<int(V * sizeof(T))>::type;

template <typename T, int V>
__device__ __forceinline__ void unpack(const ConvRaw<T, V>& raw, float (&out)[V]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_f(e[i]);
}

// raw[j] = the thread's channels of token first + j, for tokens in [0, limit); zero elsewhere.
template <typename T, int V, int N>
__device__ __forceinline__ void load_run(const T* x, int64_t c, int64_t c0, int64_t first,
                                         int64_t limit, ConvRaw<T, V> (&raw)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int64_t s = first + j;
    raw[j] = s >= 0 && s < limit ? *reinterpret_cast<const ConvRaw<T, V>*>(x + s * c + c0)
                                 : ConvRaw<T, V>{};
  }
}

template <int V, int KC>
__device__ __forceinline__ void clear(float (&a)[KC][V]) {
#pragma unroll
  for (int j = 0; j < KC; ++j)
#pragma unroll
    for (int i = 0; i < V; ++i) a[j][i] = 0.0f;
}

// The kernels run KC = 4 or 8 taps: a weight of kc ≤ KC taps is aligned to the last ones (the
// current token's) and the KC − kc before it are zero, which adds zeros ahead of the same sums in
// the same order.
template <typename T, int V, int KC>
__device__ __forceinline__ void load_taps(const T* weight, int64_t c0, int kc, float (&w)[KC][V]) {
#pragma unroll
  for (int i = 0; i < V; ++i)
#pragma unroll
    for (int tau = 0; tau < KC; ++tau)
      w[tau][i] = tau >= KC - kc ? to_f(weight[(c0 + i) * kc + tau - (KC - kc)]) : 0.0f;
}

// The taps' inputs at token t: tap τ reads x[t − (Kc − 1) + τ], which is `cur` for the last tap
// and win[Kc − 2 − τ] (x[t − 1 − j] kept as win[j]) before it.
template <int V, int KC>
__device__ __forceinline__ const float* tap_input(const float (&win)[KC][V], const float (&cur)[V],
                                                  int tau) {
  return tau == KC - 1 ? cur : win[KC - 2 - tau];
}

// Shifts the window by one token: win[j] ← win[j − 1], win[0] ← cur.
template <int V, int KC>
__device__ __forceinline__ void push_window(float (&win)[KC][V], const float (&cur)[V]) {
#pragma unroll
  for (int j = KC - 2; j > 0; --j)
#pragma unroll
    for (int i = 0; i < V; ++i) win[j][i] = win[j - 1][i];
  if constexpr (KC > 1)
#pragma unroll
    for (int i = 0; i < V; ++i) win[0][i] = cur[i];
}

// The window before the run's first token t0, whose inputs start at raw[0] = x[t0 − (Kc − 1)]:
// win[j] = x[t0 − 1 − j], zero before the document's start.
template <typename T, int V, int KC, int N>
__device__ __forceinline__ void first_window(const ConvRaw<T, V> (&raw)[N], int64_t t0,
                                             int64_t start, float (&win)[KC][V]) {
  clear(win);
#pragma unroll
  for (int j = 0; j < KC - 1; ++j)
    if (t0 - 1 - j >= start) unpack<T, V>(raw[KC - 2 - j], win[j]);
}

// The pre-activations at one token, taps summed in order as the CPU op does.
template <int V, int KC>
__device__ __forceinline__ void conv_taps(const float (&w)[KC][V], const float (&win)[KC][V],
                                          const float (&cur)[V], float (&pre)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) pre[i] = 0.0f;
#pragma unroll
  for (int tau = 0; tau < KC; ++tau) {
    const float* in = tap_input<V, KC>(win, cur, tau);
#pragma unroll
    for (int i = 0; i < V; ++i) pre[i] += w[tau][i] * in[i];
  }
}

// kda_qk_conv's L2 norm of B tokens' rows at once: a head's row of kNormLanes · V channels sits
// on kNormLanes adjacent lanes, which every lane of the warp reaches at the same tokens. Each row
// is rounded to T and scaled by 1 / ν, ν = sqrt(Σ c² + eps), summed and scaled as
// l2_fwd_vec_kernel does it, so the result has the bits of the conv followed by that kernel; the B
// rows' shuffles interleave, so that their latencies overlap rather than add up.
template <typename T, int V, int kNormLanes, int B>
__device__ __forceinline__ void normalise_rows(float (&v)[B][V], float eps, float* norm_out,
                                               int64_t norm_stride, int valid) {
  float ss[B];
#pragma unroll
  for (int k = 0; k < B; ++k) {
    ss[k] = 0.0f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      v[k][i] = to_f(from_f<T>(v[k][i]));
      ss[k] += v[k][i] * v[k][i];
    }
  }
#pragma unroll
  for (int o = kNormLanes / 2; o > 0; o >>= 1)
#pragma unroll
    for (int k = 0; k < B; ++k) ss[k] += __shfl_xor_sync(0xffffffffu, ss[k], o);
#pragma unroll
  for (int k = 0; k < B; ++k) {
    const float nu = sqrtf(ss[k] + eps), r = 1.0f / nu;
    if (norm_out && k < valid && threadIdx.x % kNormLanes == 0) norm_out[k * norm_stride] = nu;
#pragma unroll
    for (int i = 0; i < V; ++i) v[k][i] = v[k][i] * r;
  }
}

template <typename T, int V, int KC, int kNormLanes = 0>
__global__ void __launch_bounds__(kConvFwdThreads)
    conv_fwd_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                    const int* __restrict__ cu, int ndoc, int64_t tokens, int64_t c, int kc,
                    bool silu, T* __restrict__ y, float eps = 0.0f,
                    float* __restrict__ norm = nullptr) {
  const int64_t groups = c / V, idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t c0 = (idx % groups) * V, t0 = (idx / groups) * kConvRun;
  if (t0 >= tokens) return;
  const int64_t t1 = t0 + kConvRun < tokens ? t0 + kConvRun : tokens;
  ConvRaw<T, V> raw[KC - 1 + kConvRun];
  load_run<T, V>(x, c, c0, t0 - (KC - 1), t1, raw);
  float w[KC][V], win[KC][V];
  load_taps<T, V, KC>(weight, c0, kc, w);
  int doc = doc_of(cu, ndoc, t0);
  int64_t start = cu[doc], end = cu[doc + 1];
  first_window<T, V, KC>(raw, t0, start, win);
  // Tokens go kBatch at a time: their conv outputs first, then their norms together.
  constexpr int kBatch = kNormLanes > 0 ? 4 : 1;
  static_assert(kConvRun % kBatch == 0);
#pragma unroll
  for (int i0 = 0; i0 < kConvRun; i0 += kBatch) {
    if (t0 + i0 >= t1) break;
    const int valid = int(t1 - (t0 + i0) < kBatch ? t1 - (t0 + i0) : kBatch);
    float out[kBatch][V];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t t = t0 + i0 + k;
      if (k >= valid) {
#pragma unroll
        for (int v = 0; v < V; ++v) out[k][v] = 0.0f;
        continue;
      }
      if (t >= end) {  // a new document (after any empty ones) starts at t
        while (cu[doc + 1] <= t) ++doc;
        start = cu[doc];
        end = cu[doc + 1];
        clear(win);
      }
      float cur[V];
      unpack<T, V>(raw[i0 + k + KC - 1], cur);
      conv_taps<V, KC>(w, win, cur, out[k]);
#pragma unroll
      for (int v = 0; v < V; ++v)
        out[k][v] = silu ? out[k][v] * silu_sigmoid(out[k][v]) : out[k][v];
      push_window<V, KC>(win, cur);
    }
    if constexpr (kNormLanes > 0) {
      const int64_t heads = c / (kNormLanes * V);
      normalise_rows<T, V, kNormLanes, kBatch>(
          out, eps, norm ? norm + (t0 + i0) * heads + c0 / (kNormLanes * V) : nullptr, heads,
          valid);
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (k < valid) detail::store_elems<V>(y + (t0 + i0 + k) * c + c0, out[k]);
  }
}

// dpre[s] = dy[s] · act'(pre[s]); the input gradient dx[t] = Σ_τ w[τ] · dpre[t + Kc − 1 − τ] over
// the outputs inside t's document, built up as the thread walks s forward: dpre[s] adds w[τ] ·
// dpre[s] to token s − (Kc − 1) + τ, so token s − (Kc − 1) is complete after s. pend[j] holds the
// partial gradient of token s − 1 − j. The weight gradient dw[τ] = Σ_s dpre[s] · x[s − (Kc − 1) +
// τ] over the block's tokens, summed over its runs in order into partial[blockIdx.y].
template <typename T, int V, int KC>
__global__ void __launch_bounds__(kConvGroups* kConvRuns)
    conv_bwd_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ dy,
                    const int* __restrict__ cu, int ndoc, int64_t tokens, int64_t c, int kc,
                    bool silu, T* __restrict__ dx, float* __restrict__ dw_partial) {
  constexpr int kSteps = kConvRun + KC - 1;  // the outputs s a run's input gradients reach
  __shared__ float dw_runs[kConvRuns][KC][kConvGroups * V];
  const int gi = threadIdx.x % kConvGroups, ri = threadIdx.x / kConvGroups;
  const int64_t c0 = (int64_t(blockIdx.x) * kConvGroups + gi) * V;
  const int64_t t0 = int64_t(blockIdx.y) * kConvBlockTokens + int64_t(ri) * kConvRun;
  float dw[KC][V];
  clear(dw);
  if (c0 < c && t0 < tokens) {
    const int64_t t1 = t0 + kConvRun < tokens ? t0 + kConvRun : tokens;
    const int64_t s1 = t1 + KC - 1 < tokens ? t1 + KC - 1 : tokens;
    ConvRaw<T, V> xr[KC - 1 + kSteps], gr[kSteps];
    load_run<T, V>(x, c, c0, t0 - (KC - 1), s1, xr);
    load_run<T, V>(dy, c, c0, t0, s1, gr);
    float w[KC][V], win[KC][V], pend[KC][V];
    load_taps<T, V, KC>(weight, c0, kc, w);
    int doc = doc_of(cu, ndoc, t0);
    int64_t start = cu[doc], end = cu[doc + 1];
    first_window<T, V, KC>(xr, t0, start, win);
    clear(pend);
    // Stores the pending gradients of this run's tokens before s (those of the document).
    const auto flush = [&](int64_t s) {
#pragma unroll
      for (int j = 0; j < KC - 1; ++j) {
        const int64_t p = s - 1 - j;
        if (p >= t0 && p < t1 && p >= start) detail::store_elems<V>(dx + p * c + c0, pend[j]);
      }
    };
    bool to_the_end = true;  // the walk reaches s1 (not a document's end past the run)
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int64_t s = t0 + i;
      if (s >= s1) break;
      if (s >= end) {  // the document ends before s: its pending tokens are complete
        flush(s);
        if (s >= t1) {
          to_the_end = false;
          break;
        }
        while (cu[doc + 1] <= s) ++doc;
        start = cu[doc];
        end = cu[doc + 1];
        clear(win);
        clear(pend);
      }
      float cur[V], g[V], dpre[V];
      unpack<T, V>(xr[i + KC - 1], cur);
      unpack<T, V>(gr[i], g);
      conv_taps<V, KC>(w, win, cur, dpre);
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const float p = dpre[v], sg = silu ? silu_sigmoid(p) : 1.0f;
        dpre[v] = silu ? g[v] * sg * (1.0f + p * (1.0f - sg)) : g[v];
      }
      if (s < t1) {
#pragma unroll
        for (int tau = 0; tau < KC; ++tau) {
          const float* in = tap_input<V, KC>(win, cur, tau);
#pragma unroll
          for (int v = 0; v < V; ++v) dw[tau][v] += dpre[v] * in[v];
        }
      }
      // Token s − (Kc − 1) (pend[Kc − 2]) receives its last term and is stored; the others
      // move up one slot, token s starting at w[Kc − 1] · dpre[s].
      float done[V];
#pragma unroll
      for (int v = 0; v < V; ++v)
        done[v] = (KC > 1 ? pend[KC > 1 ? KC - 2 : 0][v] : 0.0f) + w[0][v] * dpre[v];
      const int64_t p = s - (KC - 1);
      if (p >= t0 && p < t1 && p >= start) detail::store_elems<V>(dx + p * c + c0, done);
#pragma unroll
      for (int j = KC - 2; j > 0; --j)
#pragma unroll
        for (int v = 0; v < V; ++v) pend[j][v] = pend[j - 1][v] + w[KC - 1 - j][v] * dpre[v];
      if constexpr (KC > 1)
#pragma unroll
        for (int v = 0; v < V; ++v) pend[0][v] = w[KC - 1][v] * dpre[v];
      push_window<V, KC>(win, cur);
    }
    if (to_the_end) flush(s1);  // the pack (or the run's reach) ends: what is pending is complete
  }
#pragma unroll
  for (int tau = 0; tau < KC; ++tau)
#pragma unroll
    for (int i = 0; i < V; ++i) dw_runs[ri][tau][gi * V + i] = dw[tau][i];
  __syncthreads();
  // One thread per (channel, weight tap) of the block: the runs summed in order.
  for (int e = threadIdx.x; e < kConvGroups * V * kc; e += blockDim.x) {
    const int cl = e / kc, tap = e % kc, tau = tap + (KC - kc);
    const int64_t ch = int64_t(blockIdx.x) * kConvGroups * V + cl;
    if (ch >= c) continue;
    float acc = 0.0f;
    for (int r = 0; r < kConvRuns; ++r) acc += dw_runs[r][tau][cl];
    dw_partial[(int64_t(blockIdx.y) * c + ch) * kc + tap] = acc;
  }
}

// ---- gate and beta ----------------------------------------------------------------------------

template <typename T>
__global__ void gate_fwd_kernel(const T* __restrict__ graw, const float* __restrict__ dt_bias,
                                const float* __restrict__ a_log, int64_t n, int64_t ql, int hl,
                                bool bounded, float lb, float* __restrict__ g) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t ch = i % ql;
    const float rate = expf(a_log[ch / hl]);
    const float z = to_f(graw[i]) + dt_bias[ch];
    g[i] = bounded ? lb * sigmoid_f(rate * z) : -rate * (z > 20.0f ? z : logf(1.0f + expf(z)));
  }
}

// Four adjacent channels per thread (the channel count a multiple of 4, 16-byte aligned rows),
// rows blockIdx.y, + gridDim.y, ...: each channel's rate and bias read once, graw read 4 at a
// time and g written 16 bytes at a time. The same arithmetic as gate_fwd_kernel: the same bits.
template <typename T>
__global__ void gate_fwd_x4_kernel(const T* __restrict__ graw, const float* __restrict__ dt_bias,
                                   const float* __restrict__ a_log, int64_t tokens, int64_t ql,
                                   int hl, bool bounded, float lb, float* __restrict__ g) {
  const int64_t c = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * 4;
  if (c >= ql) return;
  float rate[4], bias[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    rate[j] = expf(a_log[(c + j) / hl]);
    bias[j] = dt_bias[c + j];
  }
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y) {
    float z[4];
    if constexpr (std::is_same_v<T, bf16>) {
      const uint2 raw = *reinterpret_cast<const uint2*>(graw + t * ql + c);
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
      z[0] = lo.x;
      z[1] = lo.y;
      z[2] = hi.x;
      z[3] = hi.y;
    } else {
      detail::load_vec<4>(graw + t * ql + c, z);
    }
    float out[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float x = z[j] + bias[j];
      out[j] =
          bounded ? lb * sigmoid_f(rate[j] * x) : -rate[j] * (x > 20.0f ? x : logf(1.0f + expf(x)));
    }
    detail::store_vec<4>(g + t * ql + c, out);
  }
}

// One channel per thread over a fixed token block: d graw, and the block's sums of dz (dt_bias)
// and of the A_log term.
template <typename T>
__global__ void gate_bwd_kernel(const T* __restrict__ graw, const float* __restrict__ dt_bias,
                                const float* __restrict__ a_log, const float* __restrict__ dg,
                                int64_t tokens, int64_t ql, int hl, bool bounded, float lb,
                                int64_t tokens_per_block, T* __restrict__ dgraw,
                                float* __restrict__ part_dt, float* __restrict__ part_a) {
  const int64_t ch = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (ch >= ql) return;
  const float rate = expf(a_log[ch / hl]), bias = dt_bias[ch];
  const int64_t t0 = int64_t(blockIdx.y) * tokens_per_block;
  const int64_t t1 = t0 + tokens_per_block < tokens ? t0 + tokens_per_block : tokens;
  float acc_dt = 0.0f, acc_a = 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i = t * ql + ch;
    const float z = to_f(graw[i]) + bias, d = dg[i];
    float dz;
    if (bounded) {
      const float s = sigmoid_f(rate * z);
      dz = d * lb * s * (1.0f - s) * rate;
      acc_a += dz * z;
    } else {
      dz = -rate * d * (z > 20.0f ? 1.0f : sigmoid_f(z));
      acc_a += d * (-rate * (z > 20.0f ? z : logf(1.0f + expf(z))));
    }
    acc_dt += dz;
    dgraw[i] = from_f<T>(dz);
  }
  part_dt[int64_t(blockIdx.y) * ql + ch] = acc_dt;
  part_a[int64_t(blockIdx.y) * ql + ch] = acc_a;
}

// d A_log[h] += Σ_a per_channel[h·HL + a], channels in order.
__global__ void head_sums_kernel(const float* __restrict__ per_channel, int nl, int hl,
                                 float* __restrict__ out) {
  const int h = blockIdx.x * blockDim.x + threadIdx.x;
  if (h >= nl) return;
  float acc = 0.0f;
  for (int a = 0; a < hl; ++a) acc += per_channel[int64_t(h) * hl + a];
  out[h] += acc;
}

template <typename T>
__global__ void beta_fwd_kernel(const T* __restrict__ logits, int64_t n, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = sigmoid_f(to_f(logits[i]));
}

__global__ void beta_bwd_kernel(const float* __restrict__ beta, const float* __restrict__ dbeta,
                                int64_t n, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = dbeta[i] * beta[i] * (1.0f - beta[i]);
}

// ---- per-row norms: one warp per row ----------------------------------------------------------

// Σ x² of one row, summed by its warp: lane-strided partial sums, then the butterfly, so every
// lane holds the same total. The forward and backward kernels recompute it alike.
template <typename T>
__device__ __forceinline__ float warp_row_sum_squares(const T* __restrict__ xr, int n, int lane) {
  float ss = 0.0f;
  for (int j = lane; j < n; j += 32) ss += to_f(xr[j]) * to_f(xr[j]);
  return detail::warp_sum(ss);
}

template <typename T>
__global__ void l2_fwd_kernel(const T* __restrict__ x, int64_t rows, int n, float eps,
                              T* __restrict__ y, float* __restrict__ norm) {
  const int64_t row = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* xr = x + row * n;
  const float ss = warp_row_sum_squares(xr, n, lane);
  const float nu = sqrtf(ss + eps), r = 1.0f / nu;
  if (norm && lane == 0) norm[row] = nu;
  for (int j = lane; j < n; j += 32) y[row * n + j] = from_f<T>(to_f(xr[j]) * r);
}

// Rows of kLanes 16-byte pieces (the 128-wide KDA heads: 16 lanes of eight bf16, or 32 of four
// f32): a row on kLanes adjacent lanes, its sum by shuffles among them. Every lane of a warp takes
// part in the shuffles; lanes past the last row hold zeros.
// Sum of v over the kLanes adjacent lanes of a row (a butterfly: the same bits in each lane).
template <int kLanes>
__device__ __forceinline__ float row_lanes_sum(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ν = sqrt(Σ x² + eps) of the row of which this lane holds kVec elements.
template <int kLanes, int kVec>
__device__ __forceinline__ float row_norm(const float (&v)[kVec], float eps) {
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kVec; ++j) ss += v[j] * v[j];
  return sqrtf(row_lanes_sum<kLanes>(ss) + eps);
}

template <typename T, int kLanes>
__global__ void l2_fwd_vec_kernel(const T* __restrict__ x, int64_t rows, float eps,
                                  T* __restrict__ y, float* __restrict__ norm) {
  constexpr int kVec = 16 / sizeof(T), kN = kLanes * kVec;
  const int64_t gid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, row = gid / kLanes;
  const int64_t off = row * kN + (gid % kLanes) * kVec;
  const bool valid = row < rows;
  float v[kVec] = {};
  if (valid) detail::load_vec<kVec>(x + off, v);
  const float nu = row_norm<kLanes>(v, eps), r = 1.0f / nu;
  if (!valid) return;
  if (norm && gid % kLanes == 0) norm[row] = nu;
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = v[j] * r;
  detail::store_vec<kVec>(y + off, v);
}

// dx = (dy − y·⟨y, dy⟩) / ν with y = x / ν.
template <typename T>
__global__ void l2_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, int64_t rows,
                              int n, float eps, T* __restrict__ dx) {
  const int64_t row = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* xr = x + row * n;
  const T* gr = dy + row * n;
  const float nu = sqrtf(warp_row_sum_squares(xr, n, lane) + eps);
  float dot = 0.0f;
  for (int j = lane; j < n; j += 32) dot += (to_f(xr[j]) / nu) * to_f(gr[j]);
  dot = detail::warp_sum(dot);
  for (int j = lane; j < n; j += 32)
    dx[row * n + j] = from_f<T>((to_f(gr[j]) - (to_f(xr[j]) / nu) * dot) / nu);
}

// l2_bwd_kernel on rows of kLanes 16-byte pieces, as l2_fwd_vec_kernel.
template <typename T, int kLanes>
__global__ void l2_bwd_vec_kernel(const T* __restrict__ dy, const T* __restrict__ x, int64_t rows,
                                  float eps, T* __restrict__ dx) {
  constexpr int kVec = 16 / sizeof(T), kN = kLanes * kVec;
  const int64_t gid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, row = gid / kLanes;
  const int64_t off = row * kN + (gid % kLanes) * kVec;
  const bool valid = row < rows;
  float xv[kVec] = {}, gv[kVec] = {};
  if (valid) {
    detail::load_vec<kVec>(x + off, xv);
    detail::load_vec<kVec>(dy + off, gv);
  }
  const float nu = row_norm<kLanes>(xv, eps);
  float dot = 0.0f;
#pragma unroll
  for (int j = 0; j < kVec; ++j) dot += (xv[j] / nu) * gv[j];
  dot = row_lanes_sum<kLanes>(dot);
  if (!valid) return;
#pragma unroll
  for (int j = 0; j < kVec; ++j) gv[j] = (gv[j] - (xv[j] / nu) * dot) / nu;
  detail::store_vec<kVec>(dx + off, gv);
}

// The gated o_norm: one warp per row of n ≤ 32·P elements, lane ℓ holding [ℓ·P, ℓ·P + P) in
// registers, so that each row is read once. kWide: n = 32·P and P-wide accesses (aligned);
// otherwise element by element, past n reading zero.
template <typename T, int P, bool kWide>
__device__ __forceinline__ void load_lane(const T* row, int n, int lane, float (&v)[P]) {
  if constexpr (kWide) {
    detail::load_elems<P>(row + lane * P, v);
  } else {
#pragma unroll
    for (int i = 0; i < P; ++i) v[i] = lane * P + i < n ? to_f(row[lane * P + i]) : 0.0f;
  }
}

template <typename T, int P, bool kWide>
__device__ __forceinline__ void store_lane(T* row, int n, int lane, const float (&v)[P]) {
  if constexpr (kWide) {
    detail::store_elems<P>(row + lane * P, v);
  } else {
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (lane * P + i < n) row[lane * P + i] = from_f<T>(v[i]);
  }
}

template <int P>
__device__ __forceinline__ float lane_rstd(const float (&xv)[P], int n, float eps) {
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < P; ++i) ss += xv[i] * xv[i];
  return 1.0f / sqrtf(detail::warp_sum(ss) / float(n) + eps);
}

template <typename T, int P, bool kWide>
__global__ void __launch_bounds__(kThreads)
    gated_fwd_kernel(const T* __restrict__ x, const float* __restrict__ w, const T* __restrict__ z,
                     int64_t rows, int n, float eps, T* __restrict__ y) {
  const int64_t row = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  float xv[P], zv[P];
  load_lane<T, P, kWide>(x + row * n, n, lane, xv);
  load_lane<T, P, kWide>(z + row * n, n, lane, zv);
  const float r = lane_rstd(xv, n, eps);
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const float wj = lane * P + i < n ? w[lane * P + i] : 0.0f;
    xv[i] = wj * (xv[i] * r) * sigmoid_f(zv[i]);
  }
  store_lane<T, P, kWide>(y + row * n, n, lane, xv);
}

// Rows [blockIdx.x · rows_per_block, ...), warp v taking every 8th row; each lane sums its
// columns' weight gradient over its rows, and the block sums its warps in order into
// partial[blockIdx.x].
template <typename T, int P, bool kWide>
__global__ void __launch_bounds__(kThreads)
    gated_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ w,
                     const T* __restrict__ z, int64_t rows, int n, float eps,
                     int64_t rows_per_block, T* __restrict__ dx, T* __restrict__ dz,
                     float* __restrict__ dw_partial) {
  __shared__ float dw_warp[kThreads / 32][32 * P];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float wv[P], dw[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    wv[i] = lane * P + i < n ? w[lane * P + i] : 0.0f;
    dw[i] = 0.0f;
  }
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
  for (int64_t row = r0 + warp; row < r1; row += kThreads / 32) {
    float xv[P], gv[P], zv[P];
    load_lane<T, P, kWide>(x + row * n, n, lane, xv);
    load_lane<T, P, kWide>(dy + row * n, n, lane, gv);
    load_lane<T, P, kWide>(z + row * n, n, lane, zv);
    const float r = lane_rstd(xv, n, eps);
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      zv[i] = sigmoid_f(zv[i]);
      dot += gv[i] * zv[i] * wv[i] * xv[i];
      dw[i] += gv[i] * (xv[i] * r) * zv[i];
    }
    const float c = detail::warp_sum(dot) * r * r * r / float(n);
    float dxv[P], dzv[P];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const float s = zv[i];
      dxv[i] = r * (gv[i] * s * wv[i]) - c * xv[i];
      dzv[i] = gv[i] * wv[i] * (xv[i] * r) * s * (1.0f - s);
    }
    store_lane<T, P, kWide>(dx + row * n, n, lane, dxv);
    store_lane<T, P, kWide>(dz + row * n, n, lane, dzv);
  }
#pragma unroll
  for (int i = 0; i < P; ++i) dw_warp[warp][lane * P + i] = dw[i];
  __syncthreads();
  for (int j = threadIdx.x; j < n; j += kThreads) {
    float acc = 0.0f;
    for (int v = 0; v < kThreads / 32; ++v) acc += dw_warp[v][j];
    dw_partial[int64_t(blockIdx.x) * n + j] = acc;
  }
}

// ---- host side --------------------------------------------------------------------------------

bool float_act(const Tensor& t) {
  return t.defined() && t.device().is_cuda() && t.is_contiguous() &&
         (t.dtype() == DType::bf16 || t.dtype() == DType::f32);
}

void require_act(const Tensor& t, const char* what, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(float_act(t), std::string(op) + ": " + what + " " + detail::describe(t) +
                                            " must be a contiguous bf16/f32 CUDA tensor");
}

void require_same(const Tensor& t, const Tensor& like, DType dtype, const char* what,
                  const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(t.defined() && t.dtype() == dtype && t.shape() == like.shape() &&
                              t.is_contiguous() && t.device() == like.device(),
                          std::string(op) + ": " + what + " " + detail::describe(t) +
                              " must be contiguous, shaped like " + like.str());
}

void require_vec(const Tensor& t, int64_t n, const Tensor& like, const char* what, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(t.defined() && t.dtype() == DType::f32 && t.numel() == n &&
                              t.is_contiguous() && t.device() == like.device(),
                          std::string(op) + ": " + what + " " + detail::describe(t) +
                              " must be a contiguous f32 CUDA tensor of " + std::to_string(n) +
                              " values");
}

void require_cu(const Tensor& cu, const Tensor& x, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(cu.defined() && cu.dtype() == DType::i32 && cu.dim() == 1 &&
                              cu.size(0) >= 2 && cu.is_contiguous() && cu.device() == x.device(),
                          std::string(op) + ": cu_seqlens " + detail::describe(cu) +
                              " must be an int32 CUDA tensor [ndoc + 1]");
}

// The gate's operands, checked alike by the forward and the backward: graw [T, NL·HL] with
// dt_bias [NL·HL] and A_log [NL].
struct GateDims {
  int64_t t, ql, nl, hl;
};
GateDims gate_dims(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log, const char* op) {
  require_act(graw, "graw", op);
  GLMTUNE_CUDA_OP_REQUIRE(
      graw.dim() == 2 && A_log.defined() && A_log.numel() >= 1 && graw.size(1) % A_log.numel() == 0,
      std::string(op) + ": graw must be [T, NL·HL]");
  const int64_t t = graw.size(0), ql = graw.size(1), nl = A_log.numel();
  require_vec(dt_bias, ql, graw, "dt_bias", op);
  require_vec(A_log, nl, graw, "A_log", op);
  return {t, ql, nl, ql / nl};
}

// The conv's operands, checked alike by the forward and the backward in this order: x [T, C],
// dy like x (backward only), the depthwise weight [C, Kc] (contiguous, x's dtype, at most
// kMaxTaps taps: the kernels keep them in registers) and cu_seqlens.
struct ConvDims {
  int kc, ndoc;
};
ConvDims conv_dims(const Tensor& x, const Tensor* dy, const Tensor& weight,
                   const Tensor& cu_seqlens, const char* op) {
  require_act(x, "x", op);
  GLMTUNE_CUDA_OP_REQUIRE(x.dim() == 2, std::string(op) + ": x must be [T, C]");
  if (dy) require_same(*dy, x, x.dtype(), "dy", op);
  const int64_t c = x.size(1);
  GLMTUNE_CUDA_OP_REQUIRE(weight.defined() && weight.dtype() == x.dtype() &&
                              weight.is_contiguous() && weight.device() == x.device() &&
                              weight.size(0) == c && weight.numel() % c == 0 &&
                              weight.numel() / c <= kMaxTaps,
                          std::string(op) + ": weight " + detail::describe(weight) +
                              " must be contiguous [C, Kc] in x's dtype, Kc <= 8");
  require_cu(cu_seqlens, x, op);
  return {int(weight.numel() / c), int(cu_seqlens.size(0) - 1)};
}

Tensor& grad_buffer(Tensor* slot, const Tensor& param, const char* what, const char* op) {
  if (!slot->defined()) *slot = Tensor::zeros(param.shape(), DType::f32, param.device());
  require_same(*slot, param, DType::f32, what, op);
  return *slot;
}

int grid_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return int(b < 8192 ? (b > 0 ? b : 1) : 8192);
}

// Calls f(tag) with a value of the activation type of `t`.
template <typename F>
void by_dtype(const Tensor& t, F&& f) {
  if (t.dtype() == DType::bf16)
    f(bf16());
  else
    f(float());
}

int64_t per_block(int64_t tokens) { return (tokens + kTokenBlocks - 1) / kTokenBlocks; }

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Calls f with the lanes per row (8, 16 or 32, as a constant) of the 16-byte-piece row kernels
// when a row of n elements of T is that many 16-byte pieces and every pointer is 16-byte aligned;
// returns whether it did.
template <typename T, typename F>
bool with_row_lanes(int64_t n, std::initializer_list<const void*> ptrs, F&& f) {
  constexpr int64_t kVec = 16 / sizeof(T);
  for (const void* p : ptrs)
    if (!aligned(p, 16)) return false;
  if (n == 8 * kVec)
    f(std::integral_constant<int, 8>{});
  else if (n == 16 * kVec)
    f(std::integral_constant<int, 16>{});
  else if (n == 32 * kVec)
    f(std::integral_constant<int, 32>{});
  else
    return false;
  return true;
}

// Calls f(V, KC) with the conv's channels per thread V (BYTES / sizeof(T) when the channels
// divide into such groups and every pointer is BYTES-aligned, else 1) and the kernels' taps KC (4
// for kc ≤ 4, else 8; load_taps), both as constants.
template <typename T, int BYTES, typename F>
void with_conv_shape(int64_t c, int kc, std::initializer_list<const void*> ptrs, F&& f) {
  constexpr int kWide = BYTES / int(sizeof(T));
  bool wide = c % kWide == 0;
  for (const void* p : ptrs) wide = wide && aligned(p, BYTES);
  const auto with_taps = [&](auto v) {
    if (kc <= 4)
      f(v, std::integral_constant<int, 4>{});
    else
      f(v, std::integral_constant<int, kMaxTaps>{});
  };
  if (wide)
    with_taps(std::integral_constant<int, kWide>{});
  else
    with_taps(std::integral_constant<int, 1>{});
}

// Calls f(P, wide) for the gated norm's rows of n ≤ 256 elements: P = the elements per lane
// (1, 2, 4 or 8) and wide = rows of exactly 32·P elements with every pointer aligned to a lane's
// P elements, both as constants.
template <typename T, typename F>
void with_lane_elems(int64_t n, std::initializer_list<const void*> ptrs, F&& f) {
  const auto with_wide = [&](auto p) {
    constexpr int P = decltype(p)::value;
    constexpr int kWidth = detail::access_width(int(P * sizeof(T)));
    bool wide = n == 32 * P;
    for (const void* q : ptrs) wide = wide && aligned(q, kWidth);
    if (wide)
      f(p, std::true_type{});
    else
      f(p, std::false_type{});
  };
  if (n <= 32)
    with_wide(std::integral_constant<int, 1>{});
  else if (n <= 64)
    with_wide(std::integral_constant<int, 2>{});
  else if (n <= 128)
    with_wide(std::integral_constant<int, 4>{});
  else
    with_wide(std::integral_constant<int, 8>{});
}

Tensor conv_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                     const ConvDims& dims, bool silu, const Tensor& dy, Tensor* grad_weight,
                     cudaStream_t stream, const char* op) {
  const int64_t t = x.size(0), c = x.size(1);
  const int kc = dims.kc, ndoc = dims.ndoc;
  detail::DeviceGuard guard(x.device().index);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (t == 0 || c == 0) return dx;
  const int64_t blocks = (t + kConvBlockTokens - 1) / kConvBlockTokens;
  Tensor partial = Tensor::empty({blocks, c, kc}, DType::f32, x.device());
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    // 8-byte accesses: half the registers of 16-byte ones for the inputs the backward keeps.
    with_conv_shape<T, 8>(
        c, kc, {x.data_ptr(), dy.data_ptr(), dx.data_ptr()}, [&](auto v, auto taps) {
          constexpr int V = decltype(v)::value, KC = decltype(taps)::value;
          const int64_t groups = c / V;
          const dim3 grid(unsigned((groups + kConvGroups - 1) / kConvGroups), unsigned(blocks));
          conv_bwd_kernel<T, V, KC><<<grid, kConvGroups * kConvRuns, 0, stream>>>(
              cptr<T>(x), cptr<T>(weight), cptr<T>(dy), cu_seqlens.data<int32_t>(), ndoc, t, c, kc,
              silu, mptr<T>(dx), partial.data<float>());
        });
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  if (grad_weight) {
    Tensor& gw = grad_buffer(grad_weight, weight, "conv weight gradient", op);
    sum_blocks_kernel<<<unsigned((c * kc + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        partial.data<float>(), blocks, c * kc, gw.data<float>());
    GLMTUNE_CUDA_CHECK(cudaGetLastError());
  }
  return dx;
}

}  // namespace

Tensor causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens, bool silu,
                     cudaStream_t stream) {
  const char* op = "cuda::causal_conv1d";
  const ConvDims dims = conv_dims(x, nullptr, weight, cu_seqlens, op);
  const int64_t t = x.size(0), c = x.size(1);
  const int kc = dims.kc, ndoc = dims.ndoc;
  detail::DeviceGuard guard(x.device().index);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (t == 0 || c == 0) return y;
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    with_conv_shape<T, 16>(c, kc, {x.data_ptr(), y.data_ptr()}, [&](auto v, auto taps) {
      constexpr int V = decltype(v)::value, KC = decltype(taps)::value;
      const int64_t threads = (c / V) * ((t + kConvRun - 1) / kConvRun);
      conv_fwd_kernel<T, V, KC><<<unsigned((threads + kConvFwdThreads - 1) / kConvFwdThreads),
                                  kConvFwdThreads, 0, stream>>>(cptr<T>(x), cptr<T>(weight),
                                                                cu_seqlens.data<int32_t>(), ndoc, t,
                                                                c, kc, silu, mptr<T>(y));
    });
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  return y;
}

Tensor causal_conv1d_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                              bool silu, const Tensor& dy, Tensor* grad_weight,
                              cudaStream_t stream) {
  const char* op = "cuda::causal_conv1d_backward";
  return conv_backward(x, weight, cu_seqlens, conv_dims(x, &dy, weight, cu_seqlens, op), silu, dy,
                       grad_weight, stream, op);
}

Tensor kda_qk_conv(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                   int64_t head_dim, double eps, Tensor* norm, cudaStream_t stream) {
  const char* op = "cuda::kda_qk_conv";
  const ConvDims dims = conv_dims(x, nullptr, weight, cu_seqlens, op);
  const int64_t t = x.size(0), c = x.size(1);
  GLMTUNE_CUDA_OP_REQUIRE(head_dim >= 1 && c % head_dim == 0,
                          std::string(op) + ": " + std::to_string(c) +
                              " channels are not a multiple of head_dim " +
                              std::to_string(head_dim));
  const int64_t heads = c / head_dim;
  detail::DeviceGuard guard(x.device().index);
  Tensor y = Tensor::empty({t, heads, head_dim}, x.dtype(), x.device());
  Tensor nu = Tensor::empty({t, heads}, DType::f32, x.device());
  bool fused = t == 0;
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / int(sizeof(T));
    // Every lane of a warp at the same token (whole warps of channel groups), a head on 8, 16 or
    // 32 of them.
    if (fused || c % (32 * kVec) != 0) return;
    with_row_lanes<T>(head_dim, {x.data_ptr(), y.data_ptr()}, [&](auto lanes) {
      constexpr int L = decltype(lanes)::value;
      with_conv_shape<T, 16>(c, dims.kc, {x.data_ptr(), y.data_ptr()}, [&](auto v, auto taps) {
        constexpr int V = decltype(v)::value, KC = decltype(taps)::value;
        if constexpr (V == kVec) {
          const int64_t threads = (c / V) * ((t + kConvRun - 1) / kConvRun);
          conv_fwd_kernel<T, V, KC, L>
              <<<unsigned((threads + kConvFwdThreads - 1) / kConvFwdThreads), kConvFwdThreads, 0,
                 stream>>>(cptr<T>(x), cptr<T>(weight), cu_seqlens.data<int32_t>(), dims.ndoc, t, c,
                           dims.kc, true, mptr<T>(y), float(eps), nu.data<float>());
          fused = true;
        }
      });
    });
  });
  if (!fused) {  // other widths and alignments: the conv, then the norm (the same bits)
    y = l2_norm(causal_conv1d(x, weight, cu_seqlens, true, stream).view({t, heads, head_dim}), eps,
                &nu, stream);
  }
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  if (norm) *norm = nu;
  return y;
}

Tensor kda_qk_conv_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                            int64_t head_dim, double eps, const Tensor& norm, const Tensor& dy,
                            Tensor* grad_weight, cudaStream_t stream) {
  const char* op = "cuda::kda_qk_conv_backward";
  const int64_t t = x.defined() && x.dim() == 2 ? x.size(0) : 0;
  const int64_t c = x.defined() && x.dim() == 2 ? x.size(1) : 0;
  GLMTUNE_CUDA_OP_REQUIRE(head_dim >= 1 && c % head_dim == 0,
                          std::string(op) + ": " + std::to_string(c) +
                              " channels are not a multiple of head_dim " +
                              std::to_string(head_dim));
  const Tensor d_rows = dy.defined() && dy.numel() == x.numel() ? dy.reshape({t, c}) : dy;
  conv_dims(x, &d_rows, weight, cu_seqlens, op);
  const int64_t heads = c / head_dim;
  GLMTUNE_CUDA_OP_REQUIRE(norm.defined() && norm.dtype() == DType::f32 &&
                              norm.numel() == t * heads && norm.is_contiguous() &&
                              norm.device() == x.device(),
                          std::string(op) + ": norm " + detail::describe(norm) +
                              " must be kda_qk_conv's f32 [T, C / head_dim]");
  // The conv output under the norm is recomputed (ν with it), then the norm's backward and the
  // conv's run in turn: one kernel that did all three, its row sums on shuffles of one warp, took
  // 1.3 times as long as the three kernels together (docs/PERF.md).
  const Shape rows{t, heads, head_dim};
  const Tensor conv_out = causal_conv1d(x, weight, cu_seqlens, true, stream);
  const Tensor dc = l2_norm_backward(d_rows.view(rows), conv_out.view(rows), eps, stream);
  return causal_conv1d_backward(x, weight, cu_seqlens, true, dc.view({t, c}), grad_weight, stream);
}

Tensor kda_gate(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                std::optional<double> lower_bound, cudaStream_t stream) {
  const char* op = "cuda::kda_gate";
  const GateDims dims = gate_dims(graw, dt_bias, A_log, op);
  const int64_t t = dims.t, ql = dims.ql, nl = dims.nl, hl = dims.hl;
  detail::DeviceGuard guard(graw.device().index);
  Tensor g = Tensor::empty({t, nl, hl}, DType::f32, graw.device());
  if (t == 0) return g;
  const bool bounded = lower_bound.has_value();
  const float lb = float(lower_bound.value_or(0.0));
  by_dtype(graw, [&](auto tag) {
    using T = decltype(tag);
    if (ql % 4 == 0 && aligned(graw.data_ptr(), 4 * sizeof(T))) {
      // Enough row blocks for about eight blocks per SM on the largest GPUs.
      const unsigned cols = unsigned((ql / 4 + kThreads - 1) / kThreads);
      const unsigned row_blocks = unsigned(std::min<int64_t>(t, std::max(1u, 1056u / cols)));
      gate_fwd_x4_kernel<T><<<dim3(cols, row_blocks), kThreads, 0, stream>>>(
          cptr<T>(graw), dt_bias.data<float>(), A_log.data<float>(), t, ql, int(hl), bounded, lb,
          g.data<float>());
    } else {
      gate_fwd_kernel<T><<<grid_for(t * ql), kThreads, 0, stream>>>(
          cptr<T>(graw), dt_bias.data<float>(), A_log.data<float>(), t * ql, ql, int(hl), bounded,
          lb, g.data<float>());
    }
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  return g;
}

Tensor kda_gate_backward(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                         std::optional<double> lower_bound, const Tensor& dg, Tensor* grad_dt_bias,
                         Tensor* grad_A_log, cudaStream_t stream) {
  const char* op = "cuda::kda_gate_backward";
  const GateDims dims = gate_dims(graw, dt_bias, A_log, op);
  const int64_t t = dims.t, ql = dims.ql, nl = dims.nl, hl = dims.hl;
  require_vec(dg, t * ql, graw, "dg", op);
  detail::DeviceGuard guard(graw.device().index);
  Tensor dgraw = Tensor::empty(graw.shape(), graw.dtype(), graw.device());
  if (t == 0) return dgraw;
  const int64_t per = per_block(t), blocks = (t + per - 1) / per;
  Tensor part_dt = Tensor::empty({blocks, ql}, DType::f32, graw.device());
  Tensor part_a = Tensor::empty({blocks, ql}, DType::f32, graw.device());
  const dim3 grid(unsigned((ql + kThreads - 1) / kThreads), unsigned(blocks));
  by_dtype(graw, [&](auto tag) {
    using T = decltype(tag);
    gate_bwd_kernel<T><<<grid, kThreads, 0, stream>>>(
        cptr<T>(graw), dt_bias.data<float>(), A_log.data<float>(), dg.data<float>(), t, ql, int(hl),
        lower_bound.has_value(), float(lower_bound.value_or(0.0)), per, mptr<T>(dgraw),
        part_dt.data<float>(), part_a.data<float>());
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  const unsigned cgrid = unsigned((ql + kThreads - 1) / kThreads);
  if (grad_dt_bias) {
    Tensor& gdt = grad_buffer(grad_dt_bias, dt_bias, "dt_bias gradient", op);
    sum_blocks_kernel<<<cgrid, kThreads, 0, stream>>>(part_dt.data<float>(), blocks, ql,
                                                      gdt.data<float>());
  }
  if (grad_A_log) {
    Tensor& ga = grad_buffer(grad_A_log, A_log, "A_log gradient", op);
    Tensor per_channel = Tensor::zeros({ql}, DType::f32, graw.device());
    sum_blocks_kernel<<<cgrid, kThreads, 0, stream>>>(part_a.data<float>(), blocks, ql,
                                                      per_channel.data<float>());
    head_sums_kernel<<<unsigned((nl + 63) / 64), 64, 0, stream>>>(
        per_channel.data<float>(), int(nl), int(hl), ga.data<float>());
  }
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  return dgraw;
}

Tensor kda_beta(const Tensor& logits, cudaStream_t stream) {
  require_act(logits, "logits", "cuda::kda_beta");
  detail::DeviceGuard guard(logits.device().index);
  Tensor out = Tensor::empty(logits.shape(), DType::f32, logits.device());
  if (logits.numel() == 0) return out;
  by_dtype(logits, [&](auto tag) {
    using T = decltype(tag);
    beta_fwd_kernel<T><<<grid_for(logits.numel()), kThreads, 0, stream>>>(
        cptr<T>(logits), logits.numel(), out.data<float>());
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  return out;
}

Tensor kda_beta_backward(const Tensor& beta, const Tensor& d_beta, cudaStream_t stream) {
  const char* op = "cuda::kda_beta_backward";
  GLMTUNE_CUDA_OP_REQUIRE(beta.defined() && beta.dtype() == DType::f32 && beta.is_contiguous() &&
                              beta.device().is_cuda(),
                          std::string(op) + ": beta must be a contiguous f32 CUDA tensor");
  require_same(d_beta, beta, DType::f32, "d_beta", op);
  detail::DeviceGuard guard(beta.device().index);
  Tensor out = Tensor::empty(beta.shape(), DType::f32, beta.device());
  if (beta.numel() == 0) return out;
  beta_bwd_kernel<<<grid_for(beta.numel()), kThreads, 0, stream>>>(
      beta.data<float>(), d_beta.data<float>(), beta.numel(), out.data<float>());
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  return out;
}

Tensor l2_norm(const Tensor& x, double eps, Tensor* norm, cudaStream_t stream) {
  const char* op = "cuda::l2_norm";
  require_act(x, "x", op);
  const int64_t n = x.size(-1), rows = n > 0 ? x.numel() / n : 0;
  detail::DeviceGuard guard(x.device().index);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  Shape lead = x.shape();
  lead.pop_back();
  if (norm) *norm = Tensor::empty(lead, DType::f32, x.device());
  if (rows == 0) return y;
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    float* nu = norm ? norm->data<float>() : nullptr;
    const bool launched = with_row_lanes<T>(n, {x.data_ptr(), y.data_ptr()}, [&](auto lanes) {
      constexpr int kLanes = decltype(lanes)::value;
      l2_fwd_vec_kernel<T, kLanes>
          <<<unsigned((rows * kLanes + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
              cptr<T>(x), rows, float(eps), mptr<T>(y), nu);
    });
    if (!launched)
      l2_fwd_kernel<T><<<unsigned((rows * 32 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
          cptr<T>(x), rows, int(n), float(eps), mptr<T>(y), nu);
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  return y;
}

Tensor l2_norm_backward(const Tensor& dy, const Tensor& x, double eps, cudaStream_t stream) {
  const char* op = "cuda::l2_norm_backward";
  require_act(x, "x", op);
  require_same(dy, x, x.dtype(), "dy", op);
  const int64_t n = x.size(-1), rows = n > 0 ? x.numel() / n : 0;
  detail::DeviceGuard guard(x.device().index);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (rows == 0) return dx;
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    const bool launched =
        with_row_lanes<T>(n, {x.data_ptr(), dy.data_ptr(), dx.data_ptr()}, [&](auto lanes) {
          constexpr int kLanes = decltype(lanes)::value;
          l2_bwd_vec_kernel<T, kLanes>
              <<<unsigned((rows * kLanes + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
                  cptr<T>(dy), cptr<T>(x), rows, float(eps), mptr<T>(dx));
        });
    if (!launched)
      l2_bwd_kernel<T><<<unsigned((rows * 32 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
          cptr<T>(dy), cptr<T>(x), rows, int(n), float(eps), mptr<T>(dx));
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  return dx;
}

Tensor rms_norm_gated(const Tensor& x, const Tensor& weight, const Tensor& gate, double eps,
                      cudaStream_t stream) {
  const char* op = "cuda::rms_norm_gated";
  require_act(x, "x", op);
  require_same(gate, x, x.dtype(), "gate", op);
  const int64_t n = x.size(-1), rows = n > 0 ? x.numel() / n : 0;
  GLMTUNE_CUDA_OP_REQUIRE(n <= kMaxRow, std::string(op) + ": rows longer than 256");
  require_vec(weight, n, x, "weight", op);
  detail::DeviceGuard guard(x.device().index);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (rows == 0) return y;
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    with_lane_elems<T>(n, {x.data_ptr(), gate.data_ptr(), y.data_ptr()}, [&](auto p, auto wide) {
      gated_fwd_kernel<T, decltype(p)::value, decltype(wide)::value>
          <<<unsigned((rows * 32 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
              cptr<T>(x), weight.data<float>(), cptr<T>(gate), rows, int(n), float(eps),
              mptr<T>(y));
    });
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  return y;
}

ops::RmsNormGatedGrads rms_norm_gated_backward(const Tensor& dy, const Tensor& x,
                                               const Tensor& weight, const Tensor& gate, double eps,
                                               Tensor* grad_weight, cudaStream_t stream) {
  const char* op = "cuda::rms_norm_gated_backward";
  require_act(x, "x", op);
  require_same(gate, x, x.dtype(), "gate", op);
  require_same(dy, x, x.dtype(), "dy", op);
  const int64_t n = x.size(-1), rows = n > 0 ? x.numel() / n : 0;
  GLMTUNE_CUDA_OP_REQUIRE(n <= kMaxRow, std::string(op) + ": rows longer than 256");
  require_vec(weight, n, x, "weight", op);
  detail::DeviceGuard guard(x.device().index);
  ops::RmsNormGatedGrads r{Tensor::empty(x.shape(), x.dtype(), x.device()),
                           Tensor::empty(x.shape(), x.dtype(), x.device())};
  if (rows == 0) return r;
  // Enough blocks to fill the device (a warp per row); the split depends on the rows alone, so
  // the weight gradient's sum order does too.
  const int64_t per = std::max<int64_t>(kThreads / 32, (rows + kGatedBlocks - 1) / kGatedBlocks),
                blocks = (rows + per - 1) / per;
  Tensor partial = Tensor::empty({blocks, n}, DType::f32, x.device());
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    with_lane_elems<T>(
        n, {x.data_ptr(), dy.data_ptr(), gate.data_ptr(), r.dx.data_ptr(), r.dgate.data_ptr()},
        [&](auto p, auto wide) {
          gated_bwd_kernel<T, decltype(p)::value, decltype(wide)::value>
              <<<unsigned(blocks), kThreads, 0, stream>>>(
                  cptr<T>(dy), cptr<T>(x), weight.data<float>(), cptr<T>(gate), rows, int(n),
                  float(eps), per, mptr<T>(r.dx), mptr<T>(r.dgate), partial.data<float>());
        });
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  if (grad_weight) {
    Tensor& gw = grad_buffer(grad_weight, weight, "o_norm weight gradient", op);
    sum_blocks_kernel<<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        partial.data<float>(), blocks, n, gw.data<float>());
    GLMTUNE_CUDA_CHECK(cudaGetLastError());
  }
  return r;
}

}  // namespace glmtune::cuda
