// LayerNorm forward and backward kernels (ops/cuda/norm.h), for the vision tower's norms.

#include <type_traits>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/norm.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

constexpr int kThreads = 256;
// Blocks of the backward: each owns a contiguous range of ceil(rows / kGradBlocks) rows, so the
// grouping of the parameter-gradient sums depends on the row count only.
constexpr int64_t kGradBlocks = 512;

struct RowStats {
  float mean, rstd;
};

// Mean, then the biased variance around it (two passes over the row, which stays in L1/L2): more
// accurate than E[x²] − E[x]² when the mean is large against the spread.
template <typename T>
__device__ __forceinline__ RowStats row_stats(const T* __restrict__ xr, int n, float eps,
                                              float* scratch) {
  float s = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) s += detail::to_f(xr[j]);
  const float mean = detail::block_sum(s, scratch) / float(n);
  float ss = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float d = detail::to_f(xr[j]) - mean;
    ss += d * d;
  }
  const float var = detail::block_sum(ss, scratch) / float(n);
  // IEEE division and square root (no fast-math), as the CPU computes 1 / sqrt(var + eps).
  return {mean, 1.0f / sqrtf(var + eps)};
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    layer_norm_fwd_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w,
                          const T* __restrict__ b, T* __restrict__ y, int64_t ldy,
                          float* __restrict__ mean_out, float* __restrict__ rstd_out, int n,
                          float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * ldx;
  T* yr = y + row * ldy;
  const RowStats st = row_stats(xr, n, eps, scratch);
  if (threadIdx.x == 0) {
    if (mean_out) mean_out[row] = st.mean;
    if (rstd_out) rstd_out[row] = st.rstd;
  }
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    float v = (detail::to_f(xr[j]) - st.mean) * st.rstd;
    if (w) v *= detail::to_f(w[j]);
    if (b) v += detail::to_f(b[j]);
    yr[j] = detail::from_f<T>(v);
  }
}

// dx for rows [blockIdx.x · rows_per_block, ...) and this block's share of the parameter
// gradients, written to dw_partial / db_partial [blockIdx.x, :]. With x̂ = (x − μ)·r and
// u = w ⊙ dy: dx = r·(u − mean(u) − x̂·mean(u ⊙ x̂)).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    layer_norm_bwd_kernel(const T* __restrict__ dy, int64_t lddy, const T* __restrict__ x,
                          int64_t ldx, const T* __restrict__ w, const float* __restrict__ mean_in,
                          const float* __restrict__ rstd_in, T* __restrict__ dx, int64_t lddx,
                          int64_t rows, int n, int64_t rows_per_block, float eps,
                          float* __restrict__ dw_partial, float* __restrict__ db_partial) {
  extern __shared__ float acc[];  // [2n]: dw then db; each thread owns its columns
  __shared__ float scratch[32];
  float* dw_acc = acc;
  float* db_acc = acc + n;
  for (int j = threadIdx.x; j < n; j += blockDim.x) dw_acc[j] = db_acc[j] = 0.0f;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
  for (int64_t row = r0; row < r1; ++row) {
    const T* xr = x + row * ldx;
    const T* gr = dy + row * lddy;
    const RowStats st =
        mean_in && rstd_in ? RowStats{mean_in[row], rstd_in[row]} : row_stats(xr, n, eps, scratch);
    float su = 0.0f, sux = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      const float xh = (detail::to_f(xr[j]) - st.mean) * st.rstd;
      const float g = detail::to_f(gr[j]);
      const float u = w ? g * detail::to_f(w[j]) : g;
      su += u;
      sux += u * xh;
      dw_acc[j] += g * xh;
      db_acc[j] += g;
    }
    const float mu = detail::block_sum(su, scratch) / float(n);
    const float mux = detail::block_sum(sux, scratch) / float(n);
    T* dxr = dx + row * lddx;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      const float xh = (detail::to_f(xr[j]) - st.mean) * st.rstd;
      const float g = detail::to_f(gr[j]);
      const float u = w ? g * detail::to_f(w[j]) : g;
      dxr[j] = detail::from_f<T>(st.rstd * (u - mu - xh * mux));
    }
  }
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    dw_partial[int64_t(blockIdx.x) * n + j] = dw_acc[j];
    db_partial[int64_t(blockIdx.x) * n + j] = db_acc[j];
  }
}

