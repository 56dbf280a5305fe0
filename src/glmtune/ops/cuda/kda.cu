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
constexpr int kTokenBlocks = 128;  // fixed token blocks of the parameter-gradient sums
constexpr int kMaxRow = 256;       // longest row of the per-row norms

using detail::from_f;
using detail::to_f;
__device__ __forceinline__ float sigmoid_f(float v) { return 1.0f / (1.0f + expf(-v)); }

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
__device__ __forceinline__ int64_t doc_start(const int* cu, int ndoc, int64_t t) {
  return cu[doc_of(cu, ndoc, t)];
}
__device__ __forceinline__ int64_t doc_end(const int* cu, int ndoc, int64_t t) {
  return cu[doc_of(cu, ndoc, t) + 1];
}

// ---- conv -------------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float conv_pre(const T* x, const float* w, int kc, int64_t c, int64_t ch,
                                          int64_t t, int64_t start) {
  const int64_t first = (kc - 1) - (t - start) > 0 ? (kc - 1) - (t - start) : 0;
  float acc = 0.0f;
  for (int tau = int(first); tau < kc; ++tau)
    acc += w[tau] * to_f(x[(t - (kc - 1) + tau) * c + ch]);
  return acc;
}

// One channel per thread over a fixed block of tokens.
template <typename T>
__global__ void conv_fwd_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                const int* __restrict__ cu, int ndoc, int64_t tokens, int64_t c,
                                int kc, int64_t tokens_per_block, bool silu, T* __restrict__ y) {
  const int64_t ch = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (ch >= c) return;
  float w[kMaxTaps];
  for (int tau = 0; tau < kc; ++tau) w[tau] = to_f(weight[ch * kc + tau]);
  const int64_t t0 = int64_t(blockIdx.y) * tokens_per_block;
  const int64_t t1 = t0 + tokens_per_block < tokens ? t0 + tokens_per_block : tokens;
  for (int64_t t = t0; t < t1; ++t) {
    const float p = conv_pre(x, w, kc, c, ch, t, doc_start(cu, ndoc, t));
    y[t * c + ch] = from_f<T>(silu ? p * sigmoid_f(p) : p);
  }
}

// d pre-activation at token s (inside its document).
template <typename T>
__device__ __forceinline__ float conv_dpre(const T* x, const T* dy, const float* w, int kc,
                                           int64_t c, int64_t ch, int64_t s, int64_t start,
                                           bool silu) {
  const float g = to_f(dy[s * c + ch]);
  if (!silu) return g;
  const float p = conv_pre(x, w, kc, c, ch, s, start), sg = sigmoid_f(p);
  return g * sg * (1.0f + p * (1.0f - sg));
}

template <typename T>
__global__ void conv_bwd_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                const T* __restrict__ dy, const int* __restrict__ cu, int ndoc,
                                int64_t tokens, int64_t c, int kc, int64_t tokens_per_block,
                                bool silu, T* __restrict__ dx, float* __restrict__ dw_partial) {
  const int64_t ch = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (ch >= c) return;
  float w[kMaxTaps], dw[kMaxTaps];
  for (int tau = 0; tau < kc; ++tau) {
    w[tau] = to_f(weight[ch * kc + tau]);
    dw[tau] = 0.0f;
  }
  const int64_t t0 = int64_t(blockIdx.y) * tokens_per_block;
  const int64_t t1 = t0 + tokens_per_block < tokens ? t0 + tokens_per_block : tokens;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t start = doc_start(cu, ndoc, t), end = doc_end(cu, ndoc, t);
    // x[t] feeds y[t + (Kc−1) − τ] for the taps that stay inside the document.
    float acc = 0.0f;
    for (int tau = 0; tau < kc; ++tau) {
      const int64_t out_t = t + (kc - 1) - tau;
      if (out_t < end) acc += w[tau] * conv_dpre(x, dy, w, kc, c, ch, out_t, start, silu);
    }
    dx[t * c + ch] = from_f<T>(acc);
    const float dp = conv_dpre(x, dy, w, kc, c, ch, t, start, silu);
    for (int tau = 0; tau < kc; ++tau) {
      const int64_t src = t - (kc - 1) + tau;
      if (src >= start) dw[tau] += dp * to_f(x[src * c + ch]);
    }
  }
  for (int tau = 0; tau < kc; ++tau)
    dw_partial[(int64_t(blockIdx.y) * c + ch) * kc + tau] = dw[tau];
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
  const float nu = sqrtf(ss + eps);
  if (norm && lane == 0) norm[row] = nu;
  for (int j = lane; j < n; j += 32) y[row * n + j] = from_f<T>(to_f(xr[j]) / nu);
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
  const float nu = row_norm<kLanes>(v, eps);
  if (!valid) return;
  if (norm && gid % kLanes == 0) norm[row] = nu;
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = v[j] / nu;
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

