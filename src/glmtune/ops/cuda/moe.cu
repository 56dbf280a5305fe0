// The MoE block on the GPU (ops/cuda/moe.h): router, permutation, combine and their backward as
// kernels here; the GEMMs through cuda::gemm / cuda::linear and the grouped expert GEMMs.

#include <cub/device/device_radix_sort.cuh>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/fp8.h"
#include "glmtune/ops/cuda/gemm.h"
#include "glmtune/ops/cuda/moe.h"
#include "glmtune/ops/cuda/streams.h"
#include "glmtune/ops/cuda/swiglu.cuh"
#include "glmtune/ops/cuda/swiglu.h"
#include "glmtune/ops/topk_order.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

constexpr int kThreads = 256;
constexpr int kRouteWarps = 4;

using ops::ranks_before;

// The best (value, index) over the warp; index −1 means "none". Every lane ends with the same
// answer, and the answer is the unique maximum of a total order, so it never depends on timing.
__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
    const int oi = __shfl_xor_sync(0xffffffffu, i, offset);
    if (oi >= 0 && (i < 0 || ranks_before(ov, oi, v, i))) {
      v = ov;
      i = oi;
    }
  }
}

struct RouteArgs {
  const float* logits;
  const float* bias;
  int64_t rows;
  int n_exp, n_group, topk_group, top_k;
  bool norm_topk_prob;
  float rsf;
  float* weights;
  int32_t* indices;
};

// One warp per token. Shared memory per warp: p[E], c[E] (floats), allowed[E] (bytes).
__global__ void __launch_bounds__(kRouteWarps * 32) route_kernel(RouteArgs a) {
  extern __shared__ float route_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kRouteWarps + warp;
  const int E = a.n_exp;
  float* p = route_smem + size_t(warp) * 2 * E;
  float* c = p + E;
  unsigned char* allowed =
      reinterpret_cast<unsigned char*>(route_smem + size_t(kRouteWarps) * 2 * E) + warp * E;
  if (row >= a.rows) return;
  const float* lr = a.logits + row * E;
  for (int e = lane; e < E; e += 32) {
    const float pe = 1.0f / (1.0f + expf(-lr[e]));
    p[e] = pe;
    c[e] = pe + a.bias[e];
    allowed[e] = 1;
  }
  __syncwarp();
  if (a.topk_group < a.n_group) {
    // Lane g scores group g by its two best biased scores; then the topk_group best groups stay.
    const int per = E / a.n_group;
    const float score = lane < a.n_group ? ops::top2_sum(c + lane * per, per) : 0.0f;
    bool kept = false, taken = false;
    for (int r = 0; r < a.topk_group; ++r) {
      float v = score;
      int i = lane < a.n_group && !taken ? lane : -1;
      warp_best(v, i);
      if (i == lane) {
        taken = true;
        kept = true;
      }
    }
    const unsigned kept_mask = __ballot_sync(0xffffffffu, kept);
    for (int e = lane; e < E; e += 32) allowed[e] = (kept_mask >> (e / per)) & 1u;
    __syncwarp();
  }
  float sum = 0.0f;
  int32_t* ir = a.indices + row * a.top_k;
  float* wr = a.weights + row * a.top_k;
  for (int r = 0; r < a.top_k; ++r) {
    float v = 0.0f;
    int i = -1;
    for (int e = lane; e < E; e += 32)
      if (allowed[e] && (i < 0 || ranks_before(c[e], e, v, i))) {
        v = c[e];
        i = e;
      }
    warp_best(v, i);
    if (lane == 0) {
      ir[r] = i;
      wr[r] = p[i];
      sum += p[i];
      allowed[i] = 0;
    }
    __syncwarp();
  }
  if (lane == 0) {
    // The CPU op's order: normalise by (sum + 1e-20), then scale.
    const float denom = sum + 1e-20f;
    for (int r = 0; r < a.top_k; ++r) {
      float w = wr[r];
      if (a.norm_topk_prob) w /= denom;
      wr[r] = w * a.rsf;
    }
  }
}

__global__ void iota_kernel(int32_t* out, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = int32_t(i);
}

// offsets[e] = first position in the sorted expert ids holding an id ≥ e, for e in [0, E].
__global__ void expert_offsets_kernel(const int32_t* sorted_ids, int64_t n, int n_exp,
                                      int32_t* offsets) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e > n_exp) return;
  offsets[e] = int32_t(detail::lower_bound(sorted_ids, n, e));
}

__global__ void inverse_kernel(const int32_t* sorted_slots, int64_t n, int32_t* position) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < n) position[sorted_slots[r]] = int32_t(r);
}

// out[r] = x[sorted_slots[r] / K]: one block per permuted row.
template <int VEC, typename T>
__global__ void gather_rows_kernel(const T* __restrict__ x, const int32_t* sorted_slots, int k,
                                   int cols, T* __restrict__ out) {
  const int64_t r = blockIdx.x;
  const T* src = x + int64_t(sorted_slots[r] / k) * cols;
  T* dst = out + r * cols;
  for (int j = threadIdx.x * VEC; j < cols; j += blockDim.x * VEC) {
    float v[VEC];
    detail::load_vec<VEC>(src + j, v);
    detail::store_vec<VEC>(dst + j, v);
  }
}

// y[t] = T(Σ_k w[t,k] · yp[pos[t·K+k]] (+ extra[t])): one block per token, k in order.
template <int VEC, typename T>
__global__ void combine_kernel(const T* __restrict__ yp, const float* __restrict__ weights,
                               const int32_t* __restrict__ position, int k, int cols,
                               const float* __restrict__ extra, T* __restrict__ y) {
  const int64_t t = blockIdx.x;
  for (int j = threadIdx.x * VEC; j < cols; j += blockDim.x * VEC) {
    float acc[VEC] = {};
    for (int s = 0; s < k; ++s) {
      const float w = weights[t * k + s];
      float v[VEC];
      detail::load_vec<VEC>(yp + int64_t(position[t * k + s]) * cols + j, v);
#pragma unroll
      for (int q = 0; q < VEC; ++q) acc[q] += w * v[q];
    }
    if (extra) {
#pragma unroll
      for (int q = 0; q < VEC; ++q) acc[q] += extra[t * cols + j + q];
    }
    detail::store_vec<VEC>(y + t * cols + j, acc);
  }
}

// dx[t] = Out(extra[t] + Σ_k dxp[pos[t·K+k]]): one block per token, k in order (extra may be
// null).
template <int VEC, typename T, typename Out>
__global__ void unpermute_sum_kernel(const T* __restrict__ dxp,
                                     const int32_t* __restrict__ position, int k, int cols,
                                     const float* __restrict__ extra, Out* __restrict__ dx) {
  const int64_t t = blockIdx.x;
  for (int j = threadIdx.x * VEC; j < cols; j += blockDim.x * VEC) {
    float acc[VEC] = {};
    for (int s = 0; s < k; ++s) {
      float v[VEC];
      detail::load_vec<VEC>(dxp + int64_t(position[t * k + s]) * cols + j, v);
#pragma unroll
      for (int q = 0; q < VEC; ++q) acc[q] += v[q];
    }
    if (extra) {
#pragma unroll
      for (int q = 0; q < VEC; ++q) acc[q] += extra[t * cols + j + q];
    }
    if constexpr (std::is_same_v<Out, T>) {
      detail::store_vec<VEC>(dx + t * cols + j, acc);
    } else {
#pragma unroll
      for (int q = 0; q < VEC; ++q) dx[t * cols + j + q] = acc[q];
    }
  }
}

// Per permuted row r (slot s, token t): d_weights[s] = ⟨dy[t], yp[r]⟩ and dyp[r] = w[s] · dy[t].
template <int VEC, typename T>
__global__ void __launch_bounds__(kThreads)
    expert_output_grad_kernel(const T* __restrict__ dy, const T* __restrict__ yp,
                              const float* __restrict__ weights,
                              const int32_t* __restrict__ sorted_slots, int k, int cols,
                              float* __restrict__ d_weights, T* __restrict__ dyp) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const int32_t s = sorted_slots[r];
  const T* dyr = dy + int64_t(s / k) * cols;
  const float w = weights[s];
  float dot = 0.0f;
  for (int j = threadIdx.x * VEC; j < cols; j += blockDim.x * VEC) {
    float g[VEC], v[VEC], o[VEC];
    detail::load_vec<VEC>(dyr + j, g);
    detail::load_vec<VEC>(yp + r * cols + j, v);
#pragma unroll
    for (int q = 0; q < VEC; ++q) {
      dot += g[q] * v[q];
      o[q] = w * g[q];
    }
    detail::store_vec<VEC>(dyp + r * cols + j, o);
  }
  dot = detail::block_sum(dot, scratch);
  if (threadIdx.x == 0) d_weights[s] = dot;
}