void check_operand(const Tensor& t, const Tensor& x, const char* what, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(t.defined() && t.dtype() == x.dtype() && t.shape() == x.shape() &&
                              t.device() == x.device() && detail::has_row_layout(t),
                          std::string(op) + ": " + what + " " + detail::describe(t) +
                              " must have x's dtype and shape " + x.str() +
                              " (contiguous or rows with unit inner stride)");
}

void check_vector(const Tensor& v, const Tensor& x, const char* what, const char* op) {
  if (!v.defined()) return;
  GLMTUNE_CUDA_OP_REQUIRE(v.dtype() == x.dtype() && v.dim() == 1 && v.size(0) == x.size(-1) &&
                              v.is_contiguous() && v.device() == x.device(),
                          std::string(op) + ": " + what + " " + v.str() +
                              " must be a contiguous vector of x's dtype matching x " + x.str());
}

void check_stat(const Tensor& s, const Tensor& x, const char* what, const char* op) {
  Shape lead = x.shape();
  lead.pop_back();
  GLMTUNE_CUDA_OP_REQUIRE(
      s.dtype() == DType::f32 && s.shape() == lead && s.is_contiguous() && s.device() == x.device(),
      std::string(op) + ": " + what + " " + detail::describe(s) + " must be f32 " +
          shape_str(lead) + " on " + x.device().str());
}

Tensor& grad_vector(Tensor* slot, const Tensor& x, const char* what, const char* op) {
  const int64_t n = x.size(-1);
  if (!slot->defined()) *slot = Tensor::zeros({n}, DType::f32, x.device());
  GLMTUNE_CUDA_OP_REQUIRE(slot->dtype() == DType::f32 && slot->dim() == 1 && slot->size(0) == n &&
                              slot->is_contiguous() && slot->device() == x.device(),
                          std::string(op) + ": " + what + " gradient " + slot->str() +
                              " must be a contiguous f32 vector of " + std::to_string(n));
  return *slot;
}

Shape leading(const Tensor& x) {
  Shape lead = x.shape();
  lead.pop_back();
  return lead;
}

}  // namespace

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                  Tensor* mean, Tensor* rstd, cudaStream_t stream) {
  const char* op = "cuda::layer_norm";
  GLMTUNE_CUDA_OP_REQUIRE(x.defined() && x.dim() >= 1 && x.device().is_cuda() &&
                              (x.dtype() == DType::bf16 || x.dtype() == DType::f32) &&
                              detail::has_row_layout(x),
                          std::string(op) + ": x " + detail::describe(x) +
                              " must be a bf16 or f32 CUDA tensor with unit inner stride");
  check_vector(weight, x, "weight", op);
  check_vector(bias, x, "bias", op);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (mean) *mean = Tensor::empty(leading(x), DType::f32, x.device());
  if (rstd) *rstd = Tensor::empty(leading(x), DType::f32, x.device());
  const detail::RowsView xv = detail::rows_view(x), yv = detail::rows_view(y);
  if (xv.rows == 0 || xv.cols == 0) return y;
  GLMTUNE_CUDA_OP_REQUIRE(xv.cols <= INT32_MAX, std::string(op) + ": rows too long");
  detail::DeviceGuard guard(x.device().index);
  auto launch = [&]<typename T>(T*) {
    auto ptr = [](const Tensor& t) {
      return t.defined() ? static_cast<const T*>(t.data_ptr()) : nullptr;
    };
    layer_norm_fwd_kernel<T><<<unsigned(xv.rows), kThreads, 0, stream>>>(
        static_cast<const T*>(xv.data), xv.ld, ptr(weight), ptr(bias), static_cast<T*>(yv.data),
        yv.ld, mean ? mean->data<float>() : nullptr, rstd ? rstd->data<float>() : nullptr,
        int(xv.cols), float(eps));
  };
  if (x.dtype() == DType::f32)
    launch(static_cast<float*>(nullptr));
  else
    launch(static_cast<bf16*>(nullptr));
  GLMTUNE_CUDA_CHECK_LAUNCH();
  return y;
}