template <typename T>
__global__ void gated_fwd_kernel(const T* __restrict__ x, const float* __restrict__ w,
                                 const T* __restrict__ z, int64_t rows, int n, float eps,
                                 T* __restrict__ y) {
  const int64_t row = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* xr = x + row * n;
  const float ss = warp_row_sum_squares(xr, n, lane);
  const float r = 1.0f / sqrtf(ss / float(n) + eps);
  for (int j = lane; j < n; j += 32) {
    const float v = w[j] * (to_f(xr[j]) * r);
    y[row * n + j] = from_f<T>(v * sigmoid_f(to_f(z[row * n + j])));
  }
}

// Rows [blockIdx.x · rows_per_block, ...), warp w taking every 8th row; per-lane weight-gradient
// columns j = lane + 32·m, summed over the block's warps in order into partial[blockIdx.x].
template <typename T>
__global__ void __launch_bounds__(kThreads)
    gated_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ w,
                     const T* __restrict__ z, int64_t rows, int n, float eps,
                     int64_t rows_per_block, T* __restrict__ dx, T* __restrict__ dz,
                     float* __restrict__ dw_partial) {
  __shared__ float dw_warp[kThreads / 32][kMaxRow];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float dw[kMaxRow / 32] = {};
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
  for (int64_t row = r0 + warp; row < r1; row += kThreads / 32) {
    const T* xr = x + row * n;
    const T* gr = dy + row * n;
    const T* zr = z + row * n;
    const float r = 1.0f / sqrtf(warp_row_sum_squares(xr, n, lane) / float(n) + eps);
    float dot = 0.0f;
#pragma unroll
    for (int m = 0; m < kMaxRow / 32; ++m) {
      const int j = lane + 32 * m;
      if (j >= n) break;
      const float xv = to_f(xr[j]), g = to_f(gr[j]), s = sigmoid_f(to_f(zr[j]));
      dot += g * s * w[j] * xv;
      dw[m] += g * (xv * r) * s;
    }
    dot = detail::warp_sum(dot);
    const float c = dot * r * r * r / float(n);
#pragma unroll
    for (int m = 0; m < kMaxRow / 32; ++m) {
      const int j = lane + 32 * m;
      if (j >= n) break;
      const float xv = to_f(xr[j]), g = to_f(gr[j]), s = sigmoid_f(to_f(zr[j]));
      dx[row * n + j] = from_f<T>(r * (g * s * w[j]) - c * xv);
      dz[row * n + j] = from_f<T>(g * w[j] * (xv * r) * s * (1.0f - s));
    }
  }
#pragma unroll
  for (int m = 0; m < kMaxRow / 32; ++m)
    if (lane + 32 * m < n) dw_warp[warp][lane + 32 * m] = dw[m];
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
  const int64_t per = per_block(t);
  const dim3 grid(unsigned((c + kThreads - 1) / kThreads), unsigned((t + per - 1) / per));
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    conv_fwd_kernel<T><<<grid, kThreads, 0, stream>>>(cptr<T>(x), cptr<T>(weight),
                                                      cu_seqlens.data<int32_t>(), ndoc, t, c, kc,
                                                      per, silu, mptr<T>(y));
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  return y;
}

Tensor causal_conv1d_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                              bool silu, const Tensor& dy, Tensor* grad_weight,
                              cudaStream_t stream) {
  const char* op = "cuda::causal_conv1d_backward";
  const ConvDims dims = conv_dims(x, &dy, weight, cu_seqlens, op);
  const int64_t t = x.size(0), c = x.size(1);
  const int kc = dims.kc, ndoc = dims.ndoc;
  detail::DeviceGuard guard(x.device().index);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (t == 0 || c == 0) return dx;
  const int64_t per = per_block(t), blocks = (t + per - 1) / per;
  Tensor partial = Tensor::empty({blocks, c, kc}, DType::f32, x.device());
  const dim3 grid(unsigned((c + kThreads - 1) / kThreads), unsigned(blocks));
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    conv_bwd_kernel<T><<<grid, kThreads, 0, stream>>>(
        cptr<T>(x), cptr<T>(weight), cptr<T>(dy), cu_seqlens.data<int32_t>(), ndoc, t, c, kc, per,
        silu, mptr<T>(dx), partial.data<float>());
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
  require_vec(weight, n, x, "weight", op);
  detail::DeviceGuard guard(x.device().index);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (rows == 0) return y;
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    gated_fwd_kernel<T><<<unsigned((rows * 32 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        cptr<T>(x), weight.data<float>(), cptr<T>(gate), rows, int(n), float(eps), mptr<T>(y));
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
  const int64_t per = per_block(rows), blocks = (rows + per - 1) / per;
  Tensor partial = Tensor::empty({blocks, n}, DType::f32, x.device());
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    gated_bwd_kernel<T><<<unsigned(blocks), kThreads, 0, stream>>>(
        cptr<T>(dy), cptr<T>(x), weight.data<float>(), cptr<T>(gate), rows, int(n), float(eps), per,
        mptr<T>(r.dx), mptr<T>(r.dgate), partial.data<float>());
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