// The routed experts' backward from the down projection's input gradient (routed_backward). Per
// permuted row r (slot s) with g = dy[t] · down_e, the down projection's input gradient of the
// unweighted output: act = swiglu(h[r]) as the forward rounded it, d_weights[s] = ⟨g, act⟩ (=
// ⟨dy[t], act · down_eᵀ⟩, the combine weight's gradient without the expert's output),
// act_w[r] = w[s] · act for the down projection's weight gradient, and dh[r] = the SwiGLU's
// gradient of w[s] · g. h and dh are [gate | up] rows of 2 · inter.
template <int VEC, typename T>
__global__ void __launch_bounds__(kThreads)
    expert_activation_grad_kernel(const T* __restrict__ h, const T* __restrict__ g,
                                  const float* __restrict__ weights,
                                  const int32_t* __restrict__ sorted_slots, int inter, float lim,
                                  float* __restrict__ d_weights, T* __restrict__ act_w,
                                  T* __restrict__ dh) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const int32_t s = sorted_slots[r];
  const float w = weights[s];
  const T* gate = h + r * 2 * inter;
  const T* up = gate + inter;
  T* d_gate = dh + r * 2 * inter;
  T* d_up = d_gate + inter;
  float dot = 0.0f;
  for (int j = threadIdx.x * VEC; j < inter; j += blockDim.x * VEC) {
    float gv[VEC], uv[VEC], dv[VEC], aw[VEC], dgv[VEC], duv[VEC];
    detail::load_vec<VEC>(gate + j, gv);
    detail::load_vec<VEC>(up + j, uv);
    detail::load_vec<VEC>(g + r * inter + j, dv);
#pragma unroll
    for (int q = 0; q < VEC; ++q) {
      const float act = detail::to_f(detail::from_f<T>(swiglu_math::value(gv[q], uv[q], lim)));
      dot += dv[q] * act;
      aw[q] = w * act;
      swiglu_math::grads(gv[q], uv[q], w * dv[q], lim, dgv[q], duv[q]);
    }
    detail::store_vec<VEC>(act_w + r * inter + j, aw);
    detail::store_vec<VEC>(d_gate + j, dgv);
    detail::store_vec<VEC>(d_up + j, duv);
  }
  dot = detail::block_sum(dot, scratch);
  if (threadIdx.x == 0) d_weights[s] = dot;
}

// d_logits (zeroed by the caller) at the selected experts, one thread per row: the CPU op's
// formula and order (ops/cpu/moe_backward.cpp).
__global__ void route_backward_kernel(const float* __restrict__ logits,
                                      const int32_t* __restrict__ idx,
                                      const float* __restrict__ d_weights, int64_t rows, int n_exp,
                                      int k, bool norm_topk_prob, float rsf,
                                      float* __restrict__ d_logits) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const int32_t* ir = idx + r * k;
  const float* dw = d_weights + r * k;
  const float* lr = logits + r * n_exp;
  float* dl = d_logits + r * n_exp;
  float sum = 0.0f, dot = 0.0f;
  for (int i = 0; i < k; ++i) {
    const float p = 1.0f / (1.0f + expf(-lr[ir[i]]));
    sum += p;
    dot += dw[i] * p;
  }
  const float den = sum + 1e-20f;
  for (int i = 0; i < k; ++i) {
    const float p = 1.0f / (1.0f + expf(-lr[ir[i]]));
    const float dp = norm_topk_prob ? rsf * (dw[i] / den - dot / (den * den)) : rsf * dw[i];
    dl[ir[i]] += dp * p * (1.0f - p);
  }
}

// v = d_logits (+ extra) split into bf16 hi = bf16(v) and lo = bf16(v − hi): hi + lo carries
// about 16 significant bits, so two bf16 GEMMs give the router products in near fp32.
__global__ void split_hi_lo_kernel(const float* __restrict__ v, const float* __restrict__ extra,
                                   int64_t n, bf16* __restrict__ hi, bf16* __restrict__ lo) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = v[i] + (extra ? extra[i] : 0.0f);
  const bf16 h = __float2bfloat16_rn(x);
  hi[i] = h;
  lo[i] = __float2bfloat16_rn(x - __bfloat162float(h));
}

template <typename T>
__global__ void accumulate_kernel(const float* __restrict__ src, int64_t n, T* __restrict__ dst) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if constexpr (std::is_same_v<T, float>) {
    dst[i] += src[i];
  } else {
    dst[i] = __float2bfloat16_rn(__bfloat162float(dst[i]) + src[i]);
  }
}

__global__ void count_kernel(const int32_t* __restrict__ idx, int64_t n, int n_exp,
                             unsigned long long* __restrict__ counts) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n && idx[i] >= 0 && idx[i] < n_exp) atomicAdd(counts + idx[i], 1ull);
}

// ---- balancing loss (model/balancing_loss.h)
// -----------------------------------------------------

// coef[e] = weight · E · K · n_e / (Σ n)², zero when nothing was routed; one block.
__global__ void balancing_coef_kernel(const int64_t* __restrict__ loads, int n_exp, int top_k,
                                      double weight, double* __restrict__ coef) {
  __shared__ double total;
  if (threadIdx.x == 0) {
    int64_t sum = 0;
    for (int e = 0; e < n_exp; ++e) sum += loads[e];
    total = double(sum);
  }
  __syncthreads();
  const double scale = total > 0 ? weight * double(n_exp) * double(top_k) / (total * total) : 0.0;
  for (int e = threadIdx.x; e < n_exp; e += blockDim.x) coef[e] = scale * double(loads[e]);
}

// One warp per row, in f64 as the CPU form: u_e = σ(l_e) + b_e, Z = Σ u, the row's loss
// Σ c_e u_e / Z and its gradient (c_e − loss) / Z · σ(l_e)(1 − σ(l_e)). Rows from `counted` on
// are padding: zero loss, zero gradient.
__global__ void __launch_bounds__(kThreads)
    balancing_rows_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                          const double* __restrict__ coef, int64_t rows, int64_t counted, int n_exp,
                          float* __restrict__ grad, double* __restrict__ row_loss) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const float* l = logits + row * n_exp;
  float* g = grad + row * n_exp;
  if (row >= counted) {
    for (int e = lane; e < n_exp; e += 32) g[e] = 0.0f;
    if (lane == 0) row_loss[row] = 0.0;
    return;
  }
  double z = 0.0, weighted = 0.0;
  for (int e = lane; e < n_exp; e += 32) {
    const double u = 1.0 / (1.0 + exp(-double(l[e]))) + double(bias[e]);
    z += u;
    weighted += coef[e] * u;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    z += __shfl_xor_sync(0xffffffffu, z, offset);
    weighted += __shfl_xor_sync(0xffffffffu, weighted, offset);
  }
  const double loss = weighted / z;
  for (int e = lane; e < n_exp; e += 32) {
    const double s = 1.0 / (1.0 + exp(-double(l[e])));
    g[e] = float((coef[e] - loss) / z * s * (1.0 - s));
  }
  if (lane == 0) row_loss[row] = loss;
}

// loss_sum[0] += Σ row_loss, in a fixed order (each thread a strided run, then a tree): the same
// sum at every run. One block of kThreads.
__global__ void __launch_bounds__(kThreads)
    balancing_sum_kernel(const double* __restrict__ row_loss, int64_t rows,
                         double* __restrict__ loss_sum) {
  __shared__ double part[kThreads];
  double s = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += kThreads) s += row_loss[r];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) loss_sum[0] += part[0];
}

// ---- host helpers ----------------------------------------------------------------------------

unsigned blocks_for(int64_t n, int threads = kThreads) {
  return unsigned((n + threads - 1) / threads);
}

// 16-byte accesses: bf16 rows of whole 8-element groups on 16-byte boundaries.
bool vec8_ok(const Tensor& t, int64_t cols) {
  return t.dtype() == DType::bf16 && cols % 8 == 0 && detail::aligned16(t.data_ptr());
}

// Calls f(VEC, T*) with the vector width and a null pointer of the storage of `a` and `b` (bf16,
// or f32 in the fp32 mode): VEC = 8 where both allow 16-byte accesses over rows of `cols`.
template <typename F>
void dispatch_rows(const Tensor& a, const Tensor& b, int64_t cols, F&& f) {
  using std::integral_constant;
  if (a.dtype() == DType::f32)
    f(integral_constant<int, 1>{}, static_cast<float*>(nullptr));
  else if (vec8_ok(a, cols) && vec8_ok(b, cols))
    f(integral_constant<int, 8>{}, static_cast<bf16*>(nullptr));
  else
    f(integral_constant<int, 1>{}, static_cast<bf16*>(nullptr));
}