Tensor layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                           const Tensor& mean, const Tensor& rstd, Tensor* grad_weight,
                           Tensor* grad_bias, cudaStream_t stream) {
  const char* op = "cuda::layer_norm_backward";
  GLMTUNE_CUDA_OP_REQUIRE(x.defined() && x.dim() >= 1 && x.device().is_cuda() &&
                              (x.dtype() == DType::bf16 || x.dtype() == DType::f32) &&
                              detail::has_row_layout(x),
                          std::string(op) + ": x " + detail::describe(x) +
                              " must be a bf16 or f32 CUDA tensor with unit inner stride");
  check_operand(dy, x, "dy", op);
  check_vector(weight, x, "weight", op);
  GLMTUNE_CUDA_OP_REQUIRE(mean.defined() == rstd.defined(),
                          std::string(op) + ": give both statistics or neither");
  if (mean.defined()) {
    check_stat(mean, x, "mean", op);
    check_stat(rstd, x, "rstd", op);
  }
  GLMTUNE_CUDA_OP_REQUIRE(weight.defined() || !grad_weight,
                          std::string(op) + ": an un-weighted norm has no weight gradient");
  float* gw = grad_weight ? grad_vector(grad_weight, x, "weight", op).data<float>() : nullptr;
  float* gb = grad_bias ? grad_vector(grad_bias, x, "bias", op).data<float>() : nullptr;
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  const detail::RowsView xv = detail::rows_view(x), gv = detail::rows_view(dy),
                         dv = detail::rows_view(dx);
  if (xv.rows == 0 || xv.cols == 0) return dx;
  GLMTUNE_CUDA_OP_REQUIRE(xv.cols <= INT32_MAX, std::string(op) + ": rows too long");
  const int n = int(xv.cols);
  detail::DeviceGuard guard(x.device().index);
  const int64_t rows_per_block = (xv.rows + kGradBlocks - 1) / kGradBlocks;
  const int64_t blocks = (xv.rows + rows_per_block - 1) / rows_per_block;
  const size_t smem = 2 * size_t(n) * sizeof(float);
  Tensor partial = Tensor::empty({2, blocks, int64_t(n)}, DType::f32, x.device());
  float* dw_partial = partial.data<float>();
  float* db_partial = dw_partial + blocks * n;
  auto launch = [&]<typename T>(T*) {
    auto kernel = layer_norm_bwd_kernel<T>;
    // Rows longer than 6144 need more than the default 48 KB of dynamic shared memory.
    if (smem > 48 * 1024)
      GLMTUNE_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const T* wp = weight.defined() ? static_cast<const T*>(weight.data_ptr()) : nullptr;
    kernel<<<unsigned(blocks), kThreads, smem, stream>>>(
        static_cast<const T*>(gv.data), gv.ld, static_cast<const T*>(xv.data), xv.ld, wp,
        mean.defined() ? mean.data<float>() : nullptr,
        rstd.defined() ? rstd.data<float>() : nullptr, static_cast<T*>(dv.data), dv.ld, xv.rows, n,
        rows_per_block, float(eps), dw_partial, db_partial);
  };
  if (x.dtype() == DType::f32)
    launch(static_cast<float*>(nullptr));
  else
    launch(static_cast<bf16*>(nullptr));
  GLMTUNE_CUDA_CHECK_LAUNCH();
  const unsigned col_blocks = unsigned((n + kThreads - 1) / kThreads);
  if (gw) detail::sum_blocks_kernel<<<col_blocks, kThreads, 0, stream>>>(dw_partial, blocks, n, gw);
  if (gb) detail::sum_blocks_kernel<<<col_blocks, kThreads, 0, stream>>>(db_partial, blocks, n, gb);
  GLMTUNE_CUDA_CHECK_LAUNCH();
  return dx;
}

}  // namespace glmtune::cuda