void gather_rows(const Tensor& x, const Tensor& sorted_slots, int k, Tensor& out,
                 cudaStream_t stream) {
  const int64_t n = out.size(0), cols = x.size(1);
  if (n == 0) return;
  dispatch_rows(x, out, cols, [&]<typename T>(auto vec, T*) {
    gather_rows_kernel<decltype(vec)::value, T><<<unsigned(n), 128, 0, stream>>>(
        static_cast<const T*>(x.data_ptr()), sorted_slots.data<int32_t>(), k, int(cols),
        static_cast<T*>(out.data_ptr()));
  });
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void combine(const Tensor& yp, const Tensor& weights, const Tensor& position, int k,
             const float* extra, Tensor& y, cudaStream_t stream) {
  const int64_t rows = y.size(0), cols = y.size(1);
  if (rows == 0) return;
  dispatch_rows(yp, y, cols, [&]<typename T>(auto vec, T*) {
    combine_kernel<decltype(vec)::value, T><<<unsigned(rows), 128, 0, stream>>>(
        static_cast<const T*>(yp.data_ptr()), weights.data<float>(), position.data<int32_t>(), k,
        int(cols), extra, static_cast<T*>(y.data_ptr()));
  });
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

// grad += src (f32), creating grad as f32 zeros shaped like `param` when undefined.
Tensor& grad_buffer(Tensor& grad, const Tensor& param, const char* what) {
  if (!grad.defined()) grad = Tensor::zeros(param.shape(), DType::f32, param.device());
  GLMTUNE_CUDA_OP_REQUIRE(
      grad.shape() == param.shape() && grad.is_contiguous() && grad.device() == param.device() &&
          (grad.dtype() == DType::f32 || grad.dtype() == DType::bf16),
      std::string("cuda::moe_backward: gradient ") + what + " " + detail::describe(grad) +
          " must be a contiguous f32/bf16 tensor like " + param.str());
  return grad;
}

// grad_buffer for a trained parameter; nullptr (no buffer, no gradient) for a frozen one.
Tensor* trained_buffer(Tensor& grad, const Tensor& param, const char* what) {
  return param.frozen() ? nullptr : &grad_buffer(grad, param, what);
}

void accumulate(Tensor& grad, const Tensor& src, cudaStream_t stream) {
  const int64_t n = src.numel();
  if (n == 0) return;
  if (grad.dtype() == DType::f32)
    accumulate_kernel<float>
        <<<blocks_for(n), kThreads, 0, stream>>>(src.data<float>(), n, grad.data<float>());
  else
    accumulate_kernel<bf16><<<blocks_for(n), kThreads, 0, stream>>>(
        src.data<float>(), n, static_cast<bf16*>(grad.data_ptr()));
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void check_config(const ops::MoeConfig& cfg) {
  GLMTUNE_CUDA_OP_REQUIRE(
      cfg.n_experts > 0 && cfg.top_k > 0 && cfg.top_k <= cfg.n_experts && cfg.n_group >= 1 &&
          cfg.n_group <= 32 && cfg.n_experts % cfg.n_group == 0 && cfg.topk_group >= 1 &&
          cfg.topk_group <= cfg.n_group && (cfg.n_group == 1 || cfg.n_experts / cfg.n_group >= 2) &&
          cfg.topk_group * (cfg.n_experts / cfg.n_group) >= cfg.top_k,
      "cuda MoE: unsupported config (E " + std::to_string(cfg.n_experts) + ", top_k " +
          std::to_string(cfg.top_k) + ", groups " + std::to_string(cfg.n_group) + "/" +
          std::to_string(cfg.topk_group) + "; at most 32 groups)");
}

// Activations, weights and dy share x's storage dtype: bf16, or f32 in the fp32 mode.
void check_like_x(const Tensor& t, const Shape& shape, const Tensor& x, const char* what) {
  GLMTUNE_CUDA_OP_REQUIRE(t.defined() && t.dtype() == x.dtype() && t.is_contiguous() &&
                              t.device() == x.device() && t.shape() == shape,
                          std::string("cuda MoE: ") + what + " " + detail::describe(t) +
                              " must be a contiguous " + std::string(dtype_name(x.dtype())) +
                              " tensor (x's dtype) of shape " + shape_str(shape) + " on " +
                              x.device().str());
}

void check_x(const Tensor& x, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(x.defined() && x.dim() == 2 &&
                              (x.dtype() == DType::bf16 || x.dtype() == DType::f32) &&
                              x.is_contiguous() && x.device().is_cuda(),
                          std::string(op) + ": x must be a contiguous bf16 or f32 CUDA [T, D] " +
                              "tensor, got " + detail::describe(x));
}

// The shared expert's three weights, or none of them (no shared expert here: ops::moe_forward
// runs one with adapters beside these kernels).
void check_shared(const ops::MlpParams& shared, const Tensor& x) {
  if (!shared.gate_proj.weight.defined() && !shared.up_proj.weight.defined() &&
      !shared.down_proj.weight.defined())
    return;
  const int64_t dim = x.size(1);
  const int64_t shared_inter =
      shared.gate_proj.weight.defined() ? shared.gate_proj.weight.size(0) : 0;
  check_like_x(shared.gate_proj.weight, {shared_inter, dim}, x, "shared gate_proj");
  check_like_x(shared.up_proj.weight, {shared_inter, dim}, x, "shared up_proj");
  check_like_x(shared.down_proj.weight, {dim, shared_inter}, x, "shared down_proj");
}

void check_routing(const ops::Routing& r, int64_t rows, int64_t n_exp, int64_t k,
                   const Device& dev) {
  GLMTUNE_CUDA_OP_REQUIRE(
      r.indices.defined() && r.indices.dtype() == DType::i32 && r.indices.is_contiguous() &&
          r.indices.device() == dev && r.indices.shape() == Shape({rows, k}) &&
          r.weights.defined() && r.weights.dtype() == DType::f32 && r.weights.is_contiguous() &&
          r.weights.device() == dev && r.weights.shape() == Shape({rows, k}),
      "cuda MoE: routing indices " + detail::describe(r.indices) + " / weights " +
          detail::describe(r.weights) + " must be contiguous int32 / f32 [" + std::to_string(rows) +
          ", " + std::to_string(k) + "] on " + dev.str());
  if (r.logits.defined())
    GLMTUNE_CUDA_OP_REQUIRE(r.logits.dtype() == DType::f32 && r.logits.is_contiguous() &&
                                r.logits.shape() == Shape({rows, n_exp}),
                            "cuda MoE: router logits " + r.logits.str() + " must be f32 [" +
                                std::to_string(rows) + ", " + std::to_string(n_exp) + "]");
}

// Each expert's weight blocks (ops::fp8_weight_blocks: pinned, reused in the step, or quantised
// now), for the experts that have rows; the others get none.
std::vector<ops::Fp8Blocks> expert_weight_blocks(const Tensor& w,
                                                 const std::vector<int64_t>& offsets) {
  std::vector<ops::Fp8Blocks> blocks(size_t(w.size(0)));
  for (int64_t e = 0; e < w.size(0); ++e)
    if (offsets[size_t(e) + 1] != offsets[size_t(e)])
      blocks[size_t(e)] = ops::fp8_weight_blocks(w.select(0, e));
  return blocks;
}

// Every expert's FP8 weight blocks as one stack [E · N, K] (ops/cuda/fp8.h, offsets on the
// device): the fused weight viewed as one matrix, whose blocks are each expert's own when N is a
// multiple of 128 (pinned released codes, the step's reused blocks, or quantised now).
ops::Fp8Blocks stacked_weight_blocks(const Tensor& w) {
  return ops::fp8_weight_blocks(w.reshape({w.size(0) * w.size(1), w.size(2)}));
}

// Whether an FP8 product y[rows, n] = x[rows, k] · w_eᵀ per expert runs on the grouped FP8 kernel
// of one launch: the backend names the device-offset kernels and it takes these devices and sizes
// (the layouts are checked again when the operands exist); else one cuBLASLt GEMM per expert.
bool grouped_fp8_possible(GroupedGemmBackend backend, const Tensor& rows, const Tensor& w,
                          int64_t n, int64_t k) {
  return backend == GroupedGemmBackend::kWgmmaDeviceOffsets && w.is_contiguous() &&
         rows.size(0) > 0 &&
         fp8_grouped_device_offsets_possible(rows.device().index, w.size(0), n, k);
}

// Whether a bf16 product of `weight` runs on the device-offset kernels: the backend names them
// and they take these operands (else the host offsets are read).
bool on_device_offsets(GroupedGemmBackend backend, const Tensor& first, const Tensor& second,
                       const Tensor& out, const Tensor& weight) {
  return backend == GroupedGemmBackend::kWgmmaDeviceOffsets &&
         grouped_gemm_device_offsets_fit(first, second, out, weight.size(0));
}

// The weight's products of an expert projection on the permuted rows: the grouped GEMMs, or with
// Linear::fp8 the block-scaled FP8 ones (ops/cuda/fp8.h, ops/fp8.h's linear_fp8 per expert), each
// expert's rows quantised on their own from its first row, as the CPU op quantises each expert's
// gathered rows.
void expert_linear(Tensor& y, const Tensor& x, const ops::Linear& l, const ExpertPermutation& perm,
                   GroupedGemmBackend backend, cudaStream_t stream) {
  if (!l.fp8 && on_device_offsets(backend, x, l.weight, y, l.weight)) {
    grouped_linear(y, x, l.weight, perm.device_offsets, stream);
    return;
  }
  if (l.fp8 && grouped_fp8_possible(backend, x, l.weight, l.weight.size(1), l.weight.size(2))) {
    fp8_grouped_linear(y, quantize_fp8_blocks(x, 1, 128, stream), stacked_weight_blocks(l.weight),
                       perm.device_offsets, stream);
    return;
  }
  const std::vector<int64_t>& offsets = perm.offsets();
  if (!l.fp8) {
    grouped_linear(y, x, l.weight, offsets, backend, stream);
    return;
  }
  fp8_grouped_linear(y, quantize_fp8_grouped(x, offsets, 1, 128, stream),
                     expert_weight_blocks(l.weight, offsets), offsets, stream);
}

void expert_linear_backward_input(Tensor& dx, const Tensor& dy, const ops::Linear& l,
                                  const ExpertPermutation& perm, GroupedGemmBackend backend,
                                  cudaStream_t stream) {
  if (!l.fp8 && on_device_offsets(backend, dy, l.weight, dx, l.weight)) {
    grouped_linear_backward_input(dx, dy, l.weight, perm.device_offsets, stream);
    return;
  }
  // The transposed stack's blocks must not span two experts either: K a multiple of 128 too.
  if (l.fp8 && l.weight.size(1) % 128 == 0 && l.weight.size(2) % 128 == 0 &&
      grouped_fp8_possible(backend, dy, l.weight, l.weight.size(2), l.weight.size(1))) {
    fp8_grouped_linear_backward_input(dx, quantize_fp8_blocks(dy, 1, 128, stream),
                                      stacked_weight_blocks(l.weight), perm.device_offsets, stream);
    return;
  }
  const std::vector<int64_t>& offsets = perm.offsets();
  if (!l.fp8) {
    grouped_linear_backward_input(dx, dy, l.weight, offsets, backend, stream);
    return;
  }
  fp8_grouped_linear_backward_input(dx, quantize_fp8_grouped(dy, offsets, 1, 128, stream),
                                    expert_weight_blocks(l.weight, offsets), offsets, stream);
}

void expert_linear_backward_weight(Tensor& dw, const Tensor& dy, const Tensor& x,
                                   const ops::Linear& l, const ExpertPermutation& perm,
                                   GroupedGemmBackend backend, cudaStream_t stream) {
  if (!l.fp8 && on_device_offsets(backend, dy, x, dw, l.weight)) {
    grouped_linear_backward_weight(dw, dy, x, perm.device_offsets, stream);
    return;
  }
  if (l.fp8 && l.weight.size(2) % 128 == 0 && dw.is_contiguous() &&
      (dw.dtype() == DType::f32 || dw.dtype() == DType::bf16) &&
      grouped_fp8_possible(backend, dy, l.weight, l.weight.size(1), l.weight.size(2))) {
    fp8_grouped_linear_backward_weight(
        dw, quantize_fp8_token_tiles(dy, perm.device_offsets, stream),
        quantize_fp8_token_tiles(x, perm.device_offsets, stream), perm.device_offsets, stream);
    return;
  }
  const std::vector<int64_t>& offsets = perm.offsets();
  if (!l.fp8) {
    grouped_linear_backward_weight(dw, dy, x, offsets, backend, stream);
    return;
  }
  fp8_grouped_linear_backward_weight(dw, quantize_fp8_grouped(dy, offsets, 128, 1, stream),
                                     quantize_fp8_grouped(x, offsets, 128, 1, stream), offsets,
                                     stream);
}

// out += scale · (in A_e^T) B_e^T per expert segment; returns the scaled u.
Tensor add_expert_adapter(Tensor& out, const Tensor& in, const ops::LoraAdapter& a,
                          const ExpertPermutation& perm, GroupedGemmBackend backend,
                          cudaStream_t stream) {
  if (!a.defined()) return Tensor();
  const std::vector<int64_t>& offsets = perm.offsets();
  Tensor u = Tensor::empty({in.size(0), a.A.size(1)}, in.dtype(), in.device());
  grouped_linear(u, in, a.A, offsets, backend, stream);
  if (u.numel() > 0) scale_inplace(u, a.scale, stream);
  grouped_linear(out, u, a.B, offsets, backend, stream, /*accumulate=*/true);
  return u;
}

// Whether the routed backward takes the combine weights' gradient from the down projection's
// input gradient (routed_backward), so that it reads neither act nor the experts' outputs.
bool combine_grad_from_input_grad(const ops::Linear& down) {
  return !down.lora.defined() && !down.fp8;
}

// Expert activations of the permuted rows (ExpertActivations, ops/cuda/moe.h), each projection
// with its per-expert adapter when it has one (ops/linear.h): u = scale · in A_e^T [rows, r] is
// kept for the backward and u B_e^T added into the projection's output, as the dense composite
// does. `kept_h` (with its adapter's u_gate_up): the gate/up output a forward kept, so only the
// gather, the activation and the down projection run, and their values are the forward's.
// Without `through_down`, x_perm and h (and u_gate_up) alone: all a backward from the down
// projection's input gradient needs (routed_backward).
ExpertActivations run_experts(const ops::MoeConfig& cfg, const ops::Linear& gate_up,
                              const ops::Linear& down, const Tensor& x,
                              const ExpertPermutation& perm, GroupedGemmBackend backend,
                              cudaStream_t stream, const ExpertActivations* kept_h = nullptr,
                              bool through_down = true) {
  const int64_t n = perm.sorted_slots.numel(), dim = x.size(1), inter = down.weight.size(2);
  const Device dev = x.device();
  const DType st = x.dtype();
  ExpertActivations a;
  a.x_perm = Tensor::empty({n, dim}, st, dev);
  gather_rows(x, perm.sorted_slots, int(cfg.top_k), a.x_perm, stream);
  if (kept_h) {
    a.h = kept_h->h;
    a.u_gate_up = kept_h->u_gate_up;
  } else {
    a.h = Tensor::empty({n, 2 * inter}, st, dev);
    expert_linear(a.h, a.x_perm, gate_up, perm, backend, stream);
    a.u_gate_up = add_expert_adapter(a.h, a.x_perm, gate_up.lora, perm, backend, stream);
  }
  if (!through_down) return a;
  a.act = Tensor::empty({n, inter}, st, dev);
  if (n > 0)
    swiglu_clamped_out(a.act, a.h.slice(1, 0, inter), a.h.slice(1, inter, 2 * inter),
                       cfg.swiglu_limit, stream);
  a.yp = Tensor::empty({n, dim}, st, dev);
  expert_linear(a.yp, a.act, down, perm, backend, stream);
  a.u_down = add_expert_adapter(a.yp, a.act, down.lora, perm, backend, stream);
  return a;
}

void check_expert_adapter(const ops::Linear& fused, const Tensor& x, const char* name) {
  if (!fused.lora.defined()) return;
  const Tensor &w = fused.weight, &A = fused.lora.A, &B = fused.lora.B;
  GLMTUNE_CUDA_OP_REQUIRE(B.defined() && A.dim() == 3 && B.dim() == 3 && A.size(0) == w.size(0) &&
                              B.size(0) == w.size(0) && A.size(1) == B.size(2) &&
                              A.size(2) == w.size(2) && B.size(1) == w.size(1),
                          std::string("cuda MoE: the adapter of experts.") + name + " (A " +
                              detail::describe(A) + ", B " + detail::describe(B) +
                              ") must be [E, r, in] and [E, out, r] for " + detail::describe(w));
  check_like_x(A, A.shape(), x, "an expert adapter's A");
  check_like_x(B, B.shape(), x, "an expert adapter's B");
}

void check_expert_weights(const ops::MoeConfig& cfg, const ops::Linear& gate_up,
                          const ops::Linear& down, const Tensor& x) {
  GLMTUNE_CUDA_OP_REQUIRE(
      down.weight.defined() && down.weight.dim() == 3,
      "cuda MoE: down_proj must be [E, D, Im], got " + detail::describe(down.weight));
  const int64_t inter = down.weight.size(2), dim = x.size(1);
  check_like_x(gate_up.weight, {cfg.n_experts, 2 * inter, dim}, x, "gate_up_proj");
  check_like_x(down.weight, {cfg.n_experts, dim, inter}, x, "down_proj");
  check_expert_adapter(gate_up, x, "gate_up_proj");
  check_expert_adapter(down, x, "down_proj");
}

}  // namespace

ops::Routing moe_route(const ops::MoeConfig& cfg, const Tensor& router_weight,
                       const Tensor& e_score_correction_bias, const Tensor& x,
                       cudaStream_t stream) {
  check_config(cfg);
  check_x(x, "cuda::moe_route");
  const Device dev = x.device();
  check_like_x(router_weight, {cfg.n_experts, x.size(1)}, x, "router weight");
  GLMTUNE_CUDA_OP_REQUIRE(
      e_score_correction_bias.defined() && e_score_correction_bias.dtype() == DType::f32 &&
          e_score_correction_bias.is_contiguous() && e_score_correction_bias.device() == dev &&
          e_score_correction_bias.shape() == Shape({cfg.n_experts}),
      "cuda::moe_route: e_score_correction_bias must be f32 [E], got " +
          detail::describe(e_score_correction_bias));
  detail::DeviceGuard guard(dev.index);
  const int64_t rows = x.size(0);
  ops::Routing r;
  r.logits = linear(x, router_weight, Tensor(), DType::f32, stream);
  r.weights = Tensor::empty({rows, cfg.top_k}, DType::f32, dev);
  r.indices = Tensor::empty({rows, cfg.top_k}, DType::i32, dev);
  if (rows == 0) return r;
  RouteArgs a{r.logits.data<float>(),
              e_score_correction_bias.data<float>(),
              rows,
              int(cfg.n_experts),
              int(cfg.n_group),
              int(cfg.topk_group),
              int(cfg.top_k),
              cfg.norm_topk_prob,
              float(cfg.routed_scaling_factor),
              r.weights.data<float>(),
              r.indices.data<int32_t>()};
  const size_t smem = size_t(kRouteWarps) * cfg.n_experts * (2 * sizeof(float) + 1);
  GLMTUNE_CUDA_OP_REQUIRE(smem <= 48 * 1024, "cuda::moe_route: too many experts");
  route_kernel<<<unsigned((rows + kRouteWarps - 1) / kRouteWarps), kRouteWarps * 32, smem,
                 stream>>>(a);
  GLMTUNE_CUDA_CHECK_LAUNCH();
  return r;
}

struct ExpertPermutation::HostOffsets {
  int64_t slots = 0;
  cudaStream_t stream = nullptr;
  bool read = false;
  std::vector<int64_t> values;
};

ExpertPermutation moe_permute(const Tensor& indices, int64_t n_experts, cudaStream_t stream,
                              bool read_offsets) {
  GLMTUNE_CUDA_OP_REQUIRE(indices.defined() && indices.dtype() == DType::i32 &&
                              indices.is_contiguous() && indices.device().is_cuda() &&
                              indices.numel() < int64_t(INT32_MAX),
                          "cuda::moe_permute: indices must be contiguous int32 on the GPU, got " +
                              detail::describe(indices));
  const Device dev = indices.device();
  detail::DeviceGuard guard(dev.index);
  const int64_t n = indices.numel();
  ExpertPermutation p;
  p.sorted_slots = Tensor::empty({n}, DType::i32, dev);
  p.slot_position = Tensor::empty({n}, DType::i32, dev);
  Tensor slots = Tensor::empty({n}, DType::i32, dev);
  Tensor sorted_ids = Tensor::empty({n}, DType::i32, dev);
  Tensor offsets = Tensor::empty({n_experts + 1}, DType::i32, dev);
  if (n > 0) {
    iota_kernel<<<blocks_for(n), kThreads, 0, stream>>>(slots.data<int32_t>(), n);
    GLMTUNE_CUDA_CHECK_LAUNCH();
    // A radix sort is stable: slots of one expert keep their ascending order. All 32 bits are
    // sorted so that a negative or oversized id cannot alias a valid one (checked below).
    size_t temp_bytes = 0;
    GLMTUNE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, temp_bytes, indices.data<int32_t>(), sorted_ids.data<int32_t>(),
        slots.data<int32_t>(), p.sorted_slots.data<int32_t>(), n, 0, 32, stream));
    Tensor temp = Tensor::empty({int64_t(temp_bytes / 8) + 1}, DType::i64, dev);
    GLMTUNE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        temp.data_ptr(), temp_bytes, indices.data<int32_t>(), sorted_ids.data<int32_t>(),
        slots.data<int32_t>(), p.sorted_slots.data<int32_t>(), n, 0, 32, stream));
    inverse_kernel<<<blocks_for(n), kThreads, 0, stream>>>(p.sorted_slots.data<int32_t>(), n,
                                                           p.slot_position.data<int32_t>());
    GLMTUNE_CUDA_CHECK_LAUNCH();
  }
  expert_offsets_kernel<<<blocks_for(n_experts + 1), kThreads, 0, stream>>>(
      sorted_ids.data<int32_t>(), n, int(n_experts), offsets.data<int32_t>());
  GLMTUNE_CUDA_CHECK_LAUNCH();
  p.device_offsets = offsets;
  p.host = std::make_shared<ExpertPermutation::HostOffsets>();
  p.host->slots = n;
  p.host->stream = stream;
  if (read_offsets) p.offsets();
  return p;
}

const std::vector<int64_t>& ExpertPermutation::offsets() const {
  GLMTUNE_CUDA_OP_REQUIRE(host && device_offsets.defined(),
                          "ExpertPermutation::offsets: not made by cuda::moe_permute");
  if (host->read) return host->values;
  const int64_t n_experts = device_offsets.numel() - 1;
  std::vector<int32_t> copy(size_t(device_offsets.numel()));
  detail::DeviceGuard guard(device_offsets.device().index);
  GLMTUNE_CUDA_CHECK(cudaMemcpyAsync(copy.data(), device_offsets.data_ptr(),
                                     copy.size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                     host->stream));
  GLMTUNE_CUDA_CHECK(cudaStreamSynchronize(host->stream));
  GLMTUNE_CUDA_OP_REQUIRE(
      copy.front() == 0 && int64_t(copy.back()) == host->slots,
      "cuda::moe_permute: routed expert ids outside [0, " + std::to_string(n_experts) + ")");
  host->values.assign(copy.begin(), copy.end());
  host->read = true;
  return host->values;
}

Tensor moe_expert_counts(const ops::Routing& routing, int64_t n_experts, int64_t rows,
                         cudaStream_t stream) {
  const Tensor& idx = routing.indices;
  GLMTUNE_CUDA_OP_REQUIRE(idx.defined() && idx.dtype() == DType::i32 && idx.dim() == 2 &&
                              idx.is_contiguous() && idx.device().is_cuda(),
                          "cuda::moe_expert_counts needs int32 [T, K] routing indices on the GPU");
  if (rows < 0) rows = idx.size(0);
  GLMTUNE_CUDA_OP_REQUIRE(rows <= idx.size(0), "cuda::moe_expert_counts: too many rows");
  detail::DeviceGuard guard(idx.device().index);
  Tensor counts = Tensor::zeros({n_experts}, DType::i64, idx.device());
  const int64_t n = rows * idx.size(1);
  if (n > 0) {
    count_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        idx.data<int32_t>(), n, int(n_experts),
        reinterpret_cast<unsigned long long*>(counts.data_ptr()));
    GLMTUNE_CUDA_CHECK_LAUNCH();
  }
  return counts;
}

Tensor moe_balancing_loss(const Tensor& logits, const Tensor& bias, const Tensor& loads,
                          int64_t counted_rows, int64_t top_k, double weight, Tensor& loss_sum,
                          cudaStream_t stream) {
  GLMTUNE_CUDA_OP_REQUIRE(logits.defined() && logits.dim() == 2 && logits.dtype() == DType::f32 &&
                              logits.is_contiguous() && logits.device().is_cuda(),
                          "cuda::moe_balancing_loss needs contiguous f32 [T, E] logits on the GPU");
  const int64_t rows = logits.size(0), n_exp = logits.size(1);
  const Device dev = logits.device();
  GLMTUNE_CUDA_OP_REQUIRE(bias.defined() && bias.dtype() == DType::f32 && bias.is_contiguous() &&
                              bias.numel() == n_exp && bias.device() == dev,
                          "cuda::moe_balancing_loss needs a contiguous f32 [E] bias beside the "
                          "logits");
  GLMTUNE_CUDA_OP_REQUIRE(loads.defined() && loads.dtype() == DType::i64 && loads.is_contiguous() &&
                              loads.numel() == n_exp && loads.device() == dev,
                          "cuda::moe_balancing_loss needs int64 [E] loads beside the logits");
  GLMTUNE_CUDA_OP_REQUIRE(loss_sum.defined() && loss_sum.dtype() == DType::f64 &&
                              loss_sum.numel() == 1 && loss_sum.device() == dev,
                          "cuda::moe_balancing_loss needs an f64 [1] loss sum beside the logits");
  GLMTUNE_CUDA_OP_REQUIRE(
      counted_rows >= 0 && counted_rows <= rows && top_k >= 1,
      "cuda::moe_balancing_loss: counted rows outside the logits, or top-k < 1");
  detail::DeviceGuard guard(dev.index);
  Tensor grad = Tensor::empty({rows, n_exp}, DType::f32, dev);
  if (rows == 0 || n_exp == 0) return grad;
  Tensor coef = Tensor::empty({n_exp}, DType::f64, dev);
  Tensor row_loss = Tensor::empty({rows}, DType::f64, dev);
  balancing_coef_kernel<<<1, kThreads, 0, stream>>>(loads.data<int64_t>(), int(n_exp), int(top_k),
                                                    weight, coef.data<double>());
  GLMTUNE_CUDA_CHECK_LAUNCH();
  balancing_rows_kernel<<<blocks_for(rows, kThreads / 32), kThreads, 0, stream>>>(
      logits.data<float>(), bias.data<float>(), coef.data<double>(), rows, counted_rows, int(n_exp),
      grad.data<float>(), row_loss.data<double>());
  GLMTUNE_CUDA_CHECK_LAUNCH();
  balancing_sum_kernel<<<1, kThreads, 0, stream>>>(row_loss.data<double>(), rows,
                                                   loss_sum.data<double>());
  GLMTUNE_CUDA_CHECK_LAUNCH();
  return grad;
}

Tensor moe_experts(const ops::MoeConfig& cfg, const ops::Linear& gate_up_proj,
                   const ops::Linear& down_proj, const Tensor& x, const ops::Routing& routing,
                   GroupedGemmBackend backend, cudaStream_t stream) {
  check_config(cfg);
  check_x(x, "cuda::moe_experts");
  check_expert_weights(cfg, gate_up_proj, down_proj, x);
  check_routing(routing, x.size(0), cfg.n_experts, cfg.top_k, x.device());
  detail::DeviceGuard guard(x.device().index);
  const ExpertPermutation perm = moe_permute(routing.indices, cfg.n_experts, stream,
                                             backend != GroupedGemmBackend::kWgmmaDeviceOffsets);
  const ExpertActivations a = run_experts(cfg, gate_up_proj, down_proj, x, perm, backend, stream);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  combine(a.yp, routing.weights, perm.slot_position, int(cfg.top_k), nullptr, y, stream);
  return y;
}

ops::MoeOutput moe_forward(const ops::MoeConfig& cfg, const ops::MoeParams& params, const Tensor& x,
                           int64_t counted_rows, MoeContext* ctx, GroupedGemmBackend backend,
                           cudaStream_t stream, bool keep_activations) {
  check_config(cfg);
  check_x(x, "cuda::moe_forward");
  check_expert_weights(cfg, params.gate_up_proj, params.down_proj, x);
  const Device dev = x.device();
  const int64_t rows = x.size(0), dim = x.size(1);
  check_shared(params.shared, x);
  const int64_t shared_inter =
      params.shared.gate_proj.weight.defined() ? params.shared.gate_proj.weight.size(0) : 0;
  detail::DeviceGuard guard(dev.index);

  ops::MoeOutput out;
  out.routing = moe_route(cfg, params.router_weight, params.e_score_correction_bias, x, stream);
  ExpertPermutation perm = moe_permute(out.routing.indices, cfg.n_experts, stream,
                                       backend != GroupedGemmBackend::kWgmmaDeviceOffsets);
  ExpertActivations a =
      run_experts(cfg, params.gate_up_proj, params.down_proj, x, perm, backend, stream);

  // Shared expert (when given: ops::moe_forward runs one with adapters beside these kernels):
  // gate | up side by side (kept for the backward), fp32 down output.
  Tensor gate_up, shared;
  if (shared_inter > 0) {
    gate_up = Tensor::empty({rows, 2 * shared_inter}, x.dtype(), dev);
    Tensor gate = gate_up.slice(1, 0, shared_inter),
           up = gate_up.slice(1, shared_inter, 2 * shared_inter);
    linear_out(gate, x, params.shared.gate_proj.weight, Tensor(), false, stream);
    linear_out(up, x, params.shared.up_proj.weight, Tensor(), false, stream);
    const Tensor act = swiglu_clamped(gate, up, cfg.swiglu_limit, stream);
    shared = linear(act, params.shared.down_proj.weight, Tensor(), DType::f32, stream);
  }

  out.y = Tensor::empty({rows, dim}, x.dtype(), dev);
  combine(a.yp, out.routing.weights, perm.slot_position, int(cfg.top_k),
          rows > 0 && shared.defined() ? shared.data<float>() : nullptr, out.y, stream);
  out.expert_counts = moe_expert_counts(out.routing, cfg.n_experts, counted_rows, stream);
  if (ctx) {
    ctx->x = x;
    ctx->routing = out.routing;
    ctx->permutation = std::move(perm);
    ctx->shared_gate_up = gate_up;
    if (keep_activations) {
      // The backward reads act and yp only for an adapted or FP8 down projection (routed_backward).
      if (combine_grad_from_input_grad(params.down_proj)) a.act = a.yp = Tensor();
      ctx->activations = std::move(a);
    }
  }
  return out;
}

Tensor moe_route_backward(const ops::MoeConfig& cfg, const ops::Routing& routing,
                          const Tensor& d_weights, cudaStream_t stream) {
  GLMTUNE_CUDA_OP_REQUIRE(routing.logits.defined() && routing.logits.device().is_cuda(),
                          "cuda::moe_route_backward needs the router logits");
  const Device dev = routing.logits.device();
  const int64_t rows = routing.logits.size(0);
  check_routing(routing, rows, cfg.n_experts, cfg.top_k, dev);
  GLMTUNE_CUDA_OP_REQUIRE(d_weights.defined() && d_weights.dtype() == DType::f32 &&
                              d_weights.is_contiguous() && d_weights.device() == dev &&
                              d_weights.shape() == routing.weights.shape(),
                          "cuda::moe_route_backward: d_weights " + detail::describe(d_weights) +
                              " must be f32 like the weights");
  detail::DeviceGuard guard(dev.index);
  Tensor d_logits = Tensor::zeros({rows, cfg.n_experts}, DType::f32, dev);
  if (rows > 0) {
    route_backward_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(
        routing.logits.data<float>(), routing.indices.data<int32_t>(), d_weights.data<float>(),
        rows, int(cfg.n_experts), int(cfg.top_k), cfg.norm_topk_prob,
        float(cfg.routed_scaling_factor), d_logits.data<float>());
    GLMTUNE_CUDA_CHECK_LAUNCH();
  }
  return d_logits;
}

namespace {

// The routed experts' backward on the permuted rows (routed_backward, below): d_weights f32 [T, K]
// and the permuted input gradient dxp [T·K, D] (x's dtype). The gradients of the trained tensors
// (the expert weights, their adapters' A and B) accumulate into `grads`; a frozen tensor gets
// none.
struct RoutedBackward {
  Tensor d_weights, dxp;
};

// An expert adapter's part of its projection's backward on the permuted rows: with u = scale ·
// in A^T from the forward, dB += dout^T u, du = scale · dout B, dA += du^T in and d_in += du A.
void expert_adapter_backward(const ops::LoraAdapter& a, const Tensor& u, const Tensor& in,
                             const Tensor& dout, Tensor& d_in, ops::LoraAdapter& g,
                             const ExpertPermutation& perm, GroupedGemmBackend backend,
                             cudaStream_t stream) {
  if (!a.defined()) return;
  const std::vector<int64_t>& offsets = perm.offsets();
  if (Tensor* dB = trained_buffer(g.B, a.B, "an expert adapter's B"))
    grouped_linear_backward_weight(*dB, dout, u, offsets, backend, stream);
  Tensor du = Tensor::empty(u.shape(), u.dtype(), u.device());
  grouped_linear_backward_input(du, dout, a.B, offsets, backend, stream);
  if (du.numel() > 0) scale_inplace(du, a.scale, stream);
  if (Tensor* dA = trained_buffer(g.A, a.A, "an expert adapter's A"))
    grouped_linear_backward_weight(*dA, du, in, offsets, backend, stream);
  grouped_linear_backward_input(d_in, du, a.A, offsets, backend, stream, /*accumulate=*/true);
}

// The routed experts' backward. For a plain down projection the combine weights' gradient is
// taken from the down projection's input gradient of the unweighted dy, ⟨dy[t] · down_e, act⟩ =
// ⟨dy[t], act · down_eᵀ⟩ (expert_activation_grad_kernel): neither act nor the experts' outputs
// are needed, so a kept gate/up spares the down projection's forward GEMM, and every path (kept,
// recomputed, offloaded) takes the same arithmetic. An adapted down projection adds its low-rank
// term to the output, and an FP8 one would quantise other operands than the CPU op's (dy instead
// of the output's input, w · act instead of w · dy): for those the output is formed (or taken from
// a whole context) and dotted with dy, the CPU op's formula.
RoutedBackward routed_backward(const ops::MoeConfig& cfg, const ops::Linear& gate_up,
                               const ops::Linear& down, const Tensor& x,
                               const ops::Routing& routing, const ExpertPermutation& perm,
                               const Tensor& dy, ops::MoeParams& grads, GroupedGemmBackend backend,
                               cudaStream_t stream, const ExpertActivations& saved = {}) {
  const Device dev = x.device();
  const int64_t rows = x.size(0), dim = x.size(1), k = cfg.top_k;
  const int64_t inter = down.weight.size(2);
  const int64_t n = perm.sorted_slots.numel();
  const bool from_input_grad = combine_grad_from_input_grad(down);
  // Kept: x_perm with h (and act, yp where the backward reads them), or h alone (a context held
  // across the step), the rest rebuilt.
  const bool whole = saved.x_perm.defined();
  if (saved.h.defined())
    GLMTUNE_CUDA_OP_REQUIRE(
        saved.h.size(0) == n && saved.h.size(1) == 2 * inter &&
            saved.u_gate_up.defined() == gate_up.lora.defined() &&
            (whole ? saved.x_perm.size(0) == n &&
                         (from_input_grad ||
                          (saved.act.defined() && saved.yp.defined() && saved.act.size(0) == n &&
                           saved.yp.size(0) == n && saved.yp.size(1) == dim &&
                           saved.u_down.defined() == down.lora.defined()))
                   : !saved.act.defined() && !saved.yp.defined() && !saved.u_down.defined()),
        "cuda MoE backward: the kept expert activations (h " + detail::describe(saved.h) +
            ") do not fit " + std::to_string(n) + " routed rows of this MoE");
  const ExpertActivations a =
      whole ? saved
            : run_experts(cfg, gate_up, down, x, perm, backend, stream,
                          saved.h.defined() ? &saved : nullptr, !from_input_grad);
  const DType st = x.dtype();
  RoutedBackward r;
  r.d_weights = Tensor::empty({rows, k}, DType::f32, dev);
  Tensor* d_down = trained_buffer(grads.down_proj.weight, down.weight, "down_proj");
  Tensor dh = Tensor::empty({n, 2 * inter}, st, dev);
  if (from_input_grad) {
    Tensor dy_perm = Tensor::empty({n, dim}, st, dev);
    gather_rows(dy, perm.sorted_slots, int(k), dy_perm, stream);
    Tensor g = Tensor::empty({n, inter}, st, dev);
    expert_linear_backward_input(g, dy_perm, down, perm, backend, stream);
    Tensor act_w = Tensor::empty({n, inter}, st, dev);
    if (n > 0) {
      dispatch_rows(a.h, g, inter, [&]<typename T>(auto vec, T*) {
        expert_activation_grad_kernel<decltype(vec)::value, T>
            <<<unsigned(n), kThreads, 0, stream>>>(
                static_cast<const T*>(a.h.data_ptr()), static_cast<const T*>(g.data_ptr()),
                routing.weights.data<float>(), perm.sorted_slots.data<int32_t>(), int(inter),
                float(cfg.swiglu_limit), r.d_weights.data<float>(),
                static_cast<T*>(act_w.data_ptr()), static_cast<T*>(dh.data_ptr()));
      });
      GLMTUNE_CUDA_CHECK_LAUNCH();
    }
    if (d_down) expert_linear_backward_weight(*d_down, dy_perm, act_w, down, perm, backend, stream);
  } else {
    Tensor dyp = Tensor::empty({n, dim}, st, dev);
    if (n > 0) {
      auto launch = [&]<typename T>(auto kernel, T*) {
        kernel<<<unsigned(n), kThreads, 0, stream>>>(
            static_cast<const T*>(dy.data_ptr()), static_cast<const T*>(a.yp.data_ptr()),
            routing.weights.data<float>(), perm.sorted_slots.data<int32_t>(), int(k), int(dim),
            r.d_weights.data<float>(), static_cast<T*>(dyp.data_ptr()));
      };
      if (st == DType::f32)
        launch(expert_output_grad_kernel<1, float>, static_cast<float*>(nullptr));
      else if (dim % 8 == 0)
        launch(expert_output_grad_kernel<8, bf16>, static_cast<bf16*>(nullptr));
      else
        launch(expert_output_grad_kernel<1, bf16>, static_cast<bf16*>(nullptr));
      GLMTUNE_CUDA_CHECK_LAUNCH();
    }
    if (d_down) expert_linear_backward_weight(*d_down, dyp, a.act, down, perm, backend, stream);
    Tensor d_act = Tensor::empty({n, inter}, st, dev);
    expert_linear_backward_input(d_act, dyp, down, perm, backend, stream);
    expert_adapter_backward(down.lora, a.u_down, a.act, dyp, d_act, grads.down_proj.lora, perm,
                            backend, stream);
    if (n > 0) {
      Tensor dhg = dh.slice(1, 0, inter), dhu = dh.slice(1, inter, 2 * inter);
      swiglu_clamped_backward(a.h.slice(1, 0, inter), a.h.slice(1, inter, 2 * inter), d_act,
                              cfg.swiglu_limit, dhg, dhu, stream);
    }
  }
  if (Tensor* d_gate_up = trained_buffer(grads.gate_up_proj.weight, gate_up.weight, "gate_up_proj"))
    expert_linear_backward_weight(*d_gate_up, dh, a.x_perm, gate_up, perm, backend, stream);
  r.dxp = Tensor::empty({n, dim}, st, dev);
  expert_linear_backward_input(r.dxp, dh, gate_up, perm, backend, stream);
  expert_adapter_backward(gate_up.lora, a.u_gate_up, a.x_perm, dh, r.dxp, grads.gate_up_proj.lora,
                          perm, backend, stream);
  return r;
}

// dx[t] = Out(extra[t] + Σ_k dxp[pos(t, k)]), k in order (extra may be null).
void unpermute_sum(const Tensor& dxp, const Tensor& position, int k, const float* extra, Tensor& dx,
                   cudaStream_t stream) {
  const int64_t rows = dx.size(0), dim = dx.size(1);
  if (rows == 0) return;
  if (dx.dtype() == DType::f32 && dxp.dtype() != DType::f32) {
    const bool vec = vec8_ok(dxp, dim);
    auto launch = [&](auto kernel) {
      kernel<<<unsigned(rows), 128, 0, stream>>>(static_cast<const bf16*>(dxp.data_ptr()),
                                                 position.data<int32_t>(), k, int(dim), extra,
                                                 dx.data<float>());
    };
    if (vec)
      launch(unpermute_sum_kernel<8, bf16, float>);
    else
      launch(unpermute_sum_kernel<1, bf16, float>);
  } else {
    dispatch_rows(dxp, dx, dim, [&]<typename T>(auto vec, T*) {
      unpermute_sum_kernel<decltype(vec)::value, T, T><<<unsigned(rows), 128, 0, stream>>>(
          static_cast<const T*>(dxp.data_ptr()), position.data<int32_t>(), k, int(dim), extra,
          static_cast<T*>(dx.data_ptr()));
    });
  }
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

// The router (from the combine weights' gradient d_weights, plus d_router_logits when defined)
// and the shared expert (from shared_gate_up, its pre-clamp gate | up): their input gradients
// added into dx_f32, their weight gradients into grads.
void router_and_shared_backward(const ops::MoeConfig& cfg, const ops::MoeParams& params,
                                const Tensor& x, const ops::Routing& routing,
                                const Tensor& shared_gate_up, const Tensor& dy,
                                const Tensor& d_weights, const Tensor& d_router_logits,
                                ops::MoeParams& grads, Tensor& dx_f32, cudaStream_t stream) {
  const Device dev = x.device();
  const int64_t rows = x.size(0), dim = x.size(1);
  const DType st = x.dtype();
  Tensor* d_router = trained_buffer(grads.router_weight, params.router_weight, "router weight");
  // Router: combine weights → logits → GEMMs into fp32. bf16 operands take the fp32 logit
  // gradient as two bf16 parts (hi + lo); f32 operands take it whole.
  Tensor d_logits = moe_route_backward(cfg, routing, d_weights, stream);
  if (rows == 0) return;
  const int64_t ne = rows * cfg.n_experts;
  const float* extra = d_router_logits.defined() ? d_router_logits.data<float>() : nullptr;
  std::vector<const void*> parts;
  Tensor split;
  if (st == DType::f32) {
    if (extra) {
      accumulate_kernel<float>
          <<<blocks_for(ne), kThreads, 0, stream>>>(extra, ne, d_logits.data<float>());
      GLMTUNE_CUDA_CHECK_LAUNCH();
    }
    parts = {d_logits.data_ptr()};
  } else {
    split = Tensor::empty({2, rows, cfg.n_experts}, DType::bf16, dev);
    auto* hi = static_cast<bf16*>(split.data_ptr());
    split_hi_lo_kernel<<<blocks_for(ne), kThreads, 0, stream>>>(d_logits.data<float>(), extra, ne,
                                                                hi, hi + ne);
    GLMTUNE_CUDA_CHECK_LAUNCH();
    parts = {hi, hi + ne};
  }
  Tensor d_router_f32;
  if (d_router)
    d_router_f32 = d_router->dtype() == DType::f32
                       ? *d_router
                       : Tensor::zeros(d_router->shape(), DType::f32, dev);
  for (const void* dl : parts) {
    GemmArgs g;
    g.device = dev.index;
    g.m = rows, g.n = dim, g.k = cfg.n_experts;
    g.a = dl, g.lda = cfg.n_experts;
    g.b = params.router_weight.data_ptr(), g.ldb = dim;
    g.c = dx_f32.data_ptr(), g.ldc = dim, g.c_dtype = DType::f32, g.beta = 1.0f;
    g.ab_dtype = st;
    gemm(g, stream);
    if (!d_router) continue;
    GemmArgs w;
    w.device = dev.index;
    w.trans_a = true;
    w.m = cfg.n_experts, w.n = dim, w.k = rows;
    w.a = dl, w.lda = cfg.n_experts;
    w.b = x.data_ptr(), w.ldb = dim;
    w.c = d_router_f32.data_ptr(), w.ldc = dim, w.c_dtype = DType::f32, w.beta = 1.0f;
    w.ab_dtype = st;
    gemm(w, stream);
  }
  if (d_router && d_router->dtype() != DType::f32) accumulate(*d_router, d_router_f32, stream);

  // Shared expert, into the same fp32 dx (none given: ops::moe_backward differentiates an adapted
  // one itself).
  if (!shared_gate_up.defined()) return;
  const int64_t shared_inter = shared_gate_up.size(1) / 2;
  Tensor* d_sg = trained_buffer(grads.shared.gate_proj.weight, params.shared.gate_proj.weight,
                                "shared gate_proj");
  Tensor* d_su =
      trained_buffer(grads.shared.up_proj.weight, params.shared.up_proj.weight, "shared up_proj");
  Tensor* d_sd = trained_buffer(grads.shared.down_proj.weight, params.shared.down_proj.weight,
                                "shared down_proj");
  const Tensor gate = shared_gate_up.slice(1, 0, shared_inter);
  const Tensor up = shared_gate_up.slice(1, shared_inter, 2 * shared_inter);
  const Tensor act = swiglu_clamped(gate, up, cfg.swiglu_limit, stream);
  const Tensor d_sact = linear_backward_input(dy, params.shared.down_proj.weight, st, stream);
  if (d_sd) linear_backward_weight(*d_sd, dy, act, stream);
  Tensor d_sgu = Tensor::empty({rows, 2 * shared_inter}, st, dev);
  Tensor dsg = d_sgu.slice(1, 0, shared_inter),
         dsu = d_sgu.slice(1, shared_inter, 2 * shared_inter);
  swiglu_clamped_backward(gate, up, d_sact, cfg.swiglu_limit, dsg, dsu, stream);
  if (d_sg) linear_backward_weight(*d_sg, dsg, x, stream);
  if (d_su) linear_backward_weight(*d_su, dsu, x, stream);
  linear_backward_input_out(dx_f32, dsg, params.shared.gate_proj.weight, true, stream);
  linear_backward_input_out(dx_f32, dsu, params.shared.up_proj.weight, true, stream);
}

void check_router_logit_grad(const Tensor& d_router_logits, const ops::Routing& routing) {
  if (d_router_logits.defined())
    GLMTUNE_CUDA_OP_REQUIRE(d_router_logits.dtype() == DType::f32 &&
                                d_router_logits.is_contiguous() &&
                                d_router_logits.shape() == routing.logits.shape(),
                            "cuda::moe_backward: d_router_logits must be f32 like the logits");
}

// The shared expert's gate | up before the clamps, [T, 2·Is] in x's dtype.
Tensor shared_gate_up_of(const ops::MlpParams& shared, const Tensor& x, cudaStream_t stream) {
  if (!shared.gate_proj.weight.defined()) return Tensor();
  const int64_t shared_inter = shared.gate_proj.weight.size(0);
  Tensor gate_up = Tensor::empty({x.size(0), 2 * shared_inter}, x.dtype(), x.device());
  Tensor gate = gate_up.slice(1, 0, shared_inter),
         up = gate_up.slice(1, shared_inter, 2 * shared_inter);
  linear_out(gate, x, shared.gate_proj.weight, Tensor(), false, stream);
  linear_out(up, x, shared.up_proj.weight, Tensor(), false, stream);
  return gate_up;
}

}  // namespace

Tensor moe_backward(const ops::MoeConfig& cfg, const ops::MoeParams& params, const MoeContext& ctx,
                    const Tensor& dy, ops::MoeParams& grads, const Tensor& d_router_logits,
                    GroupedGemmBackend backend, cudaStream_t stream) {
  check_config(cfg);
  const Tensor& x = ctx.x;
  GLMTUNE_CUDA_OP_REQUIRE(x.defined(),
                          "cuda::moe_backward needs the context filled by cuda::moe_forward");
  const Device dev = x.device();
  const int64_t rows = x.size(0), dim = x.size(1);
  check_expert_weights(cfg, params.gate_up_proj, params.down_proj, x);
  check_like_x(dy, x.shape(), x, "dy");
  check_routing(ctx.routing, rows, cfg.n_experts, cfg.top_k, dev);
  check_router_logit_grad(d_router_logits, ctx.routing);
  detail::DeviceGuard guard(dev.index);
  const RoutedBackward r =
      routed_backward(cfg, params.gate_up_proj, params.down_proj, x, ctx.routing, ctx.permutation,
                      dy, grads, backend, stream, ctx.activations);
  Tensor dx_f32 = Tensor::zeros({rows, dim}, DType::f32, dev);
  router_and_shared_backward(cfg, params, x, ctx.routing, ctx.shared_gate_up, dy, r.d_weights,
                             d_router_logits, grads, dx_f32, stream);
  Tensor dx = Tensor::empty({rows, dim}, x.dtype(), dev);
  unpermute_sum(r.dxp, ctx.permutation.slot_position, int(cfg.top_k),
                rows > 0 ? dx_f32.data<float>() : nullptr, dx, stream);
  return dx;
}

ExpertsBackward moe_experts_backward(const ops::MoeConfig& cfg, const ops::Linear& gate_up_proj,
                                     const ops::Linear& down_proj, const Tensor& x,
                                     const ops::Routing& routing, const Tensor& dy,
                                     ops::MoeParams& grads, GroupedGemmBackend backend,
                                     cudaStream_t stream) {
  check_config(cfg);
  check_x(x, "cuda::moe_experts_backward");
  check_expert_weights(cfg, gate_up_proj, down_proj, x);
  check_like_x(dy, x.shape(), x, "dy");
  check_routing(routing, x.size(0), cfg.n_experts, cfg.top_k, x.device());
  detail::DeviceGuard guard(x.device().index);
  const ExpertPermutation perm = moe_permute(routing.indices, cfg.n_experts, stream,
                                             backend != GroupedGemmBackend::kWgmmaDeviceOffsets);
  RoutedBackward r =
      routed_backward(cfg, gate_up_proj, down_proj, x, routing, perm, dy, grads, backend, stream);
  ExpertsBackward out;
  out.dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  unpermute_sum(r.dxp, perm.slot_position, int(cfg.top_k), nullptr, out.dx, stream);
  out.d_weights = std::move(r.d_weights);
  return out;
}

Tensor moe_backward_routed_elsewhere(const ops::MoeConfig& cfg, const ops::MoeParams& params,
                                     const Tensor& x, const ops::Routing& routing, const Tensor& dy,
                                     const Tensor& routed_dx, const Tensor& routed_d_weights,
                                     ops::MoeParams& grads, const Tensor& d_router_logits,
                                     cudaStream_t stream) {
  check_config(cfg);
  check_x(x, "cuda::moe_backward_routed_elsewhere");
  const Device dev = x.device();
  const int64_t rows = x.size(0), dim = x.size(1);
  check_like_x(dy, x.shape(), x, "dy");
  check_shared(params.shared, x);
  check_routing(routing, rows, cfg.n_experts, cfg.top_k, dev);
  check_router_logit_grad(d_router_logits, routing);
  GLMTUNE_CUDA_OP_REQUIRE(routed_dx.defined() && routed_dx.dtype() == DType::f32 &&
                              routed_dx.is_contiguous() && routed_dx.device() == dev &&
                              routed_dx.shape() == x.shape(),
                          "cuda::moe_backward_routed_elsewhere: routed dx " +
                              detail::describe(routed_dx) + " must be f32 shaped like x");
  detail::DeviceGuard guard(dev.index);
  Tensor dx_f32 = routed_dx.clone();
  router_and_shared_backward(cfg, params, x, routing, shared_gate_up_of(params.shared, x, stream),
                             dy, routed_d_weights, d_router_logits, grads, dx_f32, stream);
  if (x.dtype() == DType::f32) return dx_f32;
  Tensor dx = Tensor::empty({rows, dim}, x.dtype(), dev);
  const int64_t n = dx.numel();
  if (n > 0) {
    GLMTUNE_CUDA_CHECK(cudaMemsetAsync(dx.data_ptr(), 0, size_t(n) * sizeof(bf16), stream));
    accumulate_kernel<bf16><<<blocks_for(n), kThreads, 0, stream>>>(
        dx_f32.data<float>(), n, static_cast<bf16*>(dx.data_ptr()));
    GLMTUNE_CUDA_CHECK_LAUNCH();
  }
  return dx;
}

Tensor moe_gather_rows(const Tensor& src, const Tensor& index, int64_t k, cudaStream_t stream) {
  GLMTUNE_CUDA_OP_REQUIRE(src.defined() && src.dim() == 2 && src.is_contiguous() &&
                              src.device().is_cuda() &&
                              (src.dtype() == DType::bf16 || src.dtype() == DType::f32),
                          "cuda::moe_gather_rows: src must be a contiguous bf16/f32 CUDA [n, c], "
                          "got " +
                              detail::describe(src));
  GLMTUNE_CUDA_OP_REQUIRE(index.defined() && index.dtype() == DType::i32 && index.dim() == 1 &&
                              index.is_contiguous() && index.device() == src.device() && k >= 1,
                          "cuda::moe_gather_rows: index must be int32 [m] on " +
                              src.device().str() + ", got " + detail::describe(index));
  detail::DeviceGuard guard(src.device().index);
  Tensor out = Tensor::empty({index.numel(), src.size(1)}, src.dtype(), src.device());
  gather_rows(src, index, int(k), out, stream);
  return out;
}

Tensor moe_combine(const Tensor& yp, const Tensor& weights, const ExpertPermutation& perm,
                   cudaStream_t stream) {
  GLMTUNE_CUDA_OP_REQUIRE(
      weights.defined() && weights.dim() == 2 && weights.dtype() == DType::f32 &&
          weights.is_contiguous() && yp.defined() && yp.dim() == 2 && yp.is_contiguous() &&
          yp.size(0) == weights.numel() && perm.slot_position.numel() == weights.numel(),
      "cuda::moe_combine: yp " + detail::describe(yp) + " must hold one row per slot of weights " +
          detail::describe(weights));
  detail::DeviceGuard guard(yp.device().index);
  Tensor y = Tensor::empty({weights.size(0), yp.size(1)}, yp.dtype(), yp.device());
  combine(yp, weights, perm.slot_position, int(weights.size(1)), nullptr, y, stream);
  return y;
}

Tensor moe_sum_slots(const Tensor& dxp, const ExpertPermutation& perm, int64_t k,
                     cudaStream_t stream) {
  GLMTUNE_CUDA_OP_REQUIRE(
      dxp.defined() && dxp.dim() == 2 && dxp.is_contiguous() && k >= 1 &&
          dxp.size(0) == perm.slot_position.numel() && dxp.size(0) % k == 0,
      "cuda::moe_sum_slots: dxp " + detail::describe(dxp) + " must hold one row per slot");
  detail::DeviceGuard guard(dxp.device().index);
  Tensor dx = Tensor::empty({dxp.size(0) / k, dxp.size(1)}, DType::f32, dxp.device());
  unpermute_sum(dxp, perm.slot_position, int(k), nullptr, dx, stream);
  return dx;
}

}  // namespace glmtune::cuda
